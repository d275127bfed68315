#!/usr/bin/python3
"""Fails when code in base/, hooks/, io/, lib/ or tools/ breaks a library rule.

- No std::filesystem: the torch wheel's libtorch_cpu.so exports its own
  copies of std::filesystem's functions (remove_all and the directory
  iterators among them); which copy a program binds to depends on its link
  order, and a mismatched one crashed test processes on a GPU machine.
  evenstep does its directory work with POSIX calls (io/env.cc:
  internal::ListDir, MakeDirs, RemoveTree).
- No std::cout / std::cerr in the library (base/, hooks/, io/, lib/): every
  line it prints goes through the one sink of base/log.cc (evenstep/log.h),
  which an application may replace. Tools print as programs do.

usage: library_rules.py SOURCE_DIR
"""
import pathlib
import re
import sys

RULES = [
    ("std::filesystem (use io/env.cc's POSIX calls)",
     re.compile(r"std::filesystem|#include <filesystem>|namespace fs\b"),
     ("base", "hooks", "io", "lib", "tools")),
    ("std::cout / std::cerr in the library (use evenstep::Log, evenstep/log.h)",
     re.compile(r"std::(cout|cerr)\b"),
     ("base", "hooks", "io", "lib")),
]


def main():
    root = pathlib.Path(sys.argv[1])
    broken = []
    for what, pattern, parts in RULES:
        for part in parts:
            for path in sorted((root / part).rglob("*")):
                if path.suffix not in (".cc", ".h"):
                    continue
                for n, line in enumerate(path.read_text().splitlines(), 1):
                    if pattern.search(line.split("//", 1)[0]):
                        broken.append(f"{path.relative_to(root)}:{n}: {what}: {line.strip()}")
    if broken:
        print("\n".join(broken))
        sys.exit(1)
    print("library rules hold: no std::filesystem, no direct std::cout / std::cerr")


if __name__ == "__main__":
    main()

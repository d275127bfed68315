#!/usr/bin/python3
"""The layer rule of docs/design.md, checked on the sources' #include lines.

  base/         sees base/ only
  hooks/        sees base/, hooks/                  (never io/ or lib/)
  io/           sees base/, io/                     (never hooks/ or lib/)
  lib/distributed/  sees base/, io/ (CommitStore), distributed/
  lib/balance/  sees base/, hooks/, distributed/, balance/ (no observation, no training)
  lib/observe/  sees base/, io/, distributed/, balance/, observe/
  lib/train/    sees everything above
  a public header (not under internal/) includes no internal/ header, so
  installing only public headers is complete; and internal/ headers are
  seen only by their own layer (and base/'s, the shared tools, by all).

Every "evenstep/..." header is owned by the folder whose include/ holds it
(the generated build_config.h belongs to base/). Exits 1 naming each
violation (file, line, header, owner), 0 when there is none. Usage:
  layering_check.py SOURCE_DIR
"""
import os
import re
import sys

LAYERS = {
    "base": {"base"},
    "hooks": {"base", "hooks"},
    "io": {"base", "io"},
    "lib/distributed": {"base", "io", "lib/distributed"},
    "lib/balance": {"base", "hooks", "lib/distributed", "lib/balance"},
    "lib/observe": {"base", "io", "lib/distributed", "lib/balance", "lib/observe"},
    "lib/train": {"base", "hooks", "io", "lib/distributed", "lib/balance", "lib/observe", "lib/train"},
}
INCLUDE = re.compile(r'^\s*#\s*include\s+"(evenstep/[^"]+)"')


def main(root):
    owner = {"evenstep/internal/build_config.h": "base"}
    for layer in LAYERS:
        inc = os.path.join(root, layer, "include")
        for dirpath, _, files in os.walk(inc):
            for f in files:
                rel = os.path.relpath(os.path.join(dirpath, f), inc)
                if rel in owner:
                    print(f"{rel} is defined twice: {owner[rel]}/ and {layer}/")
                    return 1
                owner[rel] = layer
    problems = []
    checked = 0
    for layer, allowed in LAYERS.items():
        for dirpath, _, files in os.walk(os.path.join(root, layer)):
            for f in sorted(files):
                if not f.endswith((".h", ".cc")):
                    continue
                path = os.path.join(dirpath, f)
                rel_path = os.path.relpath(path, root)
                public = f.endswith(".h") and "/internal/" not in rel_path and "/include/" in rel_path
                checked += 1
                with open(path, encoding="utf-8") as src:
                    for n, line in enumerate(src, 1):
                        m = INCLUDE.match(line)
                        if not m:
                            continue
                        header = m.group(1)
                        home = owner.get(header)
                        if home is None:
                            problems.append(f"{rel_path}:{n}: {header} is no header of any layer")
                        elif home not in allowed:
                            problems.append(f"{rel_path}:{n}: {layer}/ includes {header} of "
                                            f"{home}/ (it may use {', '.join(sorted(allowed))})")
                        elif ("/internal/" in header and home not in ("base", layer)):
                            problems.append(f"{rel_path}:{n}: {layer}/ includes {header}, an "
                                            f"internal header of {home}/")
                        if public and "/internal/" in header:
                            problems.append(f"{rel_path}:{n}: public header includes the "
                                            f"internal {header} (not installed)")
    for p in problems:
        print(p)
    print(f"layering: {checked} files of {', '.join(LAYERS)} checked, {len(problems)} violation(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))

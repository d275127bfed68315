#!/usr/bin/python3
"""Classes and source files larger than the house limits (docs/development.md).

Runs Universal Ctags over the library's sources (base/ hooks/ io/ lib/
tools/) and counts the data members of each `class` (ctags kind `member`,
static ones included). A `struct` is a plain record (a report, an options
set: StepReport, BalanceConfig) and is listed with --all only. Also lists
every library .cc over --max_lines (700) lines; hooks/grad_sync.cc, one job
as c10d's reducer.cpp is, is exempt. Exit status 1 when a class has more
than --max (30) members or a file is too long, 2 when ctags is missing.

  scripts/class_sizes.py [--max N] [--max_lines N] [--all]
"""
import argparse
import collections
import os
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DIRS = ["base", "hooks", "io", "lib", "tools"]
EXEMPT_FILES = {"hooks/grad_sync.cc"}


def members():
    """{(kind, scope): [member names]} over the library's sources."""
    out = subprocess.run(
        ["ctags", "-R", "--languages=C++", "--langmap=C++:+.h", "--kinds-C++=m",
         "--fields=+s", "-f", "-"] + DIRS,
        cwd=ROOT, capture_output=True, text=True, check=True).stdout
    found = collections.defaultdict(list)
    for line in out.splitlines():
        fields = line.split("\t")
        for f in fields[3:]:
            kind, _, scope = f.partition(":")
            if kind in ("class", "struct") and scope:
                found[(kind, scope)].append(fields[0])
    return found


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--max", type=int, default=30)
    parser.add_argument("--max_lines", type=int, default=700)
    parser.add_argument("--all", action="store_true", help="list every class and struct")
    args = parser.parse_args()
    if shutil.which("ctags") is None:
        print("class_sizes.py: ctags not found (Debian: apt-get install universal-ctags)",
              file=sys.stderr)
        return 2
    rows = sorted(((len(set(names)), kind, scope) for (kind, scope), names in members().items()),
                  reverse=True)
    over = [r for r in rows if r[1] == "class" and r[0] > args.max]
    for n, kind, scope in rows if args.all else over:
        print(f"{n:4d} {kind} {scope}")
    classes = [r for r in rows if r[1] == "class"]
    print(f"{len(classes)} classes, largest {classes[0][0] if classes else 0} data members; "
          f"{len(over)} over {args.max}", file=sys.stderr)
    long_files = []
    for d in DIRS:
        for base, _, files in os.walk(os.path.join(ROOT, d)):
            for f in files:
                path = os.path.relpath(os.path.join(base, f), ROOT)
                if f.endswith(".cc") and path not in EXEMPT_FILES:
                    with open(os.path.join(ROOT, path), encoding="utf-8", errors="replace") as fh:
                        n = sum(1 for _ in fh)
                    if n > args.max_lines:
                        long_files.append((n, path))
    for n, path in sorted(long_files, reverse=True):
        print(f"{n:5d} lines {path}")
    print(f"{len(long_files)} library .cc files over {args.max_lines} lines", file=sys.stderr)
    return 1 if over or long_files else 0


if __name__ == "__main__":
    sys.exit(main())

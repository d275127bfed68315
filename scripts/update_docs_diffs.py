#!/usr/bin/python3
"""Rewrites the sample diffs in README.md and docs/ (usage, loop, ports).

Each diff block follows a marker line
    <!-- sample diff: PLAIN.cc WRAPPED.cc -->
and holds `diff -u samples/PLAIN.cc samples/WRAPPED.cc` without its two
header lines (what tests/docs_diff_test.cmake compares). Run after changing
a sample pair: ./scripts/update_docs_diffs.py
"""
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
MARKER = re.compile(r"^<!-- sample diff: (\S+) (\S+) -->\n```diff\n.*?^```\n", re.M | re.S)


def body(plain, wrapped):
    out = subprocess.run(["diff", "-u", plain, wrapped], cwd=ROOT / "samples",
                         capture_output=True, text=True)
    if out.returncode not in (0, 1):
        sys.exit(f"diff -u {plain} {wrapped}: {out.stderr.strip()}")
    return out.stdout[out.stdout.index("\n@@") + 1:]


def main():
    for doc in ("README.md", "docs/usage.md", "docs/loop.md", "docs/ports.md"):
        path = ROOT / doc
        text = path.read_text()
        updated = MARKER.sub(
            lambda m: f"<!-- sample diff: {m[1]} {m[2]} -->\n```diff\n{body(m[1], m[2])}```\n", text)
        if updated != text:
            path.write_text(updated)
            print(f"[evenstep] {doc}: sample diffs updated")


if __name__ == "__main__":
    main()

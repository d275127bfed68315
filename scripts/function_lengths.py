#!/usr/bin/python3
"""Functions longer than the house limit (docs/development.md, "Code").

Scans C++ sources outside tests/ and lists every function body longer than
--max lines (100; a `main` may have --max_main, 150), from the line its
declaration starts on to its closing brace, lambdas and local classes
included. Exit status 1 when any is listed.

A brace-matching scan, not a parser: comments, string and character
literals (raw strings too) are skipped; a `{` opens a function when the text
before it (since the last `;`, `{` or `}`) holds a `)` and, outside its
parentheses, no `=` or `namespace`/`class`/`struct`/`enum`/`union` keyword,
at namespace or class scope. Good enough for this code base's style (clang-format'd C++17); it
errs towards counting too little, never too much.

  scripts/function_lengths.py [--max N] [--max_main N] [--all] [paths...]
"""
import argparse
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DIRS = ["base", "hooks", "io", "lib", "tools", "samples", "bench"]
AGGREGATE = re.compile(r"\b(namespace|class|struct|enum|union)\b")


def strip(text):
    """The text with comments and literals blanked (newlines kept)."""
    out = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            out.append(" " * (j - i))
            i = j
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
        elif c == "R" and text.startswith('R"', i) and (i == 0 or not text[i - 1].isalnum()):
            m = re.match(r'R"([^(\s]*)\(', text[i:])
            if not m:
                out.append(c)
                i += 1
                continue
            end = text.find(")" + m.group(1) + '"', i)
            j = n if end < 0 else end + len(m.group(1)) + 2
            out.append('""' + re.sub(r"[^\n]", " ", text[i + 2:j]))
            i = j
        elif c in "\"'":
            j = i + 1
            while j < n and text[j] != c:
                j += 2 if text[j] == "\\" else 1
            out.append(c + " " * (min(j, n) - i - 1) + c)
            i = j + 1
        else:
            out.append(c)
            i += 1
    return "".join(out)


def unparenthesized(head):
    """`head` without what is inside parentheses (default arguments)."""
    out, depth = [], 0
    for c in head:
        if c == "(":
            depth += 1
        elif c == ")":
            depth = max(0, depth - 1)
        elif depth == 0:
            out.append(c)
    return "".join(out)


def functions(path):
    """(name, first line, lines) of each function body in `path`."""
    with open(path, encoding="utf-8", errors="replace") as f:
        text = strip(f.read())
    found = []
    stack = []  # "scope" (namespace, class, data), "fn" or "block"
    head_start = 0  # where the text before the next brace began
    paren = 0  # open parentheses (a brace inside them: an initializer argument)
    for i, c in enumerate(text):
        if c == "(":
            paren += 1
        elif c == ")":
            paren = max(0, paren - 1)
        elif c == ";":
            head_start = i + 1
        elif c == "{" and paren > 0:
            stack.append("inner")
        elif c == "}" and stack and stack[-1] == "inner":
            stack.pop()
        elif c == "{":
            head = text[head_start:i]
            outside = unparenthesized(head)
            if any(k not in ("scope", "inner") for k in stack):
                stack.append("block")
            elif ")" in head and "=" not in outside.replace("operator=", "") \
                    and not AGGREGATE.search(outside):
                first = head_start + len(head) - len(head.lstrip())
                line = text.count("\n", 0, first) + 1
                name = re.findall(r"([~\w:]+)\s*\(", head)
                stack.append(("fn", name[0] if name else "?", line))
            else:
                stack.append("scope")
            head_start = i + 1
        elif c == "}":
            top = stack.pop() if stack else "scope"
            if isinstance(top, tuple):
                _, name, line = top
                end = text.count("\n", 0, i) + 1
                found.append((name, line, end - line + 1))
            head_start = i + 1
    return found


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--max", type=int, default=100)
    parser.add_argument("--max_main", type=int, default=150)
    parser.add_argument("--all", action="store_true", help="list every function, longest first")
    parser.add_argument("paths", nargs="*")
    args = parser.parse_args()
    paths = args.paths
    if not paths:
        for d in DIRS:
            for base, _, files in os.walk(os.path.join(ROOT, d)):
                paths += [os.path.join(base, f) for f in files if f.endswith((".cc", ".h"))]
    rows = []
    for p in sorted(paths):
        for name, line, length in functions(p):
            rows.append((length, os.path.relpath(p, ROOT), line, name))
    rows.sort(reverse=True)
    over = [r for r in rows if r[0] > (args.max_main if r[3] == "main" else args.max)]
    for length, path, line, name in rows if args.all else over:
        print(f"{length:5d} {path}:{line} {name}")
    if not args.all:
        lengths = [r[0] for r in rows]
        mean = sum(lengths) / len(lengths) if lengths else 0
        print(f"{len(rows)} functions, mean {mean:.1f} lines; {len(over)} over {args.max} "
              f"(main: {args.max_main})", file=sys.stderr)
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())

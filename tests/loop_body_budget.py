#!/usr/bin/python3
"""Fails when a port changes more than BUDGET lines inside its training loop.

usage: loop_body_budget.py PLAIN PORT BUDGET

The training loop is the first `for` over batches in each file (`for (auto&
batch : ...)`, or with the batch's type: `for (torch::data::Example<>& batch : ...)`), or over a stream's positions
(`for (int64_t i ...`), from its header to its closing brace. A changed line is a
line of the plain loop that the port removes or replaces, or a line of the
port's loop that it adds (difflib's alignment of the two files).
"""
import difflib
import re
import sys

LOOP = re.compile(r"^\s*for \(((const )?[\w:<>]+&\s*\w+\s*:|int64_t i\b)")


def loop_lines(lines, name):
    """The [first, last] line indices of the training loop in `lines`."""
    for first, line in enumerate(lines):
        if LOOP.match(line):
            depth = 0
            for last in range(first, len(lines)):
                depth += lines[last].count("{") - lines[last].count("}")
                if depth == 0 and "{" in "".join(lines[first:last + 1]):
                    return first, last
    sys.exit(f"{name}: no training loop (a `for (auto& batch : ...)` line, or one naming the type)")


def main():
    if len(sys.argv) != 4:
        sys.exit(__doc__)
    plain_path, port_path, budget = sys.argv[1], sys.argv[2], int(sys.argv[3])
    plain = open(plain_path).read().splitlines()
    port = open(port_path).read().splitlines()
    p0, p1 = loop_lines(plain, plain_path)
    q0, q1 = loop_lines(port, port_path)
    changed = []
    matcher = difflib.SequenceMatcher(a=plain, b=port, autojunk=False)
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag == "equal":
            continue
        changed += [f"-{plain[i]}" for i in range(i1, i2) if p0 <= i <= p1]
        changed += [f"+{port[j]}" for j in range(j1, j2) if q0 <= j <= q1]
    print(f"loop body: {len(changed)} changed lines (budget {budget})")
    for line in changed:
        print("  " + line)
    if len(changed) > budget:
        sys.exit(f"{port_path}: the port changes {len(changed)} lines inside the training loop "
                 f"(budget {budget})")


if __name__ == "__main__":
    main()

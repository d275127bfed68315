#!/usr/bin/env bash
# Regenerates the flag table in docs/flags.md (between the flags:begin/end
# markers) from the flags' help texts. Run after adding or changing a flag;
# the test docs_flags_current fails until you do.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/build.sh evenstep_flags_md >/dev/null
table=$("${EVENSTEP_BUILD_DIR:-build}/tools/evenstep_flags_md")
python3 - "$table" <<'PY'
import re, sys
table = sys.argv[1].rstrip("\n")
text = open("docs/flags.md").read()
new, n = re.subn(r"(<!-- flags:begin -->\n).*?(<!-- flags:end -->)",
                 lambda m: m.group(1) + table + "\n" + m.group(2), text, flags=re.S)
if n != 1:
    sys.exit("docs/flags.md has no flags:begin/flags:end block")
open("docs/flags.md", "w").write(new)
PY
echo "[evenstep] docs/flags.md flag table updated"

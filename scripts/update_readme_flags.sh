#!/usr/bin/env bash
# Regenerates the flag table in README.md (between the flags:begin/end
# markers) from the flags' help texts. Run after adding or changing a flag;
# the test readme_flags_current fails until you do.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/build.sh evenstep_flags_md >/dev/null
table=$("${EVENSTEP_BUILD_DIR:-build}/tools/evenstep_flags_md")
python3 - "$table" <<'PY'
import re, sys
table = sys.argv[1].rstrip("\n")
text = open("README.md").read()
new, n = re.subn(r"(<!-- flags:begin -->\n).*?(<!-- flags:end -->)",
                 lambda m: m.group(1) + table + "\n" + m.group(2), text, flags=re.S)
if n != 1:
    sys.exit("README.md has no flags:begin/flags:end block")
open("README.md", "w").write(new)
PY
echo "[evenstep] README.md flag table updated"

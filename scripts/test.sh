#!/usr/bin/env bash
# Installs what is missing, builds everything, and runs every test with ctest
# (2 at a time; each multi-process test bounded by its own timeout); then the
# same against libtorch 2.x from the PyPI torch wheel (scripts/build_torch2.sh)
# when it fits CI's 25-minute budget: it takes about 11 minutes on 2 cores
# with nothing cached, so it is skipped, loudly, when the first part took
# over 12 minutes. EVENSTEP_TORCH2=1 always runs it, EVENSTEP_TORCH2=0 never.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
./scripts/install_deps.sh
./scripts/build.sh
build_dir=${EVENSTEP_BUILD_DIR:-build}
(cd "$build_dir" && ctest --output-on-failure -j "${EVENSTEP_TEST_JOBS:-2}" --timeout 600)
elapsed=$(( $(date +%s) - start ))
torch2=${EVENSTEP_TORCH2:-auto}
if [ "$torch2" = auto ] && [ "$elapsed" -gt 720 ]; then
  echo "[evenstep] SKIPPED the libtorch 2.x stage: the first part took ${elapsed} s, and the" \
    "2.x stage (~11 min) would pass the 25-minute CI budget; EVENSTEP_TORCH2=1 runs it"
elif [ "$torch2" != 0 ]; then
  echo "[evenstep] first part done in ${elapsed} s; the same against libtorch 2.x" \
    "(EVENSTEP_TORCH2=0 skips this)"
  ./scripts/build_torch2.sh
fi

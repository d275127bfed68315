#!/usr/bin/env bash
# Installs what is missing, builds everything, and runs every test with ctest
# (2 at a time; each multi-process test bounded by its own timeout) against
# Debian's libtorch 1.13; then the same against the newest torch wheel on
# PyPI that the build supports (scripts/build_torch2.sh, which pins it),
# and ends with each stage's torch version and time. Both stages run on
# every landing (CI's limit is 90 minutes; the two take about 40 on 2 cores
# from a fresh clone); EVENSTEP_TORCH2=0 skips the second for quick local
# runs, loudly.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
./scripts/install_deps.sh
./scripts/build.sh
build_dir=${EVENSTEP_BUILD_DIR:-build}
(cd "$build_dir" && ctest --output-on-failure -j "${EVENSTEP_TEST_JOBS:-2}" --timeout 600)
first_s=$(( $(date +%s) - start ))
first="libtorch $(dpkg-query -W -f '${Version}' libtorch-dev 2>/dev/null || echo '?') (Debian): ${first_s} s"
if [ "${EVENSTEP_TORCH2:-1}" = 0 ]; then
  echo "[evenstep] stage times: ${first}; SKIPPED the torch 2.x stage (EVENSTEP_TORCH2=0)"
  exit 0
fi
echo "[evenstep] first stage done: ${first}; the same against the PyPI torch wheel"
second_start=$(date +%s)
./scripts/build_torch2.sh
second_s=$(( $(date +%s) - second_start ))
echo "[evenstep] stage times: ${first}; torch $(cat build-torch2/torch_version) (PyPI wheel):" \
  "${second_s} s; total $(( $(date +%s) - start )) s"

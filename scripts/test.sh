#!/usr/bin/env bash
# Installs what is missing, builds everything, and runs every test with ctest
# (2 at a time; each multi-process test bounded by its own timeout); then the
# same against libtorch 2.x from the PyPI torch wheel (scripts/build_torch2.sh;
# EVENSTEP_TORCH2=0 skips it).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/install_deps.sh
./scripts/build.sh
build_dir=${EVENSTEP_BUILD_DIR:-build}
(cd "$build_dir" && ctest --output-on-failure -j "${EVENSTEP_TEST_JOBS:-2}" --timeout 600)
if [ "${EVENSTEP_TORCH2:-1}" != 0 ]; then
  echo "[evenstep] the same against libtorch 2.x (EVENSTEP_TORCH2=0 skips this)"
  ./scripts/build_torch2.sh
fi

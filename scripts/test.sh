#!/usr/bin/env bash
# Installs what is missing, builds everything, and runs every test with ctest
# (2 at a time; each multi-process test bounded by its own timeout).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/install_deps.sh
./scripts/build.sh
build_dir=${EVENSTEP_BUILD_DIR:-build}
cd "$build_dir"
ctest --output-on-failure -j "${EVENSTEP_TEST_JOBS:-2}" --timeout 600

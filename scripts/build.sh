#!/usr/bin/env bash
# Configures (once) and builds evenstep in ./build with Ninja and ccache.
#   scripts/build.sh [TARGET...]     no targets: build everything
# Environment: EVENSTEP_BUILD_DIR (default build), EVENSTEP_CMAKE_ARGS (extra
# configure arguments, e.g. -DCMAKE_PREFIX_PATH=/opt/libtorch).
set -euo pipefail
cd "$(dirname "$0")/.."
build_dir=${EVENSTEP_BUILD_DIR:-build}
if [ ! -f "$build_dir/build.ninja" ]; then
  echo "[evenstep] configuring $build_dir"
  # shellcheck disable=SC2086
  cmake -S . -B "$build_dir" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo ${EVENSTEP_CMAKE_ARGS:-}
fi
start=$(date +%s)
if [ $# -gt 0 ]; then
  targets=()
  for t in "$@"; do targets+=(--target "$t"); done
  cmake --build "$build_dir" "${targets[@]}"
else
  cmake --build "$build_dir"
fi
echo "[evenstep] build finished in $(( $(date +%s) - start )) s"

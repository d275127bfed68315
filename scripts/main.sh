#!/usr/bin/env bash
# The main job: installs what is missing, builds, and runs the sample on
# local ranks (2 by default; EVENSTEP_NPROC=N for more). Extra arguments go to
# the sample (e.g. --evenstep_timeout=30s).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/install_deps.sh
./scripts/build.sh evenstep-run evenstep_collective_demo
build_dir=${EVENSTEP_BUILD_DIR:-build}
nproc_ranks=${EVENSTEP_NPROC:-2}
echo "[evenstep] running the sample on $nproc_ranks local ranks"
exec "$build_dir/tools/evenstep-run" -n "$nproc_ranks" -- \
  "$build_dir/samples/evenstep_collective_demo" "$@"

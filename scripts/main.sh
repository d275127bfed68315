#!/usr/bin/env bash
# The main job: installs what is missing, builds, and trains the sample (a
# byte-level transformer on Debian's fortune cookies, wrapped with evenstep)
# on local ranks (2 by default; EVENSTEP_NPROC=N for more), then writes the
# imbalance report. Output goes to runs/fortunes/; running it again resumes
# from the latest checkpoint. Extra arguments go to the trainer, e.g.
# --steps 2000 for a longer run, --run NAME for another run directory, or any
# --evenstep_* flag.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/install_deps.sh
# Everything the install rules name, so that `cmake --install build` (launching.md)
# works after this command too.
./scripts/build.sh evenstep evenstep-run evenstep-report evenstep-ckpt evenstep-preflight \
  train_fortunes
build_dir=${EVENSTEP_BUILD_DIR:-build}
nproc_ranks=${EVENSTEP_NPROC:-2}
run=fortunes
args=("$@")
for ((i = 0; i < ${#args[@]}; i++)); do
  case "${args[$i]}" in
    --run=*) run="${args[$i]#--run=}" ;;
    --run) run="${args[$((i + 1))]}" ;;
  esac
done
echo "[evenstep] training the fortunes sample on $nproc_ranks local ranks (runs/$run)"
"$build_dir/tools/evenstep-run" -n "$nproc_ranks" -- "$build_dir/samples/train_fortunes" "$@"
echo "[evenstep] report"
"$build_dir/tools/evenstep-report" "runs/$run"
"$build_dir/tools/evenstep-ckpt" ls "runs/$run/ckpt"
latest=$(cat "runs/$run/ckpt/latest" 2>/dev/null || echo none)
cat <<EOF
[evenstep] run: runs/$run
  checkpoints  runs/$run/ckpt (latest: $latest; run the same command again to continue)
  timelines    runs/$run/trace-*.json, merged in runs/$run/trace.json (https://ui.perfetto.dev)
  report       runs/$run/report.html, runs/$run/report.json
  logs         runs/$run/metrics-*.jsonl
EOF

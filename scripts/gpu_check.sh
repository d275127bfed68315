#!/usr/bin/env bash
# shellcheck disable=SC2317  # the functions run through phase()
# The one command for a lent GPU machine (issue 20): builds evenstep against
# that machine's own torch (its Python's torch.utils.cmake_prefix_path) with
# every other dependency from the bundle scripts/gpu_bundle.sh makes (carry
# .gpu_bundle), runs the `cuda` tests and evenstep-preflight (1 rank, then 2
# sharing the device over Gloo; JSON to $OUT), then short GPU runs of
# bench/ckpt_throughput (GPU-resident state: evenstep's save stall vs
# torch::save after the device-to-host copy vs PyTorch DCP async_save, 1 and
# 4 GiB) and bench/grad_sync on CUDA (two ranks sharing the GPU over Gloo).
# Prints each phase's elapsed time; with $OUT set, writes summary.txt (phase
# results, each test's result, the benchmarks' SUMMARY lines) and
# gpu_check.log (everything) there.
#
#   scripts/gpu_check.sh              build, cuda tests, benchmarks (<= 8 min, 16 cores)
#   scripts/gpu_check.sh --no-bench   build, tests and the preflight only
#
# Environment: EVENSTEP_PYTHON (default python3: the one with torch),
# EVENSTEP_BUNDLE (default .gpu_bundle), EVENSTEP_GPU_BUILD (default
# build-gpu), JOBS (default nproc), EVENSTEP_GPU_CHECK_TESTS (a ctest -R
# regex of more tests to run after the cuda label; scripts/bundle_check.sh
# uses it) and EVENSTEP_GPU_CHECK_TARGETS (the targets those tests need).
# Exit status 0 when every phase passed, 1 otherwise.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
bench=1
for arg in "$@"; do
  case $arg in
    --no-bench) bench=0 ;;
    -h | --help) sed -n '3,23p' "$0"; exit 0 ;;
    *) echo "gpu_check: unknown argument $arg (see --help)" >&2; exit 2 ;;
  esac
done
python=${EVENSTEP_PYTHON:-python3}
bundle=${EVENSTEP_BUNDLE:-.gpu_bundle}
build=${EVENSTEP_GPU_BUILD:-build-gpu}
jobs=${JOBS:-$(nproc)}
if [ ! -d "$bundle/usr/include" ]; then
  echo "gpu_check: no bundle at $bundle: run scripts/gpu_bundle.sh and carry .gpu_bundle" >&2
  exit 2
fi
bundle=$(cd "$bundle" && pwd)
mkdir -p "$build"
build=$(cd "$build" && pwd)
report=${OUT:-$build}
mkdir -p "$report"
summary=$report/summary.txt
log=$report/gpu_check.log
: >"$summary"
: >"$log"
begin=$(date +%s)
failed=0

say() { echo "$*" | tee -a "$summary"; }
# phase NAME COMMAND...: runs it with its output in the log; one line each.
phase() {
  local name=$1 t0 rc
  shift
  t0=$(date +%s)
  echo "=== $name: $*" >>"$log"
  "$@" >>"$log" 2>&1
  rc=$?
  if [ "$rc" -eq 0 ]; then
    say "phase $name: ok in $(($(date +%s) - t0)) s (total $(($(date +%s) - begin)) s)"
  else
    failed=1
    say "phase $name: FAILED (exit $rc) in $(($(date +%s) - t0)) s"
    echo "--- the end of its output:"
    sed -n "/^=== $name: /,\$p" "$log" | tail -n 40
  fi
  return "$rc"
}

# A CUDA torch's CMake package enables CMake's CUDA language: nvcc on the PATH.
if ! command -v nvcc >/dev/null && [ -x /usr/local/cuda/bin/nvcc ]; then
  export PATH=/usr/local/cuda/bin:$PATH
fi

machine() {
  uname -a
  nvidia-smi -L 2>&1 || echo "(no nvidia-smi)"
  "$python" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda,
"available", torch.cuda.is_available(), torch.cuda.device_count(), "device(s)")'
  "${CXX:-c++}" --version | head -n 1
  cmake --version | head -n 1
  echo "ninja $(ninja --version)"
  nvcc --version 2>&1 | tail -n 1 || echo "(no nvcc)"
}
phase machine machine || exit 1
say "$(grep -m1 '^torch ' "$log")"

# The bundle's libraries, and from its fallback/ those this system lacks
# (found in neither the loader's cache nor the default directories).
libs=$build/fallback-libs
rm -rf "$libs"
mkdir -p "$libs"
have() {
  { ldconfig -p 2>/dev/null || /sbin/ldconfig -p 2>/dev/null; } | awk '{print $1}' | grep -qxF "$1" ||
    [ -e "/lib/x86_64-linux-gnu/$1" ] || [ -e "/usr/lib/x86_64-linux-gnu/$1" ] ||
    [ -e "/lib64/$1" ] || [ -e "/usr/lib64/$1" ]
}
taken=()
for f in "$bundle"/fallback/lib/x86_64-linux-gnu/*.so.* "$bundle"/fallback/usr/lib/x86_64-linux-gnu/*.so.*; do
  [ -e "$f" ] || continue
  name=$(basename "$f")
  if ! have "$name"; then
    ln -sf "$f" "$libs/$name"
    taken+=("$name")
  fi
done
say "fallback libraries taken from the bundle (missing here): ${taken[*]:-none}"
lib=$bundle/usr/lib/x86_64-linux-gnu
export EVENSTEP_FORTUNES_DIR=$bundle/usr/share/games/fortunes  # the sample trainer's data
export LD_LIBRARY_PATH="$lib:$lib/hdf5/serial:$libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"

configure() {
  local prefix
  prefix=$("$python" -c 'import torch.utils; print(torch.utils.cmake_prefix_path)') || return 1
  # The torch package root first: TorchConfig's find_library would
  # otherwise take a system libtorch (as scripts/build_torch2.sh).
  prefix="$(dirname "$(dirname "$prefix")");$prefix"
  # A CUDA wheel's libtorch_cuda.so needs the NVIDIA runtime wheels'
  # libraries at link time too: their folders for -rpath-link.
  local site nvlibs
  site=$("$python" -c 'import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))')
  nvlibs=$(find "$site/nvidia" -name '*.so*' -printf '%h\n' 2>/dev/null | sort -u | paste -sd:)
  local link=${nvlibs:+-Wl,-rpath-link,$nvlibs}
  # -isystem: headers found by no package (Gloo's, which c10d's
  # ProcessGroupGloo.hpp includes; a torch wheel ships none).
  cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DCMAKE_CXX_FLAGS="-isystem $bundle/usr/include" \
    -DCMAKE_EXE_LINKER_FLAGS="$link" -DCMAKE_SHARED_LINKER_FLAGS="$link" \
    -DCMAKE_PREFIX_PATH="$prefix;$bundle/usr" \
    -DCMAKE_INCLUDE_PATH="$bundle/usr/include;$bundle/usr/include/hdf5/serial" \
    -DCMAKE_LIBRARY_PATH="$lib;$lib/hdf5/serial" \
    -Dabsl_DIR="$lib/cmake/absl" -DGTest_DIR="$lib/cmake/GTest" \
    -Dbenchmark_DIR="$lib/cmake/benchmark" -DBoost_DIR="$lib/cmake/Boost-1.74.0" \
    -Dnlohmann_json_DIR="$bundle/usr/share/cmake/nlohmann_json" \
    -DEVENSTEP_BUILD_FUZZ=OFF \
    -DEVENSTEP_TORCH_PYTHON="$(command -v "$python")" \
    -DEVENSTEP_PEER_PYTHON="$(command -v "$python")"
}
phase configure configure || exit 1
targets=(cuda_test evenstep-run evenstep-preflight)
if [ "$bench" -eq 1 ]; then targets+=(evenstep_bench_ckpt_throughput evenstep_bench_grad_sync); fi
# shellcheck disable=SC2206  # a list of target names
targets+=(${EVENSTEP_GPU_CHECK_TARGETS:-})
phase build cmake --build "$build" -j "$jobs" --target "${targets[@]}" || exit 1

# No test selected is a failure (ctest itself exits 0 then).
run_tests() {
  local regex=$1
  (cd "$build" && ctest "${@:2}" --output-on-failure --timeout 300 -j 4 ${regex:+-R "$regex"} \
    --no-tests=error)
}
phase cuda_tests run_tests "" -L cuda
sed -n '/^=== cuda_tests: /,$p' "$log" | grep -E '^ *[0-9]+/[0-9]+ Test +#' |
  sed -E 's/^ *[0-9]+\/[0-9]+ Test +#[0-9]+: //; s/ \.+ */ /; s/\*+//' >>"$summary"
if [ -n "${EVENSTEP_GPU_CHECK_TESTS:-}" ]; then
  phase more_tests run_tests "$EVENSTEP_GPU_CHECK_TESTS"
  sed -n '/^=== more_tests: /,$p' "$log" | grep -E '^[0-9]+% tests passed' >>"$summary"
fi

# The preflight's figures on this machine's device (bf16 products,
# host-to-device copies, free device memory, the all-reduce): one rank over
# the default backend (NCCL on a GPU), then two ranks sharing the device over
# Gloo. Exit 3 (an outlier named) counts as run: the figures are the point.
preflight() {
  local ranks=$1 rc
  "$build/tools/evenstep-run" -n "$ranks" -- "$build/tools/evenstep-preflight" --quick \
    --evenstep_ckpt_dir="$build/preflight_ckpt" --json="$report/preflight-$ranks.json" "${@:2}"
  rc=$?
  rm -rf "$build/preflight_ckpt"
  [ "$rc" -eq 0 ] || [ "$rc" -eq 3 ]
}
for ranks in 1 2; do
  backend=()
  if [ "$ranks" -gt 1 ]; then backend=(--evenstep_backend=gloo); fi
  phase "preflight_$ranks" preflight "$ranks" "${backend[@]}"
  sed -n "/^=== preflight_$ranks: /,\$p" "$log" | grep '^\[0\] ' | grep -v '\[Gloo\]' | sed 's/^\[0\] /  /' >>"$summary"
done

if [ "$bench" -eq 1 ]; then
  ckpt_dir=$build/ckpt_bench
  phase ckpt_throughput "$build/bench/evenstep_bench_ckpt_throughput" --device=cuda \
    --sizes_mb=1024,4096 --ranks=1 --dir="$ckpt_dir" --torch_python="$(command -v "$python")"
  rm -rf "$ckpt_dir"
  phase grad_sync "$build/bench/evenstep_bench_grad_sync" --device=cuda --evenstep_backend=gloo \
    --steps=10 --torch_python="$(command -v "$python")"
  grep -E '^(\[0\] )?SUMMARY ' "$log" | sed -E 's/^\[0\] //' >>"$summary"
fi
say "gpu_check: $([ "$failed" -eq 0 ] && echo passed || echo FAILED) in $(($(date +%s) - begin)) s"
echo "--- summary ($summary):"
cat "$summary"
exit "$failed"

#!/usr/bin/env bash
# The libtorch 2.x configuration in one command: downloads the PyPI torch
# wheel (>= 2.7: earlier wheels use the pre-C++11 string ABI, which cannot
# link with Debian's Abseil/GoogleTest) and the NVIDIA runtime wheels its
# libtorch_cuda.so needs at link and load time (CPU-only use; no GPU needed),
# installs them into a venv per version under .torch2/ (Debian's python3 with
# its system packages), builds evenstep against the wheel's libtorch
# (torch.utils.cmake_prefix_path) into build-torch2/ and runs every test
# there (the PyTorch interop test loads checkpoints with the wheel's torch),
# then smoke runs of the DCP and DDP peers (bench/dcp_peer.py,
# bench/ddp_grad_sync_peer.py) on that torch.
#   ./scripts/build_torch2.sh                  # the pinned newest torch
#   TORCH_VERSION=2.8.0 ./scripts/build_torch2.sh   # the oldest supported
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/install_deps.sh
. scripts/torch_pin.sh  # EVENSTEP_TORCH_NEWEST: the one pin
version=${TORCH_VERSION:-$EVENSTEP_TORCH_NEWEST}
root=$PWD/.torch2
venv=$root/venv-$version
nvlib=$root/nvlib-$version
mkdir -p "$root"
# A venv of Debian's python3 that also sees Debian's h5py/numpy/xxhash; the
# wheel's torch in it shadows Debian's python3-torch.
if [ ! -x "$venv/bin/pip" ]; then
  /usr/bin/python3 -m venv --system-site-packages "$venv"  # python3-venv: install_deps.sh
fi
py=$venv/bin/python
if [ ! -f "$venv/torch-$version.done" ]; then
  echo "[evenstep] downloading torch $version and its NVIDIA runtime wheels from PyPI"
  start=$(date +%s)
  "$venv/bin/pip" download -q -d "$root/wheels-$version" "torch==$version"
  echo "[evenstep] downloaded in $(( $(date +%s) - start )) s; installing into $venv"
  start=$(date +%s)
  "$venv/bin/pip" install -q --no-index --find-links "$root/wheels-$version" "torch==$version"
  echo "[evenstep] installed in $(( $(date +%s) - start )) s"
  rm -rf "$root/wheels-$version" "$nvlib"
  touch "$venv/torch-$version.done"
fi
# libtorch_cuda.so needs the NVIDIA runtime libraries at link and load time.
site=$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
if [ ! -d "$nvlib" ]; then
  mkdir -p "$nvlib"
  find "$site/nvidia" -name '*.so*' -exec ln -sf {} "$nvlib/" \;
fi
export LD_LIBRARY_PATH="$nvlib:${LD_LIBRARY_PATH:-}"
# .torch2/venv: the venv last built against, where the benchmarks' PyTorch
# peers look for torch by default (a directory of the old one-venv layout
# is left alone).
if [ -L "$root/venv" ] || [ ! -e "$root/venv" ]; then
  ln -sfn "venv-$version" "$root/venv"
fi
# torch.utils.cmake_prefix_path (TorchConfig.cmake) and the package root
# before it: TorchConfig's find_library would otherwise take Debian's
# /usr/lib/x86_64-linux-gnu/libtorch.so from the system paths.
prefix=$("$py" -c 'import torch.utils; print(torch.utils.cmake_prefix_path)')
prefix="$(dirname "$(dirname "$prefix")");$prefix"
echo "[evenstep] torch $("$py" -c 'import torch; print(torch.__version__)') at $prefix"
build=build-torch2
# One build directory for whichever version was built last: another version
# configures afresh (ccache keeps what does not depend on the torch headers).
if [ -f "$build/CMakeCache.txt" ] && [ "$(cat "$build/torch_version" 2>/dev/null)" != "$version" ]; then
  echo "[evenstep] $build was built against torch $(cat "$build/torch_version" 2>/dev/null || echo '?'); configuring it afresh for $version"
  rm -rf "$build"
fi
mkdir -p "$build"
echo "$version" > "$build/torch_version"
# The benchmarks and the manifest fuzzer (built from ATen-free io/ sources)
# do not depend on the libtorch version: the first configuration runs them.
cmake -S . -B "$build" -G Ninja -DEVENSTEP_BUILD_BENCH=OFF -DEVENSTEP_BUILD_FUZZ=OFF \
  -DCMAKE_PREFIX_PATH="$prefix" -DEVENSTEP_TORCH_PYTHON="$py" -DEVENSTEP_PEER_PYTHON="$py" \
  -DCMAKE_EXE_LINKER_FLAGS="-Wl,-rpath-link,$nvlib" \
  -DCMAKE_SHARED_LINKER_FLAGS="-Wl,-rpath-link,$nvlib"
start=$(date +%s)
cmake --build "$build"
echo "[evenstep] built against torch $version in $(( $(date +%s) - start )) s"
# Tests of code that does not touch libtorch (the launcher, the launch
# environment, the docs checks) and the 10-moment launcher SIGTERM test
# (its Session path runs here in PreemptionTest.ASignalToOneRank...) ran in
# the first configuration; the rest runs again against this libtorch.
(cd "$build" && ctest -j2 --output-on-failure \
  -E '^(LauncherTest|LaunchEnvTest|SlurmNodelistTest|StatusMacrosTest)\.|^docs_|^layering$|SigtermToTheLauncherAtTenRandomMoments')
# The PyTorch peers of the benchmarks, on the wheel's torch (smoke runs):
# DCP (bench/ckpt_throughput) and DDP (bench/grad_sync, bench/sync_topology).
# Each peer's whole output is kept; a failure prints it (a CI log used to
# show only that the DDP peer failed after printing its result, not why).
# A peer that fails once runs once more, both outputs shown: a smoke run of
# a benchmark's comparison, not a test of evenstep; a second failure stops.
peer_dir=$(mktemp -d)
smoke() {  # smoke NAME RESULT_PREFIX COMMAND...: runs it, prints its result line
  local name=$1 prefix=$2 try rc log
  log="$peer_dir/$(basename "$name").log"
  shift 2
  for try in 1 2; do
    rc=0
    rm -rf "$peer_dir/dcp" && mkdir -p "$peer_dir/dcp"
    timeout 600 "$@" > "$log" 2>&1 || rc=$?
    if [ "$rc" = 0 ] && grep "^$prefix " "$log"; then return 0; fi
    echo "[evenstep] $name failed with torch $version (try $try, exit status $rc); its output:" >&2
    tail -n 80 "$log" >&2
  done
  return 1
}
smoke bench/dcp_peer.py RESULT "$py" bench/dcp_peer.py --size_mb 8 --ranks 2 --dir "$peer_dir/dcp" || exit 1
smoke bench/ddp_grad_sync_peer.py DDP_PEER env OMP_NUM_THREADS=1 "$py" bench/ddp_grad_sync_peer.py \
  --shapes mlp:64,branch:64 --layers 2 --batch 8 --steps 2 --bucket_bytes mlp=65536,branch=65536 || exit 1
rm -rf "$peer_dir"
echo "[evenstep] torch $version: built, tested, peers ran"

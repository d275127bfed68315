#!/usr/bin/env bash
# The libtorch 2.x configuration in one command: downloads the PyPI torch
# wheel (>= 2.7: earlier wheels use the pre-C++11 string ABI, which cannot
# link with Debian's Abseil/GoogleTest) and the NVIDIA runtime wheels its
# libtorch_cuda.so needs at link and load time (CPU-only use; no GPU needed),
# installs them into a venv under .torch2/ (Debian's python3 with its system
# packages), builds evenstep against the wheel's libtorch
# (torch.utils.cmake_prefix_path) into build-torch2/ and runs every test
# there (the PyTorch interop test loads checkpoints with the wheel's torch),
# then a smoke run of the DCP peer (bench/dcp_peer.py).
#   ./scripts/build_torch2.sh            # torch 2.8.0
#   TORCH_VERSION=2.9.0 ./scripts/build_torch2.sh
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/install_deps.sh
version=${TORCH_VERSION:-2.8.0}
root=$PWD/.torch2
mkdir -p "$root"
# A venv of Debian's python3 that also sees Debian's h5py/numpy/xxhash; the
# wheel's torch in it shadows Debian's python3-torch.
if [ ! -x "$root/venv/bin/pip" ]; then
  /usr/bin/python3 -m venv --system-site-packages "$root/venv"  # python3-venv: install_deps.sh
fi
py=$root/venv/bin/python
if [ ! -f "$root/torch-$version.done" ]; then
  echo "[evenstep] downloading torch $version and its NVIDIA runtime wheels from PyPI"
  start=$(date +%s)
  "$root/venv/bin/pip" download -q -d "$root/wheels" "torch==$version"
  echo "[evenstep] downloaded in $(( $(date +%s) - start )) s; installing into $root/venv"
  start=$(date +%s)
  "$root/venv/bin/pip" install -q --no-index --find-links "$root/wheels" "torch==$version"
  echo "[evenstep] installed in $(( $(date +%s) - start )) s"
  rm -rf "$root/wheels" "$root/nvlib"
  touch "$root/torch-$version.done"
fi
# libtorch_cuda.so needs the NVIDIA runtime libraries at link and load time.
site=$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
if [ ! -d "$root/nvlib" ]; then
  mkdir -p "$root/nvlib"
  find "$site/nvidia" -name '*.so*' -exec ln -sf {} "$root/nvlib/" \;
fi
export LD_LIBRARY_PATH="$root/nvlib:${LD_LIBRARY_PATH:-}"
# torch.utils.cmake_prefix_path (TorchConfig.cmake) and the package root
# before it: TorchConfig's find_library would otherwise take Debian's
# /usr/lib/x86_64-linux-gnu/libtorch.so from the system paths.
prefix=$("$py" -c 'import torch.utils; print(torch.utils.cmake_prefix_path)')
prefix="$(dirname "$(dirname "$prefix")");$prefix"
echo "[evenstep] torch $("$py" -c 'import torch; print(torch.__version__)') at $prefix"
build=build-torch2
# The benchmarks and the manifest fuzzer (built from ATen-free io/ sources)
# do not depend on the libtorch version: the first configuration runs them.
cmake -S . -B "$build" -G Ninja -DEVENSTEP_BUILD_BENCH=OFF -DEVENSTEP_BUILD_FUZZ=OFF \
  -DCMAKE_PREFIX_PATH="$prefix" -DEVENSTEP_TORCH_PYTHON="$py" \
  -DCMAKE_EXE_LINKER_FLAGS="-Wl,-rpath-link,$root/nvlib" \
  -DCMAKE_SHARED_LINKER_FLAGS="-Wl,-rpath-link,$root/nvlib"
start=$(date +%s)
cmake --build "$build"
echo "[evenstep] built against torch $version in $(( $(date +%s) - start )) s"
# Tests of code that does not touch libtorch (the launcher, the launch
# environment, the docs checks) and the 10-moment launcher SIGTERM test
# (its Session path runs here in PreemptionTest.ASignalToOneRank...) ran in
# the first configuration; the rest runs again against this libtorch.
(cd "$build" && ctest -j2 --output-on-failure \
  -E '^(LauncherTest|LaunchEnvTest|SlurmNodelistTest|StatusMacrosTest)\.|^docs_|^layering$|SigtermToTheLauncherAtTenRandomMoments')
# The PyTorch DCP peer of bench/ckpt_throughput, on the wheel's torch (smoke run).
peer_dir=$(mktemp -d)
if ! "$py" bench/dcp_peer.py --size_mb 8 --ranks 2 --dir "$peer_dir" 2>&1 | grep "^RESULT "; then
  echo "[evenstep] bench/dcp_peer.py failed with torch $version" >&2
  exit 1
fi
rm -rf "$peer_dir"

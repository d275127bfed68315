#!/usr/bin/env bash
# The libtorch 2.x configuration in one command: downloads the PyPI torch
# wheel (>= 2.7: earlier wheels use the pre-C++11 string ABI, which cannot
# link with Debian's Abseil/GoogleTest) and the NVIDIA runtime wheels its
# libtorch_cuda.so needs at link and load time (CPU-only use; no GPU needed),
# unpacks their libraries under .torch2/, builds evenstep against them into
# build-torch2/ and runs every test there.
#   ./scripts/build_torch2.sh            # torch 2.8.0
#   TORCH_VERSION=2.9.0 ./scripts/build_torch2.sh
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/install_deps.sh
version=${TORCH_VERSION:-2.8.0}
root=$PWD/.torch2
mkdir -p "$root"
if [ ! -x "$root/venv/bin/pip" ]; then
  apt-get install -y -qq --no-install-recommends python3-venv python3-pip >/dev/null
  python3 -m venv "$root/venv"
fi
if [ ! -f "$root/torch-$version.done" ]; then
  echo "[evenstep] downloading torch $version and its NVIDIA runtime wheels from PyPI"
  start=$(date +%s)
  "$root/venv/bin/pip" download -q -d "$root/wheels" "torch==$version"
  echo "[evenstep] downloaded in $(( $(date +%s) - start )) s; unpacking libraries"
  rm -rf "$root/torch" "$root/nvidia" "$root/nvlib"
  (cd "$root" && unzip -q -o "wheels/torch-$version-"*.whl 'torch/include/*' 'torch/lib/*' 'torch/share/*')
  for w in "$root"/wheels/nvidia_*.whl; do (cd "$root" && unzip -q -o "$w" 'nvidia/*/lib/*' || true); done
  mkdir -p "$root/nvlib"
  find "$root/nvidia" -name '*.so*' -exec ln -sf {} "$root/nvlib/" \;
  touch "$root/torch-$version.done"
fi
export LD_LIBRARY_PATH="$root/nvlib:${LD_LIBRARY_PATH:-}"
build=build-torch2
cmake -S . -B "$build" -G Ninja -DEVENSTEP_BUILD_BENCH=OFF \
  -DCMAKE_PREFIX_PATH="$root/torch" \
  -DCMAKE_EXE_LINKER_FLAGS="-Wl,-rpath-link,$root/nvlib" \
  -DCMAKE_SHARED_LINKER_FLAGS="-Wl,-rpath-link,$root/nvlib"
start=$(date +%s)
cmake --build "$build"
echo "[evenstep] built against torch $version in $(( $(date +%s) - start )) s"
cd "$build" && ctest -j2 --output-on-failure -E find_package_consumer

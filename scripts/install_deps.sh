#!/usr/bin/env bash
# Installs every Debian bookworm package evenstep needs to build, test and run
# its sample. Idempotent: packages already present are not touched, so a second
# run costs one dpkg query. Must run as root (or with sudo available).
set -euo pipefail

PACKAGES=(
  build-essential cmake ninja-build ccache pkg-config git
  libtorch-dev libgloo-dev
  libhdf5-dev
  libabsl-dev
  libboost-fiber-dev libboost-context-dev
  libgtest-dev libgmock-dev libbenchmark-dev
  libxxhash-dev nlohmann-json3-dev hdf5-tools
  python3 python3-h5py python3-numpy python3-matplotlib python3-xxhash python3-torch
  python3-venv python3-pip
  fortunes procps iproute2 util-linux universal-ctags
)

missing=()
for p in "${PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if [ ${#missing[@]} -eq 0 ]; then
  echo "[evenstep] all ${#PACKAGES[@]} Debian packages already installed"
  exit 0
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
  command -v sudo >/dev/null || { echo "[evenstep] need root to install: ${missing[*]}" >&2; exit 1; }
  SUDO="sudo"
fi
echo "[evenstep] installing ${#missing[@]} packages: ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
echo "[evenstep] dependencies installed"

#!/usr/bin/env bash
# Makes the bundle a device machine needs to build evenstep against its own
# torch (issue 20): the headers, shared libraries and CMake files of every
# dependency besides torch, from Debian bookworm's packages (apt-get download
# + dpkg -x into one prefix), for a machine that has neither Debian's -dev
# packages nor a network. Boost's headers are pruned to those
# <boost/fiber/all.hpp> reaches (the compiler's own dependency list), which
# keeps the bundle small.
#
#   scripts/gpu_bundle.sh [OUT]     (default .gpu_bundle, ignored by git)
#
# Prints the bundle's size and the libraries its shared objects need that
# are neither in the bundle nor part of a base system (glibc, libstdc++):
# those must exist on the device machine.
#
# Status: the bundle is made and measured here. The clean-environment build
# that proves it complete (issue 20) is not written yet.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-.gpu_bundle}
packages=(
  libabsl-dev libabsl20220623
  libboost1.74-dev libboost-fiber1.74-dev libboost-fiber1.74.0
  libboost-context1.74-dev libboost-context1.74.0
  libhdf5-dev libhdf5-103-1 libaec0 libsz2
  libxxhash-dev libxxhash0
  nlohmann-json3-dev
  libgtest-dev libgmock-dev libbenchmark-dev libbenchmark1debian
)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
echo "gpu_bundle: downloading ${#packages[@]} packages"
(cd "$work" && { apt-get download -q "${packages[@]}" 2>&1 | grep -v "unsandboxed" || true; })
n=$(find "$work" -name '*.deb' | wc -l)
if [ "$n" -ne "${#packages[@]}" ]; then
  echo "gpu_bundle: got $n of ${#packages[@]} packages; apt-get update may be needed" >&2
  exit 1
fi
rm -rf "$out.tmp"
mkdir -p "$out.tmp"
for deb in "$work"/*.deb; do dpkg -x "$deb" "$out.tmp"; done
# Boost: only the headers Boost.Fiber's umbrella header reaches.
inc="$out.tmp/usr/include"
keep=$(echo '#include <boost/fiber/all.hpp>' | g++ -std=c++17 -x c++ -E -M -nostdinc++ \
  -isystem "$inc" -I/usr/include/c++/12 -I/usr/include/x86_64-linux-gnu/c++/12 - 2>/dev/null |
  tr -d '\134' | tr -s ' ' '\n' | grep "^$inc/boost/" | sed "s|^$inc/||" | sort -u)
mkdir -p "$work/boost"
while read -r h; do
  mkdir -p "$work/boost/$(dirname "$h")"
  cp "$inc/$h" "$work/boost/$h"
done <<<"$keep"
rm -rf "$inc/boost"
mv "$work/boost/boost" "$inc/boost"
# Documentation and static archives nobody links.
rm -rf "$out.tmp/usr/share/doc" "$out.tmp/usr/share/man" "$out.tmp/usr/share/lintian"
find "$out.tmp" -name '*.a' ! -name 'libgtest*' ! -name 'libgmock*' ! -name 'libbenchmark*' -delete
rm -rf "$out"
mv "$out.tmp" "$out"
echo "gpu_bundle: $out: $(du -sh "$out" | cut -f1), $(echo "$keep" | wc -l) Boost headers kept"
# What the bundle's libraries need from outside it.
echo "gpu_bundle: libraries needed from the device machine's system:"
find "$out" -name '*.so*' -type f -exec objdump -p {} \; 2>/dev/null |
  awk '/NEEDED/ {print $2}' | sort -u | while read -r lib; do
  if ! find "$out" -name "$lib" | grep -q .; then echo "  $lib"; fi
done

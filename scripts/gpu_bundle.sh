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
# The libraries those shared objects need in turn (libcurl and its own
# dependencies, for HDF5) come along in fallback/, used only where the device
# machine lacks them; only glibc, libstdc++ and libgcc_s must be there.
# scripts/bundle_check.sh proves the bundle complete: it builds and runs
# evenstep in a bare Debian root that holds nothing else but a torch wheel.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-.gpu_bundle}
packages=(
  libabsl-dev libabsl20220623
  libboost1.74-dev libboost-fiber1.74-dev libboost-fiber1.74.0
  libboost-context1.74-dev libboost-context1.74.0
  libboost-filesystem1.74-dev libboost-filesystem1.74.0  # Boost.Fiber's CMake package asks for it
  libhdf5-dev libhdf5-103-1 libaec0 libsz2
  libxxhash-dev libxxhash0
  nlohmann-json3-dev
  libgloo-dev  # c10d's ProcessGroupGloo.hpp includes them; a torch wheel has none
  libgtest-dev libgmock-dev libbenchmark-dev libbenchmark1debian
  fortunes-min fortunes  # the sample trainer's data (its CUDA test)
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
# The libraries those need in turn, beyond a base system (glibc's libraries,
# libstdc++, libgcc), also from Debian's packages (the ones this machine has installed),
# into fallback/: scripts/gpu_check.sh uses each only where the device
# machine's system lacks that library (HDF5 needs libcurl, for one).
base='^(ld-linux-x86-64\.so\.2|libc\.so\.6|libm\.so\.6|libmvec\.so\.1|libresolv\.so\.2|libutil\.so\.1|libanl\.so\.1|libpthread\.so\.0|libdl\.so\.2|librt\.so\.1|libstdc\+\+\.so\.6|libgcc_s\.so\.1)$'
missing_libs() {
  find "$out.tmp" \( -name '*.so' -o -name '*.so.*' \) -type f -exec objdump -p {} \; 2>/dev/null |
    awk '/NEEDED/ {print $2}' | sort -u | grep -Ev "$base" | while read -r lib; do
    find "$out.tmp" -name "$lib" | grep -q . || echo "$lib"
  done
}
for round in 1 2 3 4 5 6 7 8; do
  missing=$(missing_libs)
  [ -z "$missing" ] && break
  pkgs=$(for lib in $missing; do
    dpkg -S "*x86_64-linux-gnu/$lib" 2>/dev/null | head -1 | cut -d: -f1
  done | sort -u)
  if [ -z "$pkgs" ]; then
    echo "gpu_bundle: no installed package provides: $missing" >&2
    exit 1
  fi
  echo "gpu_bundle: round $round: $(echo "$missing" | wc -w) libraries needed from $(echo "$pkgs" | tr "\n" " ")"
  rm -f "$work"/*.deb
  # shellcheck disable=SC2086  # one word per package
  (cd "$work" && { apt-get download -q $pkgs 2>&1 | grep -v "unsandboxed" || true; })
  for deb in "$work"/*.deb; do dpkg -x "$deb" "$out.tmp/fallback"; done
done
if [ -n "$(missing_libs)" ]; then
  echo "gpu_bundle: still missing after 8 rounds: $(missing_libs)" >&2
  exit 1
fi
# Documentation and static archives nobody links.
rm -rf "$out.tmp/usr/share/doc" "$out.tmp/usr/share/man" "$out.tmp/usr/share/lintian"
rm -rf "$out.tmp/fallback/usr/share" "$out.tmp/fallback/etc" "$out.tmp/fallback/usr/bin"
find "$out.tmp" -name '*.a' ! -name 'libgtest*' ! -name 'libgmock*' ! -name 'libbenchmark*' -delete
rm -rf "$out"
mv "$out.tmp" "$out"
echo "gpu_bundle: $out: $(du -sh "$out" | cut -f1) ($(du -sh "$out/fallback" | cut -f1) of it in fallback/), $(echo "$keep" | wc -l) Boost headers kept"
echo "gpu_bundle: the device machine must provide glibc, libstdc++ (GCC >= 12) and libgcc_s"

# The one pin of the newest torch wheel (PyPI) that evenstep builds and
# passes with, sourced by scripts/build_torch2.sh (the second stage of
# scripts/test.sh, on every landing) and scripts/bundle_check.sh.
# 2.15.0: released October 2026; the newest on PyPI when checked, 2026-12-03.
# The oldest 2.x supported: 2.7.0 (the first wheel with the C++11 string ABI,
# which Debian's Abseil and GoogleTest need); 2.8.0 is the oldest tested.
EVENSTEP_TORCH_NEWEST=2.15.0

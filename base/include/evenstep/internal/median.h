// The two medians evenstep uses, one name each:
//   UpperMedian: the upper middle element for an even count (nth_element),
//     for lib/'s fits and plans, which want a value that occurred;
//   Median: the mean of the two middle elements for an even count, for
//     reports and verdicts across ranks (with 2 ranks, the later arrival is
//     late against their midpoint).
// Both are 0 for none.
#pragma once

#include <algorithm>
#include <vector>

namespace evenstep::internal {

inline double UpperMedian(std::vector<double> v) {
  if (v.empty()) return 0;
  const size_t mid = v.size() / 2;
  std::nth_element(v.begin(), v.begin() + mid, v.end());
  return v[mid];
}

inline double Median(std::vector<double> v) {
  if (v.empty()) return 0;
  const size_t mid = v.size() / 2;
  std::nth_element(v.begin(), v.begin() + mid, v.end());
  if (v.size() % 2 == 1) return v[mid];
  return 0.5 * (v[mid] + *std::max_element(v.begin(), v.begin() + mid));
}

}  // namespace evenstep::internal

// The median that lib/'s fits and plans use: the upper middle element for an
// even count (nth_element), 0 for none. (tools/evenstep-report averages the
// middle two instead: it reports skews between 2 ranks.)
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

}  // namespace evenstep::internal

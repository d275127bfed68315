#include "evenstep/internal/shard_plan.h"

#include <algorithm>
#include <numeric>
#include <queue>

#include "absl/strings/str_cat.h"

namespace evenstep::internal {

std::vector<std::vector<Piece>> PlanShards(const std::vector<TensorMeta>& tensors, int world,
                                           int64_t slice_bytes) {
  std::vector<Piece> pieces;
  for (int t = 0; t < static_cast<int>(tensors.size()); ++t) {
    const TensorMeta& m = tensors[t];
    const int64_t bytes = m.numel * m.element_size;
    if (bytes <= slice_bytes || m.numel <= 1) {
      pieces.push_back({t, 0, m.numel, true});
      continue;
    }
    const int64_t per_slice = std::max<int64_t>(1, slice_bytes / m.element_size);
    for (int64_t b = 0; b < m.numel; b += per_slice) {
      pieces.push_back({t, b, std::min(m.numel, b + per_slice), false});
    }
  }
  auto bytes_of = [&](const Piece& p) {
    return (p.end - p.begin) * tensors[p.tensor].element_size;
  };
  std::vector<size_t> order(pieces.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t a, size_t b) { return bytes_of(pieces[a]) > bytes_of(pieces[b]); });
  using Load = std::pair<int64_t, int>;  // (bytes, rank): min-heap
  std::priority_queue<Load, std::vector<Load>, std::greater<Load>> heap;
  for (int r = 0; r < world; ++r) heap.push({0, r});
  std::vector<std::vector<Piece>> plan(world);
  for (size_t i : order) {
    auto [load, r] = heap.top();
    heap.pop();
    plan[r].push_back(pieces[i]);
    heap.push({load + bytes_of(pieces[i]), r});
  }
  // Within a shard, keep the state's order (readers find tensors in order).
  for (auto& shard : plan) {
    std::stable_sort(shard.begin(), shard.end(), [](const Piece& a, const Piece& b) {
      return a.tensor != b.tensor ? a.tensor < b.tensor : a.begin < b.begin;
    });
  }
  return plan;
}

std::string DatasetPath(const TensorMeta& tensor, const Piece& piece) {
  return piece.whole ? absl::StrCat("/", tensor.name)
                     : absl::StrCat("/", tensor.name, "@", piece.begin);
}

}  // namespace evenstep::internal

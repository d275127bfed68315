// This rank's micro-batch cap: learned from failures, predicted from peaks.
#include "evenstep/internal/memory_caps.h"

#include <algorithm>
#include <cstdlib>
#include <utility>

namespace evenstep::internal {

int64_t MemoryCaps::cap() const {
  if (learned_ <= 0) return predicted_;
  return predicted_ <= 0 ? learned_ : std::min(learned_, predicted_);
}

void MemoryCaps::Record(size_t part, int64_t padded_tokens, int64_t peak_bytes) {
  if (predicting() && peak_bytes > 0 && part < fits_.size()) {
    fits_[part].Record(padded_tokens, peak_bytes);
  }
}

void MemoryCaps::NoteFailed(int64_t padded_tokens) {
  failed_min_ = std::min(failed_min_, padded_tokens);
  step_failed_max_ = std::max(step_failed_max_, padded_tokens);
}

void MemoryCaps::Learn(int64_t largest) {
  learned_ = std::min(std::max(learned_, largest), failed_min_ - 1);
}

std::optional<MemoryCaps::Prediction> MemoryCaps::Predict() {
  if (!predicting()) return std::nullopt;
  Prediction p;
  for (size_t k = 0; k < fits_.size(); ++k) {
    const int64_t c = fits_[k].Cap(budget_);
    if (c <= 0) return std::nullopt;  // a part without a prediction yet
    if (p.cap == 0 || c < p.cap) {
      p.cap = c;
      p.part = k;
    }
  }
  if (failed_min_ != std::numeric_limits<int64_t>::max()) {
    p.cap = std::max<int64_t>(1, std::min(p.cap, failed_min_ - 1));
  }
  // The fit moves a little with every micro-step; the cap only with a
  // change of more than 5 %.
  if (predicted_ > 0 && std::abs(p.cap - predicted_) * 20 <= predicted_) return std::nullopt;
  predicted_ = p.cap;
  p.line = fits_[p.part].line();
  return p;
}

void MemoryCaps::Restore(std::vector<int64_t> caps, int rank) {
  all_ = std::move(caps);
  learned_ = all_.empty() ? 0 : all_[static_cast<size_t>(rank)];
}

}  // namespace evenstep::internal

// This rank's cap on a micro-batch's padded tokens (BalancedStep): learned
// from out-of-memory failures (the largest piece that fit, below the
// smallest that failed) and predicted from the peaks of earlier micro-steps
// (a MemoryFit per model part, within a byte budget: the device's limit
// times BalanceConfig::memory_headroom). The cap in force is the smaller of
// the two; every rank's learned cap travels in the step exchange and in the
// balance state.
#pragma once

#include <cstddef>
#include <cstdint>
#include <limits>
#include <optional>
#include <vector>

#include "evenstep/memory_probe.h"

namespace evenstep::internal {

class MemoryCaps {
 public:
  // `budget_bytes` 0: no prediction (no limit known).
  MemoryCaps(double budget_bytes, size_t parts) : budget_(budget_bytes), fits_(parts) {}

  bool predicting() const { return budget_ > 0; }
  double budget() const { return budget_; }
  // The cap in force, padded tokens (0 = none).
  int64_t cap() const;

  // A micro-step of `part` of `padded_tokens` peaked at `peak_bytes`.
  void Record(size_t part, int64_t padded_tokens, int64_t peak_bytes);
  // A micro-batch of `padded_tokens` ran out of memory.
  void NoteFailed(int64_t padded_tokens);
  // After a recovery: `largest` padded tokens fit.
  void Learn(int64_t largest);
  void BeginStep() { step_failed_max_ = 0; }
  // The largest micro-batch that failed in this step (0 = none).
  int64_t step_failed_max() const { return step_failed_max_; }

  // A new predicted cap, when it moved by more than 5 % (each change
  // repacks a step planned ahead): the cap, the part whose fit bounds it
  // and that fit's line.
  struct Prediction {
    int64_t cap = 0;
    size_t part = 0;
    MemoryFit::Line line;
  };
  std::optional<Prediction> Predict();

  // Every rank's learned cap (from the exchange, saved in BalanceState);
  // empty when none is known.
  const std::vector<int64_t>& all() const { return all_; }
  void set_all(std::vector<int64_t> caps) { all_ = std::move(caps); }
  // Restored from a BalanceState of the same world: this rank's learned cap.
  void Restore(std::vector<int64_t> caps, int rank);

 private:
  double budget_;
  std::vector<MemoryFit> fits_;                               // per part
  int64_t learned_ = 0;                                       // padded tokens (0 = none)
  int64_t predicted_ = 0;                                     // padded tokens (0 = none)
  int64_t failed_min_ = std::numeric_limits<int64_t>::max();  // the smallest that failed
  int64_t step_failed_max_ = 0;
  std::vector<int64_t> all_;
};

}  // namespace evenstep::internal

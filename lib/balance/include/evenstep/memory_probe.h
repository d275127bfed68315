// Peak memory of one training step on this rank.
//
// On an accelerator whose allocator keeps statistics (CUDA's caching
// allocator, in a CUDA libtorch) the figures are the allocator's: the peak
// bytes allocated and reserved during the step (its peak statistics reset
// at Begin). Elsewhere (the CPU) they are the process's resident set: its
// high-water mark during the step (Linux resets it through
// /proc/self/clear_refs; where that is refused, the process's peak so far)
// and its growth over the resident set at Begin.
//
// MemoryFit: a micro-step's peak memory against its size, for the caps
// BalancedStep predicts (BalanceConfig::memory_limit_bytes).
//
// Thread-safety: one probe (and fit) per training thread.
#pragma once

#include <cstdint>
#include <deque>

#include "c10/core/Device.h"

namespace evenstep {

struct MemoryPeak {
  int64_t peak_bytes = 0;      // allocated (device) or resident (CPU) at its peak
  int64_t reserved_bytes = 0;  // device: the allocator's peak reserved; CPU: 0
  int64_t growth_bytes = 0;    // peak_bytes above the figure at Begin
  bool device = false;         // from an accelerator's allocator
  bool since_begin = true;     // false: the process's peak so far (no reset)
};

class MemoryProbe {
 public:
  explicit MemoryProbe(c10::Device device);
  // Resets the peak (the allocator's statistics, or the resident set's
  // high-water mark) and notes the current figure.
  void Begin();
  // The peak since Begin.
  MemoryPeak End();
  // From the device allocator only: the peak since Begin or the previous
  // Lap (a micro-step's, when called as each one ends), and the peak reset
  // for the next; End still reports the step's. -1 where the figures are the
  // resident set (too coarse for one micro-step: freed memory stays
  // resident).
  int64_t Lap();
  // The bytes this rank's allocator may hold: on CUDA the device's capacity
  // times the caching allocator's memory fraction (where this libtorch has
  // one); 0 where unknown (the CPU).
  int64_t DeviceLimit() const;
  // Frees the blocks the device allocator holds cached but unallocated
  // (CUDA's emptyCache); the reserved bytes that released. 0 on the CPU.
  int64_t ReleaseCache();

 private:
  c10::Device device_;
  bool device_stats_ = false;
  int64_t begin_bytes_ = 0;
  int64_t step_peak_ = 0;  // device: the laps' peaks so far in the step
  bool reset_ok_ = true;
};

// Peak bytes of a micro-step against its padded tokens (samples x longest
// length), fitted as bytes = fixed + per_token x tokens over the last
// `window` micro-steps (RobustLinearFit). The fixed part (the model, its
// gradients and the optimizer's state) must be identified by the points
// themselves: at least 6 whose sizes vary.
class MemoryFit {
 public:
  explicit MemoryFit(int window = 256) : window_(window) {}
  void Record(int64_t padded_tokens, int64_t peak_bytes);
  // The largest micro-batch (padded tokens) whose peak the fit puts within
  // `budget_bytes`, and never below the largest one recorded that peaked
  // within it; 0 = no prediction (the fit is not identified, or memory does
  // not grow with the size).
  int64_t Cap(double budget_bytes) const;
  // The fit: bytes = fixed_bytes + per_token_bytes x tokens; valid false
  // while Cap predicts nothing.
  struct Line {
    double fixed_bytes = 0;
    double per_token_bytes = 0;
    bool valid = false;
  };
  Line line() const;
  void Reset() { points_.clear(); }

 private:
  int window_;
  std::deque<std::pair<int64_t, int64_t>> points_;  // (padded tokens, peak bytes)
};

namespace internal {
// VmRSS and VmHWM (bytes) from a /proc/<pid>/status text; -1 where absent.
struct ResidentSet {
  int64_t current = -1;
  int64_t peak = -1;
};
ResidentSet ParseProcStatus(const char* text);
}  // namespace internal

}  // namespace evenstep

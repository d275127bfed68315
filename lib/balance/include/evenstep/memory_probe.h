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
// Thread-safety: one probe per training thread; Begin and End on it.
#pragma once

#include <cstdint>

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

 private:
  c10::Device device_;
  bool device_stats_ = false;
  int64_t begin_bytes_ = 0;
  bool reset_ok_ = true;
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

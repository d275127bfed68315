// The preflight's parts, shared by its files (lib/observe/): the per-rank
// figures and how each is judged, the measurements (preflight_measure.cc)
// and the helpers that judge gathered figures (preflight_judge.cc). The
// orchestration is preflight.cc, the table and JSON preflight_print.cc.
#pragma once

#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>
#include <sched.h>

#include <cstddef>
#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/time/time.h"

namespace evenstep::internal::preflight {

inline constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

// A per-rank figure: how it is named and judged.
struct Metric {
  const char* name;
  const char* label;
  const char* unit;
  double threshold;  // named below this ratio to the reference
};

const std::vector<Metric>& Metrics();

// --- Measurements (preflight_measure.cc) ---

// Matrix products of n x n per second, as GFLOP/s, for about `budget`
// (each counted product done `slowdown` times: PreflightOptions::
// compute_slowdown, a benchmark's planted slow rank).
double MatmulGflops(const c10::Device& device, at::ScalarType dtype, int64_t n,
                    absl::Duration budget, double slowdown);

// Runs `f` with this thread on the `index`-th (mod count) of the CPUs it may
// use, then restores its affinity: on a CPU device each round measures on
// another core, so one busy or slow core (a neighbour's, the hypervisor's)
// does not mark a rank slow, while a rank confined to slow cores still shows.
template <typename F>
auto OnCpu(int index, F&& f) {
  cpu_set_t allowed;
  CPU_ZERO(&allowed);
  if (::sched_getaffinity(0, sizeof(allowed), &allowed) != 0) return f();
  std::vector<int> cpus;
  for (int c = 0; c < CPU_SETSIZE; ++c) {
    if (CPU_ISSET(c, &allowed)) cpus.push_back(c);
  }
  if (cpus.size() < 2) return f();
  cpu_set_t one;
  CPU_ZERO(&one);
  CPU_SET(cpus[static_cast<size_t>(index) % cpus.size()], &one);
  ::sched_setaffinity(0, sizeof(one), &one);
  struct Restore {
    cpu_set_t mask;
    ~Restore() { ::sched_setaffinity(0, sizeof(mask), &mask); }
  } restore{allowed};
  return f();
}

// The best of three host memcpy's of `bytes`, in GB/s.
double MemcpyGbps(size_t bytes);
// The best of three host-to-device copies of `bytes`, in GB/s.
double HostToDeviceGbps(const c10::Device& device, size_t bytes, bool pinned);
// Write + fsync, then a cold read (cached pages dropped), of a test file in
// `dir`, in GB/s. A failure is a note and NaNs.
std::pair<double, double> DiskGbps(const std::string& dir, size_t bytes, int rank,
                                   std::vector<std::string>* notes);
// The memory this process may still use, in GB: the least of the host's
// MemAvailable, its cgroup's room (v2) and its address-space limit's room.
double FreeMemoryGb();
// Free memory on `device` in GB (CUDA: cudaMemGetInfo); NaN where it cannot
// be told.
double FreeDeviceGb(const c10::Device& device);

// --- Judging gathered figures (preflight_judge.cc) ---

// A figure's measured values: those of the ranks that measured it (not NaN).
std::vector<double> Measured(const std::vector<double>& values);
// The median of the measured values (the mean of the middle two for an even
// count); NaN when none was measured.
double MedianOfMeasured(const std::vector<double>& values);
// The value a figure is judged against: the median of the measured values,
// or the better one when only two ranks measured it; nullopt when no rank
// measured it (one rank's value is its own reference: nobody is named).
std::optional<double> ReferenceOfMeasured(const std::vector<double>& values);

}  // namespace evenstep::internal::preflight

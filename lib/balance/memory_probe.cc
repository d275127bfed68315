// MemoryProbe: a step's peak memory from the device allocator or the
// resident set.
#include "evenstep/memory_probe.h"

#include <fcntl.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "evenstep/cost_model.h"
#include "evenstep/internal/build_config.h"

#if EVENSTEP_HAVE_NCCL  // a CUDA libtorch
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_runtime_api.h>
#endif

namespace evenstep {
namespace internal {

ResidentSet ParseProcStatus(const char* text) {
  ResidentSet out;
  auto field = [text](const char* name) -> int64_t {
    const char* at = std::strstr(text, name);
    if (at == nullptr) return -1;
    char* end = nullptr;
    const long long kb = std::strtoll(at + std::strlen(name), &end, 10);
    if (end == at + std::strlen(name)) return -1;
    return static_cast<int64_t>(kb) * 1024;
  };
  out.current = field("\nVmRSS:");
  out.peak = field("\nVmHWM:");
  return out;
}

}  // namespace internal

namespace {

internal::ResidentSet ReadResidentSet() {
  char buf[4096];
  buf[0] = '\n';  // fields are matched after a newline
  const int fd = ::open("/proc/self/status", O_RDONLY | O_CLOEXEC);
  if (fd < 0) return {};
  size_t n = 1;
  for (ssize_t got; n + 1 < sizeof(buf) && (got = ::read(fd, buf + n, sizeof(buf) - 1 - n)) > 0;) {
    n += static_cast<size_t>(got);
  }
  ::close(fd);
  buf[n] = '\0';
  return internal::ParseProcStatus(buf);
}

// Resets the process's resident high-water mark (Linux >= 4.0).
bool ResetResidentPeak() {
  const int fd = ::open("/proc/self/clear_refs", O_WRONLY | O_CLOEXEC);
  if (fd < 0) return false;
  const bool ok = ::write(fd, "5", 1) == 1;
  ::close(fd);
  return ok;
}

int64_t ProcessPeakRss() {
  struct rusage usage;
  return getrusage(RUSAGE_SELF, &usage) == 0 ? static_cast<int64_t>(usage.ru_maxrss) * 1024 : 0;
}

#if EVENSTEP_HAVE_NCCL
constexpr size_t kAggregate = 0;  // StatType::AGGREGATE in every libtorch

c10::DeviceIndex CudaIndex(c10::Device device) {
  return device.has_index() ? device.index() : c10::cuda::current_device();
}
#endif

}  // namespace

MemoryProbe::MemoryProbe(c10::Device device) : device_(device) {
#if EVENSTEP_HAVE_NCCL
  device_stats_ = device_.is_cuda();
#endif
}

void MemoryProbe::Begin() {
#if EVENSTEP_HAVE_NCCL
  if (device_stats_) {
    namespace alloc = c10::cuda::CUDACachingAllocator;
    const c10::DeviceIndex index = CudaIndex(device_);
    alloc::resetPeakStats(index);
    begin_bytes_ = alloc::getDeviceStats(index).allocated_bytes[kAggregate].current;
    step_peak_ = begin_bytes_;
    return;
  }
#endif
  if (reset_ok_) reset_ok_ = ResetResidentPeak();
  const internal::ResidentSet rss = ReadResidentSet();
  begin_bytes_ = rss.current > 0 ? rss.current : 0;
}

MemoryPeak MemoryProbe::End() {
  MemoryPeak out;
#if EVENSTEP_HAVE_NCCL
  if (device_stats_) {
    namespace alloc = c10::cuda::CUDACachingAllocator;
    const auto stats = alloc::getDeviceStats(CudaIndex(device_));
    out.device = true;
    out.peak_bytes = std::max(step_peak_, stats.allocated_bytes[kAggregate].peak);
    out.reserved_bytes = stats.reserved_bytes[kAggregate].peak;
    out.growth_bytes = std::max<int64_t>(0, out.peak_bytes - begin_bytes_);
    return out;
  }
#endif
  const internal::ResidentSet rss = ReadResidentSet();
  out.since_begin = reset_ok_ && rss.peak > 0;
  out.peak_bytes = out.since_begin ? rss.peak : ProcessPeakRss();
  out.growth_bytes = std::max<int64_t>(0, out.peak_bytes - begin_bytes_);
  return out;
}

int64_t MemoryProbe::ReleaseCache() {
#if EVENSTEP_HAVE_NCCL
  if (device_stats_) {
    namespace alloc = c10::cuda::CUDACachingAllocator;
    const c10::DeviceIndex index = CudaIndex(device_);
    const int64_t before = alloc::getDeviceStats(index).reserved_bytes[kAggregate].current;
    alloc::emptyCache();
    const int64_t after = alloc::getDeviceStats(index).reserved_bytes[kAggregate].current;
    return std::max<int64_t>(0, before - after);
  }
#endif
  return 0;
}

int64_t MemoryProbe::Lap() {
#if EVENSTEP_HAVE_NCCL
  if (device_stats_) {
    namespace alloc = c10::cuda::CUDACachingAllocator;
    const c10::DeviceIndex index = CudaIndex(device_);
    const int64_t peak = alloc::getDeviceStats(index).allocated_bytes[kAggregate].peak;
    alloc::resetPeakStats(index);
    step_peak_ = std::max(step_peak_, peak);
    return peak;
  }
#endif
  return -1;
}

int64_t MemoryProbe::DeviceLimit() const {
#if EVENSTEP_HAVE_NCCL
  if (device_stats_) {
    const c10::DeviceIndex index = CudaIndex(device_);
    c10::cuda::CUDAGuard guard(index);
    size_t free_bytes = 0, total = 0;
    if (cudaMemGetInfo(&free_bytes, &total) != cudaSuccess) {
      (void)cudaGetLastError();  // not sticky: clear it
      return 0;
    }
    double fraction = 1.0;
#if EVENSTEP_HAVE_CUDA_MEMORY_FRACTION
    fraction = c10::cuda::CUDACachingAllocator::getMemoryFraction(index);
#endif
    return static_cast<int64_t>(static_cast<double>(total) * fraction);
  }
#endif
  return 0;
}

void MemoryFit::Record(int64_t padded_tokens, int64_t peak_bytes) {
  if (padded_tokens <= 0 || peak_bytes <= 0) return;
  points_.emplace_back(padded_tokens, peak_bytes);
  while (static_cast<int>(points_.size()) > window_) points_.pop_front();
}

MemoryFit::Line MemoryFit::line() const {
  std::vector<double> x, y;
  for (const auto& [tokens, bytes] : points_) {
    x.push_back(static_cast<double>(tokens));
    y.push_back(static_cast<double>(bytes));
  }
  bool identified = false;
  const CostFit fit =
      RobustLinearFit(x.data(), y.data(), static_cast<int>(x.size()), -1, &identified);
  Line out;
  out.fixed_bytes = fit.fixed_s;
  out.per_token_bytes = fit.per_unit_s;
  out.valid = identified && fit.per_unit_s > 0;
  return out;
}

int64_t MemoryFit::Cap(double budget_bytes) const {
  const Line fit = line();
  if (!fit.valid || !(budget_bytes > 0)) return 0;
  int64_t fitted = 0;  // the largest recorded size that peaked within the budget
  for (const auto& [tokens, bytes] : points_) {
    if (static_cast<double>(bytes) <= budget_bytes) fitted = std::max(fitted, tokens);
  }
  // (The epsilon keeps an exact fit's whole number from rounding down.)
  const double predicted = (budget_bytes - fit.fixed_bytes) / fit.per_token_bytes + 1e-6;
  const int64_t cap = predicted >= 1 ? static_cast<int64_t>(std::min(predicted, 1e15)) : 1;
  return std::max(cap, fitted);
}

}  // namespace evenstep

// The preflight's measurements on this rank (preflight_parts.h): compute,
// host and host-to-device copies, disk write and cold read, free memory.
#include <ATen/ATen.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <fcntl.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "evenstep/env.h"
#include "evenstep/internal/build_config.h"
#include "evenstep/internal/preflight_parts.h"

#if EVENSTEP_HAVE_NCCL  // a CUDA libtorch
#include <c10/cuda/CUDAGuard.h>
#include <cuda_runtime_api.h>
#endif

namespace evenstep::internal::preflight {

namespace {

double Seconds(absl::Time since) { return absl::ToDoubleSeconds(absl::Now() - since); }

void SyncDevice(const c10::Device& device) {
  if (device.is_cpu()) return;
  const c10::impl::VirtualGuardImpl guard(device.type());
  guard.synchronizeStream(guard.getStream(device));
}

// A number from a "Key:   value kB" line of a /proc file; -1 when absent.
double ProcKb(const std::string& file, const std::string& key) {
  std::ifstream in(file);
  std::string line;
  while (std::getline(in, line)) {
    absl::string_view v = line;
    if (!absl::ConsumePrefix(&v, key + ":")) continue;
    v = absl::StripAsciiWhitespace(v);
    absl::ConsumeSuffix(&v, " kB");
    double kb = 0;
    if (absl::SimpleAtod(v, &kb)) return kb;
  }
  return -1;
}

double ReadNumber(const std::string& file) {
  std::ifstream in(file);
  std::string s;
  double v = 0;
  if (!(in >> s) || !absl::SimpleAtod(s, &v)) return -1;
  return v;
}

}  // namespace

double MatmulGflops(const c10::Device& device, at::ScalarType dtype, int64_t n,
                    absl::Duration budget, double slowdown) {
  const auto options = at::TensorOptions().device(device).dtype(dtype);
  const at::Tensor a = at::randn({n, n}, options);
  const at::Tensor b = at::randn({n, n}, options);
  at::Tensor c = at::mm(a, b);
  SyncDevice(device);
  int64_t counted = 0;
  const absl::Time begin = absl::Now();
  while (counted < 3 || absl::Now() - begin < budget) {
    for (int k = 0; k < 4; ++k, ++counted) {
      for (double w = 0; w < slowdown; w += 1) at::mm_out(c, a, b);
    }
    SyncDevice(device);
  }
  const double s = Seconds(begin);
  return 2.0 * static_cast<double>(n * n * n) * static_cast<double>(counted) / s / 1e9;
}

double MemcpyGbps(size_t bytes) {
  std::vector<char> from(bytes, 1), to(bytes, 0);
  std::memcpy(to.data(), from.data(), bytes);  // touch both
  double best = 0;
  for (int k = 0; k < 3; ++k) {
    const absl::Time begin = absl::Now();
    std::memcpy(to.data(), from.data(), bytes);
    best = std::max(best, static_cast<double>(bytes) / Seconds(begin) / 1e9);
    from[k] = to[bytes - 1 - k];  // keep the copies observable
  }
  return best;
}

double HostToDeviceGbps(const c10::Device& device, size_t bytes, bool pinned) {
  const at::Tensor host = at::ones({static_cast<int64_t>(bytes)},
                                   at::TensorOptions().dtype(at::kByte).pinned_memory(pinned));
  at::Tensor dev = at::empty_like(host, at::TensorOptions().device(device).pinned_memory(false));
  dev.copy_(host, pinned);
  SyncDevice(device);
  double best = 0;
  for (int k = 0; k < 3; ++k) {
    const absl::Time begin = absl::Now();
    dev.copy_(host, pinned);
    SyncDevice(device);
    best = std::max(best, static_cast<double>(bytes) / Seconds(begin) / 1e9);
  }
  return best;
}

std::pair<double, double> DiskGbps(const std::string& dir, size_t bytes, int rank,
                                   std::vector<std::string>* notes) {
  const std::string path =
      absl::StrCat(dir, "/.evenstep_preflight.rank", rank, ".", ::getpid(), ".tmp");
  auto fail = [&](const std::string& what) {
    notes->push_back(absl::StrCat("rank ", rank, ": ", what, " ", path, ": ", std::strerror(errno),
                                  " (not measured)"));
    ::unlink(path.c_str());
    return std::make_pair(kNaN, kNaN);
  };
  Env::Default()->CreateDirs(dir).IgnoreError();  // failing, the open below says why
  constexpr size_t kChunk = size_t{1} << 20;
  std::vector<char> chunk(kChunk);
  for (size_t i = 0; i < kChunk; ++i) chunk[i] = static_cast<char>(i * 2654435761u >> 13);
  const absl::Time begin = absl::Now();
  int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0) return fail("creating");
  for (size_t done = 0; done < bytes; done += kChunk) {
    const size_t n = std::min(kChunk, bytes - done);
    if (::write(fd, chunk.data(), n) != static_cast<ssize_t>(n)) {
      ::close(fd);
      return fail("writing");
    }
  }
  if (::fsync(fd) != 0) {
    ::close(fd);
    return fail("syncing");
  }
  ::close(fd);
  const double write = static_cast<double>(bytes) / Seconds(begin) / 1e9;
  fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return fail("opening");
  ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
  const absl::Time read_begin = absl::Now();
  for (size_t done = 0; done < bytes; done += kChunk) {
    if (::pread(fd, chunk.data(), kChunk, static_cast<off_t>(done)) <= 0) {
      ::close(fd);
      return fail("reading");
    }
  }
  const double read = static_cast<double>(bytes) / Seconds(read_begin) / 1e9;
  ::close(fd);
  ::unlink(path.c_str());
  return {write, read};
}

double FreeMemoryGb() {
  double free_bytes = ProcKb("/proc/meminfo", "MemAvailable") * 1024;
  std::ifstream cgroup("/proc/self/cgroup");
  std::string line;
  while (std::getline(cgroup, line)) {
    if (!absl::StartsWith(line, "0::")) continue;
    const std::string dir = absl::StrCat("/sys/fs/cgroup", line.substr(3));
    const double max = ReadNumber(dir + "/memory.max");  // "max" reads as -1
    const double current = ReadNumber(dir + "/memory.current");
    if (max > 0 && current >= 0) free_bytes = std::min(free_bytes, max - current);
  }
  rlimit as{};
  if (::getrlimit(RLIMIT_AS, &as) == 0 && as.rlim_cur != RLIM_INFINITY) {
    const double used = ProcKb("/proc/self/status", "VmSize") * 1024;
    free_bytes = std::min(free_bytes, static_cast<double>(as.rlim_cur) - used);
  }
  return std::max(0.0, free_bytes) / 1e9;
}

double FreeDeviceGb(const c10::Device& device) {
#if EVENSTEP_HAVE_NCCL
  if (device.is_cuda()) {
    const c10::cuda::CUDAGuard guard(device);
    size_t free_bytes = 0, total = 0;
    if (cudaMemGetInfo(&free_bytes, &total) == cudaSuccess) {
      return static_cast<double>(free_bytes) / 1e9;
    }
  }
#else
  (void)device;
#endif
  return kNaN;
}

}  // namespace evenstep::internal::preflight

#include "evenstep/preflight.h"

#include <ATen/ATen.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <fcntl.h>
#include <sched.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <sstream>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "evenstep/internal/build_config.h"
#include "evenstep/internal/median.h"
#include "evenstep/status_macros.h"

#if EVENSTEP_HAVE_NCCL  // a CUDA libtorch
#include <c10/cuda/CUDAGuard.h>
#include <cuda_runtime_api.h>
#endif

namespace evenstep {

namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

// A per-rank figure: how it is named and judged.
struct Metric {
  const char* name;
  const char* label;
  const char* unit;
  double threshold;  // named below this ratio to the reference
};

const std::vector<Metric>& Metrics() {
  static const std::vector<Metric> metrics = {
      {"matmul_fp32_gflops", "matmul fp32", "GFLOP/s", 0.7},
      {"matmul_bf16_gflops", "matmul bf16", "GFLOP/s", 0.7},
      {"memcpy_gbps", "host memcpy", "GB/s", 0.5},
      {"h2d_pinned_gbps", "host-to-device pinned", "GB/s", 0.5},
      {"h2d_pageable_gbps", "host-to-device pageable", "GB/s", 0.5},
      {"ckpt_write_gbps", "checkpoint dir write+fsync", "GB/s", 0.5},
      {"ckpt_read_gbps", "checkpoint dir cold read", "GB/s", 0.5},
      {"data_read_gbps", "data dir cold read", "GB/s", 0.5},
      {"free_memory_gb", "free memory", "GB", 0.5},
      {"free_device_memory_gb", "free device memory", "GB", 0.5},
  };
  return metrics;
}

// Pair links below this ratio to the median pair are named.
constexpr double kPairThreshold = 0.5;
// Cross-node bandwidth below this fraction of the intra-node one is noted.
constexpr double kCrossThreshold = 0.25;
// Clock offsets beyond this are noted (the report's arrival times shift).
constexpr double kClockOffsetMs = 10;

double Seconds(absl::Time since) { return absl::ToDoubleSeconds(absl::Now() - since); }

void SyncDevice(const c10::Device& device) {
  if (device.is_cpu()) return;
  const c10::impl::VirtualGuardImpl guard(device.type());
  guard.synchronizeStream(guard.getStream(device));
}

// Matrix products of n x n per second, as GFLOP/s, for about `budget`.
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

// Write + fsync, then a cold read (cached pages dropped), of a test file in
// `dir`, in GB/s. A failure is a note and NaNs.
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
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
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

// The memory this process may still use, in GB: the least of the host's
// MemAvailable, its cgroup's room (v2) and its address-space limit's room.
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

// Free memory on `device` in GB (CUDA: cudaMemGetInfo); NaN where it cannot
// be told.
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

// A figure's measured values: those of the ranks that measured it (not NaN).
std::vector<double> Measured(const std::vector<double>& values) {
  std::vector<double> present;
  for (double x : values) {
    if (!std::isnan(x)) present.push_back(x);
  }
  return present;
}

// The median of the measured values (the mean of the middle two for an even
// count); NaN when none was measured.
double Median(const std::vector<double>& values) {
  std::vector<double> v = Measured(values);
  return v.empty() ? kNaN : internal::Median(std::move(v));
}

// The rank a figure is judged against: the median of the measured values,
// or the better one when only two ranks measured it.
double Reference(const std::vector<double>& present) {
  return present.size() == 2 ? std::max(present[0], present[1]) : Median(present);
}

// Reference() of a figure's measured values; nullopt when no rank measured
// it (one rank's value is its own reference: nobody is named).
std::optional<double> ReferenceOfMeasured(const std::vector<double>& values) {
  const std::vector<double> present = Measured(values);
  if (present.empty()) return std::nullopt;
  return Reference(present);
}

// Every rank's value of `mine` (NaN allowed), through the control group.
absl::StatusOr<std::vector<double>> GatherDoubles(DistContext& ctx,
                                                  const std::vector<double>& mine) {
  at::Tensor in = at::tensor(mine, at::kDouble);
  std::vector<at::Tensor> all;
  EVENSTEP_RETURN_IF_ERROR(ctx.AllGather(in, &all));
  std::vector<double> out;
  for (const at::Tensor& t : all) {
    for (int64_t i = 0; i < t.numel(); ++i) out.push_back(t[i].item<double>());
  }
  return out;
}

int RunCounter() {
  static int runs = 0;
  return runs++;
}

std::string Ratio(double r) { return std::isnan(r) ? "-" : absl::StrFormat("%.2fx", r); }

}  // namespace

namespace {

// The device the preflight measures: options.device, or CUDA when present.
absl::StatusOr<c10::Device> PreflightDevice(const PreflightOptions& options) {
  try {
    return options.device.empty()
               ? (at::hasCUDA() ? c10::Device(c10::kCUDA, 0) : c10::Device(c10::kCPU))
               : c10::Device(options.device);
  } catch (const std::exception& e) {
    return absl::InvalidArgumentError(
        absl::StrCat("preflight: device '", options.device, "' is not a device"));
  }
}

// The figures `rank` reports instead of measuring them (options.injected),
// by name; InvalidArgument for a name that is no per-rank figure.
absl::StatusOr<std::map<std::string, double>> InjectedFigures(const PreflightOptions& options,
                                                              int rank) {
  std::map<std::string, double> injected;
  for (const PreflightOptions::Injected& f : options.injected) {
    const bool known = std::any_of(Metrics().begin(), Metrics().end(),
                                   [&f](const Metric& m) { return f.metric == m.name; });
    if (!known) {
      std::vector<std::string> names;
      for (const Metric& m : Metrics()) names.push_back(m.name);
      return absl::InvalidArgumentError(absl::StrCat("preflight: injected figure '", f.metric,
                                                     "': no such per-rank figure (",
                                                     absl::StrJoin(names, ", "), ")"));
    }
    if (std::find(f.ranks.begin(), f.ranks.end(), rank) != f.ranks.end()) {
      injected[f.metric] = f.value;
    }
  }
  return injected;
}

// One preflight on this rank: its measurements, taken in the same order on
// every rank (the collectives and the turns line up), and the gathered,
// judged report.
class PreflightRun {
 public:
  PreflightRun(DistContext& ctx, const PreflightOptions& options, c10::Device device,
               NodeLayout layout, std::map<std::string, double> injected)
      : ctx_(ctx),
        options_(options),
        device_(device),
        layout_(std::move(layout)),
        injected_(std::move(injected)),
        rank_(ctx.rank()),
        world_(ctx.world_size()),
        ns_(absl::StrCat("evenstep/preflight/", RunCounter(), "/")) {
    for (const auto& members : layout_.ranks) turns_ = std::max<int>(turns_, members.size());
    const auto& mine = layout_.ranks[layout_.node_of[rank_]];
    my_turn_ = static_cast<int>(std::find(mine.begin(), mine.end(), rank_) - mine.begin());
    for (const Metric& m : Metrics()) mine_[m.name] = kNaN;
    report_.world_size = world_;
    report_.nodes = layout_.names;
  }

  absl::StatusOr<PreflightReport> Run();

 private:
  // One round: device compute at once, then the host resources in turns.
  absl::Status MeasureRound(bool first);
  // This rank's host figures, in its turn.
  void MeasureHost(int cpu, bool first);
  // Clock offsets from rank 0: the median over rounds of the clocks read
  // right after a barrier.
  absl::Status MeasureClocks();
  // Collectives over all ranks: latency and bus bandwidth.
  absl::Status MeasureGroup();
  // Within each node and across nodes (ranks with the same place in their
  // node), all such groups at once; the worst group is reported.
  absl::Status MeasureNodeGroups();
  // Pairs: round k pairs rank i with i xor 2^k; the pairs whose lower rank
  // is on one node take turns (they share its host and network interface),
  // the nodes go at once.
  absl::Status MeasurePairs();
  // Everyone's figures into the report, judged.
  absl::Status Gather();
  // A figure kept as the best seen so far.
  void Best(const char* name, double v) {
    if (std::isnan(v)) return;
    double& slot = mine_[name];
    slot = std::isnan(slot) ? v : std::max(slot, v);
  }
  bool quick() const { return options_.quick; }
  int iters() const { return quick() ? 5 : 8; }
  size_t group_bytes() const { return (quick() ? size_t{1} : size_t{4}) << 20; }
  double Matmul(at::ScalarType dtype) const {
    const int64_t n = device_.is_cpu() ? (quick() ? 192 : 384) : (quick() ? 2048 : 4096);
    return MatmulGflops(device_, dtype, n, absl::Milliseconds(quick() ? 80 : 200),
                        std::max(1.0, options_.compute_slowdown));
  }

  DistContext& ctx_;
  const PreflightOptions& options_;
  const c10::Device device_;
  const NodeLayout layout_;
  const std::map<std::string, double> injected_;
  const int rank_, world_;
  const std::string ns_;  // the subgroups' names
  int turns_ = 0, my_turn_ = 0;
  PreflightReport report_;
  std::vector<std::string> notes_;
  std::map<std::string, double> mine_;  // this rank's figures
  bool bf16_ = !device_.is_cpu();
  bool ckpt_ok_ = !options_.ckpt_dir.empty(), data_ok_ = !options_.data_dir.empty();
  int round_index_ = 0;
  std::vector<std::unique_ptr<Subgroup>> pair_groups_;
  std::vector<double> pair_bw_;
};

absl::StatusOr<PreflightReport> PreflightRun::Run() {
  const absl::Time begin = absl::Now();
  for (int round = 0; round < 3; ++round) EVENSTEP_RETURN_IF_ERROR(MeasureRound(round == 0));
  EVENSTEP_RETURN_IF_ERROR(MeasureClocks());
  if (world_ > 1) EVENSTEP_RETURN_IF_ERROR(MeasureGroup());
  if (layout_.nodes() > 1) EVENSTEP_RETURN_IF_ERROR(MeasureNodeGroups());
  EVENSTEP_RETURN_IF_ERROR(MeasurePairs());
  EVENSTEP_RETURN_IF_ERROR(Gather());
  // An outlier is measured again before it is named: up to two more rounds
  // (every rank, so the turns stay the same), keeping the best figures. The
  // findings are the same on every rank, so every rank decides alike.
  auto outliers = [&] {
    for (const PreflightFinding& f : report_.findings) {
      if (f.metric != "clock_offset_ms" && f.metric != "cross_node_busbw_gbps") return true;
    }
    return false;
  };
  for (int again = 0; again < 2 && outliers(); ++again) {
    EVENSTEP_RETURN_IF_ERROR(MeasureRound(false));
    EVENSTEP_RETURN_IF_ERROR(MeasurePairs());
    EVENSTEP_RETURN_IF_ERROR(Gather());
  }
  report_.elapsed = absl::Now() - begin;
  for (const std::string& note : notes_) {
    report_.findings.push_back({"note", {rank_}, "", 1, note});
  }
  return std::move(report_);
}

absl::Status PreflightRun::MeasureRound(bool first) {
  // Ranks measuring at once (one per node) start on different cores.
  const int cpu = layout_.node_of[rank_] + round_index_++;
  if (!device_.is_cpu()) {
    Best("matmul_fp32_gflops", Matmul(at::kFloat));
    if (bf16_) {
      try {
        Best("matmul_bf16_gflops", Matmul(at::kBFloat16));
      } catch (const std::exception&) {
        bf16_ = false;
        notes_.push_back(absl::StrCat("rank ", rank_, ": bf16 matrix products not supported"));
      }
    }
  }
  for (int turn = 0; turn < turns_; ++turn) {
    if (turn == my_turn_) MeasureHost(cpu, first);
    EVENSTEP_RETURN_IF_ERROR(ctx_.Barrier(), "preflight turn ", turn);
  }
  return absl::OkStatus();
}

void PreflightRun::MeasureHost(int cpu, bool first) {
  const bool gpu = !device_.is_cpu();
  const size_t copy_bytes = (quick() ? size_t{32} : size_t{64}) << 20;
  const size_t disk_bytes = (quick() ? size_t{8} : size_t{64}) << 20;
  if (!gpu) Best("matmul_fp32_gflops", OnCpu(cpu, [&] { return Matmul(at::kFloat); }));
  Best("memcpy_gbps", OnCpu(cpu, [&] { return MemcpyGbps(copy_bytes); }));
  if (gpu) {
    Best("h2d_pinned_gbps", HostToDeviceGbps(device_, copy_bytes, true));
    Best("h2d_pageable_gbps", HostToDeviceGbps(device_, copy_bytes, false));
  }
  // A directory that failed once is not tried again.
  if (ckpt_ok_) {
    auto [w, r] = DiskGbps(options_.ckpt_dir, disk_bytes, rank_, &notes_);
    ckpt_ok_ = !std::isnan(w);
    Best("ckpt_write_gbps", w);
    Best("ckpt_read_gbps", r);
  }
  if (data_ok_) {
    const double r = DiskGbps(options_.data_dir, disk_bytes, rank_, &notes_).second;
    data_ok_ = !std::isnan(r);
    Best("data_read_gbps", r);
  }
  if (first) {
    mine_["free_memory_gb"] = FreeMemoryGb();
    if (gpu) mine_["free_device_memory_gb"] = FreeDeviceGb(device_);
  }
}

absl::Status PreflightRun::MeasureClocks() {
  std::vector<std::vector<double>> offsets(world_);
  for (int k = 0; k < 5; ++k) {
    EVENSTEP_RETURN_IF_ERROR(ctx_.Barrier(), "preflight clock round");
    const double now_ms = absl::ToDoubleMilliseconds(absl::Now() - absl::UnixEpoch());
    EVENSTEP_ASSIGN_OR_RETURN(std::vector<double> clocks, GatherDoubles(ctx_, {now_ms}));
    for (int r = 0; r < world_; ++r) offsets[r].push_back(clocks[r] - clocks[0]);
  }
  std::vector<double> clock(world_);
  for (int r = 0; r < world_; ++r) clock[r] = Median(offsets[r]);
  report_.per_rank["clock_offset_ms"] = clock;
  return absl::OkStatus();
}

absl::Status PreflightRun::MeasureGroup() {
  std::vector<double> lat;
  at::Tensor one = at::ones({1});
  for (int i = 0; i < (quick() ? 10 : 20); ++i) {
    const absl::Time t = absl::Now();
    EVENSTEP_RETURN_IF_ERROR(ctx_.AllReduce(one));
    lat.push_back(absl::ToDoubleMicroseconds(absl::Now() - t));
  }
  report_.group["allreduce_latency_us"] = Median(lat);
  for (size_t mb : quick() ? std::vector<size_t>{1} : std::vector<size_t>{1, 16}) {
    EVENSTEP_ASSIGN_OR_RETURN(
        double bw, MeasureBusBandwidth(world_, mb << 20, iters(),
                                       [&](at::Tensor& t) { return ctx_.AllReduce(t); }));
    report_.group[absl::StrCat("allreduce_busbw_gbps_", mb, "mb")] = bw;
    report_.group["allreduce_busbw_gbps"] = bw;
  }
  return absl::OkStatus();
}

absl::Status PreflightRun::MeasureNodeGroups() {
  const int node = layout_.node_of[rank_];
  std::vector<double> sub = {kNaN, kNaN};
  const auto& local = layout_.ranks[node];
  if (local.size() > 1) {
    EVENSTEP_ASSIGN_OR_RETURN(auto g, ctx_.NewSubgroup(absl::StrCat(ns_, "node", node), local));
    EVENSTEP_ASSIGN_OR_RETURN(sub[0],
                              MeasureBusBandwidth(g->size(), group_bytes(), iters(),
                                                  [&](at::Tensor& t) { return g->AllReduce(t); }));
  }
  std::vector<int> across;
  for (const auto& members : layout_.ranks) {
    if (my_turn_ < static_cast<int>(members.size())) across.push_back(members[my_turn_]);
  }
  if (across.size() > 1) {
    EVENSTEP_ASSIGN_OR_RETURN(auto g,
                              ctx_.NewSubgroup(absl::StrCat(ns_, "cross", my_turn_), across));
    EVENSTEP_ASSIGN_OR_RETURN(sub[1],
                              MeasureBusBandwidth(g->size(), group_bytes(), iters(),
                                                  [&](at::Tensor& t) { return g->AllReduce(t); }));
  }
  EVENSTEP_ASSIGN_OR_RETURN(std::vector<double> groups, GatherDoubles(ctx_, sub));
  double local_min = kNaN, cross_min = kNaN;
  for (int r = 0; r < world_; ++r) {
    const double l = groups[2 * r], c = groups[2 * r + 1];
    if (!std::isnan(l)) local_min = std::isnan(local_min) ? l : std::min(local_min, l);
    if (!std::isnan(c)) cross_min = std::isnan(cross_min) ? c : std::min(cross_min, c);
  }
  if (!std::isnan(local_min)) report_.group["local_busbw_gbps"] = local_min;
  if (!std::isnan(cross_min)) report_.group["cross_node_busbw_gbps"] = cross_min;
  return absl::OkStatus();
}

absl::Status PreflightRun::MeasurePairs() {
  const std::vector<std::vector<int>>& node_ranks = layout_.ranks;
  int k = 0;
  for (int bit = 1; bit < world_; bit <<= 1, ++k) {
    const int partner = rank_ ^ bit;
    const int low = std::min(rank_, partner);
    std::vector<int> lows;  // lower ranks of this round's pairs on low's node
    if (partner < world_) {
      for (int r : node_ranks[layout_.node_of[low]]) {
        if ((r ^ bit) < world_ && r < (r ^ bit)) lows.push_back(r);
      }
    }
    int pair_turns = 0;
    for (const auto& members : node_ranks) {
      int count = 0;
      for (int r : members) count += (r ^ bit) < world_ && r < (r ^ bit);
      pair_turns = std::max(pair_turns, count);
    }
    if (pair_bw_.size() <= static_cast<size_t>(k)) {
      pair_bw_.push_back(kNaN);
      pair_groups_.emplace_back();
      if (partner < world_) {
        EVENSTEP_ASSIGN_OR_RETURN(
            pair_groups_[k],
            ctx_.NewSubgroup(absl::StrCat(ns_, "pair", low, "_", std::max(rank_, partner)),
                             {rank_, partner}));
      }
    }
    const int my_pair_turn =
        static_cast<int>(std::find(lows.begin(), lows.end(), low) - lows.begin());
    for (int turn = 0; turn < pair_turns; ++turn) {
      if (partner < world_ && turn == my_pair_turn) {
        Subgroup& g = *pair_groups_[k];
        EVENSTEP_ASSIGN_OR_RETURN(
            double bw, MeasureBusBandwidth(2, group_bytes(), iters(),
                                           [&](at::Tensor& t) { return g.AllReduce(t); }));
        pair_bw_[k] = std::isnan(pair_bw_[k]) ? bw : std::max(pair_bw_[k], bw);
      }
      EVENSTEP_RETURN_IF_ERROR(ctx_.Barrier(), "preflight after a turn of pairs");
    }
  }
  return absl::OkStatus();
}

absl::Status PreflightRun::Gather() {
  for (const auto& [name, value] : injected_) mine_[name] = value;
  std::vector<double> values;
  for (const Metric& m : Metrics()) values.push_back(mine_[m.name]);
  values.insert(values.end(), pair_bw_.begin(), pair_bw_.end());
  EVENSTEP_ASSIGN_OR_RETURN(std::vector<double> all, GatherDoubles(ctx_, values));
  const size_t per = values.size();
  for (size_t m = 0; m < Metrics().size(); ++m) {
    std::vector<double> column(world_);
    bool any = false;
    for (int r = 0; r < world_; ++r) {
      column[r] = all[r * per + m];
      any = any || !std::isnan(column[r]);
    }
    if (any) report_.per_rank[Metrics()[m].name] = column;
  }
  for (int r = 0; r < world_; ++r) {
    for (size_t k = 0; k < pair_bw_.size(); ++k) {
      const int partner = r ^ (1 << k);
      if (partner < world_ && r < partner) {
        report_.pairs[{r, partner}] = all[r * per + Metrics().size() + k];
      }
    }
  }
  JudgePreflight(&report_);
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<PreflightReport> RunPreflight(DistContext& ctx, const PreflightOptions& options) {
  EVENSTEP_ASSIGN_OR_RETURN(const c10::Device device, PreflightDevice(options));
  EVENSTEP_ASSIGN_OR_RETURN(auto injected, InjectedFigures(options, ctx.rank()));
  // Nodes: host names (and the launcher's node index), exchanged once per job.
  EVENSTEP_ASSIGN_OR_RETURN(NodeLayout layout, ctx.Nodes(), "preflight: exchanging node names");
  PreflightRun run(ctx, options, device, std::move(layout), std::move(injected));
  return run.Run();
}

namespace {

// Per-rank figure `m`: ranks below its threshold of the reference (the
// median rank; with two, the other one), a node named when all of its ranks
// are.
void JudgeFigure(const Metric& m, PreflightReport* report) {
  const int world = report->world_size;
  std::vector<PreflightFinding>& out = report->findings;
  const std::set<std::string> distinct(report->nodes.begin(), report->nodes.end());
  auto node_ranks = [&](const std::string& node) {
    std::vector<int> r;
    for (int i = 0; i < world; ++i) {
      if (report->nodes.size() == static_cast<size_t>(world) && report->nodes[i] == node) {
        r.push_back(i);
      }
    }
    return r;
  };
  auto it = report->per_rank.find(m.name);
  if (it == report->per_rank.end()) return;
  const std::vector<double>& v = it->second;
  const std::vector<double> present = Measured(v);
  if (present.size() < 2) return;  // one rank has no one to be compared with
  const double ref = Reference(present);
  if (!(ref > 0)) return;
  const bool two = present.size() == 2;
  const std::string ref_name = two ? "the other rank" : "the median";
  std::vector<int> slow;
  for (int r = 0; r < world; ++r) {
    if (!std::isnan(v[r]) && v[r] / ref < m.threshold) slow.push_back(r);
  }
  // A node all of whose ranks are slow (with more than one node) is named
  // as the node.
  std::set<int> done;
  if (distinct.size() > 1) {
    for (const std::string& node : distinct) {
      std::vector<int> members = node_ranks(node);
      const bool all = !members.empty() && std::all_of(members.begin(), members.end(), [&](int r) {
        return std::find(slow.begin(), slow.end(), r) != slow.end();
      });
      if (!all || members.size() < 2) continue;
      double worst = 1;
      for (int r : members) worst = std::min(worst, v[r] / ref);
      out.push_back({m.name, members, node, worst,
                     absl::StrFormat("node %s: %s %.2fx %s (ranks %s)", node, m.label, worst,
                                     ref_name, absl::StrJoin(members, ","))});
      done.insert(members.begin(), members.end());
    }
  }
  for (int r : slow) {
    if (done.count(r)) continue;
    const std::string where =
        report->nodes.size() == static_cast<size_t>(world) && distinct.size() > 1
            ? absl::StrCat(" (node ", report->nodes[r], ")")
            : "";
    out.push_back({m.name,
                   {r},
                   "",
                   v[r] / ref,
                   absl::StrFormat("rank %d%s: %s %.2fx %s (%.3g vs %.3g %s)", r, where, m.label,
                                   v[r] / ref, ref_name, v[r], ref, m.unit)});
  }
}

// Links: pairs well below the median pair; a rank all of whose pairs are
// slow is named instead of its links.
void JudgePairs(PreflightReport* report) {
  const int world = report->world_size;
  std::vector<PreflightFinding>& out = report->findings;
  if (report->pairs.size() < 2) return;
  std::vector<double> bws;
  for (const auto& [p, bw] : report->pairs) bws.push_back(bw);
  const double median = Median(bws);
  std::map<int, std::pair<int, int>> per_rank;  // rank -> (slow pairs, pairs)
  for (const auto& [p, bw] : report->pairs) {
    const bool slow = median > 0 && bw / median < kPairThreshold;
    for (int r : {p.first, p.second}) {
      per_rank[r].second += 1;
      per_rank[r].first += slow;
    }
  }
  std::set<int> slow_ranks;
  for (const auto& [r, c] : per_rank) {
    if (c.second >= 2 && c.first == c.second) slow_ranks.insert(r);
  }
  for (int r : slow_ranks) {
    double worst = 1;
    for (const auto& [p, bw] : report->pairs) {
      if (p.first == r || p.second == r) worst = std::min(worst, bw / median);
    }
    out.push_back({"pair_busbw_gbps",
                   {r},
                   "",
                   worst,
                   absl::StrFormat("rank %d: every link measured is slow, down to %.2fx the "
                                   "median pair (its network interface or its host?)",
                                   r, worst)});
  }
  for (const auto& [p, bw] : report->pairs) {
    if (!(median > 0) || bw / median >= kPairThreshold) continue;
    if (slow_ranks.count(p.first) || slow_ranks.count(p.second)) continue;
    const bool hosts = report->nodes.size() == static_cast<size_t>(world) &&
                       report->nodes[p.first] != report->nodes[p.second];
    out.push_back(
        {"pair_busbw_gbps",
         {p.first, p.second},
         "",
         bw / median,
         absl::StrFormat("link %d-%d%s: all-reduce %.2fx the median pair (%.3g vs %.3g GB/s)",
                         p.first, p.second,
                         hosts ? absl::StrCat(" (", report->nodes[p.first], " to ",
                                              report->nodes[p.second], ")")
                               : std::string(),
                         bw / median, bw, median)});
  }
}

// The group figures (cross-node against intra-node bandwidth) and the
// ranks' clocks.
void JudgeGroupAndClocks(PreflightReport* report) {
  const int world = report->world_size;
  std::vector<PreflightFinding>& out = report->findings;
  const auto local = report->group.find("local_busbw_gbps");
  const auto cross = report->group.find("cross_node_busbw_gbps");
  if (local != report->group.end() && cross != report->group.end() && local->second > 0 &&
      cross->second / local->second < kCrossThreshold) {
    out.push_back({"cross_node_busbw_gbps",
                   {},
                   "",
                   cross->second / local->second,
                   absl::StrFormat("cross-node all-reduce %.2fx intra-node (%.3g vs %.3g GB/s): "
                                   "keep gradient traffic inside the nodes with "
                                   "--evenstep_sync_topology=hierarchical (auto, the default, "
                                   "chooses it at this ratio)",
                                   cross->second / local->second, cross->second, local->second)});
  }
  if (auto c = report->per_rank.find("clock_offset_ms"); c != report->per_rank.end()) {
    for (int r = 0; r < world; ++r) {
      const double off = c->second[r];
      if (std::isnan(off) || std::abs(off) <= kClockOffsetMs) continue;
      out.push_back({"clock_offset_ms",
                     {r},
                     "",
                     1,
                     absl::StrFormat("rank %d: clock %.1f ms %s rank 0's: arrival times in the "
                                     "report are off by as much (synchronise the clocks: "
                                     "chrony/PTP)",
                                     r, std::abs(off), off > 0 ? "ahead of" : "behind")});
    }
  }
}

}  // namespace

void JudgePreflight(PreflightReport* report) {
  std::vector<PreflightFinding>& out = report->findings;
  out.erase(std::remove_if(out.begin(), out.end(),
                           [](const PreflightFinding& f) { return f.metric != "note"; }),
            out.end());
  for (const Metric& m : Metrics()) JudgeFigure(m, report);
  JudgePairs(report);
  JudgeGroupAndClocks(report);
}

std::string PreflightReport::Table() const {
  std::ostringstream s;
  std::set<std::string> distinct(nodes.begin(), nodes.end());
  s << absl::StrFormat("evenstep preflight: %d ranks on %d node%s, %.1f s\n", world_size,
                       distinct.size(), distinct.size() == 1 ? "" : "s",
                       absl::ToDoubleSeconds(elapsed));
  const bool columns = world_size <= 8;
  s << absl::StrFormat("  %-28s %-8s", "figure", "unit");
  if (columns) {
    for (int r = 0; r < world_size; ++r) s << absl::StrFormat(" %17s", absl::StrCat("rank ", r));
  } else {
    s << absl::StrFormat(" %12s %12s %10s", "median", "worst", "worst rank");
  }
  s << "\n";
  auto row = [&](const std::string& label, const std::string& unit, const std::vector<double>& v,
                 bool ratios) {
    s << absl::StrFormat("  %-28s %-8s", label, unit);
    const double ref = ReferenceOfMeasured(v).value_or(kNaN);
    if (columns) {
      for (double x : v) {
        s << absl::StrFormat(" %17s", std::isnan(x) ? "-"
                                      : ratios ? absl::StrFormat("%.3g (%s)", x, Ratio(x / ref))
                                               : absl::StrFormat("%.3g", x));
      }
    } else {
      int worst = -1;
      for (int r = 0; r < world_size; ++r) {
        if (!std::isnan(v[r]) && (worst < 0 || v[r] < v[worst])) worst = r;
      }
      s << absl::StrFormat(" %12.3g %12.3g %10d", ref, worst >= 0 ? v[worst] : kNaN, worst);
    }
    s << "\n";
  };
  for (const Metric& m : Metrics()) {
    if (auto it = per_rank.find(m.name); it != per_rank.end())
      row(m.label, m.unit, it->second, true);
  }
  if (auto it = per_rank.find("clock_offset_ms"); it != per_rank.end()) {
    row("clock offset from rank 0", "ms", it->second, false);
  }
  if (columns && distinct.size() > 1) {
    s << absl::StrFormat("  %-28s %-8s", "node", "");
    for (const std::string& n : nodes) s << absl::StrFormat(" %17s", n);
    s << "\n";
  }
  // Group figures by name; allreduce_busbw_gbps repeats the largest size's.
  static const std::map<std::string, std::pair<const char*, const char*>> kGroupLabels = {
      {"allreduce_latency_us", {"all-reduce latency", "us"}},
      {"allreduce_busbw_gbps_1mb", {"all-reduce busbw, 1 MB", "GB/s"}},
      {"allreduce_busbw_gbps_16mb", {"all-reduce busbw, 16 MB", "GB/s"}},
      {"local_busbw_gbps", {"intra-node busbw, worst node", "GB/s"}},
      {"cross_node_busbw_gbps", {"cross-node busbw, worst", "GB/s"}},
  };
  for (const auto& [k, v] : group) {
    if (k == "allreduce_busbw_gbps" && group.size() > 1) continue;
    auto it = kGroupLabels.find(k);
    s << absl::StrFormat("  %-28s %-8s %17.4g\n", it == kGroupLabels.end() ? k : it->second.first,
                         it == kGroupLabels.end() ? "" : it->second.second, v);
  }
  if (!pairs.empty()) {
    double lo = std::numeric_limits<double>::infinity();
    std::pair<int, int> worst;
    std::vector<double> bws;
    for (const auto& [p, bw] : pairs) {
      bws.push_back(bw);
      if (bw < lo) lo = bw, worst = p;
    }
    s << absl::StrFormat("  %d pair links: median %.3g GB/s, slowest %d-%d %.3g GB/s\n",
                         pairs.size(), Median(bws), worst.first, worst.second, lo);
  }
  int named = 0;
  for (const PreflightFinding& f : findings) {
    if (f.metric == "note") continue;
    s << "  OUTLIER " << f.text << "\n";
    ++named;
  }
  for (const PreflightFinding& f : findings) {
    if (f.metric == "note") s << "  note: " << f.text << "\n";
  }
  if (named == 0) s << "  no outliers\n";
  return s.str();
}

std::string PreflightReport::Json() const {
  auto num = [](double x) { return std::isnan(x) ? nlohmann::json(nullptr) : nlohmann::json(x); };
  nlohmann::json j;
  j["world_size"] = world_size;
  j["nodes"] = nodes;
  j["elapsed_s"] = absl::ToDoubleSeconds(elapsed);
  for (const auto& [k, v] : per_rank) {
    nlohmann::json col = nlohmann::json::array();
    for (double x : v) col.push_back(num(x));
    j["per_rank"][k] = col;
  }
  // What each judged figure's ratios are taken against (tools/evenstep_plot.py
  // draws them from this, rather than repeating the rule).
  j["reference"] = nlohmann::json::object();
  for (const Metric& m : Metrics()) {
    auto it = per_rank.find(m.name);
    if (it == per_rank.end()) continue;
    if (const std::optional<double> ref = ReferenceOfMeasured(it->second))
      j["reference"][m.name] = *ref;
  }
  for (const auto& [k, v] : group) j["group"][k] = num(v);
  j["pairs"] = nlohmann::json::array();
  for (const auto& [p, bw] : pairs)
    j["pairs"].push_back({{"ranks", {p.first, p.second}}, {"busbw_gbps", num(bw)}});
  j["findings"] = nlohmann::json::array();
  for (const PreflightFinding& f : findings) {
    j["findings"].push_back({{"metric", f.metric},
                             {"ranks", f.ranks},
                             {"node", f.node},
                             {"ratio", num(f.ratio)},
                             {"text", f.text}});
  }
  return j.dump();
}

std::vector<double> PreflightReport::ComputeShares() const {
  std::vector<double> shares(world_size, 1.0 / world_size);
  auto it = per_rank.find("matmul_bf16_gflops");
  if (it == per_rank.end()) it = per_rank.find("matmul_fp32_gflops");
  if (it == per_rank.end()) return shares;
  for (double x : it->second) {
    if (std::isnan(x) || x <= 0) return shares;
  }
  // Within 10 % of the median rank is the median: measurement noise between
  // equal devices would otherwise start them unequal.
  const double median = Median(it->second);
  std::vector<double> speed = it->second;
  double sum = 0;
  for (double& x : speed) {
    if (std::abs(x / median - 1) <= 0.1) x = median;
    sum += x;
  }
  for (int r = 0; r < world_size; ++r) shares[r] = speed[r] / sum;
  return shares;
}

}  // namespace evenstep

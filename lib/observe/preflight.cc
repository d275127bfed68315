// The preflight's orchestration (RunPreflight): every rank measures in the
// same order (preflight_measure.cc), in rounds and turns, the group and
// pair links and the clocks are measured together, the figures gathered and
// judged (preflight_judge.cc).
#include "evenstep/preflight.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <optional>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "evenstep/internal/median.h"
#include "evenstep/internal/preflight_parts.h"
#include "evenstep/status_macros.h"

namespace evenstep {

namespace preflight = internal::preflight;

namespace {

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
    const bool known = std::any_of(preflight::Metrics().begin(), preflight::Metrics().end(),
                                   [&f](const preflight::Metric& m) { return f.metric == m.name; });
    if (!known) {
      std::vector<std::string> names;
      for (const preflight::Metric& m : preflight::Metrics()) names.push_back(m.name);
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
    my_turn_ = layout_.place_of(rank_);
    for (const preflight::Metric& m : preflight::Metrics()) mine_[m.name] = preflight::kNaN;
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
    return preflight::MatmulGflops(device_, dtype, n, absl::Milliseconds(quick() ? 80 : 200),
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
  if (!gpu) Best("matmul_fp32_gflops", preflight::OnCpu(cpu, [&] { return Matmul(at::kFloat); }));
  Best("memcpy_gbps", preflight::OnCpu(cpu, [&] { return preflight::MemcpyGbps(copy_bytes); }));
  if (gpu) {
    Best("h2d_pinned_gbps", preflight::HostToDeviceGbps(device_, copy_bytes, true));
    Best("h2d_pageable_gbps", preflight::HostToDeviceGbps(device_, copy_bytes, false));
  }
  // A directory that failed once is not tried again.
  if (ckpt_ok_) {
    auto [w, r] = preflight::DiskGbps(options_.ckpt_dir, disk_bytes, rank_, &notes_);
    ckpt_ok_ = !std::isnan(w);
    Best("ckpt_write_gbps", w);
    Best("ckpt_read_gbps", r);
  }
  if (data_ok_) {
    const double r = preflight::DiskGbps(options_.data_dir, disk_bytes, rank_, &notes_).second;
    data_ok_ = !std::isnan(r);
    Best("data_read_gbps", r);
  }
  if (first) {
    mine_["free_memory_gb"] = preflight::FreeMemoryGb();
    if (gpu) mine_["free_device_memory_gb"] = preflight::FreeDeviceGb(device_);
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
  for (int r = 0; r < world_; ++r) clock[r] = preflight::MedianOfMeasured(offsets[r]);
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
  report_.group["allreduce_latency_us"] = preflight::MedianOfMeasured(lat);
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
  std::vector<double> sub = {preflight::kNaN, preflight::kNaN};
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
  double local_min = preflight::kNaN, cross_min = preflight::kNaN;
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
      pair_bw_.push_back(preflight::kNaN);
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
  for (const preflight::Metric& m : preflight::Metrics()) values.push_back(mine_[m.name]);
  values.insert(values.end(), pair_bw_.begin(), pair_bw_.end());
  EVENSTEP_ASSIGN_OR_RETURN(std::vector<double> all, GatherDoubles(ctx_, values));
  const size_t per = values.size();
  for (size_t m = 0; m < preflight::Metrics().size(); ++m) {
    std::vector<double> column(world_);
    bool any = false;
    for (int r = 0; r < world_; ++r) {
      column[r] = all[r * per + m];
      any = any || !std::isnan(column[r]);
    }
    if (any) report_.per_rank[preflight::Metrics()[m].name] = column;
  }
  for (int r = 0; r < world_; ++r) {
    for (size_t k = 0; k < pair_bw_.size(); ++k) {
      const int partner = r ^ (1 << k);
      if (partner < world_ && r < partner) {
        report_.pairs[{r, partner}] = all[r * per + preflight::Metrics().size() + k];
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

}  // namespace evenstep

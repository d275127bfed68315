// The preflight's verdicts on the gathered figures (JudgePreflight): slow
// ranks and nodes per figure, slow pair links, a slow cross-node link and
// clock offsets; and the compute shares a balanced run starts from.
#include <algorithm>
#include <cmath>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "evenstep/internal/median.h"
#include "evenstep/internal/preflight_parts.h"
#include "evenstep/preflight.h"

namespace evenstep {
namespace internal::preflight {

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

namespace {
// The rank a figure is judged against: the median of the measured values,
// or the better one when only two ranks measured it.
double Reference(const std::vector<double>& present) {
  return present.size() == 2 ? std::max(present[0], present[1]) : MedianOfMeasured(present);
}
}  // namespace

std::vector<double> Measured(const std::vector<double>& values) {
  std::vector<double> present;
  for (double x : values) {
    if (!std::isnan(x)) present.push_back(x);
  }
  return present;
}

double MedianOfMeasured(const std::vector<double>& values) {
  std::vector<double> v = Measured(values);
  return v.empty() ? kNaN : internal::Median(std::move(v));
}

std::optional<double> ReferenceOfMeasured(const std::vector<double>& values) {
  const std::vector<double> present = Measured(values);
  if (present.empty()) return std::nullopt;
  return Reference(present);
}

}  // namespace internal::preflight

namespace preflight = internal::preflight;

namespace {

// Pair links below this ratio to the median pair are named.
constexpr double kPairThreshold = 0.5;
// Cross-node bandwidth below this fraction of the intra-node one is noted.
constexpr double kCrossThreshold = 0.25;
// Clock offsets beyond this are noted (the report's arrival times shift).
constexpr double kClockOffsetMs = 10;

// Per-rank figure `m`: ranks below its threshold of the reference (the
// median rank; with two, the other one), a node named when all of its ranks
// are.
void JudgeFigure(const preflight::Metric& m, PreflightReport* report) {
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
  const std::vector<double> present = preflight::Measured(v);
  if (present.size() < 2) return;                         // one rank has no one to be compared with
  const double ref = *preflight::ReferenceOfMeasured(v);  // at least two measured
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
  const double median = preflight::MedianOfMeasured(bws);
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
  for (const preflight::Metric& m : preflight::Metrics()) JudgeFigure(m, report);
  JudgePairs(report);
  JudgeGroupAndClocks(report);
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
  const double median = preflight::MedianOfMeasured(it->second);
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

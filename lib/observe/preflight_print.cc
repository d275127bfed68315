// The preflight report as a table for people and as JSON for tools
// (PreflightReport::Table, Json).
#include <cmath>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "evenstep/internal/preflight_parts.h"
#include "evenstep/preflight.h"

namespace evenstep {

namespace preflight = internal::preflight;

namespace {

std::string Ratio(double r) { return std::isnan(r) ? "-" : absl::StrFormat("%.2fx", r); }

}  // namespace

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
    const double ref = preflight::ReferenceOfMeasured(v).value_or(preflight::kNaN);
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
      s << absl::StrFormat(" %12.3g %12.3g %10d", ref, worst >= 0 ? v[worst] : preflight::kNaN,
                           worst);
    }
    s << "\n";
  };
  for (const preflight::Metric& m : preflight::Metrics()) {
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
                         pairs.size(), preflight::MedianOfMeasured(bws), worst.first, worst.second,
                         lo);
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
  for (const preflight::Metric& m : preflight::Metrics()) {
    auto it = per_rank.find(m.name);
    if (it == per_rank.end()) continue;
    if (const std::optional<double> ref = preflight::ReferenceOfMeasured(it->second))
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

}  // namespace evenstep

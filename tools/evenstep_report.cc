// evenstep-report RUN_DIR: reads the ranks' timelines (RUN_DIR/trace-*.json,
// see lib/observe/include/evenstep/timeline.h) and reports
//   - per rank: steps, mean/p50/p95 step time, and its split into data /
//     compute / sync wait / optimizer / io (checkpoint, log) / eval / other
//   - balance efficiency per step: mean/max over ranks of data + compute
//   - stragglers by arrival at the gradient sync: which rank arrives last
//     (in at least 60 % of the steps, by more than 10 % of a step),
//     how often, by how much, in which phase it lost the time (its phase
//     times since the previous step against the other ranks' median), and
//     whether it is periodic (late every N steps)
//   - memory imbalance, apart from compute: a rank whose peak memory (the
//     device allocator's, or the resident set on the CPU) is 1.2x the
//     median rank's or more, beyond what its largest micro-batch explains
// and writes RUN_DIR/trace.json (all ranks merged, for Perfetto or
// chrome://tracing), RUN_DIR/report.json, and with Debian's
// python3-matplotlib RUN_DIR/phases.png, RUN_DIR/arrival_skew.png,
// RUN_DIR/memory.png and RUN_DIR/report.html.
#include <dirent.h>
#include <sys/wait.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iostream>
#include <map>
#include <nlohmann/json.hpp>
#include <numeric>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "evenstep/internal/median.h"

namespace {

using nlohmann::json;

const std::vector<std::string> kPhases = {"data",     "compute", "sync_wait", "optimizer",
                                          "exchange", "io",      "eval",      "other"};

// A span's phase: checkpoint writes and logs are io; an evaluation is its
// own phase (it computes, it does not wait for a disk).
std::string PhaseOf(const std::string& name) {
  if (name == "checkpoint" || name == "log") return "io";
  for (const std::string& p : kPhases) {
    if (p == name) return p;
  }
  return "other";
}

struct Span {
  std::string name;
  double ts = 0, dur = 0;  // microseconds
  int64_t step = 0;
  int segment = 0;  // trace-RRRRR.json is 0, trace-RRRRR.N.json (after a resume) N
};

struct RankTrace {
  std::vector<Span> spans;
  std::map<int64_t, double> arrive;  // step -> ts
  // step -> the latest segment that ran it: a step run again after a resume
  // counts as the later run only.
  std::map<int64_t, int> segment_of;
  // Peak memory over its steps (MB: the device allocator's allocated bytes
  // or the resident set), and the largest micro-batch it ran (padded
  // tokens): the work that memory held.
  double peak_memory_mb = 0;
  int64_t largest_micro_batch = 0;
  bool memory_on_device = false;
  // Online health: its lowest individual score (speed vs its own best) and
  // the step it was seen.
  double min_health = 1;
  int64_t min_health_step = 0;
};

double Percentile(std::vector<double> v, double q) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, static_cast<size_t>(q * (v.size() - 1) + 0.5))];
}

using evenstep::internal::Median;  // the mean of the two middle values for an even count

// A trace file; tolerates a missing closing bracket (a rank that died).
bool ReadTrace(const std::string& path, json* events) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  std::string text = ss.str();
  *events = json::parse(text, nullptr, false);
  if (events->is_discarded()) {
    while (!text.empty() && (text.back() == '\n' || text.back() == ',' || text.back() == ' ')) {
      text.pop_back();
    }
    *events = json::parse(text + "\n]", nullptr, false);
  }
  return !events->is_discarded() && events->is_array();
}

// Memory imbalance, apart from compute: a rank whose peak memory is at
// least kMemoryRatio x the median rank's, more than its work explains (its
// largest micro-batch against the median's, with 10 % room). Prints one
// line per such rank (or that memory is even) and returns them as JSON.
json MemoryVerdict(const std::map<int, RankTrace>& ranks) {
  constexpr double kMemoryRatio = 1.2;
  json out = json::array();
  std::vector<double> peaks, micro;
  for (const auto& [r, t] : ranks) {
    if (t.peak_memory_mb > 0) peaks.push_back(t.peak_memory_mb);
    if (t.largest_micro_batch > 0) micro.push_back(static_cast<double>(t.largest_micro_batch));
  }
  if (ranks.size() < 2 || peaks.size() != ranks.size()) return out;
  const double median = Median(peaks);
  const double median_micro = Median(micro);
  double highest = 0;
  for (const auto& [r, t] : ranks) {
    const double ratio = t.peak_memory_mb / median;
    highest = std::max(highest, ratio);
    const double work = median_micro > 0 && t.largest_micro_batch > 0
                            ? static_cast<double>(t.largest_micro_batch) / median_micro
                            : 1.0;
    if (ratio < kMemoryRatio || ratio < 1.1 * work) continue;
    const std::string work_text =
        std::abs(work - 1) < 0.05
            ? std::string("at the same work")
            : absl::StrFormat("with %.2fx the median's largest micro-batch", work);
    std::cout << absl::StrFormat(
        "  memory: rank %d peaks at %.2fx the median rank's memory (%.0f MB against %.0f MB, %s), "
        "%s: another buffer, process or fragmentation there; its room for micro-batches is "
        "smaller (a memory imbalance, not a compute straggler)\n",
        r, ratio, t.peak_memory_mb, median, t.memory_on_device ? "device" : "resident set",
        work_text);
    out.push_back({{"rank", r},
                   {"peak_memory_mb", t.peak_memory_mb},
                   {"ratio_to_median", ratio},
                   {"micro_batch_ratio", work}});
  }
  if (out.empty()) {
    std::cout << absl::StrFormat(
        "  memory: even (the highest rank peaks at %.2fx the median rank's memory)\n", highest);
  }
  return out;
}

}  // namespace

// `s` as one word for /bin/sh: single-quoted, each ' written as '\''.
static std::string ShellQuoted(const std::string& s) {
  std::string out = "'";
  for (char c : s) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return out + "'";
}

namespace {

// Every rank's trace segments in `dir` into `ranks` (and merged into
// DIR/trace.json); false, said, when there are none.
bool LoadTraces(const std::string& dir, std::map<int, RankTrace>* ranks) {
  json merged = json::array();
  std::vector<std::string> files;
  // opendir, not std::filesystem (see io/env.cc): this tool links no torch,
  // but keeps to the rule of the code that does.
  DIR* listing = ::opendir(dir.c_str());
  const bool error = listing == nullptr;
  while (listing != nullptr) {
    const struct dirent* e = ::readdir(listing);
    if (e == nullptr) break;
    const std::string name = e->d_name;
    if (absl::StartsWith(name, "trace-") && absl::EndsWith(name, ".json")) {
      files.push_back(dir + "/" + name);
    }
  }
  if (listing != nullptr) ::closedir(listing);
  // Segment order: trace-RRRRR.json, then trace-RRRRR.1.json, ...
  auto segment_of_file = [](const std::string& path) {
    // trace-RRRRR[.N].json -> trace-RRRRR[.N]
    std::string name = path.substr(path.rfind('/') + 1);
    name.resize(name.size() - 5);
    const size_t dot = name.find('.');
    int n = 0;
    if (dot != std::string::npos && !absl::SimpleAtoi(name.substr(dot + 1), &n)) n = 0;
    return n;
  };
  std::sort(files.begin(), files.end(), [&](const std::string& a, const std::string& b) {
    const int sa = segment_of_file(a), sb = segment_of_file(b);
    return sa != sb ? sa < sb : a < b;
  });
  if (error || files.empty()) {
    std::cerr << "evenstep-report: no trace-*.json in " << dir << "\n";
    return false;
  }
  for (const std::string& file : files) {
    const int segment = segment_of_file(file);
    json events;
    if (!ReadTrace(file, &events)) {
      std::cerr << "evenstep-report: " << file << " is not a trace (skipped)\n";
      continue;
    }
    for (const json& e : events) {
      merged.push_back(e);
      if (!e.contains("pid") || !e.contains("ts")) continue;
      const int rank = e["pid"].get<int>();
      const int64_t step =
          e.contains("args") && e["args"].contains("step") ? e["args"]["step"].get<int64_t>() : 0;
      const std::string name = e.value("name", "");
      int& latest = (*ranks)[rank].segment_of[step];
      latest = std::max(latest, segment);
      if (e.value("ph", "") == "X") {
        (*ranks)[rank].spans.push_back(
            {name, e["ts"].get<double>(), e.value("dur", 0.0), step, segment});
      } else if (name == "arrive") {
        (*ranks)[rank].arrive[step] = e["ts"].get<double>();
      } else if (name == "health" && e.contains("args")) {
        const double h = e["args"].value("health", 1.0);
        if (h < (*ranks)[rank].min_health) {
          (*ranks)[rank].min_health = h;
          (*ranks)[rank].min_health_step = step;
        }
      } else if (name == "memory" && e.contains("args")) {
        RankTrace& t = (*ranks)[rank];
        t.peak_memory_mb = std::max(t.peak_memory_mb, e["args"].value("peak_mb", 0.0));
        t.largest_micro_batch =
            std::max(t.largest_micro_batch, e["args"].value("largest_micro_batch", int64_t{0}));
        t.memory_on_device = e["args"].value("device", 0) != 0;
      } else if (name == "peak_rss_mb" && e.contains("args")) {  // traces before the memory event
        (*ranks)[rank].peak_memory_mb =
            std::max((*ranks)[rank].peak_memory_mb, e["args"].value("peak_rss_mb", 0.0));
      }
    }
  }
  std::ofstream(dir + "/trace.json") << merged.dump();
  for (auto& [r, t] : *ranks) {
    t.spans.erase(
        std::remove_if(t.spans.begin(), t.spans.end(),
                       [&t = t](const Span& sp) { return sp.segment < t.segment_of[sp.step]; }),
        t.spans.end());
  }
  return true;
}

// Steps every rank reached the sync in.
std::set<int64_t> CommonSteps(const std::map<int, RankTrace>& ranks) {
  std::set<int64_t> steps;
  for (const auto& [r, t] : ranks) {
    for (const auto& [s, ts] : t.arrive) steps.insert(s);
  }
  for (const auto& [r, t] : ranks) {
    for (auto it = steps.begin(); it != steps.end();) {
      it = t.arrive.count(*it) ? std::next(it) : steps.erase(it);
    }
  }
  return steps;
}

// Per rank and step: the window since the previous step ended (its
// exchange end) up to the arrival, split by phase; and the step's time.
struct StepView {
  std::map<std::string, double> window;  // phase -> us before arrival
  std::map<std::string, double> total;   // phase -> us in the whole step
  double end = 0;                        // exchange end
  double busy = 0;                       // data + compute
};
using Views = std::map<int, std::map<int64_t, StepView>>;

Views BuildViews(std::map<int, RankTrace>& ranks, const std::set<int64_t>& steps) {
  Views views;
  for (auto& [r, t] : ranks) {
    std::sort(t.spans.begin(), t.spans.end(),
              [](const Span& a, const Span& b) { return a.ts < b.ts; });
    for (const Span& sp : t.spans) {
      StepView& v = views[r][sp.step];
      v.total[PhaseOf(sp.name)] += sp.dur;
      if (sp.name == "data" || sp.name == "compute") v.busy += sp.dur;
      if (sp.name == "exchange") v.end = std::max(v.end, sp.ts + sp.dur);
    }
    double previous_end = t.spans.empty() ? 0 : t.spans.front().ts;
    for (int64_t s : steps) {
      StepView& v = views[r][s];
      const double arrive = t.arrive[s];
      double covered = 0;
      for (const Span& sp : t.spans) {
        // Spans that end in (previous_end, arrive]: the time before the sync.
        const double b = std::max(sp.ts, previous_end), e = std::min(sp.ts + sp.dur, arrive);
        if (e <= b) continue;
        const std::string phase = PhaseOf(sp.name);
        if (phase == "sync_wait" || phase == "optimizer" || phase == "exchange") continue;
        v.window[phase] += e - b;
        covered += e - b;
      }
      v.window["other"] += std::max(0.0, arrive - previous_end - covered);
      v.total["step"] = arrive - previous_end;  // filled below with the full step
      if (v.end > 0) previous_end = v.end;
    }
  }
  return views;
}

// The per-rank table (and report["ranks"]).
void PrintRankTable(const std::string& dir, const std::map<int, RankTrace>& ranks,
                    const std::set<int64_t>& steps, Views& views, json* report_out) {
  json& report = *report_out;
  const int world = static_cast<int>(ranks.size());
  std::cout << absl::StrFormat("evenstep-report %s: %d ranks, %d steps\n", dir, world,
                               steps.size());
  std::cout << absl::StrFormat(
      "  %4s %6s %9s %9s %9s | %8s %8s %8s %8s %8s %8s %8s (mean ms) | %8s\n", "rank", "steps",
      "mean ms", "p50 ms", "p95 ms", "data", "compute", "sync", "optim", "io", "eval", "other",
      "peak MB");
  for (const auto& [r, t] : ranks) {
    std::vector<double> step_ms;
    std::map<std::string, double> sums;
    double previous = -1;
    for (int64_t s : steps) {
      const StepView& v = views[r][s];
      if (previous >= 0 && v.end > 0) step_ms.push_back((v.end - previous) / 1e3);
      if (v.end > 0) previous = v.end;
      for (const auto& [phase, us] : v.total) sums[phase] += us / 1e3;
      sums["other_window"] += v.window.count("other") ? v.window.at("other") / 1e3 : 0;
    }
    const double n = std::max<size_t>(steps.size(), 1);
    const double mean_ms =
        step_ms.empty() ? 0 : std::accumulate(step_ms.begin(), step_ms.end(), 0.0) / step_ms.size();
    std::cout << absl::StrFormat(
        "  %4d %6d %9.2f %9.2f %9.2f | %8.2f %8.2f %8.2f %8.2f %8.2f %8.2f %8.2f           | "
        "%8.0f\n",
        r, steps.size(), mean_ms, Median(step_ms), Percentile(step_ms, 0.95), sums["data"] / n,
        sums["compute"] / n, sums["sync_wait"] / n, sums["optimizer"] / n, sums["io"] / n,
        sums["eval"] / n, (sums["other"] + sums["other_window"]) / n, t.peak_memory_mb);
    report["ranks"].push_back({{"rank", r},
                               {"steps", steps.size()},
                               {"step_ms_mean", mean_ms},
                               {"step_ms_p50", Median(step_ms)},
                               {"step_ms_p95", Percentile(step_ms, 0.95)},
                               {"data_ms", sums["data"] / n},
                               {"compute_ms", sums["compute"] / n},
                               {"sync_wait_ms", sums["sync_wait"] / n},
                               {"optimizer_ms", sums["optimizer"] / n},
                               {"io_ms", sums["io"] / n},
                               {"eval_ms", sums["eval"] / n},
                               {"peak_memory_mb", t.peak_memory_mb},
                               {"memory_source", t.memory_on_device ? "device" : "resident set"},
                               {"largest_micro_batch", t.largest_micro_batch}});
  }
}

// Who arrived last at the sync, step by step: only by a significant margin
// (more than 10 % of the median step and over 2 ms).
struct Lateness {
  std::map<int, int> count;
  std::map<int, std::vector<int64_t>> steps;
  std::map<std::pair<int, int64_t>, double> skew;       // (rank, step) -> us
  std::map<int, std::map<std::string, double>> excess;  // rank -> phase -> us
};

// Per step: the balance efficiency, the last arriver and its skew (into
// `report`), and who was late where.
Lateness AnalyseSteps(const std::map<int, RankTrace>& ranks, const std::set<int64_t>& steps,
                      Views& views, json* report_out) {
  json& report = *report_out;
  // Per step: efficiency, last arriver and skew.
  Lateness late;
  std::vector<double> efficiencies;
  std::vector<double> step_lengths;
  for (int64_t s : steps) {
    std::vector<double> busy, arrivals;
    int last = -1;
    double last_ts = -1;
    for (const auto& [r, t] : ranks) {
      busy.push_back(views[r][s].busy);
      arrivals.push_back(t.arrive.at(s));
      if (t.arrive.at(s) > last_ts) {
        last_ts = t.arrive.at(s);
        last = r;
      }
      step_lengths.push_back(views[r][s].total["step"]);
    }
    const double max_busy = *std::max_element(busy.begin(), busy.end());
    const double efficiency =
        max_busy > 0 ? std::accumulate(busy.begin(), busy.end(), 0.0) / busy.size() / max_busy : 1;
    efficiencies.push_back(efficiency);
    const double skew = last_ts - Median(arrivals);
    json step = {
        {"step", s}, {"efficiency", efficiency}, {"last_rank", last}, {"skew_ms", skew / 1e3}};
    for (const auto& [r, t] : ranks)
      step["arrival_ms"].push_back((t.arrive.at(s) - Median(arrivals)) / 1e3);
    report["steps"].push_back(step);
    // Significant: more than 10 % of the median step and over 2 ms (below
    // that it is scheduling noise, not a rank losing time).
    const double typical = Median(step_lengths);
    if (ranks.size() > 1 && skew > std::max(2000.0, 0.10 * typical)) {
      ++late.count[last];
      late.steps[last].push_back(s);
      late.skew[{last, s}] = skew;
      for (const std::string& phase : {"data", "compute", "io", "eval", "other"}) {
        std::vector<double> others;
        for (const auto& [r, t] : ranks) {
          if (r != last) others.push_back(views[r][s].window[phase]);
        }
        late.excess[last][phase] += views[last][s].window[phase] - Median(others);
      }
    }
  }
  const double mean_eff =
      efficiencies.empty()
          ? 1
          : std::accumulate(efficiencies.begin(), efficiencies.end(), 0.0) / efficiencies.size();
  std::cout << absl::StrFormat(
      "  balance efficiency (mean/max busy before the sync): mean %.3f, min %.3f\n", mean_eff,
      efficiencies.empty() ? 1 : *std::min_element(efficiencies.begin(), efficiencies.end()));
  report["balance_efficiency"] = mean_eff;
  return late;
}

// The straggler (last in at least 60 % of the steps, by a significant
// margin) and periodic stalls, said and put into `report`.
void NameStraggler(Lateness& late, const std::set<int64_t>& steps, json* report_out) {
  json& report = *report_out;
  // The straggler: last in at least 60 % of the steps, by a significant margin.
  int straggler = -1;
  for (const auto& [r, count] : late.count) {
    if (count >= 3 && count * 5 >= 3 * static_cast<int>(steps.size()) &&
        (straggler < 0 || count > late.count[straggler])) {
      straggler = r;
    }
  }
  // Periodic stalls: a rank late every N steps (N > 1) in most of its late
  // steps. Only its big delays count (at least half its median late skew),
  // so scheduling noise on a loaded machine does not break the period.
  std::string periodic;
  for (const auto& [r, list] : late.steps) {
    std::vector<double> skews;
    for (int64_t s : list) skews.push_back(late.skew[{r, s}]);
    const double cut = 0.5 * Median(skews);
    std::vector<int64_t> big;
    for (int64_t s : list) {
      if (late.skew[{r, s}] >= cut) big.push_back(s);
    }
    if (big.size() < 3) continue;
    std::map<int64_t, int> gaps;
    for (size_t i = 1; i < big.size(); ++i) ++gaps[big[i] - big[i - 1]];
    const auto best = std::max_element(
        gaps.begin(), gaps.end(), [](const auto& a, const auto& b) { return a.second < b.second; });
    if (best->first > 1 && best->second * 5 >= 4 * static_cast<int>(big.size() - 1)) {
      periodic = absl::StrFormat("rank %d is late every %d steps", r, best->first);
    }
  }
  if (straggler >= 0) {
    std::string phase = "other";
    double worst = -1;
    for (const auto& [p, us] : late.excess[straggler]) {
      if (us > worst) {
        worst = us;
        phase = p;
      }
    }
    const std::string line = absl::StrFormat(
        "straggler: rank %d arrives last at the gradient sync in %d of %d steps; it loses the "
        "time in %s (%.1f ms per late step more than the other ranks)",
        straggler, late.count[straggler], steps.size(), phase,
        worst / 1e3 / std::max(1, late.count[straggler]));
    std::cout << "  " << line << "\n";
    report["straggler"] = {
        {"rank", straggler}, {"phase", phase}, {"late.steps", late.count[straggler]}};
  } else {
    std::cout << "  no straggler: no rank arrives last in 60 % of the steps by more than 10 % of "
                 "a step\n";
    report["straggler"] = nullptr;
  }
  if (!periodic.empty()) {
    std::cout << "  periodic stall: " << periodic << "\n";
    report["periodic"] = periodic;
  }
}

// Online health: ranks that became slower than 0.8x their own best speed
// (evenstep's --evenstep_health_warn default) at some step.
void NameDegrading(const std::map<int, RankTrace>& ranks, json* report) {
  (*report)["health"] = nlohmann::json::array();
  for (const auto& [r, t] : ranks) {
    if (t.min_health >= 0.8) continue;
    std::cout << absl::StrFormat(
        "  degrading: rank %d slowed to %.2fx its own best speed (step %d): heat, clocks or a "
        "noisy neighbour?\n",
        r, t.min_health, t.min_health_step);
    (*report)["health"].push_back(
        {{"rank", r}, {"min_health", t.min_health}, {"step", t.min_health_step}});
  }
}

// Pictures. The run directory is quoted for the shell (a path with a
// space or a quote is a path too); a failed plot is this tool's failure.
int Plot(const std::string& dir) {
  const std::string plot = absl::StrCat("/usr/bin/python3 ", ShellQuoted(EVENSTEP_PLOT_SCRIPT), " ",
                                        ShellQuoted(dir), " 2>&1");
  FILE* p = popen(plot.c_str(), "r");
  if (p == nullptr) {
    std::cerr << "evenstep-report: cannot start the plot (" << strerror(errno) << ")\n";
    return 1;
  }
  char buf[1024];
  while (fgets(buf, sizeof(buf), p) != nullptr) std::cout << "  " << buf;
  const int status = pclose(p);
  if (status != 0) {
    std::cerr << "evenstep-report: the plot of " << dir << " failed ("
              << (WIFEXITED(status) ? absl::StrCat("exit ", WEXITSTATUS(status))
                                    : absl::StrCat("status ", status))
              << "): no phases.png / report.html; the text report and JSON above stand\n";
    return 1;
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::cerr << "usage: evenstep-report RUN_DIR\n";
    return 2;
  }
  const std::string dir = argv[1];
  std::map<int, RankTrace> ranks;
  if (!LoadTraces(dir, &ranks)) return 1;
  const std::set<int64_t> steps = CommonSteps(ranks);
  Views views = BuildViews(ranks, steps);
  json report = {{"ranks", json::array()}, {"steps", json::array()}};
  PrintRankTable(dir, ranks, steps, views, &report);
  Lateness late = AnalyseSteps(ranks, steps, views, &report);
  NameStraggler(late, steps, &report);
  NameDegrading(ranks, &report);
  report["memory"] = MemoryVerdict(ranks);
  std::ofstream(dir + "/report.json") << report.dump(1);
  std::cout << "  wrote " << dir
            << "/trace.json (open in https://ui.perfetto.dev or chrome://tracing), " << dir
            << "/report.json\n";
  return Plot(dir);
}

// Balance benchmark: 4 real ranks (Gloo, evenstep-run) train on the
// variable-length fortune-cookie collection with BalancedStep in each mode —
// static (equal sample counts, the usual practice), work (equal bytes),
// dynamic (bytes x measured speed) — side by side in one run.
//
// Scenarios:
//   steady  rank 3 is slowed by --slow (default 2x) per cost unit throughout
//   change  every rank starts equal; rank 3 becomes --slow x slower halfway
//   startup rank 3 --slow x slower from the first step: dynamic balancing from
//           equal shares vs seeded by a preflight (which sees the same
//           slowdown through its test switch); steps until efficiency >= 0.95
//   model   a real byte-level model (embedding + MLP, next-byte loss) instead
//           of calibrated sleep, rank 3 slowed by an injected per-unit delay
//
// In steady and change, compute is a calibrated sleep per cost unit plus a
// fixed cost per micro-step (plus a negligible loss over the byte model's
// parameters, so real gradients are synced),
// so 4 ranks do not contend for the machine's cores and the ideal step time
// is known: all work spread in proportion to the true speeds. The model
// scenario shows the same modes with real compute (4 ranks sharing the
// cores; no ideal).
//
// Per mode: mean step time, balance efficiency (mean/max of per-rank busy
// time before the sync), step time / ideal (everything: the sync, the
// optimizer and the per-step exchange included), slowest rank's busy time /
// ideal (what balancing controls), step time / (ideal + floor), where the
// floor is the mean step with no work at all, measured first (the gradient
// all-reduce, the optimizer and the exchange of cost fits: what no split can
// remove), and in `change` the steps until efficiency is back to >= 0.95.
// steady and change run at each global batch of --batches (samples per
// step): the floor is a fixed cost per step, so its share of the step, and
// with it step/ideal, falls as the work per step grows, while what balancing
// controls (busy/ideal) does not depend on it. The model scenario runs at the
// first batch only. Last line: SUMMARY {json}; the first batch's results are
// under the scenario's name, the others' under "<scenario>_batch<N>".
//
//   evenstep_bench_balance [--quick] [--steps N] [--slow F] [--batches 64,256]
//                          [--scenarios startup,steady,change,model]
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <iostream>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "bench/byte_mlp.h"
#include "bench/relaunch.h"
#include "evenstep/balanced_step.h"
#include "evenstep/dist_context.h"
#include "evenstep/flags.h"
#include "evenstep/preflight.h"
#include "samples/fortunes.h"

ABSL_FLAG(bool, quick, false, "Few steps, less work per step (the smoke test).");
ABSL_FLAG(int, steps, 0, "Steps per mode and scenario (default 30, quick 10).");
ABSL_FLAG(double, slow, 2.0, "Slow-down factor of the slowed rank.");
ABSL_FLAG(int, slow_rank, 3, "The slowed rank.");
ABSL_FLAG(double, us_per_byte, 0, "Sleep per cost unit (default 40 us, quick 10 us).");
ABSL_FLAG(double, fixed_ms, 1.0, "Sleep per micro-step.");
ABSL_FLAG(bool, verbose, false, "Print every step: shares, micro-batches and busy time per rank.");
ABSL_FLAG(std::string, scenarios, "startup,steady,change,model", "Scenarios to run.");
ABSL_FLAG(std::string, batches, "",
          "Global batches (samples per step) to run steady and change at; default 64,256 "
          "(quick: 64). The first also sets --evenstep_global_batch for the model scenario.");

namespace {

using evenstep::BalanceMode;
using evenstep::bench::ByteModel;
using evenstep::bench::Texts;

struct RunResult {
  // ideal_ratio: step time / ideal; busy_ratio: slowest rank's busy time
  // (data + compute, no sync or optimizer) / ideal.
  double step_ms = 0, efficiency = 0, ideal_ratio = 0, busy_ratio = 0;
  // step time / (ideal + the communication floor: a step with no work).
  double floor_ratio = 0;
  int rebalance_steps = -1;     // change: steps after the change until efficiency >= 0.95
  int settle_steps = -1;        // startup: steps from the start until efficiency >= 0.95
  double first_efficiency = 0;  // the first step's
};

double Mean(const std::vector<double>& v) {
  double s = 0;
  for (double x : v) s += x;
  return v.empty() ? 0 : s / v.size();
}

// The ideal step time (ms): the step's `units` spread in proportion to the
// true speeds (every rank's fixed cost and per-unit seconds).
double IdealMs(double fixed_s, const std::vector<double>& per_unit_s, double units, double cap) {
  std::vector<evenstep::CostFit> truth(per_unit_s.size());
  for (size_t r = 0; r < truth.size(); ++r) {
    truth[r].fixed_s = fixed_s;
    truth[r].per_unit_s = per_unit_s[r];
    truth[r].observations = 1;
  }
  const auto shares = evenstep::BalancedShares(truth, units, cap, 0);
  return 1e3 * evenstep::PredictedTime(truth[0], shares[0] * units, cap);
}

// One step's figures (--verbose).
void SayStep(const evenstep::StepReport& report, const std::string& row, int s, double ms,
             double ideal_ms) {
  std::vector<std::string> per_rank;
  for (size_t r = 0; r < report.shares.size(); ++r) {
    per_rank.push_back(absl::StrFormat("r%d %.3f x%d %.1fms", r, report.shares[r],
                                       report.rank_micro_batches[r], 1e3 * report.rank_busy_s[r]));
  }
  std::cout << absl::StrFormat(
      "    %s step %d: %.1f ms (ideal %.1f; rank 0: sync wait %.1f, optimizer %.1f), "
      "efficiency %.3f | %s\n",
      row, s, ms, ideal_ms, absl::ToDoubleMilliseconds(report.sync_wait),
      absl::ToDoubleMilliseconds(report.optimizer), report.balance_efficiency,
      absl::StrJoin(per_rank, " | "));
}

// `floor_ms`: the mean step time with no work at all (scenario "floor"):
// the gradient all-reduce, the optimizer and the exchange of cost fits,
// which no split of the work can remove.
// `initial_shares`: dynamic balancing's first shares (startup: from the
// preflight), empty = equal.
absl::StatusOr<RunResult> Run(evenstep::DistContext& ctx, const Texts& data, BalanceMode mode,
                              const std::string& scenario, int steps, double floor_ms = 0,
                              std::vector<double> initial_shares = {}) {
  const int rank = ctx.rank();
  const double slow = absl::GetFlag(FLAGS_slow);
  const int slow_rank = absl::GetFlag(FLAGS_slow_rank);
  const double sleep_per_unit_s =
      (absl::GetFlag(FLAGS_us_per_byte) > 0 ? absl::GetFlag(FLAGS_us_per_byte)
                                            : (absl::GetFlag(FLAGS_quick) ? 10 : 40)) *
      1e-6;
  const bool no_work = scenario == "floor";
  const double fixed_s = no_work ? 0 : absl::GetFlag(FLAGS_fixed_ms) * 1e-3;
  const double per_unit_s = no_work ? 0 : sleep_per_unit_s;
  const bool real = scenario == "model";
  const int change_at = steps / 2;
  auto factor = [&](int r, int step) {
    if (r != slow_rank) return 1.0;
    if (scenario == "change") return step > change_at ? slow : 1.0;
    // startup and steady: slow from the first step
    return slow;
  };

  EVENSTEP_ASSIGN_OR_RETURN(evenstep::BalanceConfig config, evenstep::BalanceConfigFromFlags());
  config.planner.mode = mode;
  config.initial_shares = std::move(initial_shares);
  torch::manual_seed(0);
  ByteModel model;
  torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(0.01));
  EVENSTEP_ASSIGN_OR_RETURN(
      std::unique_ptr<evenstep::BalancedStep> step,
      evenstep::BalancedStep::Create(ctx, *model, optimizer, data.lengths, config));

  const double cap = step->sampler().micro_batch_cost_cap();
  std::vector<double> step_ms, efficiency, ideal_ratio, busy_ratio, floor_ratio;
  RunResult result;
  for (int s = 1; s <= steps; ++s) {
    auto report =
        step->Step([&](const evenstep::MicroBatch& mb) { return mb; },
                   [&](const evenstep::MicroBatch& mb) -> torch::Tensor {
                     if (real) {
                       torch::Tensor loss = model->LossSum(data, mb.samples);
                       const double extra = (factor(rank, s) - 1) * per_unit_s * mb.cost;
                       if (extra > 0)
                         std::this_thread::sleep_for(std::chrono::duration<double>(extra));
                       return loss;
                     }
                     const double sleep_s = fixed_s + per_unit_s * factor(rank, s) * mb.cost;
                     if (sleep_s > 0)
                       std::this_thread::sleep_for(std::chrono::duration<double>(sleep_s));
                     // A negligible loss over every parameter, so GradSync has real
                     // gradients to reduce (weight decay of the byte model).
                     torch::Tensor decay = torch::zeros({});
                     for (const auto& p : model->parameters()) decay = decay + p.pow(2).sum();
                     return decay * 1e-6;
                   });
    if (!report.ok()) return report.status();
    const double ms = absl::ToDoubleMilliseconds(report->end - report->begin);
    std::vector<double> speeds;  // per-unit seconds, per rank
    for (int r = 0; r < ctx.world_size(); ++r) speeds.push_back(per_unit_s * factor(r, s));
    const double ideal_ms = IdealMs(fixed_s, speeds, step->global_batch().cost, cap);
    if (absl::GetFlag(FLAGS_verbose) && rank == 0) {
      SayStep(*report, absl::StrCat(scenario, " ", evenstep::BalanceModeName(mode)), s, ms,
              ideal_ms);
    }
    const bool counted =
        scenario == "change" ? s > change_at + 5 || (s > 3 && s <= change_at) : s > 3;
    if (counted) {
      step_ms.push_back(ms);
      efficiency.push_back(report->balance_efficiency);
      ideal_ratio.push_back(ms / ideal_ms);
      floor_ratio.push_back(ms / (ideal_ms + floor_ms));
      busy_ratio.push_back(
          1e3 * *std::max_element(report->rank_busy_s.begin(), report->rank_busy_s.end()) /
          ideal_ms);
    }
    if (s == 1) result.first_efficiency = report->balance_efficiency;
    if (result.settle_steps < 0 && report->balance_efficiency >= 0.95) result.settle_steps = s;
    if (scenario == "change" && s > change_at && result.rebalance_steps < 0 &&
        report->balance_efficiency >= 0.95) {
      result.rebalance_steps = s - change_at;
    }
  }
  result.step_ms = Mean(step_ms);
  result.efficiency = Mean(efficiency);
  result.ideal_ratio = real ? 0 : Mean(ideal_ratio);
  result.busy_ratio = real ? 0 : Mean(busy_ratio);
  result.floor_ratio = real || no_work ? 0 : Mean(floor_ratio);
  return result;
}

// Startup: dynamic balancing from equal shares against dynamic balancing
// seeded by the preflight's compute figures, with rank --slow_rank slowed
// as in `steady` from the first step (the preflight sees the same slowdown:
// that rank does --slow times the work per product,
// PreflightOptions::compute_slowdown). Steps until the efficiency first
// reaches 0.95. The SUMMARY's "startup" field.
absl::StatusOr<std::string> Startup(evenstep::DistContext& ctx, const Texts& data, int steps,
                                    double floor_ms, int64_t batch, bool print) {
  absl::SetFlag(&FLAGS_evenstep_global_batch, batch);
  evenstep::PreflightOptions pf;
  pf.quick = true;
  pf.compute_slowdown =
      ctx.rank() == absl::GetFlag(FLAGS_slow_rank) ? absl::GetFlag(FLAGS_slow) : 1;
  const absl::Time pf_begin = absl::Now();
  absl::StatusOr<evenstep::PreflightReport> preflight = evenstep::RunPreflight(ctx, pf);
  if (!preflight.ok()) {
    return preflight.status();
  }
  const double pf_s = absl::ToDoubleSeconds(absl::Now() - pf_begin);
  const std::vector<double> seeded = preflight->ComputeShares();
  absl::StatusOr<RunResult> plain =
      Run(ctx, data, BalanceMode::kDynamic, "startup", steps, floor_ms);
  absl::StatusOr<RunResult> seed =
      Run(ctx, data, BalanceMode::kDynamic, "startup", steps, floor_ms, seeded);
  if (!plain.ok()) return plain.status();
  if (!seed.ok()) return seed.status();
  if (print) {
    std::vector<std::string> shares;
    for (double x : seeded) shares.push_back(absl::StrFormat("%.3f", x));
    auto settle = [](const RunResult& r) {
      return r.settle_steps < 0 ? std::string("never") : absl::StrCat(r.settle_steps);
    };
    std::cout << absl::StrFormat(
        "startup (global batch %d, rank %d %.1fx slower from step 1): preflight %.1f s, seeded "
        "shares [%s]\n  dynamic, equal first shares:   first step's efficiency %.3f, >= 0.95 at "
        "step %s, mean efficiency %.3f\n  dynamic, seeded by preflight:  first step's "
        "efficiency %.3f, >= 0.95 at step %s, mean efficiency %.3f\n",
        batch, absl::GetFlag(FLAGS_slow_rank), absl::GetFlag(FLAGS_slow), pf_s,
        absl::StrJoin(shares, ", "), plain->first_efficiency, settle(*plain), plain->efficiency,
        seed->first_efficiency, settle(*seed), seed->efficiency);
  }
  return absl::StrFormat(
      "\"startup\": {\"unseeded_settle_steps\": %d, \"seeded_settle_steps\": %d, "
      "\"unseeded_first_efficiency\": %.4f, \"seeded_first_efficiency\": %.4f, "
      "\"preflight_s\": %.2f}",
      plain->settle_steps, seed->settle_steps, plain->first_efficiency, seed->first_efficiency,
      pf_s);
}

}  // namespace

int main(int argc, char** argv) {
  // The benchmark's defaults; --evenstep_* on the command line override them.
  absl::SetFlag(&FLAGS_evenstep_micro_batch_tokens, 4096);
  absl::SetFlag(&FLAGS_evenstep_sort_window, 0);  // windows of 50 batches, as measured
  absl::SetFlag(&FLAGS_evenstep_timeout, absl::Minutes(2));
  // Parsed before the relaunch: an unknown flag stops once, not on each rank.
  absl::ParseCommandLine(argc, argv);
  if (int rc = evenstep::bench::RelaunchUnlessLaunched(4, argc, argv); rc != 0) return rc;
  torch::set_num_threads(1);
  const bool quick = absl::GetFlag(FLAGS_quick);
  const int steps = absl::GetFlag(FLAGS_steps) > 0 ? absl::GetFlag(FLAGS_steps) : (quick ? 10 : 30);
  std::vector<int64_t> batches;
  const std::string batch_list = !absl::GetFlag(FLAGS_batches).empty()
                                     ? absl::GetFlag(FLAGS_batches)
                                     : (quick ? "64" : "64,256");
  for (absl::string_view b : absl::StrSplit(batch_list, ',', absl::SkipEmpty())) {
    int64_t n = 0;
    if (!absl::SimpleAtoi(b, &n) || n < 1) {
      std::cerr << "--batches: \"" << b << "\" is not a positive sample count\n";
      return 2;
    }
    batches.push_back(n);
  }
  if (batches.empty()) {
    std::cerr << "--batches: no global batch given\n";
    return 2;
  }
  auto ctx = evenstep::DistContextFromFlags();
  if (!ctx.ok()) {
    std::cerr << ctx.status() << "\n";
    return 1;
  }
  const bool print = (*ctx)->rank() == 0;
  auto fortunes = evenstep::samples::LoadFortunes();
  if (!fortunes.ok()) {
    std::cerr << fortunes.status() << "\n";
    return 1;
  }
  Texts data;
  data.texts = *std::move(fortunes);
  data.lengths = evenstep::samples::Lengths(data.texts);
  if (print) {
    std::cout << absl::StrFormat(
        "balance: %d ranks, %d fortunes (1-%d bytes), global batches of %s samples, micro-batch "
        "cap %d padded bytes, rank %d slowed %.1fx, %d steps per mode\n",
        (*ctx)->world_size(), data.lengths.size(),
        *std::max_element(data.lengths.begin(), data.lengths.end()), absl::StrJoin(batches, ", "),
        absl::GetFlag(FLAGS_evenstep_micro_batch_tokens), absl::GetFlag(FLAGS_slow_rank),
        absl::GetFlag(FLAGS_slow), steps);
  }
  // The communication floor: the same steps with no work (dynamic mode).
  absl::StatusOr<RunResult> floor_run = Run(**ctx, data, BalanceMode::kDynamic, "floor", steps);
  if (!floor_run.ok()) {
    std::cerr << "rank " << (*ctx)->rank() << ": " << floor_run.status() << "\n";
    return 1;
  }
  const double floor_ms = floor_run->step_ms;
  if (print) {
    std::cout << absl::StrFormat(
        "floor: %.1f ms per step with no work (gradient all-reduce, optimizer, exchange of cost "
        "fits)\n",
        floor_ms);
  }
  std::string startup_json;
  if (absl::StrContains(absl::GetFlag(FLAGS_scenarios), "startup")) {
    absl::StatusOr<std::string> startup = Startup(**ctx, data, steps, floor_ms, batches[0], print);
    if (!startup.ok()) {
      std::cerr << "rank " << (*ctx)->rank() << ": " << startup.status() << "\n";
      return 1;
    }
    startup_json = *std::move(startup);
  }
  // Results by "<scenario>" (first batch) or "<scenario>_batch<N>".
  std::map<std::string, std::map<std::string, RunResult>> all;
  for (size_t bi = 0; bi < batches.size(); ++bi) {
    absl::SetFlag(&FLAGS_evenstep_global_batch, batches[bi]);
    for (absl::string_view sv : absl::StrSplit(absl::GetFlag(FLAGS_scenarios), ',')) {
      const std::string scenario(sv);
      if (scenario == "startup" || (bi > 0 && scenario == "model")) continue;
      const std::string key = bi == 0 ? scenario : absl::StrCat(scenario, "_batch", batches[bi]);
      if (print) {
        std::cout << absl::StrFormat(
            "%s (global batch %d):\n  %-8s %10s %10s %11s %11s %17s %10s\n", scenario, batches[bi],
            "mode", "step ms", "efficiency", "step/ideal", "busy/ideal", "step/(ideal+floor)",
            "rebalance");
      }
      for (BalanceMode mode : {BalanceMode::kStatic, BalanceMode::kWork, BalanceMode::kDynamic}) {
        absl::StatusOr<RunResult> r = Run(**ctx, data, mode, scenario, steps, floor_ms);
        if (!r.ok()) {
          std::cerr << "rank " << (*ctx)->rank() << ": " << r.status() << "\n";
          return 1;
        }
        all[key][evenstep::BalanceModeName(mode)] = *r;
        if (print) {
          std::cout << absl::StrFormat(
              "  %-8s %10.1f %10.3f %11s %11s %17s %10s\n", evenstep::BalanceModeName(mode),
              r->step_ms, r->efficiency,
              r->ideal_ratio > 0 ? absl::StrFormat("%.3f", r->ideal_ratio) : "-",
              r->busy_ratio > 0 ? absl::StrFormat("%.3f", r->busy_ratio) : "-",
              r->floor_ratio > 0 ? absl::StrFormat("%.3f", r->floor_ratio) : "-",
              scenario != "change"     ? "-"
              : r->rebalance_steps < 0 ? "never"
                                       : absl::StrCat(r->rebalance_steps, " steps"));
        }
      }
    }
  }
  if (print) {
    std::vector<std::string> fields = {"\"bench\": \"balance\""};
    for (const auto& [scenario, modes] : all) {
      const RunResult& d = modes.at("dynamic");
      fields.push_back(absl::StrFormat(
          "\"%s\": {\"dynamic_efficiency\": %.4f, \"dynamic_step_over_ideal\": %.4f, "
          "\"dynamic_busy_over_ideal\": %.4f, \"dynamic_step_over_ideal_plus_floor\": %.4f, "
          "\"static_efficiency\": %.4f, \"work_efficiency\": %.4f, \"static_step_over_dynamic\": "
          "%.4f, \"work_step_over_dynamic\": %.4f, \"dynamic_rebalance_steps\": %d}",
          scenario, d.efficiency, d.ideal_ratio, d.busy_ratio, d.floor_ratio,
          modes.at("static").efficiency, modes.at("work").efficiency,
          modes.at("static").step_ms / d.step_ms, modes.at("work").step_ms / d.step_ms,
          d.rebalance_steps));
    }
    if (!startup_json.empty()) fields.push_back(startup_json);
    fields.push_back(absl::StrFormat("\"floor_ms\": %.2f", floor_ms));
    fields.push_back(absl::StrFormat("\"global_batches\": [%s]", absl::StrJoin(batches, ", ")));
    fields.push_back(absl::StrFormat("\"quick\": %s", quick ? "true" : "false"));
    std::cout << "SUMMARY {" << absl::StrJoin(fields, ", ") << "}" << std::endl;
  }
  return 0;
}

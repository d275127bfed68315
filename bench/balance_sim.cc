// Planner simulation: the real Sampler, CostModel and Planner on many
// simulated ranks (default 1024) with lognormal speeds and the variable
// lengths of real text (the fortune-cookie collection; lognormal lengths when
// it is not installed). No processes, no sleeping: each rank's micro-step time
// is computed from its true speed plus noise and fed to its CostModel, as a
// real rank's timings would be. Compares static, work and dynamic: balance
// efficiency (mean/max of per-rank busy time), step time relative to the
// ideal (all work spread exactly in proportion to speed), and planning time.
// A last row plans dynamic from the true costs instead of the measured fits:
// the gap to it is what measurement noise and warm-up cost.
//
//   evenstep_bench_balance_sim [--quick] [--ranks N] [--steps N] [--speed_sigma S]
//
// Last line: SUMMARY {json}. Targets (dynamic): planning < 1 ms per step,
// efficiency >= 0.97.
#include <algorithm>
#include <cmath>
#include <iostream>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "evenstep/cost_model.h"
#include "evenstep/planner.h"
#include "evenstep/sampler.h"
#include "samples/fortunes.h"

ABSL_FLAG(bool, quick, false, "64 ranks, 12 steps (the smoke test).");
ABSL_FLAG(int, ranks, 0, "Simulated ranks (default 1024, quick 64).");
ABSL_FLAG(int, steps, 0, "Steps per mode (default 40, quick 12).");
ABSL_FLAG(int, samples_per_rank, 64, "Global batch = this x ranks samples.");
ABSL_FLAG(int64_t, micro_batch_tokens, 4096, "Per-micro-batch cap in padded bytes.");
ABSL_FLAG(int64_t, sort_window, 0, "Sampler sort window (0 = 50 global batches, 1 = none).");
ABSL_FLAG(double, speed_sigma, 0.3, "Sigma of the lognormal rank speeds.");
ABSL_FLAG(double, fixed_ms, 0.5,
          "Fixed cost of a micro-step (launch, data hand-off) on a speed-1 rank; a full "
          "micro-batch of 4096 bytes costs 8.2 ms there.");
ABSL_FLAG(double, noise, 0.03, "Relative noise of each measured micro-step time.");

namespace {

using evenstep::BalanceMode;

struct Rank {
  double fixed_s;     // per micro-step
  double per_unit_s;  // per byte
};

struct ModeResult {
  double efficiency = 0, ideal_ratio = 0;
  double plan_us_median = 0, plan_us_max = 0, split_us_median = 0;
};

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

ModeResult Simulate(BalanceMode mode, const std::vector<int64_t>& lengths,
                    const std::vector<Rank>& ranks, int steps, uint32_t seed, bool true_costs) {
  const int n = static_cast<int>(ranks.size());
  evenstep::SamplerOptions so;
  so.seed = 1;
  so.global_batch = static_cast<int64_t>(absl::GetFlag(FLAGS_samples_per_rank)) * n;
  so.micro_batch_tokens = absl::GetFlag(FLAGS_micro_batch_tokens);
  so.sort_window = absl::GetFlag(FLAGS_sort_window);
  // The dataset holds only a few global batches; a tail batch every few
  // steps would not represent training, where it comes once per epoch.
  so.drop_last = true;
  evenstep::Sampler sampler = *evenstep::Sampler::Create(lengths, so);
  evenstep::PlannerOptions po;
  po.mode = mode;
  evenstep::Planner planner(n, po);
  evenstep::CostModelOptions co;
  co.warmup_steps = 0;
  std::vector<evenstep::CostModel> models(n, evenstep::CostModel(co));
  std::vector<evenstep::CostFit> fits(n), truth(n);
  for (int r = 0; r < n; ++r) {
    truth[r].fixed_s = ranks[r].fixed_s;
    truth[r].per_unit_s = ranks[r].per_unit_s;
    truth[r].observations = 1;
  }
  std::mt19937 rng(seed);
  std::normal_distribution<double> noise(1.0, absl::GetFlag(FLAGS_noise));
  std::vector<double> eff, ratio, plan_us, split_us;
  const int settle = 3;
  for (int step = 0; step < steps; ++step) {
    const evenstep::GlobalBatch batch = sampler.Next();
    absl::Time t0 = absl::Now();
    if (step > 0) planner.Update(fits, batch.cost, sampler.micro_batch_cost_cap());
    absl::Time t1 = absl::Now();
    const evenstep::Plan& plan = planner.plan();
    auto parts = evenstep::SplitGlobalBatch(sampler, batch, plan);
    absl::Time t2 = absl::Now();
    std::vector<std::vector<evenstep::MicroBatch>> micro(n);
    for (int r = 0; r < n; ++r) micro[r] = sampler.Pack(std::move(parts[r]));
    double busy_sum = 0, busy_max = 0;
    for (int r = 0; r < n; ++r) {
      models[r].BeginStep();
      double busy = 0;
      for (const evenstep::MicroBatch& mb : micro[r]) {
        const double true_s = ranks[r].fixed_s + ranks[r].per_unit_s * mb.cost;
        busy += true_s;
        models[r].Record(mb.cost, 0, true_s * std::max(0.5, noise(rng)));
      }
      fits[r] = true_costs ? truth[r] : models[r].total_fit();
      busy_sum += busy;
      busy_max = std::max(busy_max, busy);
    }
    // The ideal: continuous shares exactly in proportion to true speed.
    const auto ideal_shares =
        evenstep::BalancedShares(truth, batch.cost, sampler.micro_batch_cost_cap(), 0);
    const double ideal = evenstep::PredictedTime(truth[0], ideal_shares[0] * batch.cost,
                                                 sampler.micro_batch_cost_cap());
    if (step >= settle) {
      eff.push_back(busy_sum / n / busy_max);
      ratio.push_back(busy_max / ideal);
      if (step > 0) plan_us.push_back(absl::ToDoubleMicroseconds(t1 - t0));
      split_us.push_back(absl::ToDoubleMicroseconds(t2 - t1));
    }
  }
  ModeResult result;
  double e = 0, q = 0;
  for (double x : eff) e += x;
  for (double x : ratio) q += x;
  result.efficiency = e / eff.size();
  result.ideal_ratio = q / ratio.size();
  result.plan_us_median = Median(plan_us);
  result.plan_us_max = plan_us.empty() ? 0 : *std::max_element(plan_us.begin(), plan_us.end());
  result.split_us_median = Median(split_us);
  return result;
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  const bool quick = absl::GetFlag(FLAGS_quick);
  const int n = absl::GetFlag(FLAGS_ranks) > 0 ? absl::GetFlag(FLAGS_ranks) : (quick ? 64 : 1024);
  const int steps = absl::GetFlag(FLAGS_steps) > 0 ? absl::GetFlag(FLAGS_steps) : (quick ? 12 : 40);
  std::vector<int64_t> lengths;
  std::string source;
  if (auto fortunes = evenstep::samples::LoadFortunes(); fortunes.ok()) {
    // Repeated until it holds at least two global batches, so each step
    // draws a fresh mix and every rank gets samples_per_rank on average.
    const std::vector<int64_t> one = evenstep::samples::Lengths(*fortunes);
    const size_t wanted = 2 * static_cast<size_t>(absl::GetFlag(FLAGS_samples_per_rank)) * n;
    int copies = 0;
    while (lengths.size() < wanted || copies == 0) {
      lengths.insert(lengths.end(), one.begin(), one.end());
      ++copies;
    }
    source = absl::StrFormat("%d fortune lengths in bytes (%d x the collection)", lengths.size(),
                             copies);
  } else {
    std::mt19937 rng(5);
    std::lognormal_distribution<double> len(5.0, 1.0);
    const int count = std::max(15000, 2 * absl::GetFlag(FLAGS_samples_per_rank) * n);
    for (int i = 0; i < count; ++i) lengths.push_back(1 + static_cast<int64_t>(len(rng)));
    source = absl::StrFormat("%d lognormal lengths (%s)", count, fortunes.status().ToString());
  }
  std::mt19937 rng(11);
  std::lognormal_distribution<double> speed(0.0, absl::GetFlag(FLAGS_speed_sigma));
  std::vector<Rank> ranks(n);
  for (Rank& r : ranks) {
    const double s = speed(rng);
    r.fixed_s = absl::GetFlag(FLAGS_fixed_ms) * 1e-3 / s;
    r.per_unit_s = 2e-6 / s;
  }
  std::cout << absl::StrFormat(
      "balance_sim: %d simulated ranks, lognormal speeds (sigma %.2f), %s, global batch %d "
      "samples, micro-batch cap %d padded bytes, %d steps per mode, %.0f %% timing noise\n",
      n, absl::GetFlag(FLAGS_speed_sigma), source, absl::GetFlag(FLAGS_samples_per_rank) * n,
      absl::GetFlag(FLAGS_micro_batch_tokens), steps, 100 * absl::GetFlag(FLAGS_noise));
  std::cout << absl::StrFormat("  %-20s %10s %14s %16s %18s\n", "mode", "efficiency", "step/ideal",
                               "plan us (p50/max)", "partition us p50");
  ModeResult results[3];
  auto print = [](const char* name, const ModeResult& r) {
    std::cout << absl::StrFormat("  %-20s %10.4f %14.4f %9.1f/%-7.1f %18.1f\n", name, r.efficiency,
                                 r.ideal_ratio, r.plan_us_median, r.plan_us_max, r.split_us_median);
  };
  for (BalanceMode mode : {BalanceMode::kStatic, BalanceMode::kWork, BalanceMode::kDynamic}) {
    results[static_cast<int>(mode)] = Simulate(mode, lengths, ranks, steps, 3, false);
    print(evenstep::BalanceModeName(mode), results[static_cast<int>(mode)]);
  }
  const ModeResult exact = Simulate(BalanceMode::kDynamic, lengths, ranks, steps, 3, true);
  print("dynamic, true costs", exact);
  const ModeResult& d = results[static_cast<int>(BalanceMode::kDynamic)];
  const ModeResult& s = results[static_cast<int>(BalanceMode::kStatic)];
  std::cout << absl::StrFormat(
      "SUMMARY {\"bench\": \"balance_sim\", \"ranks\": %d, \"dynamic_efficiency\": %.4f, "
      "\"dynamic_step_over_ideal\": %.4f, \"dynamic_plan_ms_p50\": %.4f, \"dynamic_plan_ms_max\": "
      "%.4f, \"partition_ms_p50\": %.4f, \"work_efficiency\": %.4f, \"static_efficiency\": %.4f, "
      "\"static_step_over_dynamic\": %.4f, \"dynamic_true_cost_efficiency\": %.4f, \"quick\": "
      "%s}\n",
      n, d.efficiency, d.ideal_ratio, d.plan_us_median / 1e3, d.plan_us_max / 1e3,
      d.split_us_median / 1e3, results[static_cast<int>(BalanceMode::kWork)].efficiency,
      s.efficiency, s.ideal_ratio / d.ideal_ratio, exact.efficiency, quick ? "true" : "false");
  return 0;
}

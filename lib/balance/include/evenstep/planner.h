// Planner: each rank's share of the next global batch.
//
// Every rank feeds the same inputs (all ranks' cost fits, gathered with one
// small all-gather) and gets the same plan, so no rank has to broadcast it.
// Modes:
//   static   equal sample counts (the usual practice; the reference)
//   work     equal cost units
//   dynamic  cost units in proportion to measured speed: rank r's predicted
//            time for u > 0 units is fixed_r * k_r(u) + per_unit_r * u, with
//            k_r(u) = max(1, u / micro_cap) micro-steps (PredictedTime); the
//            shares equalise the predicted finish times (water-filling),
//            within the bound of max_micro_batches micro-steps per rank.
// Stability: a target that differs from the current plan by less than
// `deadband` (relative, per rank) is ignored; a change up to `jump` is
// approached with `damping` (a fraction of the gap per plan), so noisy
// measurements do not make the plan oscillate; a larger change (a rank whose
// speed really changed) is applied at once, bounded to a factor of 2 per
// share and plan so a single bad measurement cannot empty a rank.
//
// Thread-safety: not thread-safe.
#pragma once

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "evenstep/cost_model.h"
#include "evenstep/sampler.h"

namespace evenstep {

enum class BalanceMode { kStatic, kWork, kDynamic };

// The mode named `name` (static, work, dynamic); InvalidArgument "WHAT=NAME:
// expected static, work or dynamic".
absl::StatusOr<BalanceMode> BalanceModeByName(absl::string_view name,
                                              absl::string_view what = "balance mode");
const char* BalanceModeName(BalanceMode mode);

struct PlannerOptions {
  BalanceMode mode = BalanceMode::kDynamic;
  // Most micro-steps any rank may take in one optimizer step; 0 = no bound.
  int max_micro_batches = 0;
  double damping = 0.3;
  double deadband = 0.02;
  double jump = 0.2;
};

struct Plan {
  BalanceMode mode = BalanceMode::kDynamic;
  // Fractions of the global batch's cost units (static: of its samples),
  // one per rank, summing to 1.
  std::vector<double> shares;
  // Predicted busy time of each rank for a global batch of `units` (dynamic
  // with valid fits; zeros otherwise).
  std::vector<double> predicted_s;
  // dynamic: the fits the plan was computed from (ranks without measurements
  // filled in with the median rank), for Sampler::PartitionByTime; empty
  // until measurements exist.
  std::vector<CostFit> fits;
};

class Planner {
 public:
  Planner(int world_size, PlannerOptions options);

  // Seeds the plan before any measurement (e.g. known device speeds); shares
  // are normalised. InvalidArgument for a wrong size or negative values.
  absl::Status SetShares(std::vector<double> shares);

  // The next plan from every rank's fit (index = rank) for a global batch of
  // `units` cost units and micro-batches of about `micro_cap_units` (infinity
  // when uncapped). A rank without a valid fit yet (warm-up, or no work
  // under the current plan) counts as the median measured rank, so it gets
  // work and starts measuring; with no valid fit at all the plan stays.
  const Plan& Update(const std::vector<CostFit>& fits, double units, double micro_cap_units);
  const Plan& plan() const { return plan_; }
  int world_size() const { return static_cast<int>(plan_.shares.size()); }

 private:
  PlannerOptions options_;
  Plan plan_;
};

// Splits `batch` across ranks as `plan` says: static by sample count, work by
// cost units, dynamic by predicted time once measurements exist
// (Sampler::PartitionByTime), by cost units before.
std::vector<std::vector<int64_t>> SplitGlobalBatch(const Sampler& sampler, const GlobalBatch& batch,
                                                   const Plan& plan);

// Predicted busy time of a rank with `fit` for `units` cost units (0 for none).
double PredictedTime(const CostFit& fit, double units, double micro_cap_units);

// The shares that equalise predicted finish times, without damping
// (exposed for tests and the simulation benchmark).
std::vector<double> BalancedShares(const std::vector<CostFit>& fits, double units,
                                   double micro_cap_units, int max_micro_batches);

}  // namespace evenstep

// Planner: deterministic shares of the global batch from all ranks' cost fits.
#include "evenstep/planner.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "evenstep/internal/choice.h"
#include "evenstep/internal/median.h"

namespace evenstep {

namespace {
constexpr internal::Choices<BalanceMode> kBalanceModes = {{"static", BalanceMode::kStatic},
                                                          {"work", BalanceMode::kWork},
                                                          {"dynamic", BalanceMode::kDynamic}};
}  // namespace

absl::StatusOr<BalanceMode> BalanceModeByName(absl::string_view name, absl::string_view what) {
  return internal::Choose(what, name, kBalanceModes);
}

const char* BalanceModeName(BalanceMode mode) { return internal::NameOf(mode, kBalanceModes); }

std::vector<std::vector<int64_t>> SplitGlobalBatch(const Sampler& sampler, const GlobalBatch& batch,
                                                   const Plan& plan) {
  if (!plan.fits.empty()) return sampler.PartitionByTime(batch, plan.fits, plan.predicted_s);
  return sampler.Partition(
      batch, plan.shares,
      plan.mode == BalanceMode::kStatic ? PartitionBy::kCount : PartitionBy::kCost);
}

double PredictedTime(const CostFit& fit, double units, double micro_cap_units) {
  if (!(units > 0)) return 0;
  const bool capped = std::isfinite(micro_cap_units) && micro_cap_units > 0;
  return fit.Predict(capped ? std::max(1.0, units / micro_cap_units) : 1.0, units);
}

std::vector<double> BalancedShares(const std::vector<CostFit>& fits, double units,
                                   double micro_cap_units, int max_micro_batches) {
  const size_t n = fits.size();
  std::vector<double> shares(n, n > 0 ? 1.0 / n : 0);
  if (n <= 1 || !(units > 0)) return shares;
  const bool capped = std::isfinite(micro_cap_units) && micro_cap_units > 0;
  // Rank r's time for u > 0 units: its fixed cost once per micro-step plus
  // per_unit * u. Without a cap every rank takes one micro-step; with one, a
  // rank takes ceil(u / cap) micro-steps, modelled as one micro-step up to
  // the cap and the fixed cost spread over the cap's units beyond it.
  std::vector<double> f(n), b(n), beyond(n), upper(n);
  for (size_t r = 0; r < n; ++r) {
    f[r] = fits[r].fixed_s;
    b[r] = std::max(fits[r].per_unit_s, 1e-15);
    beyond[r] = b[r] + (capped ? fits[r].fixed_s / micro_cap_units : 0);
    upper[r] = capped && max_micro_batches > 0 ? max_micro_batches * micro_cap_units
                                               : std::numeric_limits<double>::infinity();
  }
  auto assigned = [&](double t, size_t r) {
    if (t <= f[r]) return 0.0;
    double u = (t - f[r]) / b[r];
    if (capped && u > micro_cap_units) {
      u = micro_cap_units + (t - f[r] - b[r] * micro_cap_units) / beyond[r];
    }
    return std::min(u, upper[r]);
  };
  const double capacity = std::accumulate(upper.begin(), upper.end(), 0.0);
  if (capacity <= units) {
    for (size_t r = 0; r < n; ++r) shares[r] = upper[r] / capacity;
    return shares;
  }
  // Water-filling: the finish time T at which the ranks together take all
  // units is found by bisection (the total is monotonic in T).
  double lo = *std::min_element(f.begin(), f.end());
  double hi = 0;
  for (size_t r = 0; r < n; ++r) hi = std::max(hi, f[r] + beyond[r] * units);
  for (int iteration = 0; iteration < 100 && hi - lo > 1e-12 * hi; ++iteration) {
    const double mid = 0.5 * (lo + hi);
    double total = 0;
    for (size_t r = 0; r < n; ++r) total += assigned(mid, r);
    (total < units ? lo : hi) = mid;
  }
  double total = 0;
  for (size_t r = 0; r < n; ++r) total += (shares[r] = assigned(hi, r));
  for (double& s : shares) s /= total;
  return shares;
}

Planner::Planner(int world_size, PlannerOptions options) : options_(options) {
  plan_.mode = options.mode;
  plan_.shares.assign(std::max(world_size, 1), 1.0 / std::max(world_size, 1));
  plan_.predicted_s.assign(plan_.shares.size(), 0);
}

absl::Status Planner::SetShares(std::vector<double> shares) {
  if (shares.size() != plan_.shares.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("Planner: ", shares.size(), " shares for ", plan_.shares.size(), " ranks"));
  }
  double total = 0;
  for (size_t r = 0; r < shares.size(); ++r) {
    if (!(shares[r] >= 0) || !std::isfinite(shares[r])) {
      return absl::InvalidArgumentError(
          absl::StrCat("Planner: share of rank ", r, " is ", shares[r], "; must be >= 0"));
    }
    total += shares[r];
  }
  if (!(total > 0)) return absl::InvalidArgumentError("Planner: every share is zero");
  for (double& s : shares) s /= total;
  plan_.shares = std::move(shares);
  return absl::OkStatus();
}

const Plan& Planner::Update(const std::vector<CostFit>& fits, double units,
                            double micro_cap_units) {
  const size_t n = plan_.shares.size();
  if (options_.mode != BalanceMode::kDynamic) {
    plan_.shares.assign(n, 1.0 / n);
    return plan_;
  }
  // Ranks without measurements yet (warm-up, or no work under the current
  // plan) are assumed to be as fast as the median measured rank, so they get
  // work and start measuring; with no measurement at all the plan stays.
  auto usable = [](const CostFit& f) { return f.valid() && (f.per_unit_s > 0 || f.fixed_s > 0); };
  if (fits.size() != n) return plan_;
  std::vector<CostFit> known;
  for (const CostFit& f : fits) {
    if (usable(f)) known.push_back(f);
  }
  if (known.empty()) return plan_;
  std::vector<CostFit> filled = fits;
  if (known.size() < n) {
    auto median = [&](double CostFit::*field) {
      std::vector<double> v;
      for (const CostFit& f : known) v.push_back(f.*field);
      return internal::UpperMedian(std::move(v));
    };
    CostFit typical;
    typical.fixed_s = median(&CostFit::fixed_s);
    typical.per_unit_s = median(&CostFit::per_unit_s);
    typical.observations = 1;
    for (CostFit& f : filled) {
      if (!usable(f)) f = typical;
    }
  }
  const std::vector<double> target =
      BalancedShares(filled, units, micro_cap_units, options_.max_micro_batches);
  double largest_change = 0;
  for (size_t r = 0; r < n; ++r) {
    const double reference = std::max(plan_.shares[r], 1e-3 / n);
    largest_change = std::max(largest_change, std::abs(target[r] - plan_.shares[r]) / reference);
  }
  if (largest_change > options_.jump) {
    // A real change is followed at once, but no share moves by more than a
    // factor of 2 per plan, so one bad measurement cannot empty a rank.
    double total = 0;
    for (size_t r = 0; r < n; ++r) {
      const double floor = plan_.shares[r] > 0 ? plan_.shares[r] / 2 : 0;
      const double ceiling = plan_.shares[r] > 0 ? plan_.shares[r] * 2 : target[r];
      total += (plan_.shares[r] = std::clamp(target[r], floor, std::max(floor, ceiling)));
    }
    for (double& s : plan_.shares) s /= total;
  } else if (largest_change > options_.deadband) {
    for (size_t r = 0; r < n; ++r) {
      plan_.shares[r] += options_.damping * (target[r] - plan_.shares[r]);
    }
  }
  plan_.fits = filled;
  for (size_t r = 0; r < n; ++r) {
    plan_.predicted_s[r] = PredictedTime(filled[r], plan_.shares[r] * units, micro_cap_units);
  }
  return plan_;
}

}  // namespace evenstep

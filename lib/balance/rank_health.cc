// Online rank health: a slowing device named while the run goes on.
#include "evenstep/internal/rank_health.h"

#include <algorithm>

#include "absl/strings/str_format.h"

namespace evenstep::internal {

RankHealth::Figures RankHealth::Update(const std::vector<CostFit>& fits, double units, double warn,
                                       int64_t step) {
  const size_t world = fits.size();
  Figures out;
  out.health.assign(world, 1.0);
  out.relative_speed.assign(world, 1.0);
  if (best_s_.size() != world) {
    best_s_.assign(world, 0);
    unhealthy_.assign(world, false);
  }
  std::vector<double> time(world, 0), valid;
  for (size_t r = 0; r < world; ++r) {
    if (!fits[r].valid()) continue;
    time[r] = fits[r].Predict(1, units);
    if (time[r] > 0) valid.push_back(time[r]);
  }
  if (valid.empty()) return out;
  std::sort(valid.begin(), valid.end());
  const double median = valid[(valid.size() - 1) / 2];  // of two, the faster
  for (size_t r = 0; r < world; ++r) {
    if (!(time[r] > 0)) continue;
    out.relative_speed[r] = median / time[r];
    // A fit of few micro-steps may split fixed and per-unit cost badly: the
    // best counts from kSettled observations on.
    constexpr int64_t kSettled = 32;
    if (fits[r].observations < kSettled) continue;
    if (best_s_[r] <= 0 || time[r] < best_s_[r]) best_s_[r] = time[r];
    const double health = best_s_[r] / time[r];
    out.health[r] = health;
    if (warn <= 0) continue;
    if (!unhealthy_[r] && health < warn) {
      unhealthy_[r] = true;
      out.alerts.push_back(absl::StrFormat(
          "rank %d's micro-steps take %.2fx its own best (%.2fx speed) at step %d, and %.2fx the "
          "median rank's: a slowing device (heat, clocks, a noisy neighbour)?",
          r, 1 / health, health, step, time[r] / median));
    } else if (unhealthy_[r] && health >= warn + 0.05) {
      unhealthy_[r] = false;  // recovered: a later fall is named again
    }
  }
  return out;
}

}  // namespace evenstep::internal

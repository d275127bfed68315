// Online rank health (BalancedStep): each rank's typical micro-step time
// from its cost fit, against its own best so far and the median rank's; a
// rank whose time falls below BalanceConfig::health_warn of its best is
// named once, and again only after it recovered.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "evenstep/cost_model.h"

namespace evenstep::internal {

class RankHealth {
 public:
  struct Figures {
    std::vector<double> health;          // best / now per rank (1 = at its best)
    std::vector<double> relative_speed;  // the median rank's time / the rank's
    std::vector<std::string> alerts;     // ranks newly below health_warn
  };
  // Every rank's fit after `step`'s exchange; `units`: a typical
  // micro-batch's cost; `warn` <= 0: no alerts.
  Figures Update(const std::vector<CostFit>& fits, double units, double warn, int64_t step);

 private:
  std::vector<double> best_s_;  // each rank's best typical micro-step time so far
  std::vector<bool> unhealthy_;
};

}  // namespace evenstep::internal

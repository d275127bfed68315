// CostModel: this rank's measured cost of a micro-step as a function of its
// work. Each micro-step records its cost units (tokens, or a user function of
// the lengths), the time spent obtaining the micro-batch (data wait) and the
// time of forward + backward (compute). The model fits
//     seconds = fixed + per_unit * units
// to each, robustly: the first `warmup_steps` optimizer steps are ignored,
// Huber-weighted least squares over a window of recent micro-steps keeps
// single outliers (a page fault, a GC pause in the data loader) from swinging
// the fit (with fewer than 6 points, or units that hardly vary, the fit is
// proportional: a noisy intercept would swing the plan), and once the window
// holds 6 points a run of `change_run` consecutive residuals beyond
// `change_threshold` on the same side is taken as a real change of speed
// (thermal throttling, a noisy neighbour): the window restarts from them so
// the planner follows within a step or two.
//
// Thread-safety: not thread-safe; one training thread records and fits.
#pragma once

#include <cstdint>
#include <deque>

namespace evenstep {

struct CostFit {
  double fixed_s = 0;     // seconds per micro-step, independent of its size
  double per_unit_s = 0;  // seconds per cost unit
  int64_t observations = 0;
  bool valid() const { return observations > 0; }
  double Predict(double micro_steps, double units) const {
    return fixed_s * micro_steps + per_unit_s * units;
  }
};

struct CostModelOptions {
  int warmup_steps = 2;
  int window = 128;                // micro-steps kept
  double change_threshold = 0.25;  // relative residual that counts as "off"
  int change_run = 3;              // consecutive same-side residuals that mean a change
};

class CostModel {
 public:
  explicit CostModel(CostModelOptions options = {}) : options_(options) {}

  // Marks the start of an optimizer step (for the warm-up count).
  void BeginStep() { ++steps_; }
  void Record(double units, double data_s, double compute_s);

  CostFit data_fit() const { return Fit(&Observation::data_s); }
  CostFit compute_fit() const { return Fit(&Observation::compute_s); }
  // Data wait + compute: what the planner balances.
  CostFit total_fit() const { return Fit(&Observation::total_s); }
  // Times the window was restarted because the speed changed.
  int64_t changes_detected() const { return changes_; }
  void Reset();

 private:
  struct Observation {
    double units, data_s, compute_s, total_s;
  };
  CostFit Fit(double Observation::*field) const;

  CostModelOptions options_;
  std::deque<Observation> window_;
  int64_t steps_ = 0;
  int64_t changes_ = 0;
  int run_sign_ = 0;
  int run_length_ = 0;
};

// Huber-weighted least squares of y = a + b x with a, b >= 0 (exposed for
// tests and the simulation benchmark).
CostFit RobustLinearFit(const double* x, const double* y, int n);

}  // namespace evenstep

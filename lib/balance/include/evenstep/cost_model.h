// CostModel: this rank's measured cost of a micro-step as a function of its
// work. Each micro-step records its cost units (tokens, or a user function of
// the lengths), the time spent obtaining the micro-batch (data wait) and the
// time of forward + backward (compute). The model fits
//     seconds = fixed + per_unit * units
// to each, robustly: the first `warmup_steps` optimizer steps are ignored,
// Huber-weighted least squares over a window of recent micro-steps keeps
// single outliers (a page fault, a GC pause in the data loader) from swinging
// the fit. With fewer than 6 points, or units that hardly vary, the points
// cannot tell the fixed part from the per-unit part (a noisy intercept would
// swing the plan): the fixed part is then the last one identified since the
// window started, or zero (a proportional fit) before any; a fit that
// flipped to proportional whenever the spread of sizes dipped would make a
// rank's small micro-steps look free. Once the window
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

  // Marks the start of an optimizer step (for the warm-up count, and to
  // remember each fixed cost the window identified so far).
  void BeginStep();
  void Record(double units, double data_s, double compute_s);

  CostFit data_fit() const { return Fit(kData); }
  CostFit compute_fit() const { return Fit(kCompute); }
  // Data wait + compute: what the planner balances.
  CostFit total_fit() const { return Fit(kTotal); }
  // Times the window was restarted because the speed changed.
  int64_t changes_detected() const { return changes_; }
  void Reset();

 private:
  enum Field { kData, kCompute, kTotal, kFields };
  struct Observation {
    double units;
    double seconds[kFields];
  };
  CostFit Fit(Field field, bool* identified = nullptr) const;

  CostModelOptions options_;
  std::deque<Observation> window_;
  // The last fixed cost each fit identified since the window (re)started;
  // negative: none yet.
  double fixed_hint_[kFields] = {-1, -1, -1};
  int64_t steps_ = 0;
  int64_t changes_ = 0;
  int run_sign_ = 0;
  int run_length_ = 0;
};

// Huber-weighted least squares of y = a + b x with a, b >= 0 (exposed for
// tests and the simulation benchmark). When the points cannot identify the
// intercept (fewer than 6, or units that hardly vary), a = `fixed_hint` when
// it is >= 0 (a fixed cost identified earlier) and only b is fitted;
// without a hint the fit is proportional (a = 0). `identified`, when given,
// says whether the points identified a themselves.
CostFit RobustLinearFit(const double* x, const double* y, int n, double fixed_hint = -1,
                        bool* identified = nullptr);

}  // namespace evenstep

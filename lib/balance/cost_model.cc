// CostModel: robust per-rank fit of micro-step time against cost units.
#include "evenstep/cost_model.h"

#include <algorithm>
#include <cmath>
#include <iterator>
#include <vector>

#include "evenstep/internal/median.h"

namespace evenstep {
namespace {

constexpr int kMinPointsForIntercept = 6;

}  // namespace

CostFit RobustLinearFit(const double* x, const double* y, int n, double fixed_hint,
                        bool* identified) {
  CostFit fit;
  if (identified != nullptr) *identified = false;
  if (n <= 0) return fit;
  fit.observations = n;
  // The fixed part is only identifiable when sizes vary: with few points or
  // a narrow spread of units a noisy intercept would swing the plan (a rank
  // "with a huge fixed cost" gets no work), so the fit is proportional.
  double mean_x = 0, var_x = 0;
  for (int i = 0; i < n; ++i) mean_x += x[i] / n;
  for (int i = 0; i < n; ++i) var_x += (x[i] - mean_x) * (x[i] - mean_x) / n;
  const bool identifiable = n >= kMinPointsForIntercept && var_x > 0.01 * mean_x * mean_x;
  std::vector<double> w(n, 1.0), residual(n);
  double a = 0, b = 0;
  bool found = false;
  constexpr double kHuber = 1.345;  // 95 % efficiency under Gaussian noise
  for (int iteration = 0; iteration < 6; ++iteration) {
    double sw = 0, sx = 0, sy = 0;
    for (int i = 0; i < n; ++i) {
      sw += w[i];
      sx += w[i] * x[i];
      sy += w[i] * y[i];
    }
    const double xm = sx / sw, ym = sy / sw;
    double sxx = 0, sxy = 0, sxx0 = 0, sxy0 = 0;
    for (int i = 0; i < n; ++i) {
      sxx += w[i] * (x[i] - xm) * (x[i] - xm);
      sxy += w[i] * (x[i] - xm) * (y[i] - ym);
      sxx0 += w[i] * x[i] * x[i];
      sxy0 += w[i] * x[i] * y[i];
    }
    // Units (nearly) constant: fixed and per-unit parts cannot be told apart;
    // a proportional fit predicts other sizes best.
    const bool degenerate = !identifiable || sxx <= 1e-9 * sxx0;
    found = false;
    if (!degenerate) {
      b = sxy / sxx;
      a = ym - b * xm;
      found = a >= 0;
    }
    if (!found) {
      // The fixed part from the hint (or zero), the per-unit part by least
      // squares of y - a through the origin.
      a = degenerate && fixed_hint > 0 ? fixed_hint : 0;
      double sx0y = 0;
      for (int i = 0; i < n; ++i) sx0y += w[i] * x[i] * (y[i] - a);
      b = sxx0 > 0 ? sx0y / sxx0 : 0;
      if (a > 0 && b <= 0) {  // a hint above the times themselves: proportional
        a = 0;
        b = sxx0 > 0 ? sxy0 / sxx0 : 0;
      }
    }
    if (b < 0) {
      b = 0;
      a = ym;
    }
    for (int i = 0; i < n; ++i) residual[i] = std::abs(y[i] - (a + b * x[i]));
    const double scale = 1.4826 * internal::UpperMedian(residual);
    if (!(scale > 0)) break;
    for (int i = 0; i < n; ++i) {
      w[i] = residual[i] <= kHuber * scale ? 1.0 : kHuber * scale / residual[i];
    }
  }
  fit.fixed_s = a;
  fit.per_unit_s = b;
  if (identified != nullptr) *identified = found;
  return fit;
}

void CostModel::BeginStep() {
  ++steps_;
  for (int f = 0; f < kFields; ++f) {
    bool identified = false;
    const CostFit fit = Fit(static_cast<Field>(f), &identified);
    if (identified) fixed_hint_[f] = fit.fixed_s;
  }
}

void CostModel::Record(double units, double data_s, double compute_s) {
  if (steps_ <= options_.warmup_steps) return;
  const Observation obs{units, {data_s, compute_s, data_s + compute_s}};
  if (static_cast<int>(window_.size()) >= kMinPointsForIntercept) {
    const CostFit fit = total_fit();
    const double predicted = fit.Predict(1, units);
    const double relative = predicted > 0 ? (obs.seconds[kTotal] - predicted) / predicted : 0;
    const int sign = relative > options_.change_threshold    ? 1
                     : relative < -options_.change_threshold ? -1
                                                             : 0;
    if (sign != 0 && sign == run_sign_) {
      ++run_length_;
    } else {
      run_sign_ = sign;
      run_length_ = sign != 0 ? 1 : 0;
    }
  }
  window_.push_back(obs);
  if (run_length_ >= options_.change_run) {
    // A sustained shift, not an outlier: restart from the new regime.
    while (static_cast<int>(window_.size()) > options_.change_run) window_.pop_front();
    std::fill(std::begin(fixed_hint_), std::end(fixed_hint_), -1.0);
    ++changes_;
    run_sign_ = run_length_ = 0;
  }
  while (static_cast<int>(window_.size()) > options_.window) window_.pop_front();
}

CostFit CostModel::Fit(Field field, bool* identified) const {
  std::vector<double> x, y;
  x.reserve(window_.size());
  y.reserve(window_.size());
  for (const Observation& o : window_) {
    x.push_back(o.units);
    y.push_back(o.seconds[field]);
  }
  return RobustLinearFit(x.data(), y.data(), static_cast<int>(x.size()), fixed_hint_[field],
                         identified);
}

void CostModel::Reset() {
  window_.clear();
  std::fill(std::begin(fixed_hint_), std::end(fixed_hint_), -1.0);
  steps_ = 0;
  run_sign_ = run_length_ = 0;
}

}  // namespace evenstep

// Random numbers whose sequence is the same with every C++ standard library:
// std::mt19937_64's output is fixed by the standard, but the distributions
// (std::normal_distribution, std::lognormal_distribution, ...) are not, so a
// test that asserts a figure drawn through them could pass with libstdc++
// and fail with libc++. These draw from the engine's raw output only.
#pragma once

#include <cmath>
#include <cstdint>
#include <random>

namespace evenstep::testing {

class FixedRandom {
 public:
  explicit FixedRandom(uint64_t seed) : engine_(seed) {}

  // Uniform in [lo, hi): the top 53 bits of one engine output.
  double Uniform(double lo, double hi) {
    return lo + (hi - lo) * static_cast<double>(engine_() >> 11) * 0x1.0p-53;
  }
  // Normal(mean, sd) by Box-Muller, one engine pair per value.
  double Normal(double mean, double sd) {
    const double u1 = 1.0 - Uniform(0, 1);  // (0, 1]
    const double u2 = Uniform(0, 1);
    return mean + sd * std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
  }
  // exp(Normal(m, s)).
  double LogNormal(double m, double s) { return std::exp(Normal(m, s)); }
  // Uniform integer in [lo, hi] (modulo bias below 2^-40 for spans < 2^24).
  int64_t Int(int64_t lo, int64_t hi) {
    return lo + static_cast<int64_t>(engine_() % static_cast<uint64_t>(hi - lo + 1));
  }
  std::mt19937_64& engine() { return engine_; }

 private:
  std::mt19937_64 engine_;
};

}  // namespace evenstep::testing

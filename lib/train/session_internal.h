// What the Session's source files share (not installed).
#pragma once

#include <cmath>
#include <csignal>
#include <type_traits>
#include <variant>
#include <vector>

#include "evenstep/session.h"

namespace evenstep::internal {

// The last preemption signal received (0 = none), set by the handler the
// Session installs for --evenstep_preempt_signals (defined in session.cc).
extern volatile std::sig_atomic_t g_preempt_signal;
extern "C" void OnPreemptSignal(int sig);

// A KeepSum variable, whatever its type, as a double and back.
using SumPointer = std::variant<double*, float*, int64_t*, size_t*, int*>;
inline double Read(const SumPointer& value) {
  return std::visit([](auto* p) { return static_cast<double>(*p); }, value);
}
inline void Write(const SumPointer& value, double v) {
  std::visit(
      [v](auto* p) {
        using T = std::remove_pointer_t<decltype(p)>;
        *p = std::is_floating_point_v<T> ? static_cast<T>(v) : static_cast<T>(std::llround(v));
      },
      value);
}

// Every part's optimizer's rate, by parameter group.
inline std::vector<std::vector<double>> LearningRates(const std::vector<ModelPart>& parts) {
  std::vector<std::vector<double>> rates;
  for (const ModelPart& part : parts) {
    rates.emplace_back();
    for (auto& g : part.optimizer->param_groups()) rates.back().push_back(g.options().get_lr());
  }
  return rates;
}

}  // namespace evenstep::internal

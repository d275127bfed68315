// Session: the loop's own state across a resume (Keep, KeepSum,
// evenstep::Kept; stream state in session_streams.cc).
#include <ATen/ATen.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/file.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>
#include <torch/optim/schedulers/lr_scheduler.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <csignal>
#include <cstring>
#include <iostream>
#include <set>
#include <type_traits>
#include <variant>

#include "absl/strings/match.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"
#include "absl/synchronization/mutex.h"
#include "evenstep/internal/kept_values.h"
#include "evenstep/log.h"
#include "evenstep/metrics.h"
#include "evenstep/preflight.h"
#include "evenstep/session.h"
#include "evenstep/status_macros.h"
#include "evenstep/timeline.h"
#include "evenstep/train_checkpointer.h"
#include "nlohmann/json.hpp"
#include "session_internal.h"

namespace evenstep {

using internal::LearningRates;
using internal::Read;
using internal::Write;

absl::Status Session::LoadResumedTensor(const std::string& name, at::Tensor* tensor) {
  TrainState only;
  only.tensors.push_back({name, *tensor});
  LoadOptions load;
  load.strict = false;
  load.path = resumed_path_;
  EVENSTEP_ASSIGN_OR_RETURN(LoadResult loaded, checkpointer_->Load(only, load));
  if (!loaded.missing.empty()) {
    return absl::NotFoundError(absl::StrCat(resumed_path_, " holds no tensor ", name));
  }
  return absl::OkStatus();
}

template <typename T>
void Session::KeepValue(const std::string& name, T* value) {
  if (last_step_ >= first_step_) {
    KeepError(absl::FailedPreconditionError(absl::StrCat(
        "Session::Keep('", name, "'), rank ", ctx_.rank(),
        ": called after the first step; keep the loop's variables before it, so that a resumed "
        "run restores them before using them")));
    return;
  }
  absl::Status s = loop_vars_.kept->Add(name, value, loop_vars_.resumed_kept,
                                        [this](const std::string& tensor_name, at::Tensor* tensor) {
                                          return LoadResumedTensor(tensor_name, tensor);
                                        });
  if (!s.ok()) {
    KeepError(absl::Status(
        s.code(),
        absl::StrCat(s.message(), " (rank ", ctx_.rank(),
                     resumed_path_.empty() ? "" : ", resumed from " + resumed_path_, ")")));
  }
}

template <typename T>
void Session::KeepSumOf(const std::string& name, T* value) {
  KeepValue(name, value);
  if (!setup_error_.ok() || value == nullptr) return;
  SumBinding kept;
  kept.sum = "kept/" + name;
  kept.value = value;
  KeepError(step_->DeclareSum(kept.sum));
  loop_vars_.sums.push_back(std::move(kept));
}

void Session::KeepSum(const std::string& name, double* value) { KeepSumOf(name, value); }
void Session::KeepSum(const std::string& name, float* value) { KeepSumOf(name, value); }
void Session::KeepSum(const std::string& name, int64_t* value) { KeepSumOf(name, value); }
void Session::KeepSum(const std::string& name, size_t* value) { KeepSumOf(name, value); }
void Session::KeepSum(const std::string& name, int* value) { KeepSumOf(name, value); }

void Session::AddKeptSums() {
  for (SumBinding& k : loop_vars_.sums) {
    if (!k.bound) continue;
    const double now = Read(k.value);
    step_->AddToSum(k.sum, now - k.added);
    k.added = now;
  }
}

namespace {
// The kept sum of the variable `name` ("kept/<name>") in `sums`, or end().
template <typename Sums>
auto SumOf(Sums& sums, const std::string& name) {
  return std::find_if(sums.begin(), sums.end(),
                      [key = "kept/" + name](const auto& k) { return k.sum == key; });
}
}  // namespace

template <typename T>
void Session::BindKept(const std::string& name, T* value, bool sum) {
  if (!loop_vars_.kept->Has(name)) {
    if constexpr (std::is_arithmetic_v<T> && !std::is_same_v<T, bool>) {
      if (sum) return KeepSumOf(name, value);
    }
    return KeepValue(name, value);
  }
  absl::Status s = loop_vars_.kept->Rebind(name, value);
  auto binding = SumOf(loop_vars_.sums, name);
  if (s.ok() && sum != (binding != loop_vars_.sums.end())) {
    s = absl::InvalidArgumentError(
        absl::StrCat("evenstep::Kept('", name, "'): declared before as a Kept", sum ? "" : "Sum",
                     " and now as a Kept", sum ? "Sum" : "", "; keep one kind per name"));
  }
  if (!s.ok()) {
    KeepError(absl::Status(s.code(), absl::StrCat(s.message(), " (rank ", ctx_.rank(), ")")));
    return;
  }
  if constexpr (std::is_arithmetic_v<T> && !std::is_same_v<T, bool>) {
    if (sum) {
      binding->value = value;
      binding->start = binding->added = static_cast<double>(*value);
      binding->bound = true;
    }
  }
}

void Session::UnbindKept(const std::string& name) {
  loop_vars_.kept->Unbind(name);
  if (auto binding = SumOf(loop_vars_.sums, name); binding != loop_vars_.sums.end()) {
    binding->bound = false;
  }
}

template void Session::BindKept(const std::string&, double*, bool);
template void Session::BindKept(const std::string&, float*, bool);
template void Session::BindKept(const std::string&, int64_t*, bool);
template void Session::BindKept(const std::string&, int*, bool);
template void Session::BindKept(const std::string&, size_t*, bool);
template void Session::BindKept(const std::string&, bool*, bool);
template void Session::BindKept(const std::string&, std::string*, bool);

void Session::Keep(const std::string& name, double* value) { KeepValue(name, value); }
void Session::Keep(const std::string& name, float* value) { KeepValue(name, value); }
void Session::Keep(const std::string& name, int64_t* value) { KeepValue(name, value); }
void Session::Keep(const std::string& name, int* value) { KeepValue(name, value); }
void Session::Keep(const std::string& name, size_t* value) { KeepValue(name, value); }
void Session::Keep(const std::string& name, bool* value) { KeepValue(name, value); }
void Session::Keep(const std::string& name, std::string* value) { KeepValue(name, value); }
void Session::Keep(const std::string& name, std::vector<double>* value) { KeepValue(name, value); }
void Session::Keep(const std::string& name, std::vector<int64_t>* value) { KeepValue(name, value); }
void Session::Keep(const std::string& name, at::Tensor* value) { KeepValue(name, value); }

}  // namespace evenstep

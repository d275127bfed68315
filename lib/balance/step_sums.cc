// The step's sums over all ranks, on this rank.
#include "evenstep/internal/step_sums.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <stdexcept>

#include "absl/strings/str_cat.h"

namespace evenstep::internal {

absl::Status StepSums::Declare(const std::string& name, int rank) {
  if (began_ || std::count(names_.begin(), names_.end(), name) > 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("BalancedStep::DeclareSum('", name, "'), rank ", rank, ": ",
                     began_ ? "declare sums before the first step" : "declared twice"));
  }
  names_.push_back(name);
  return absl::OkStatus();
}

void StepSums::BeginStep() {
  began_ = true;
  values_.assign(names_.size(), 0.0);
  tensors_.assign(names_.size(), at::Tensor());
}

size_t StepSums::Index(const std::string& name, bool in_step) const {
  const auto it = std::find(names_.begin(), names_.end(), name);
  if (it == names_.end() || !in_step) {
    throw std::invalid_argument(absl::StrCat(
        "AddToSum('", name, "'): ",
        it == names_.end() ? "not declared (DeclareSum before the first step)" : "outside a step"));
  }
  return static_cast<size_t>(it - names_.begin());
}

void StepSums::Add(const std::string& name, double value, bool in_step) {
  values_[Index(name, in_step)] += value;
}

void StepSums::Add(const std::string& name, const at::Tensor& value, bool in_step) {
  at::Tensor& sum = tensors_[Index(name, in_step)];
  const at::Tensor v = value.detach().to(at::kDouble).sum();
  sum = sum.defined() ? sum + v : v;
}

void StepSums::Collect() {
  for (size_t k = 0; k < names_.size(); ++k) {
    if (tensors_[k].defined()) values_[k] += tensors_[k].item<double>();
  }
}

at::Tensor StepSums::Rewind(bool to_part_start) {
  const Mark& at = to_part_start ? part_ : micro_batch_;
  values_ = at.values;
  tensors_ = at.tensors;
  return at.loss;
}

}  // namespace evenstep::internal

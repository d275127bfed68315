// How each supported libtorch optimizer's per-parameter state maps to named
// tensors in a checkpoint and back: SGD (momentum_buffer), Adam and AdamW
// (exp_avg, exp_avg_sq, max_exp_avg_sq, step), RMSprop (square_avg,
// momentum_buffer, grad_avg, step), Adagrad (sum, step). The state object is
// reached through its real type (a checked dynamic_cast); fields are listed
// as getter/setter pairs of the libtorch state class. Stateless.
#pragma once

#include <torch/optim.h>

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "evenstep/named_tensor.h"

namespace evenstep::internal {

struct OptimizerKind {
  std::string name;                   // "Adam", as the manifest's extras record it
  std::vector<std::string> fields;    // tensors of a parameter's state (besides "step")
  std::vector<std::string> required;  // of those, the ones every state holds
  bool has_step = false;              // a 0-d int64 "step" is saved too
  std::function<bool(const torch::optim::Optimizer&)> is;
  // Appends (prefix + field, tensor) for every defined field of `state`
  // (and prefix + "step"). InvalidArgument when `state` is not this kind's.
  std::function<absl::Status(const torch::optim::OptimizerParamState& state, NamedTensors* out,
                             const std::string& prefix)>
      capture;
  // A state object of this kind holding `values` (field -> tensor, "step").
  std::function<std::unique_ptr<torch::optim::OptimizerParamState>(
      const std::map<std::string, at::Tensor>& values)>
      restore;
};

// The kind of `optimizer`; InvalidArgument naming the supported ones.
absl::StatusOr<const OptimizerKind*> OptimizerKindOf(const torch::optim::Optimizer& optimizer);

}  // namespace evenstep::internal

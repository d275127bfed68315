// What BalancedStep's source files share (not installed).
#pragma once

#include <torch/nn/module.h>

namespace evenstep::internal {

// The device the model trains on (its first parameter's; CPU without any).
inline c10::Device ModelDevice(torch::nn::Module& model) {
  for (const at::Tensor& p : model.parameters()) return p.device();
  return c10::Device(c10::kCPU);
}

}  // namespace evenstep::internal

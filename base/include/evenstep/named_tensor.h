// A tensor with its name: how evenstep passes model parameters, buffers,
// optimizer state and checkpoint contents ("model/fc.weight",
// "optimizer/0/3/exp_avg"). One spelling for the whole library.
#pragma once

#include <string>
#include <utility>
#include <vector>

namespace at {
class Tensor;
}

namespace evenstep {

using NamedTensor = std::pair<std::string, at::Tensor>;
using NamedTensors = std::vector<NamedTensor>;

}  // namespace evenstep

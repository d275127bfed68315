// Forward declarations of the libtorch C++ API types evenstep's headers name
// by pointer or reference, so that those headers need not include
// <torch/torch.h> (about 25 s of compile time per translation unit).
#pragma once

namespace torch {
namespace nn {
class Module;
}
namespace optim {
class Optimizer;
}
}  // namespace torch

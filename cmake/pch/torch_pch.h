// Precompiled header for every evenstep target that includes libtorch
// (CMake: target_precompile_headers ... REUSE_FROM evenstep_pch).
#pragma once
#include <torch/torch.h>

#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

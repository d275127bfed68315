// The benchmarks' --device, checked the same way by each: "cpu", or "cuda"
// where this libtorch sees a GPU (rank r on cuda:r modulo the GPUs).
#pragma once

#include <torch/torch.h>

#include <iostream>
#include <optional>
#include <string>

namespace evenstep::bench {

// The device `name` means for `rank`; nullopt, with the reason printed,
// when it is neither cpu nor a usable cuda.
inline std::optional<torch::Device> BenchDevice(const std::string& name, int rank) {
  if (name == "cpu") return torch::Device(torch::kCPU);
  if (name == "cuda" && torch::cuda::is_available()) {
    return torch::Device(torch::kCUDA,
                         static_cast<c10::DeviceIndex>(rank % torch::cuda::device_count()));
  }
  std::cerr << "--device=" << name
            << ": expected cpu, or cuda on a machine where this libtorch sees a GPU\n";
  return std::nullopt;
}

}  // namespace evenstep::bench

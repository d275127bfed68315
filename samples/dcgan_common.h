// The models of pytorch/examples' DCGAN (cpp/dcgan/dcgan.cpp), written here
// in their shape: the generator's four transposed convolutions with batch
// norm, the discriminator's four convolutions with leaky ReLUs; `c` scales
// their widths (64 as in the original; the tests train narrower ones).
#pragma once

#include <torch/torch.h>

#include <cstdint>

#include "samples/dist_mnist_common.h"  // SyntheticDigits, Fail

namespace evenstep::samples {

constexpr int64_t kNoiseSize = 100;

inline torch::nn::Sequential MakeGenerator(int64_t c) {
  using namespace torch::nn;
  auto up = [](int64_t in, int64_t out, int64_t k, int64_t s, int64_t p) {
    return ConvTranspose2d(ConvTranspose2dOptions(in, out, k).stride(s).padding(p).bias(false));
  };
  return Sequential(up(kNoiseSize, 4 * c, 4, 1, 0), BatchNorm2d(4 * c), Functional(torch::relu),
                    up(4 * c, 2 * c, 3, 2, 1), BatchNorm2d(2 * c), Functional(torch::relu),
                    up(2 * c, c, 4, 2, 1), BatchNorm2d(c), Functional(torch::relu),
                    up(c, 1, 4, 2, 1), Functional(torch::tanh));
}

inline torch::nn::Sequential MakeDiscriminator(int64_t c) {
  using namespace torch::nn;
  auto down = [](int64_t in, int64_t out, int64_t k, int64_t s, int64_t p) {
    return Conv2d(Conv2dOptions(in, out, k).stride(s).padding(p).bias(false));
  };
  auto leaky = [] { return LeakyReLU(LeakyReLUOptions().negative_slope(0.2)); };
  return Sequential(down(1, c, 4, 2, 1), leaky(), down(c, 2 * c, 4, 2, 1), BatchNorm2d(2 * c),
                    leaky(), down(2 * c, 4 * c, 4, 2, 1), BatchNorm2d(4 * c), leaky(),
                    down(4 * c, 1, 3, 1, 0), Functional(torch::sigmoid), Flatten());
}

}  // namespace evenstep::samples

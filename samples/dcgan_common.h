// The DCGAN of pytorch/examples (cpp/dcgan/dcgan.cpp) on synthetic digits:
// its generator and discriminator (the original's layers; --channels scales
// their widths, 64 as in the original), a dataset of 1x28x28 images in
// [-1, 1] whose target is the sample's index, and the GAN's random draws
// (noise, smoothed real labels) keyed by (epoch, sample index), so that they
// are the same whichever batch, rank or micro-batch a sample lands in, and
// the generator's step can draw the discriminator step's noise again.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <cstdio>
#include <vector>

#include "samples/dist_mnist_common.h"

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

// SyntheticDigits' images scaled to [-1, 1], with the sample's index as target.
class DigitImages : public torch::data::datasets::Dataset<DigitImages> {
 public:
  explicit DigitImages(int64_t n) : digits_(n) {}
  torch::data::Example<> get(size_t index) override {
    return {digits_.get(index).data * 2 - 1, torch::tensor(static_cast<int64_t>(index))};
  }
  torch::optional<size_t> size() const override { return digits_.size(); }

 private:
  SyntheticDigits digits_;
};

// The generator's input for the samples `indices` (a batch's targets).
inline torch::Tensor Noise(const torch::Tensor& indices, int64_t epoch) {
  std::vector<torch::Tensor> rows;
  for (int64_t i = 0; i < indices.size(0); ++i) {
    rows.push_back(
        torch::randn({kNoiseSize, 1, 1}, SampleGenerator(epoch, indices[i].item<int64_t>(), 0)));
  }
  return torch::stack(rows);
}

// The original's smoothed real labels, uniform in [0.8, 1.0].
inline torch::Tensor RealLabels(const torch::Tensor& indices, int64_t epoch) {
  std::vector<torch::Tensor> labels;
  for (int64_t i = 0; i < indices.size(0); ++i) {
    labels.push_back(torch::empty({1}).uniform_(
        0.8, 1.0, SampleGenerator(epoch, indices[i].item<int64_t>(), 1)));
  }
  return torch::cat(labels);
}

// Rank 0 prints every step's losses.
inline void GanProgress(int rank, int64_t step, double d_loss, double g_loss) {
  if (rank == 0)
    std::printf("step %lld D_loss %.9g G_loss %.9g\n", static_cast<long long>(step), d_loss,
                g_loss);
}

}  // namespace evenstep::samples

// The deep residual network of prabhuomkar/pytorch-cpp
// (tutorials/intermediate/deep_residual_network; written here in its
// shape, not copied) on synthetic CIFAR-10-shaped images: three stages of
// two residual blocks (widths w, 2w, 4w; the original's w = 16), and the
// original's augmentation (zero padding of 4, a random horizontal flip, a
// random crop back to size) as tensor transforms drawing from torch's
// default generator.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <cstdio>
#include <string>
#include <utility>
#include <vector>

#include "samples/dist_mnist_common.h"  // Fail

namespace evenstep::samples {

// n images [3, size, size] in [0, 1]: a fixed pattern per class (the same
// for every seed) plus noise; the target is the label, as CIFAR-10's.
class SyntheticImages : public torch::data::datasets::Dataset<SyntheticImages> {
 public:
  SyntheticImages(int64_t n, int64_t size, uint64_t seed = 11) {
    torch::manual_seed(11);
    const torch::Tensor patterns = torch::rand({10, 3, size, size});
    torch::manual_seed(seed);
    labels_ = torch::randint(0, 10, {n}, torch::kLong);
    images_ =
        (patterns.index_select(0, labels_) + 0.3 * torch::randn({n, 3, size, size})).clamp(0, 1);
  }
  torch::data::Example<> get(size_t index) override {
    const auto i = static_cast<int64_t>(index);
    return {images_[i], labels_[i]};
  }
  torch::optional<size_t> size() const override { return images_.size(0); }

 private:
  torch::Tensor images_, labels_;
};

// The tutorial's augmentation, as tensor transforms of one image each
// drawing from torch's default generator (as the tutorial's transform.h
// does): zero padding, a horizontal flip with probability 1/2, a crop at a
// random offset.
class ConstantPad : public torch::data::transforms::TensorTransform<> {
 public:
  explicit ConstantPad(int64_t padding) : padding_(padding) {}
  torch::Tensor operator()(torch::Tensor input) override {
    return torch::constant_pad_nd(input, {padding_, padding_, padding_, padding_}, 0);
  }

 private:
  int64_t padding_;
};

class RandomHorizontalFlip : public torch::data::transforms::TensorTransform<> {
 public:
  torch::Tensor operator()(torch::Tensor input) override {
    return torch::rand(1).item<double>() < 0.5 ? input.flip(-1) : input;
  }
};

class RandomCrop : public torch::data::transforms::TensorTransform<> {
 public:
  explicit RandomCrop(std::vector<int64_t> size) : size_(std::move(size)) {}
  torch::Tensor operator()(torch::Tensor input) override {
    const int64_t y = torch::randint(0, input.size(-2) - size_[0] + 1, {1}).item<int64_t>();
    const int64_t x = torch::randint(0, input.size(-1) - size_[1] + 1, {1}).item<int64_t>();
    return input.slice(-2, y, y + size_[0]).slice(-1, x, x + size_[1]);
  }

 private:
  std::vector<int64_t> size_;
};

inline torch::nn::Sequential Conv3x3Bn(int64_t in, int64_t out, int64_t stride) {
  using namespace torch::nn;
  return Sequential(Conv2d(Conv2dOptions(in, out, 3).stride(stride).padding(1).bias(false)),
                    BatchNorm2d(out));
}

// Two 3x3 convolutions and the shortcut (a strided convolution when the
// shape changes).
struct ResidualBlockImpl : torch::nn::Module {
  ResidualBlockImpl(int64_t in, int64_t out, int64_t stride)
      : first(register_module("first", Conv3x3Bn(in, out, stride))),
        second(register_module("second", Conv3x3Bn(out, out, 1))) {
    if (stride != 1 || in != out)
      shortcut = register_module("shortcut", Conv3x3Bn(in, out, stride));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    torch::Tensor y = second->forward(torch::relu(first->forward(x)));
    return torch::relu(y + (shortcut.is_empty() ? x : shortcut->forward(x)));
  }
  torch::nn::Sequential first, second, shortcut{nullptr};
};
TORCH_MODULE(ResidualBlock);

struct ResNetImpl : torch::nn::Module {
  ResNetImpl(int64_t width, int64_t classes) : fc(4 * width, classes) {
    stem = register_module("stem", Conv3x3Bn(3, width, 1));
    for (int64_t stage = 0, in = width; stage < 3; ++stage) {
      const int64_t out = width << stage;
      blocks->push_back(ResidualBlock(in, out, stage == 0 ? 1 : 2));
      blocks->push_back(ResidualBlock(out, out, 1));
      in = out;
    }
    register_module("blocks", blocks);
    register_module("fc", fc);
  }
  torch::Tensor forward(const torch::Tensor& x) {
    torch::Tensor y = blocks->forward(torch::relu(stem->forward(x)));
    return fc->forward(torch::adaptive_avg_pool2d(y, {1, 1}).flatten(1));
  }
  torch::nn::Sequential stem{nullptr}, blocks;
  torch::nn::Linear fc;
};
TORCH_MODULE(ResNet);

}  // namespace evenstep::samples

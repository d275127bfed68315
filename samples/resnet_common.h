// The deep residual network of prabhuomkar/pytorch-cpp
// (tutorials/intermediate/deep_residual_network) on synthetic CIFAR-10-shaped
// images: three stages of two residual blocks (widths w, 2w, 4w; the
// original's w = 16), and the original's augmentation (zero padding of 4, a
// random horizontal flip, a random crop back to size) drawn per sample from a
// generator keyed by (epoch, sample index), so that it is the same whichever
// batch, rank, micro-batch or data worker a sample lands in, and after a
// resume. The dataset's target carries {label, sample index}.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "samples/dist_mnist_common.h"  // SampleGenerator, Fail

namespace evenstep::samples {

// n images [3, size, size] in [0, 1]: a fixed pattern per class plus noise.
class SyntheticImages : public torch::data::datasets::Dataset<SyntheticImages> {
 public:
  SyntheticImages(int64_t n, int64_t size) {
    torch::manual_seed(11);
    const torch::Tensor patterns = torch::rand({10, 3, size, size});
    labels_ = torch::randint(0, 10, {n}, torch::kLong);
    images_ =
        (patterns.index_select(0, labels_) + 0.3 * torch::randn({n, 3, size, size})).clamp(0, 1);
  }
  torch::data::Example<> get(size_t index) override {
    const auto i = static_cast<int64_t>(index);
    return {images_[i], torch::stack({labels_[i], torch::tensor(i)})};
  }
  torch::optional<size_t> size() const override { return images_.size(0); }

 private:
  torch::Tensor images_, labels_;
};

// A stacked batch, augmented for `epoch`: each image padded by 4, flipped
// with probability 1/2 and cropped back at a random offset.
struct Augmented {
  torch::Tensor images, labels;
};
inline Augmented Augment(const torch::data::Example<>& batch, int64_t epoch) {
  const int64_t size = batch.data.size(-1);
  const torch::Tensor padded = torch::constant_pad_nd(batch.data, {4, 4, 4, 4}, 0);
  std::vector<torch::Tensor> images;
  for (int64_t i = 0; i < batch.data.size(0); ++i) {
    at::Generator g = SampleGenerator(epoch, batch.target[i][1].item<int64_t>(), 2);
    const torch::Tensor draws = torch::randint(0, 9, {3}, g, torch::kLong);  // flip, y, x
    torch::Tensor image = padded[i];
    if (draws[0].item<int64_t>() % 2 == 1) image = image.flip(-1);
    const int64_t y = draws[1].item<int64_t>(), x = draws[2].item<int64_t>();
    images.push_back(image.slice(-2, y, y + size).slice(-1, x, x + size));
  }
  return {torch::stack(images), batch.target.select(1, 0)};
}

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

// The original's running epoch metrics (loss per sample, accuracy): Add
// prints each step's loss and correct predictions, EndEpoch the epoch's
// figures, and starts them again. Json/Restore for a checkpoint.
struct EpochMetrics {
  double loss_sum = 0, correct = 0, samples = 0, step = 0;
  double batch_correct = 0;  // the current batch's, while its loss is computed
  void Add(double loss, double count, double right) {
    loss_sum += loss * count, correct += right, samples += count, step += 1;
    std::printf("step %.0f loss %.9g correct %.0f\n", step, loss, right);
  }
  void EndEpoch(int64_t epoch, int64_t epochs) {
    std::printf("Epoch [%lld/%lld], Trainset - Loss: %.4f, Accuracy: %.4f\n",
                static_cast<long long>(epoch + 1), static_cast<long long>(epochs),
                loss_sum / samples, correct / samples);
    loss_sum = correct = samples = 0;
  }
  std::string Json() const { return NumbersJson({loss_sum, correct, samples, step}); }
  void Restore(const std::string& json) {
    RestoreNumbers(json, {&loss_sum, &correct, &samples, &step});
  }
};

}  // namespace evenstep::samples

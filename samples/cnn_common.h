// The convolutional network of samples/cnn_plain.cc and samples/cnn.cc, in
// the shape of prabhuomkar/pytorch-cpp's convolutional neural network
// tutorial (two conv + batch norm + ReLU + max-pool layers and a linear
// classifier; written here in its shape, not copied), and the data they
// train on: SyntheticDigits (MNIST's shapes, dist_mnist_common.h).
#pragma once

#include <torch/torch.h>

#include "samples/dist_mnist_common.h"

namespace evenstep::samples {

class ConvNetImpl : public torch::nn::Module {
 public:
  explicit ConvNetImpl(int64_t num_classes)
      : layer1_(Block(1, 16)), layer2_(Block(16, 32)), fc_(7 * 7 * 32, num_classes) {
    register_module("layer1", layer1_);
    register_module("layer2", layer2_);
    register_module("fc", fc_);
  }
  torch::Tensor forward(torch::Tensor x) {
    x = layer2_->forward(layer1_->forward(x));
    return torch::log_softmax(fc_->forward(x.view({-1, 7 * 7 * 32})), 1);
  }

 private:
  static torch::nn::Sequential Block(int64_t in, int64_t out) {
    return torch::nn::Sequential(
        torch::nn::Conv2d(torch::nn::Conv2dOptions(in, out, 5).stride(1).padding(2)),
        torch::nn::BatchNorm2d(out), torch::nn::ReLU(),
        torch::nn::MaxPool2d(torch::nn::MaxPool2dOptions(2).stride(2)));
  }
  torch::nn::Sequential layer1_, layer2_;
  torch::nn::Linear fc_;
};
TORCH_MODULE(ConvNet);

}  // namespace evenstep::samples

// A torch::data map-style dataset shaped like MNIST (1x28x28 images, labels
// 0-9), generated (no download): each class is a fixed random pattern plus
// per-sample noise, so a small conv net learns it in a few hundred steps.
// Fixed by its seed; get() only reads, so concurrent calls are safe.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "evenstep/launch_env.h"

namespace evenstep::samples {

class SyntheticDigits : public torch::data::datasets::Dataset<SyntheticDigits> {
 public:
  // `pattern_seed` (0: `seed`) draws the classes' patterns: a test set
  // with its own seed and the training set's patterns is the same task.
  explicit SyntheticDigits(int64_t n, uint64_t seed = 7, uint64_t pattern_seed = 0) {
    torch::manual_seed(pattern_seed == 0 ? seed : pattern_seed);
    const torch::Tensor patterns = torch::rand({10, 1, 28, 28});
    if (pattern_seed != 0) torch::manual_seed(seed);
    targets_ = torch::randint(0, 10, {n}, torch::kLong);
    images_ = (patterns.index_select(0, targets_) + 0.5 * torch::randn({n, 1, 28, 28})).clamp(0, 1);
  }
  torch::data::Example<> get(size_t index) override {
    const auto i = static_cast<int64_t>(index);
    return {images_[i], targets_[i]};
  }
  torch::optional<size_t> size() const override { return images_.size(0); }

 private:
  torch::Tensor images_, targets_;
};

// The dist-mnist model of pytorch/examples (cpp/distributed/dist-mnist.cpp).
struct Net : torch::nn::Module {
  Net()
      : conv1(torch::nn::Conv2dOptions(1, 10, 5)),
        conv2(torch::nn::Conv2dOptions(10, 20, 5)),
        fc1(320, 50),
        fc2(50, 10) {
    register_module("conv1", conv1);
    register_module("conv2", conv2);
    register_module("conv2_drop", conv2_drop);
    register_module("fc1", fc1);
    register_module("fc2", fc2);
  }
  torch::Tensor forward(torch::Tensor x) {
    x = torch::relu(torch::max_pool2d(conv1->forward(x), 2));
    x = torch::relu(torch::max_pool2d(conv2_drop->forward(conv2->forward(x)), 2));
    x = torch::relu(fc1->forward(x.view({-1, 320})));
    x = torch::dropout(x, 0.5, is_training());
    return torch::log_softmax(fc2->forward(x), 1);
  }
  torch::nn::Conv2d conv1, conv2;
  torch::nn::Dropout2d conv2_drop;
  torch::nn::Linear fc1, fc2;
};

// A generator for sample `sample`'s draw number `draw` (< 4) in `epoch`:
// random draws keyed by sample, the same whichever batch, rank or
// micro-batch the sample lands in.
inline at::Generator SampleGenerator(int64_t epoch, int64_t sample, int64_t draw) {
  return at::make_generator<at::CPUGeneratorImpl>(
      static_cast<uint64_t>((epoch * 1000003 + sample) * 4 + draw));
}

// A loop's numbers as a JSON array (Session::set_user_state), exactly
// (17 significant digits), and back: RestoreNumbers leaves the targets as
// they are for an empty state ("{}", nothing saved yet).
inline std::string NumbersJson(const std::vector<double>& numbers) {
  std::string json = "[";
  char text[32];
  for (size_t i = 0; i < numbers.size(); ++i) {
    std::snprintf(text, sizeof(text), "%s%.17g", i == 0 ? "" : ", ", numbers[i]);
    json += text;
  }
  return json + "]";
}
inline void RestoreNumbers(const std::string& json, const std::vector<double*>& numbers) {
  if (json.empty() || json[0] != '[') return;
  const char* at = json.c_str() + 1;
  for (double* n : numbers) {
    char* end = nullptr;
    *n = std::strtod(at, &end);
    at = end + (*end == ',' ? 1 : 0);
  }
}

// Prints the loss of every 10th step on rank 0.
inline void Progress(int rank, int64_t epoch, double loss) {
  static int64_t step = 0;
  if (rank == 0 && ++step % 10 == 0) {
    std::cout << "epoch " << epoch << " step " << step << " loss " << loss << std::endl;
  }
}

// The exit status for `status` (kPreemptedExitCode after a preemption's save).
inline int Fail(const absl::Status& status) {
  std::cerr << status << std::endl;
  return evenstep::ExitCode(status);
}

}  // namespace evenstep::samples

// A byte-level next-byte model whose memory and compute grow linearly with
// a micro-batch's padded length (embedding + MLP, no attention), and its
// texts, shared by the benchmarks that train on the fortunes.
#pragma once

#include <torch/torch.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

namespace evenstep::bench {

struct Texts {
  std::vector<std::string> texts;
  std::vector<int64_t> lengths;
};

// Byte-level next-byte model.
struct ByteModelImpl : torch::nn::Module {
  ByteModelImpl()
      : embed(register_module("embed", torch::nn::Embedding(256, 64))),
        hidden(register_module("hidden", torch::nn::Linear(64, 128))),
        out(register_module("out", torch::nn::Linear(128, 256))) {}
  // Sum over real bytes of the next-byte cross-entropy.
  torch::Tensor LossSum(const Texts& data, const std::vector<int64_t>& samples) {
    int64_t longest = 0;
    for (int64_t i : samples) longest = std::max(longest, data.lengths[i]);
    const int64_t n = static_cast<int64_t>(samples.size());
    torch::Tensor bytes = torch::zeros({n, longest + 1}, torch::kLong);
    torch::Tensor mask = torch::zeros({n, longest}, torch::kFloat);
    auto b = bytes.accessor<int64_t, 2>();
    auto m = mask.accessor<float, 2>();
    for (int64_t k = 0; k < n; ++k) {
      const std::string& t = data.texts[samples[k]];
      for (size_t j = 0; j < t.size(); ++j) {
        b[k][j + 1] = static_cast<int64_t>(static_cast<unsigned char>(t[j]));
        m[k][j] = 1;
      }
    }
    torch::Tensor x = bytes.narrow(1, 0, longest), y = bytes.narrow(1, 1, longest);
    torch::Tensor logits = out(torch::tanh(hidden(embed(x))));
    torch::Tensor nll = torch::nn::functional::cross_entropy(
        logits.reshape({-1, 256}), y.reshape({-1}),
        torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kNone));
    return (nll * mask.reshape({-1})).sum();
  }
  torch::nn::Embedding embed;
  torch::nn::Linear hidden, out;
};
TORCH_MODULE(ByteModel);

}  // namespace evenstep::bench

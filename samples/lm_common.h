// The LSTM language model of prabhuomkar/pytorch-cpp
// (tutorials/intermediate/language_model) on a synthetic corpus: an
// embedding, an LSTM whose hidden and cell states (stacked: [2, layers,
// rows, hidden]) are carried from one chunk to the next (truncated BPTT),
// and a linear layer to log-probabilities. The corpus is `rows` token streams
// of `chunks` x `seq` + 1 tokens (a fixed random walk over the vocabulary,
// so the model has something to learn); chunk t of every row is one step.
#pragma once

#include <torch/torch.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <string>

#include "samples/dist_mnist_common.h"  // Fail

namespace evenstep::samples {

struct LmOutput {
  torch::Tensor output, state;
};

struct RnnLmImpl : torch::nn::Module {
  RnnLmImpl(int64_t vocab, int64_t embed, int64_t hidden, int64_t layers)
      : embed(vocab, embed),
        lstm(torch::nn::LSTMOptions(embed, hidden).num_layers(layers).batch_first(true)),
        linear(hidden, vocab) {
    register_module("embed", this->embed);
    register_module("lstm", lstm);
    register_module("linear", linear);
  }
  // `state`: [2, layers, rows, hidden] (hidden and cell states).
  LmOutput forward(const torch::Tensor& x, const torch::Tensor& state) {
    auto [out, hc] = lstm->forward(embed->forward(x), std::make_tuple(state[0], state[1]));
    out = linear->forward(out.reshape({-1, out.size(2)}));
    return {torch::log_softmax(out, 1), torch::stack({std::get<0>(hc), std::get<1>(hc)})};
  }
  torch::nn::Embedding embed;
  torch::nn::LSTM lstm;
  torch::nn::Linear linear;
};
TORCH_MODULE(RnnLm);

// The rows (streams) of the samples `s` (sample row * chunks + t), as an index tensor.
inline torch::Tensor Rows(const std::vector<int64_t>& s, int64_t chunks) {
  return torch::tensor(s).div(chunks, "floor");
}

// [rows, chunks * seq + 1] token ids.
inline torch::Tensor SyntheticCorpus(int64_t rows, int64_t chunks, int64_t seq, int64_t vocab) {
  torch::manual_seed(3);
  const int64_t n = chunks * seq + 1;
  torch::Tensor steps = torch::randint(0, 3, {rows, n}, torch::kLong);
  torch::Tensor ids = torch::empty({rows, n}, torch::kLong);
  ids.select(1, 0).copy_(torch::randint(0, vocab, {rows}, torch::kLong));
  for (int64_t k = 1; k < n; ++k)
    ids.select(1, k).copy_((ids.select(1, k - 1) * 7 + steps.select(1, k)) % vocab);
  return ids;
}

// The running metrics of the original (the epoch's loss and perplexity) and
// a step count, as JSON for a checkpoint. Add prints each step's loss.
struct RunningMetrics {
  double loss_sum = 0, perplexity_sum = 0, n = 0, step = 0;
  void Add(double loss) {
    loss_sum += loss, perplexity_sum += std::exp(loss), n += 1, step += 1;
    std::printf("step %.0f loss %.9g\n", step, loss);
  }
  // Prints the epoch's means; the sums start again.
  void EndEpoch(int64_t epoch) {
    std::printf("Epoch [%lld] Loss: %.6f, Perplexity: %.6f\n", static_cast<long long>(epoch + 1),
                loss_sum / n, perplexity_sum / n);
    loss_sum = perplexity_sum = n = 0;
  }
  std::string Json() const { return NumbersJson({loss_sum, perplexity_sum, n, step}); }
  void Restore(const std::string& json) {
    RestoreNumbers(json, {&loss_sum, &perplexity_sum, &n, &step});
  }
};

}  // namespace evenstep::samples

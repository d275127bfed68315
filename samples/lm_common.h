// The language model of prabhuomkar/pytorch-cpp's tutorial
// (tutorials/intermediate/language_model), written here in its shape: an
// embedding, an LSTM (batch first) whose hidden and cell states the loop
// carries from one chunk to the next (truncated BPTT), and a linear layer
// to log-probabilities. The corpus is synthetic: `rows` token streams of
// `chunks` x `seq` + 1 tokens (a fixed random walk over the vocabulary, so
// the model has something to learn), in place of the Penn Treebank's.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <tuple>

#include "samples/dist_mnist_common.h"  // Fail

namespace evenstep::samples {

class LanguageModelImpl : public torch::nn::Module {
 public:
  LanguageModelImpl(int64_t vocab_size, int64_t embed_size, int64_t hidden_size, int64_t num_layers)
      : embed(vocab_size, embed_size),
        lstm(torch::nn::LSTMOptions(embed_size, hidden_size)
                 .num_layers(num_layers)
                 .batch_first(true)),
        linear(hidden_size, vocab_size) {
    register_module("embed", embed);
    register_module("lstm", lstm);
    register_module("linear", linear);
  }
  // The log-probabilities of the next tokens of `x` ([rows, seq] ids), and
  // the LSTM's states after it.
  std::tuple<torch::Tensor, std::tuple<torch::Tensor, torch::Tensor>> forward(
      torch::Tensor x, std::tuple<torch::Tensor, torch::Tensor> hx) {
    auto [out, state] = lstm->forward(embed->forward(x), hx);
    out = linear->forward(out.reshape({-1, out.size(2)}));
    return {torch::log_softmax(out, 1), state};
  }

 private:
  torch::nn::Embedding embed;
  torch::nn::LSTM lstm;
  torch::nn::Linear linear;
};
TORCH_MODULE(LanguageModel);

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

}  // namespace evenstep::samples

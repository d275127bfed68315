// The sample's model and data, shared by the plain trainer and the evenstep
// trainer (their difference is only how the training loop is distributed):
// a small causal transformer over bytes, trained to predict the next byte of
// fortune cookies (Debian's `fortunes` package; one fortune = one sample, 1
// to --max_len bytes: very different lengths, exactly the imbalance evenstep
// exists for).
#pragma once

#include <torch/torch.h>

#include <cmath>
#include <string>
#include <vector>

namespace evenstep::samples {

struct BlockImpl : torch::nn::Module {
  BlockImpl(int64_t d, int64_t heads)
      : heads_(heads),
        ln1(register_module("ln1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d})))),
        qkv(register_module("qkv", torch::nn::Linear(d, 3 * d))),
        proj(register_module("proj", torch::nn::Linear(d, d))),
        ln2(register_module("ln2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d})))),
        fc1(register_module("fc1", torch::nn::Linear(d, 4 * d))),
        fc2(register_module("fc2", torch::nn::Linear(4 * d, d))) {}
  // x [B, L, d]; mask [L, L] additive (causal).
  torch::Tensor forward(torch::Tensor x, const torch::Tensor& mask) {
    const int64_t b = x.size(0), l = x.size(1), d = x.size(2), h = heads_;
    auto q_k_v = qkv(ln1(x)).view({b, l, 3, h, d / h}).permute({2, 0, 3, 1, 4});
    torch::Tensor att = torch::matmul(q_k_v[0], q_k_v[1].transpose(-2, -1)) / std::sqrt(d / h);
    att = torch::softmax(att + mask, -1);
    torch::Tensor y = torch::matmul(att, q_k_v[2]).transpose(1, 2).reshape({b, l, d});
    x = x + proj(y);
    return x + fc2(torch::gelu(fc1(ln2(x))));
  }
  int64_t heads_;
  torch::nn::LayerNorm ln1;
  torch::nn::Linear qkv, proj;
  torch::nn::LayerNorm ln2;
  torch::nn::Linear fc1, fc2;
};
TORCH_MODULE(Block);

struct ByteLMImpl : torch::nn::Module {
  ByteLMImpl(int64_t d, int64_t layers, int64_t heads, int64_t max_len)
      : embed(register_module("embed", torch::nn::Embedding(257, d))),  // 256 = begin
        pos(register_module("pos", torch::nn::Embedding(max_len + 1, d))),
        ln(register_module("ln", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d})))),
        head(register_module("head", torch::nn::Linear(d, 256))) {
    for (int64_t i = 0; i < layers; ++i) {
      blocks.push_back(register_module("block" + std::to_string(i), Block(d, heads)));
    }
  }
  // tokens [B, L] (256 = begin of text) -> logits [B, L, 256].
  torch::Tensor forward(const torch::Tensor& tokens) {
    const int64_t l = tokens.size(1);
    torch::Tensor x = embed(tokens) + pos(torch::arange(l, tokens.options()));
    const torch::Tensor mask =
        torch::full({l, l}, -1e9, x.options()).triu(1);  // a position sees itself and the past
    for (auto& b : blocks) x = b->forward(x, mask);
    return head(ln(x));
  }
  torch::nn::Embedding embed, pos;
  std::vector<Block> blocks;
  torch::nn::LayerNorm ln;
  torch::nn::Linear head;
};
TORCH_MODULE(ByteLM);

// The sum over every sample of its next-byte cross-entropy over all its
// bytes (a sample of n bytes has n targets: the first predicted from "begin").
inline torch::Tensor LossSum(ByteLM& model, const std::vector<std::string>& texts,
                             const std::vector<int64_t>& samples) {
  int64_t longest = 0;
  for (int64_t i : samples) longest = std::max<int64_t>(longest, texts[i].size());
  const int64_t n = static_cast<int64_t>(samples.size());
  torch::Tensor input = torch::full({n, longest}, 256, torch::kLong);
  torch::Tensor target = torch::full({n, longest}, -100, torch::kLong);  // -100: padding
  auto in = input.accessor<int64_t, 2>();
  auto out = target.accessor<int64_t, 2>();
  for (int64_t k = 0; k < n; ++k) {
    const std::string& t = texts[samples[k]];
    for (size_t j = 0; j < t.size(); ++j) {
      if (j + 1 < t.size()) in[k][j + 1] = static_cast<unsigned char>(t[j]);
      out[k][j] = static_cast<unsigned char>(t[j]);
    }
  }
  const torch::Device device = model->head->weight.device();
  torch::Tensor logits = model->forward(input.to(device));
  return torch::nn::functional::cross_entropy(
      logits.reshape({-1, 256}), target.to(device).reshape({-1}),
      torch::nn::functional::CrossEntropyFuncOptions().ignore_index(-100).reduction(torch::kSum));
}

// Samples `n` bytes after `prompt` (temperature 0.8, seeded).
inline std::string Generate(ByteLM& model, const std::string& prompt, int n, int64_t max_len,
                            uint64_t seed) {
  torch::NoGradGuard no_grad;
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  std::vector<int64_t> tokens = {256};
  for (unsigned char c : prompt) tokens.push_back(c);
  std::string out = prompt;
  for (int i = 0; i < n && static_cast<int64_t>(tokens.size()) < max_len; ++i) {
    torch::Tensor logits =
        model->forward(torch::tensor(tokens).unsqueeze(0).to(model->head->weight.device()))[0][-1]
            .cpu();
    torch::Tensor probs = torch::softmax(logits / 0.8, -1);
    const int64_t next = torch::multinomial(probs, 1, false, gen).item<int64_t>();
    if (next == '%' && !out.empty() && out.back() == '\n') break;
    tokens.push_back(next);
    out += static_cast<char>(next);
  }
  return out;
}

}  // namespace evenstep::samples

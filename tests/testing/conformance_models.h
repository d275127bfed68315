// The model cases of the GradSync conformance suite (conformance_test.cc):
// each a model, its loss for one rank's samples at one step and its
// optimizer. Their initial values and data are formulas that
// tests/ddp_peer.py repeats in Python, so a run can be compared with PyTorch
// DDP's. Included by conformance_test.cc alone.
//
// Cases: tied_adam, tied_sgd (tied embedding/output weight, a frozen layer, a
// branch used on some steps by some ranks, a layer never used), sparse
// (Embedding with sparse gradients), batchnorm, mixed (float64 + bf16
// layers), layout (channels-last conv, a transposed and a non-dense
// parameter), reverse (layers used in the reverse of their registration; its
// backward can throw on one rank at one step), one_param (one trainable
// parameter beside a frozen layer: DDP's test_ddp_ignore_params_arg),
// control_flow (a layer only rank 1 uses, on odd steps, and one no rank
// uses: DDP's test_ddp_control_flow_different_across_ranks),
// zero_features (a layer with no output features), random (shape, layers
// used per rank and step, and micro-steps from a seed).
#pragma once

#include <torch/torch.h>

#include <cmath>
#include <cstdint>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "tests/testing/sync_net.h"

namespace evenstep::testing::conformance {

using ::evenstep::testing::MaxRelError;

inline constexpr int kN = 18;  // samples per global batch
using torch::Tensor;

// The same formulas as tests/ddp_peer.py.
inline void InitParameters(torch::nn::Module& m) {
  torch::NoGradGuard no_grad;
  int k = 0;
  std::set<const c10::TensorImpl*> seen;
  for (auto& item : m.named_parameters()) {
    Tensor p = item.value();
    if (!seen.insert(p.unsafeGetTensorImpl()).second) continue;
    const int64_t n = p.numel();
    if (n == 0) {  // zero output features: nothing to set
      ++k;
      continue;
    }
    const double scale = p.dim() >= 2 ? 0.5 / std::sqrt(static_cast<double>(n / p.size(0))) : 0.1;
    Tensor v = torch::sin(torch::arange(n, torch::kDouble) * 0.7 + 1.3 * k + 0.2) * scale;
    p.copy_(v.view(p.sizes()).to(p.scalar_type()));
    ++k;
  }
}

inline Tensor Features(int step, int64_t s0, int64_t count, int dims) {
  Tensor s = torch::arange(s0, s0 + count, torch::kDouble).unsqueeze(1) + 100.0 * step;
  Tensor j = torch::arange(dims, torch::kDouble).unsqueeze(0);
  return torch::sin(0.37 * s + 0.91 * j).to(torch::kFloat);
}

// Inputs of `samples` of step `step` for a model that takes `dims` features,
// ids below `vocab`, or 2x4x4 images.
inline Tensor Rows(const std::vector<int64_t>& samples, int step, int dims) {
  std::vector<Tensor> rows;
  for (int64_t s : samples) rows.push_back(Features(step, s, 1, dims));
  return torch::cat(rows);
}

inline Tensor Ids(const std::vector<int64_t>& samples, int step, int vocab) {
  std::vector<int64_t> ids;
  for (int64_t s : samples) ids.push_back((step * 31 + s * 7) % vocab);
  return torch::tensor(ids, torch::kLong);
}

inline Tensor Targets(const std::vector<int64_t>& samples, int step, int classes) {
  std::vector<int64_t> t;
  for (int64_t s : samples) t.push_back((step * 5 + s * 3) % classes);
  return torch::tensor(t, torch::kLong);
}

inline Tensor SumCE(const Tensor& logits, const Tensor& targets) {
  return torch::nn::functional::cross_entropy(
      logits, targets, torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kSum));
}

inline std::vector<Tensor> UniqueTensors(const std::vector<Tensor>& all) {
  std::vector<Tensor> out;
  std::set<const c10::TensorImpl*> seen;
  for (const Tensor& t : all) {
    if (seen.insert(t.unsafeGetTensorImpl()).second) out.push_back(t);
  }
  return out;
}

// A case: the model, its loss for one shard (rank, step), its optimizer
// (over each parameter once, as Python's module.parameters() gives them).
struct Case : torch::nn::Module {
  virtual Tensor Loss(const std::vector<int64_t>& samples, int step, int rank) = 0;
  std::vector<Tensor> Params() { return UniqueTensors(parameters()); }
  virtual std::unique_ptr<torch::optim::Optimizer> Optimizer() {
    return std::make_unique<torch::optim::SGD>(Params(),
                                               torch::optim::SGDOptions(0.1).momentum(0.9));
  }
  virtual double Tolerance(const std::string& /*name*/) const { return 1e-5; }
};

struct Tied : Case {
  static constexpr int kV = 11, kD = 8;
  explicit Tied(bool adam) : adam(adam) {
    embed = register_module("embed", torch::nn::Embedding(kV, kD));
    proj = register_module("proj", torch::nn::Linear(kD, kD));
    branch = register_module("branch", torch::nn::Linear(kD, kD));
    never = register_module("never", torch::nn::Linear(kD, kD));
    head_weight = register_parameter("head_weight", embed->weight);  // tied
    for (auto& p : proj->parameters()) p.set_requires_grad(false);
  }
  static bool UsesBranch(int step, int rank) { return step % 2 == 1 && (step + rank) % 3 != 0; }
  Tensor Loss(const std::vector<int64_t>& samples, int step, int rank) override {
    Tensor h = torch::tanh(proj(embed(Ids(samples, step, kV))));
    if (UsesBranch(step, rank)) h = h + branch(h);
    return SumCE(h.matmul(head_weight.t()), Targets(samples, step, kV));
  }
  std::unique_ptr<torch::optim::Optimizer> Optimizer() override {
    if (adam) {
      return std::make_unique<torch::optim::Adam>(
          Params(), torch::optim::AdamOptions(0.01).weight_decay(0.01));
    }
    return std::make_unique<torch::optim::SGD>(
        Params(), torch::optim::SGDOptions(0.1).momentum(0.9).weight_decay(0.01));
  }
  bool adam;
  torch::nn::Embedding embed{nullptr};
  torch::nn::Linear proj{nullptr}, branch{nullptr}, never{nullptr};
  Tensor head_weight;
};

struct Sparse : Case {
  static constexpr int kV = 13, kD = 6, kC = 4;
  Sparse() {
    embed = register_module("embed",
                            torch::nn::Embedding(torch::nn::EmbeddingOptions(kV, kD).sparse(true)));
    head = register_module("head", torch::nn::Linear(kD, kC));
  }
  Tensor Loss(const std::vector<int64_t>& samples, int step, int) override {
    return SumCE(head(torch::tanh(embed(Ids(samples, step, kV)))), Targets(samples, step, kC));
  }
  std::unique_ptr<torch::optim::Optimizer> Optimizer() override {
    return std::make_unique<torch::optim::SGD>(Params(), torch::optim::SGDOptions(0.1));
  }
  torch::nn::Embedding embed{nullptr};
  torch::nn::Linear head{nullptr};
};

struct BatchNorm : Case {
  BatchNorm() {
    l1 = register_module("l1", torch::nn::Linear(5, 8));
    bn = register_module("bn", torch::nn::BatchNorm1d(8));
    l2 = register_module("l2", torch::nn::Linear(8, 3));
  }
  Tensor Loss(const std::vector<int64_t>& samples, int step, int) override {
    return SumCE(l2(torch::relu(bn(l1(Rows(samples, step, 5))))), Targets(samples, step, 3));
  }
  torch::nn::Linear l1{nullptr}, l2{nullptr};
  torch::nn::BatchNorm1d bn{nullptr};
};

struct Mixed : Case {
  Mixed() {
    l1 = register_module("l1", torch::nn::Linear(5, 8));
    l2 = register_module("l2", torch::nn::Linear(8, 3));
    l1->to(torch::kDouble);
    l2->to(torch::kBFloat16);
  }
  Tensor Loss(const std::vector<int64_t>& samples, int step, int) override {
    Tensor h = torch::tanh(l1(Rows(samples, step, 5).to(torch::kDouble)));
    return SumCE(l2(h.to(torch::kBFloat16)).to(torch::kDouble), Targets(samples, step, 3));
  }
  // bf16 arithmetic on both sides, accumulated in another order (per
  // micro-batch here, per rank in the reference); l1's gradient flows back
  // through l2's bf16 matmul, so it carries bf16 rounding too.
  double Tolerance(const std::string& name) const override {
    return name.rfind("l2.", 0) == 0 ? 1e-2 : 2e-3;
  }
  torch::nn::Linear l1{nullptr}, l2{nullptr};
};

struct Layout : Case {
  Layout() {
    conv = register_module("conv", torch::nn::Conv2d(torch::nn::Conv2dOptions(2, 4, 3).padding(1)));
    t = register_parameter("t", torch::zeros({6, 4}).t().detach());  // dense, transposed
    u = register_parameter("u", torch::zeros({3, 8}).slice(1, 0, 8, 2).detach());  // not dense
    head = register_module("head", torch::nn::Linear(6, 3));
    conv->weight.set_data(conv->weight.contiguous(at::MemoryFormat::ChannelsLast));
  }
  Tensor Loss(const std::vector<int64_t>& samples, int step, int) override {
    Tensor x = Rows(samples, step, 32).view({-1, 2, 4, 4});
    Tensor f = torch::relu(conv(x)).mean({2, 3});  // N x 4
    Tensor logits = head(torch::tanh(f.matmul(t))) + f.matmul(u.t());
    return SumCE(logits, Targets(samples, step, 3));
  }
  torch::nn::Conv2d conv{nullptr};
  torch::nn::Linear head{nullptr};
  Tensor t, u;
};

// Throws from its backward on one rank at one step (the "exception" scenario).
struct ThrowInBackward : torch::autograd::Function<ThrowInBackward> {
  static Tensor forward(torch::autograd::AutogradContext* ctx, Tensor x, bool fire) {
    ctx->saved_data["fire"] = fire;
    return x.clone();
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    if (ctx->saved_data["fire"].toBool()) {
      throw std::runtime_error("injected failure inside backward");
    }
    return {grads[0], Tensor()};
  }
};

struct Reverse : Case {
  Reverse() {
    for (int i = 0; i < 4; ++i) {
      l.push_back(register_module(absl::StrCat("l", i + 1), torch::nn::Linear(6, 6)));
    }
  }
  Tensor Loss(const std::vector<int64_t>& samples, int step, int rank) override {
    Tensor h = torch::tanh(l[3](Rows(samples, step, 6)));
    h = torch::tanh(l[2](h));
    h = ThrowInBackward::apply(h, fire_rank == rank && fire_step == step);
    h = torch::tanh(l[1](h));
    return SumCE(l[0](h), Targets(samples, step, 6));
  }
  std::vector<torch::nn::Linear> l;
  int fire_rank = -1, fire_step = -1;
};

// One trainable parameter; the rest frozen (never synced).
struct OneParam : Case {
  OneParam() {
    frozen = register_module("frozen", torch::nn::Linear(5, 5));
    w = register_module("w", torch::nn::Linear(torch::nn::LinearOptions(5, 3).bias(false)));
    for (auto& p : frozen->parameters()) p.set_requires_grad(false);
  }
  Tensor Loss(const std::vector<int64_t>& samples, int step, int) override {
    return SumCE(w(torch::tanh(frozen(Rows(samples, step, 5)))), Targets(samples, step, 3));
  }
  torch::nn::Linear frozen{nullptr}, w{nullptr};
};

// A layer with zero output features (empty weight and bias) beside real
// ones: DDP's test_ddp_zero_output_features.
struct ZeroFeatures : Case {
  ZeroFeatures() {
    a = register_module("a", torch::nn::Linear(6, 6));
    zero = register_module("zero", torch::nn::Linear(6, 0));
    head = register_module("head", torch::nn::Linear(6, 3));
  }
  Tensor Loss(const std::vector<int64_t>& samples, int step, int) override {
    Tensor x = Rows(samples, step, 6);
    Tensor h = torch::tanh(a(x));
    return SumCE(head(h), Targets(samples, step, 3)) + zero(h).sum();
  }
  torch::nn::Linear a{nullptr}, zero{nullptr}, head{nullptr};
};

// A layer only rank 1 uses, on odd steps; a layer no rank ever uses.
struct ControlFlow : Case {
  ControlFlow() {
    a = register_module("a", torch::nn::Linear(6, 6));
    b = register_module("b", torch::nn::Linear(6, 6));
    never = register_module("never", torch::nn::Linear(6, 6));
    head = register_module("head", torch::nn::Linear(6, 3));
  }
  Tensor Loss(const std::vector<int64_t>& samples, int step, int rank) override {
    Tensor h = torch::tanh(a(Rows(samples, step, 6)));
    if (rank == 1 && step % 2 == 1) h = h + b(h);
    return SumCE(head(h), Targets(samples, step, 3));
  }
  torch::nn::Linear a{nullptr}, b{nullptr}, never{nullptr}, head{nullptr};
};

// A deterministic hash of the seed and a few small numbers.
inline uint64_t Mix(uint64_t seed, int64_t a, int64_t b = 0, int64_t c = 0) {
  uint64_t h = seed * 0x9E3779B97F4A7C15ull + 0x632BE59BD9B4E019ull;
  for (int64_t v : {a, b, c}) {
    h ^= static_cast<uint64_t>(v) + 0x9E3779B97F4A7C15ull + (h << 6) + (h >> 2);
    h *= 0xBF58476D1CE4E5B9ull;
    h ^= h >> 31;
  }
  return h;
}

// The fuzz-like case: its shape and, per step and rank, which layers run
// come from --seed; the same formulas on every rank and in the reference.
struct Random : Case {
  static constexpr int kV = 9, kD = 6, kLayers = 4;
  explicit Random(uint64_t seed) : seed(seed) {
    sparse = Mix(seed, 1) % 2 == 0;
    tied = !sparse && Mix(seed, 2) % 2 == 0;
    embed = register_module(
        "embed", torch::nn::Embedding(torch::nn::EmbeddingOptions(kV, kD).sparse(sparse)));
    frozen = register_module("frozen", torch::nn::Linear(kD, kD));
    for (auto& p : frozen->parameters()) p.set_requires_grad(false);
    for (int i = 0; i < kLayers; ++i) {
      layers.push_back(register_module(absl::StrCat("l", i), torch::nn::Linear(kD, kD)));
    }
    if (tied) {
      head_weight = register_parameter("head_weight", embed->weight);
    } else {
      head = register_module("head", torch::nn::Linear(kD, kV));
    }
  }
  // Layer i runs for (step, rank) about two times in three; layer 3 never
  // on odd seeds (unused everywhere).
  bool Uses(int step, int rank, int i) const {
    if (i == kLayers - 1 && seed % 2 == 1) return false;
    return Mix(seed, step, rank, 10 + i) % 3 != 0;
  }
  int Micro(int step, int rank) const { return 1 + static_cast<int>(Mix(seed, step, rank, 7) % 3); }
  Tensor Loss(const std::vector<int64_t>& samples, int step, int rank) override {
    Tensor h = torch::tanh(frozen(embed(Ids(samples, step, kV))));
    for (int i = 0; i < kLayers; ++i) {
      if (Uses(step, rank, i)) h = h + torch::tanh(layers[i](h));
    }
    Tensor logits = tied ? h.matmul(head_weight.t()) : head(h);
    return SumCE(logits, Targets(samples, step, kV));
  }
  std::unique_ptr<torch::optim::Optimizer> Optimizer() override {
    return std::make_unique<torch::optim::SGD>(Params(), torch::optim::SGDOptions(0.1));
  }
  uint64_t seed;
  bool sparse = false, tied = false;
  torch::nn::Embedding embed{nullptr};
  torch::nn::Linear frozen{nullptr}, head{nullptr};
  std::vector<torch::nn::Linear> layers;
  Tensor head_weight;
};

inline std::shared_ptr<Case> MakeCase(const std::string& name, uint64_t seed = 0) {
  std::shared_ptr<Case> c;
  if (name == "tied_adam") c = std::make_shared<Tied>(true);
  if (name == "tied_sgd") c = std::make_shared<Tied>(false);
  if (name == "sparse") c = std::make_shared<Sparse>();
  if (name == "batchnorm") c = std::make_shared<BatchNorm>();
  if (name == "mixed") c = std::make_shared<Mixed>();
  if (name == "layout") c = std::make_shared<Layout>();
  if (name == "reverse") c = std::make_shared<Reverse>();
  if (name == "one_param") c = std::make_shared<OneParam>();
  if (name == "control_flow") c = std::make_shared<ControlFlow>();
  if (name == "zero_features") c = std::make_shared<ZeroFeatures>();
  if (name == "random") c = std::make_shared<Random>(seed);
  if (c) InitParameters(*c);
  return c;
}

// samples[r][m]: rank r's micro-batch m of the global batch (same on every
// rank, and in ddp_peer.py).
inline std::vector<std::vector<std::vector<int64_t>>> Split(int world, int idle, int micro) {
  std::vector<int> working;
  for (int r = 0; r < world; ++r) {
    if (r != idle) working.push_back(r);
  }
  std::vector<std::vector<std::vector<int64_t>>> out(world,
                                                     std::vector<std::vector<int64_t>>(micro));
  std::vector<int> count(world, 0);
  for (int64_t s = 0; s < kN; ++s) {
    const int r = working[s % working.size()];
    out[r][count[r]++ % micro].push_back(s);
  }
  return out;
}

inline void ZeroGrad(torch::optim::Optimizer& o) { o.zero_grad(); }

inline std::vector<std::pair<std::string, Tensor>> UniqueParams(torch::nn::Module& m) {
  std::vector<std::pair<std::string, Tensor>> out;
  std::set<const c10::TensorImpl*> seen;
  for (auto& item : m.named_parameters()) {
    if (seen.insert(item.value().unsafeGetTensorImpl()).second) {
      out.emplace_back(item.key(), item.value());
    }
  }
  return out;
}

// One single-process step on the whole global batch: every rank's shards
// with that rank's behaviour; BatchNorm buffers end as rank 0's (they run
// last, from the buffers the step began with), as GradSync broadcasts them.
inline void ReferenceStep(Case& ref, torch::optim::Optimizer& opt, int step, int world,
                          const std::vector<std::vector<std::vector<int64_t>>>& split,
                          bool keep_grad) {
  std::vector<Tensor> start;
  for (auto& b : ref.buffers()) start.push_back(b.detach().clone());
  for (int r = world - 1; r >= 0; --r) {
    {
      torch::NoGradGuard no_grad;
      auto buffers = ref.buffers();
      for (size_t i = 0; i < buffers.size(); ++i) buffers[i].copy_(start[i]);
    }
    // One backward per rank: BatchNorm's graph holds its running buffers,
    // so they are only reset once that graph is gone.
    Tensor total;
    for (const auto& samples : split[r]) {
      if (samples.empty()) continue;
      Tensor l = ref.Loss(samples, step, r) / kN;
      total = total.defined() ? total + l : l;
    }
    if (total.defined()) total.backward();
  }
  opt.step();
  if (!keep_grad) opt.zero_grad();
}

}  // namespace evenstep::testing::conformance

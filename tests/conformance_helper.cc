// Rank program of the GradSync conformance suite (conformance_test.cc): one
// model case trained for --steps optimizer steps of --micro micro-steps each
// through GradSync, beside a single-process reference trained on the whole
// global batch in the same process; every parameter (and buffer) is compared
// at the end. The models, their initial values and the data are formulas
// that tests/ddp_peer.py repeats in Python, so rank 0's --out file can be
// compared with PyTorch DDP's.
//
// Cases: tied_adam, tied_sgd (tied embedding/output weight, a frozen layer, a
// branch used on some steps by some ranks, a layer never used), sparse
// (Embedding with sparse gradients), batchnorm, mixed (float64 + bf16
// layers), layout (channels-last conv, a transposed and a non-dense
// parameter), reverse (layers used in the reverse of their registration),
// one_param (one trainable parameter beside a frozen layer: DDP's
// test_ddp_ignore_params_arg), control_flow (a layer only rank 1 uses, on
// odd steps, and one no rank uses: DDP's
// test_ddp_control_flow_different_across_ranks and
// test_ddp_unused_params_rebuild_buckets_exception with find_unused).
// Scenarios (--scenario): train (default), two_backward (sync enabled on two
// backwards of every step: the second adds to the reduced gradient, as in
// one process), exception (rank 1's backward throws inside step 3: every
// rank abandons step 3 and goes on; the reference skips it; --abandon says
// when the caller calls AbandonStep: never, if_needed (syncs_completed()
// did not advance) or always), unfreeze (reverse's l2.weight frozen
// after step 2: every rank's step 3 fails naming it), thaw (tied's frozen
// proj.weight made trainable after step 2: the same). --keep_grad: no
// zero_grad anywhere (the gradients accumulate over steps, on both sides);
// --create_graph: every backward with create_graph (DDP's
// test_ddp_create_graph).
// Output: "conformance ok ..." or MISMATCH lines. Exit codes: 0 passed,
// 1 mismatch, 3 init failed, 4 the expected error.
#include <torch/torch.h>

#include <cmath>
#include <fstream>
#include <iostream>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "evenstep/dist_context.h"
#include "evenstep/flags.h"
#include "evenstep/grad_sync.h"
#include "evenstep/sync_topology.h"
#include "nlohmann/json.hpp"

ABSL_FLAG(std::string, case_name, "tied_adam", "The model case.");
ABSL_FLAG(std::string, scenario, "train", "train, two_backward, exception or unfreeze.");
ABSL_FLAG(int, steps, 5, "Optimizer steps.");
ABSL_FLAG(int, micro, 3, "Micro-steps per rank per step (sync on the last).");
ABSL_FLAG(int, idle_rank, -1, "This rank has no micro-batch in any step (joins by SyncNow).");
ABSL_FLAG(std::string, out, "", "Rank 0 writes its parameters and buffers there (JSON).");
ABSL_FLAG(std::string, throw_in, "synced",
          "exception scenario: rank 1 throws in step 3's synced backward, or in its first.");
ABSL_FLAG(uint64_t, seed, 0,
          "random case: the seed of the model's shape (sparse or dense embedding, tied head "
          "or not), of the layers each rank uses at each step and of each rank's micro-steps "
          "(1-3) per step.");
ABSL_FLAG(bool, inference, false,
          "Before every step, a forward of the model under NoGradGuard and one with autograd "
          "whose graph is dropped (DDP's test_ddp_inference): neither may change anything.");
ABSL_FLAG(bool, keep_grad, false, "No zero_grad between steps (model and reference).");
ABSL_FLAG(bool, create_graph, false, "Every backward of the model with create_graph.");
ABSL_FLAG(std::string, abandon, "if_needed",
          "After an exception in a step: never, if_needed or always call AbandonStep.");

namespace {

constexpr int kN = 18;  // samples per global batch
using torch::Tensor;

// The same formulas as tests/ddp_peer.py.
void InitParameters(torch::nn::Module& m) {
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

Tensor Features(int step, int64_t s0, int64_t count, int dims) {
  Tensor s = torch::arange(s0, s0 + count, torch::kDouble).unsqueeze(1) + 100.0 * step;
  Tensor j = torch::arange(dims, torch::kDouble).unsqueeze(0);
  return torch::sin(0.37 * s + 0.91 * j).to(torch::kFloat);
}

struct Shard {
  std::vector<int64_t> samples;
};

// Inputs of `samples` of step `step` for a model that takes `dims` features,
// ids below `vocab`, or 2x4x4 images.
Tensor Rows(const std::vector<int64_t>& samples, int step, int dims) {
  std::vector<Tensor> rows;
  for (int64_t s : samples) rows.push_back(Features(step, s, 1, dims));
  return torch::cat(rows);
}

Tensor Ids(const std::vector<int64_t>& samples, int step, int vocab) {
  std::vector<int64_t> ids;
  for (int64_t s : samples) ids.push_back((step * 31 + s * 7) % vocab);
  return torch::tensor(ids, torch::kLong);
}

Tensor Targets(const std::vector<int64_t>& samples, int step, int classes) {
  std::vector<int64_t> t;
  for (int64_t s : samples) t.push_back((step * 5 + s * 3) % classes);
  return torch::tensor(t, torch::kLong);
}

Tensor SumCE(const Tensor& logits, const Tensor& targets) {
  return torch::nn::functional::cross_entropy(
      logits, targets, torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kSum));
}

std::vector<Tensor> UniqueTensors(const std::vector<Tensor>& all) {
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
uint64_t Mix(uint64_t seed, int64_t a, int64_t b = 0, int64_t c = 0) {
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

std::shared_ptr<Case> MakeCase(const std::string& name) {
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
  if (name == "random") c = std::make_shared<Random>(absl::GetFlag(FLAGS_seed));
  if (c) InitParameters(*c);
  return c;
}

// samples[r][m]: rank r's micro-batch m of the global batch (same on every
// rank, and in ddp_peer.py).
std::vector<std::vector<std::vector<int64_t>>> Split(int world, int idle, int micro) {
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

void ZeroGrad(torch::optim::Optimizer& o) { o.zero_grad(); }

std::vector<std::pair<std::string, Tensor>> UniqueParams(torch::nn::Module& m) {
  std::vector<std::pair<std::string, Tensor>> out;
  std::set<const c10::TensorImpl*> seen;
  for (auto& item : m.named_parameters()) {
    if (seen.insert(item.value().unsafeGetTensorImpl()).second) {
      out.emplace_back(item.key(), item.value());
    }
  }
  return out;
}

double MaxRelError(const Tensor& got, const Tensor& want) {
  if (got.numel() == 0 && want.numel() == 0) return 0;  // zero output features
  const Tensor g = got.to(torch::kDouble), w = want.to(torch::kDouble);
  const double scale = std::max(w.abs().max().item<double>(), 1e-12);
  return (g - w).abs().max().item<double>() / scale;
}

// One single-process step on the whole global batch: every rank's shards
// with that rank's behaviour; BatchNorm buffers end as rank 0's (they run
// last, from the buffers the step began with), as GradSync broadcasts them.
void ReferenceStep(Case& ref, torch::optim::Optimizer& opt, int step, int world,
                   const std::vector<std::vector<std::vector<int64_t>>>& split, bool keep_grad) {
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

int Run(evenstep::DistContext& dist) {
  const int world = dist.world_size(), rank = dist.rank();
  const std::string name = absl::GetFlag(FLAGS_case_name);
  const std::string scenario = absl::GetFlag(FLAGS_scenario);
  const int steps = absl::GetFlag(FLAGS_steps), micro = absl::GetFlag(FLAGS_micro);
  const int idle = absl::GetFlag(FLAGS_idle_rank);
  const bool keep_grad = absl::GetFlag(FLAGS_keep_grad);
  const bool create_graph = absl::GetFlag(FLAGS_create_graph);
  const std::string abandon = absl::GetFlag(FLAGS_abandon);
  auto model = MakeCase(name);
  auto ref = MakeCase(name);
  if (!model) {
    std::cerr << "unknown case " << name << std::endl;
    return 2;
  }
  if (scenario == "exception") static_cast<Reverse&>(*model).fire_rank = 1;
  evenstep::GradSyncOptions options;
  options.timeout = absl::Seconds(60);
  options.bucket_cap_bytes = 256;  // several buckets even for these small models
  options.first_bucket_cap_bytes = 64;
  // --evenstep_sync_topology=hierarchical: the same cases through the
  // hierarchical sync (nodes from GROUP_RANK).
  if (absl::GetFlag(FLAGS_evenstep_sync_topology) != "auto") {
    auto topology = evenstep::SyncTopologyByName(absl::GetFlag(FLAGS_evenstep_sync_topology));
    auto choice = topology.ok() ? evenstep::ApplySyncTopology(dist, *topology, &options)
                                : absl::StatusOr<evenstep::TopologyChoice>(topology.status());
    if (!choice.ok()) {
      std::cout << "topology refused: " << choice.status() << std::endl;
      return 3;
    }
    std::cout << choice->line << std::endl;
  }
  auto sync = evenstep::GradSync::Attach(*model, dist.data_group(), options);
  if (!sync.ok()) {
    std::cout << "attach failed: " << sync.status() << std::endl;
    return 3;
  }
  auto opt = model->Optimizer();
  auto ref_opt = ref->Optimizer();
  auto split = Split(world, idle, micro);
  auto* random = dynamic_cast<Random*>(model.get());
  int launched_first = -1, launched_last = -1;
  for (int step = 1; step <= steps; ++step) {
    if (random != nullptr) {
      // This step's micro-steps, per rank: 1-3, from the seed.
      for (int r = 0; r < world; ++r) {
        const int m = random->Micro(step, r);
        split[r] = Split(world, idle, m)[r];
      }
    }
    const int my_micro = static_cast<int>(split[rank].size());
    if (absl::GetFlag(FLAGS_inference) && rank != idle) {
      {
        torch::NoGradGuard no_grad;
        model->Loss(split[rank][0], step, rank);
      }
      model->Loss(split[rank][0], step, rank);  // a graph nobody runs backward on
    }
    if (scenario == "unfreeze" && step == 3) {
      static_cast<Reverse&>(*model).l[1]->weight.set_requires_grad(false);
    }
    if (scenario == "thaw" && step == 3) {
      static_cast<Tied&>(*model).proj->weight.set_requires_grad(true);
    }
    bool abandoned = false;
    const int64_t syncs_before = (*sync)->syncs_completed();
    if (rank == idle) {
      if (absl::Status s = (*sync)->SyncNow(); !s.ok()) {
        std::cout << "step " << step << " failed: " << s << std::endl;
        if (scenario == "train") return 1;
        abandoned = true;
      }
    } else {
      try {
        for (int m = 0; m < my_micro; ++m) {
          const bool last = m + 1 == my_micro;
          (*sync)->set_sync_enabled(last || (scenario == "two_backward" && m == my_micro - 2));
          if (scenario == "exception") {
            // Step 3 throws inside the synced backward, or (--throw_in=first)
            // in the first micro-step's, before any sync of the step.
            const bool here = absl::GetFlag(FLAGS_throw_in) == "first" ? m == 0 : last;
            static_cast<Reverse&>(*model).fire_step = here ? 3 : -1;
          }
          Tensor loss = model->Loss(split[rank][m], step, rank) / kN;
          if (last) {
            if (absl::Status s = (*sync)->PrepareForBackward(loss); !s.ok()) {
              throw std::runtime_error(s.ToString());
            }
          }
          loss.backward({}, /*retain_graph=*/c10::nullopt, create_graph);
        }
      } catch (const std::exception& e) {
        std::cout << "step " << step << " failed: " << e.what() << std::endl;
        if (abandon == "always" ||
            (abandon == "if_needed" && (*sync)->syncs_completed() == syncs_before)) {
          absl::Status joined = (*sync)->AbandonStep(absl::InternalError(e.what()));
          std::cout << "joined with a failure mark: " << joined << std::endl;
        }
        abandoned = true;
      }
    }
    if (abandoned) {
      std::cout << "step " << step << " abandoned; status " << (*sync)->status() << std::endl;
      for (auto& p : model->parameters()) {
        if (p.grad().defined()) {
          std::cout << "MISMATCH gradient left after the abandoned step" << std::endl;
          return 1;
        }
      }
      if (scenario == "unfreeze" || scenario == "thaw") return 4;
      ZeroGrad(*opt);
      continue;  // the reference skips the step too
    }
    const evenstep::SyncStats stats = (*sync)->last_stats();
    if (step == 1) launched_first = stats.buckets_launched_during_backward;
    launched_last = stats.buckets_launched_during_backward;
    opt->step();
    if (!keep_grad) ZeroGrad(*opt);
    ReferenceStep(*ref, *ref_opt, step, world, split, keep_grad);
    // Buffers: equal on every rank after each step.
    for (const auto& item : model->named_buffers()) {
      Tensor root = item.value().detach().clone();
      if (!dist.Broadcast(root, 0).ok()) return 3;
      if (!torch::equal(root, item.value())) {
        std::cout << "MISMATCH step " << step << ": buffer " << item.key()
                  << " differs from rank 0's" << std::endl;
        return 1;
      }
    }
  }
  if (scenario == "unfreeze" || scenario == "thaw") {
    std::cout << "UNEXPECTED: no error" << std::endl;
    return 1;
  }
  // Compare with the reference.
  int failures = 0;
  double worst = 0;
  auto mine = UniqueParams(*model), want = UniqueParams(*ref);
  for (size_t i = 0; i < mine.size(); ++i) {
    const double err = MaxRelError(mine[i].second, want[i].second);
    worst = std::max(worst, err);
    if (!(err <= model->Tolerance(mine[i].first))) {
      std::cout << "MISMATCH " << mine[i].first << ": max relative error " << err << std::endl;
      ++failures;
    }
  }
  auto buffers = model->named_buffers(), ref_buffers = ref->named_buffers();
  for (const auto& item : buffers) {
    const double err = MaxRelError(item.value(), ref_buffers[item.key()]);
    if (!(err <= 1e-5)) {
      std::cout << "MISMATCH buffer " << item.key() << ": max relative error " << err << std::endl;
      ++failures;
    }
  }
  if (rank == 0 && !absl::GetFlag(FLAGS_out).empty()) {
    nlohmann::json out;
    for (const auto& [n, p] : mine) {
      Tensor flat = p.detach().to(torch::kDouble).contiguous().view({-1});
      out["params"][n] =
          std::vector<double>(flat.data_ptr<double>(), flat.data_ptr<double>() + flat.numel());
    }
    for (const auto& item : buffers) {
      Tensor flat = item.value().detach().to(torch::kDouble).contiguous().view({-1});
      out["buffers"][item.key()] =
          std::vector<double>(flat.data_ptr<double>(), flat.data_ptr<double>() + flat.numel());
    }
    std::ofstream(absl::GetFlag(FLAGS_out)) << out.dump();
  }
  if (failures > 0) return 1;
  std::cout << "conformance ok " << name << " world " << world << " max relative error " << worst
            << " launched during backward: step 1 " << launched_first << ", last " << launched_last
            << " of " << (*sync)->num_buckets() << std::endl;
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  std::cout.setf(std::ios::unitbuf);
  torch::set_num_threads(1);
  auto ctx = evenstep::DistContext::CreateFromFlags();
  if (!ctx.ok()) {
    std::cout << "init failed: " << ctx.status() << std::endl;
    return 3;
  }
  return Run(**ctx);
}

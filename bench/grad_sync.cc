// Gradient sync benchmark: step time of (a) compute only, (b) the usual C++
// practice — all-reduce every parameter's gradient one by one after backward
// returns — and (c) evenstep's GradSync (bucketed, launched from gradient
// hooks while backward runs), side by side in one run on 2 ranks over Gloo,
// for two model shapes: "blocks" (transformer-layer-shaped parameters: many
// tensors of mixed sizes) and "mlp" (few large tensors, bandwidth-bound).
//
//   evenstep_bench_grad_sync [--quick] [--steps N] [--hidden H] [--layers L]
//
// Started without a launcher it re-runs itself under evenstep-run -n 2. The
// last line is SUMMARY {json} with overhead_ratio = (c - a) / (b - a), the
// share of the usual practice's communication overhead that remains, for the
// worse of the two models and for each.
#include "evenstep/grad_sync.h"

#include <torch/torch.h>

#include <algorithm>
#include <iostream>
#include <string>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <tuple>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "bench/relaunch.h"
#include "evenstep/dist_context.h"
#include "evenstep/status_macros.h"

ABSL_FLAG(bool, quick, false, "Small models and few steps (seconds; the smoke test uses it).");
ABSL_FLAG(int, steps, 0, "Measured steps per mode (default 20, quick 5).");
ABSL_FLAG(int, hidden, 0,
          "Width of the models (default 1024 for mlp and 256 for blocks; quick 256/128).");
ABSL_FLAG(int, layers, 8, "Linear layers of the mlp model; residual blocks of the blocks model.");
ABSL_FLAG(int, batch, 64, "Samples per step and rank.");

namespace {

double MedianMs(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Pre-norm residual block shaped like a transformer layer's parameters (two
// LayerNorms, four d x d projections, a 4d MLP: 16 tensors of very different
// sizes), without attention's sequence dimension.
struct BlockImpl : torch::nn::Module {
  explicit BlockImpl(int64_t d)
      : ln1(register_module("ln1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d})))),
        q(register_module("q", torch::nn::Linear(d, d))),
        k(register_module("k", torch::nn::Linear(d, d))),
        v(register_module("v", torch::nn::Linear(d, d))),
        o(register_module("o", torch::nn::Linear(d, d))),
        ln2(register_module("ln2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d})))),
        fc1(register_module("fc1", torch::nn::Linear(d, 4 * d))),
        fc2(register_module("fc2", torch::nn::Linear(4 * d, d))) {}
  torch::Tensor forward(torch::Tensor h) {
    torch::Tensor x = ln1(h);
    h = h + o(torch::sigmoid(q(x)) * k(x) + v(x));
    return h + fc2(torch::relu(fc1(ln2(h))));
  }
  torch::nn::LayerNorm ln1;
  torch::nn::Linear q, k, v, o;
  torch::nn::LayerNorm ln2;
  torch::nn::Linear fc1, fc2;
};
TORCH_MODULE(Block);

struct Result {
  std::string model;
  int64_t params = 0;
  int tensors = 0;
  int buckets = 0;
  int width = 0;
  double a = 0, b = 0, c = 0;  // median ms, max over ranks
  evenstep::SyncStats stats;
  double ratio() const { return b > a ? (c - a) / (b - a) : 0; }
};

// Times (a) compute only, (b) per-parameter all_reduce after backward and
// (c) GradSync on one model; modes interleaved step by step so drift
// (frequency, caches, neighbours) hits all three alike; 2 warm-up rounds.
absl::StatusOr<Result> Measure(evenstep::DistContext& dist, const std::string& name,
                               torch::nn::Sequential model, int width, int steps, int batch) {
  Result r;
  r.model = name;
  r.width = width;
  for (const auto& p : model->parameters()) {
    r.params += p.numel();
    ++r.tensors;
  }
  torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(1e-4));
  // DDP's defaults scaled to the model: the cap holds ~1/8 of the gradients
  // so the model spans >= 8 buckets; the first bucket is smaller so
  // communication starts early.
  evenstep::GradSyncOptions sync_options;
  sync_options.bucket_cap_bytes = std::max<int64_t>(r.params * 4 / 8, 1);
  sync_options.first_bucket_cap_bytes = sync_options.bucket_cap_bytes / 4;
  EVENSTEP_ASSIGN_OR_RETURN(std::unique_ptr<evenstep::GradSync> sync,
                            evenstep::GradSync::Attach(*model, dist.data_group(), sync_options));
  r.buckets = sync->num_buckets();
  torch::manual_seed(1 + dist.rank());
  const torch::Tensor x = torch::randn({batch, width});

  enum Mode { kCompute, kPerParam, kEvenstep };
  auto step = [&](Mode mode) -> double {
    sync->set_sync_enabled(mode == kEvenstep);
    at::Tensor flag = at::zeros({1});
    dist.AllReduce(flag).IgnoreError();  // start every step together
    const absl::Time start = absl::Now();
    optimizer.zero_grad();
    model->forward(x).pow(2).mean().backward();
    if (mode == kPerParam) {
      // The usual pattern of C++ distributed examples: one blocking
      // all_reduce per parameter on the process group, after backward.
      for (auto& p : model->parameters()) {
        std::vector<at::Tensor> grads{p.grad()};
        dist.data_group().allreduce(grads)->wait();
      }
    }
    optimizer.step();
    return absl::ToDoubleMilliseconds(absl::Now() - start);
  };
  std::vector<double> times[3];
  for (int s = 0; s < steps + 2; ++s) {
    for (Mode mode : {kCompute, kPerParam, kEvenstep}) {
      const double ms = step(mode);
      if (s >= 2) times[mode].push_back(ms);
    }
  }
  r.stats = sync->last_stats();
  EVENSTEP_RETURN_IF_ERROR(sync->status());
  // The slowest rank sets the pace: reduce the medians with MAX.
  at::Tensor t = at::tensor(
      {MedianMs(times[kCompute]), MedianMs(times[kPerParam]), MedianMs(times[kEvenstep])},
      at::kDouble);
  EVENSTEP_RETURN_IF_ERROR(dist.AllReduce(t, evenstep::ReduceOp::kMax));
  r.a = t[0].item<double>();
  r.b = t[1].item<double>();
  r.c = t[2].item<double>();
  return r;
}

void Print(const Result& r, int batch, int steps) {
  std::cout << absl::StrFormat(
      "%s: %.2fM params in %d tensors (%.1f MiB of gradients), %d buckets, width %d, batch %d, "
      "%d steps; median step time, max over ranks\n",
      r.model, r.params / 1e6, r.tensors, r.params * 4 / 1048576.0, r.buckets, r.width, batch,
      steps);
  std::cout << absl::StrFormat("  (a) compute only                       %8.2f ms\n", r.a);
  std::cout << absl::StrFormat("  (b) per-parameter all_reduce after bwd %8.2f ms  (+%.2f)\n", r.b,
                               r.b - r.a);
  std::cout << absl::StrFormat("  (c) evenstep GradSync                  %8.2f ms  (+%.2f)\n", r.c,
                               r.c - r.a);
  std::cout << absl::StrFormat(
      "  buckets launched during backward: %d of %d; sync wait %.2f ms; overhead_ratio %.3f; "
      "speedup b/c %.3f\n",
      r.stats.buckets_launched_during_backward, r.stats.buckets,
      absl::ToDoubleMilliseconds(r.stats.wait), r.ratio(), r.b / r.c);
}

}  // namespace

int main(int argc, char** argv) {
  if (int rc = evenstep::bench::RelaunchUnlessLaunched(2, argc, argv); rc != 0) return rc;
  absl::ParseCommandLine(argc, argv);
  const bool quick = absl::GetFlag(FLAGS_quick);
  const int steps = absl::GetFlag(FLAGS_steps) > 0 ? absl::GetFlag(FLAGS_steps) : (quick ? 5 : 20);
  const int layers = absl::GetFlag(FLAGS_layers);
  const int batch = absl::GetFlag(FLAGS_batch);
  torch::set_num_threads(1);

  auto ctx = evenstep::DistContext::CreateFromFlags();
  if (!ctx.ok()) {
    std::cerr << ctx.status() << "\n";
    return 1;
  }
  evenstep::DistContext& dist = **ctx;
  const bool print = dist.rank() == 0;

  const int d_mlp =
      absl::GetFlag(FLAGS_hidden) > 0 ? absl::GetFlag(FLAGS_hidden) : (quick ? 256 : 1024);
  const int d_blocks =
      absl::GetFlag(FLAGS_hidden) > 0 ? absl::GetFlag(FLAGS_hidden) : (quick ? 128 : 256);
  torch::manual_seed(0);
  torch::nn::Sequential blocks;
  for (int l = 0; l < layers; ++l) blocks->push_back(Block(d_blocks));
  torch::nn::Sequential mlp;
  for (int l = 0; l < layers; ++l) {
    mlp->push_back(torch::nn::Linear(d_mlp, d_mlp));
    mlp->push_back(torch::nn::ReLU());
  }
  std::vector<Result> results;
  for (auto [name, model, width] :
       {std::make_tuple("blocks", blocks, d_blocks), std::make_tuple("mlp", mlp, d_mlp)}) {
    absl::StatusOr<Result> r = Measure(dist, name, model, width, steps, batch);
    if (!r.ok()) {
      std::cerr << "rank " << dist.rank() << ": " << name << ": " << r.status() << "\n";
      return 1;
    }
    if (print) Print(*r, batch, steps);
    results.push_back(*r);
  }
  if (print) {
    // The headline is the worst of the two shapes, so a good figure on one
    // cannot hide a bad one on the other.
    const Result& worst = results[0].ratio() >= results[1].ratio() ? results[0] : results[1];
    std::string per_model;
    for (const Result& r : results) {
      per_model += absl::StrFormat(
          ", \"%s\": {\"overhead_ratio\": %.4f, \"speedup_vs_per_param\": %.4f, "
          "\"compute_ms\": %.3f, \"per_param_ms\": %.3f, \"evenstep_ms\": %.3f, "
          "\"tensors\": %d, \"buckets\": %d, \"params\": %d}",
          r.model, r.ratio(), r.b / r.c, r.a, r.b, r.c, r.tensors, r.buckets, r.params);
    }
    std::cout << absl::StrFormat(
        "SUMMARY {\"bench\": \"grad_sync\", \"overhead_ratio\": %.4f, \"worst_model\": "
        "\"%s\"%s, \"quick\": %s}\n",
        worst.ratio(), worst.model, per_model, quick ? "true" : "false");
  }
  return 0;
}

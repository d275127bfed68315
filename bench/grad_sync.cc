// Gradient sync benchmark: step time of (a) compute only, (b) the usual C++
// practice — all-reduce every parameter's gradient one by one after backward
// returns — and (c) evenstep's GradSync (bucketed, launched from gradient
// hooks while backward runs), side by side in one run on 2 ranks over Gloo.
//
//   evenstep_bench_grad_sync [--quick] [--steps N] [--hidden H] [--layers L]
//
// Started without a launcher it re-runs itself under evenstep-run -n 2. The
// last line is SUMMARY {json} with overhead_ratio = (c - a) / (b - a): the
// share of the usual practice's communication overhead that remains.
#include "evenstep/grad_sync.h"

#include <torch/torch.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <iostream>
#include <string>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "evenstep/dist_context.h"

ABSL_FLAG(bool, quick, false, "Small model and few steps (seconds; the smoke test uses it).");
ABSL_FLAG(int, steps, 0, "Measured steps per mode (default 20, quick 5).");
ABSL_FLAG(int, hidden, 0, "Width of each layer (default 1024, quick 256).");
ABSL_FLAG(int, layers, 8, "Number of Linear layers (each weight its own bucket or more).");
ABSL_FLAG(int, batch, 64, "Samples per step and rank.");

namespace {

double MedianMs(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  if (std::getenv("RANK") == nullptr) {
    // Not under a launcher: run 2 ranks of this program.
    std::vector<char*> args = {const_cast<char*>(EVENSTEP_RUN), const_cast<char*>("-n"),
                               const_cast<char*>("2"), const_cast<char*>("--"),
                               const_cast<char*>("/proc/self/exe")};
    std::string self = std::string("/proc/") + std::to_string(getpid()) + "/exe";
    char resolved[4096];
    ssize_t n = readlink(self.c_str(), resolved, sizeof(resolved) - 1);
    if (n > 0) {
      resolved[n] = 0;
      args[4] = resolved;
    }
    for (int i = 1; i < argc; ++i) args.push_back(argv[i]);
    args.push_back(nullptr);
    execv(args[0], args.data());
    perror("exec evenstep-run");
    return 1;
  }
  absl::ParseCommandLine(argc, argv);
  const bool quick = absl::GetFlag(FLAGS_quick);
  const int steps = absl::GetFlag(FLAGS_steps) > 0 ? absl::GetFlag(FLAGS_steps) : (quick ? 5 : 20);
  const int hidden =
      absl::GetFlag(FLAGS_hidden) > 0 ? absl::GetFlag(FLAGS_hidden) : (quick ? 256 : 1024);
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

  torch::manual_seed(0);
  torch::nn::Sequential model;
  for (int l = 0; l < layers; ++l) {
    model->push_back(torch::nn::Linear(hidden, hidden));
    model->push_back(torch::nn::ReLU());
  }
  int64_t params = 0;
  for (const auto& p : model->parameters()) params += p.numel();
  torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(1e-4));

  evenstep::GradSyncOptions sync_options;
  // Each weight is hidden^2 * 4 bytes; cap at one weight so the model spans
  // >= `layers` buckets, first bucket smaller so communication starts early.
  sync_options.bucket_cap_bytes = static_cast<int64_t>(hidden) * hidden * 4;
  sync_options.first_bucket_cap_bytes = sync_options.bucket_cap_bytes / 4;
  auto sync = evenstep::GradSync::Attach(*model, dist.data_group(), sync_options);
  if (!sync.ok()) {
    std::cerr << sync.status() << "\n";
    return 1;
  }
  (*sync)->set_sync_enabled(false);
  torch::manual_seed(1 + dist.rank());
  const torch::Tensor x = torch::randn({batch, hidden});

  auto forward_backward = [&] {
    optimizer.zero_grad();
    model->forward(x).pow(2).mean().backward();
  };
  enum Mode { kCompute, kPerParam, kEvenstep };
  auto step = [&](Mode mode) -> double {
    (*sync)->set_sync_enabled(mode == kEvenstep);
    at::Tensor flag = at::zeros({1});
    dist.AllReduce(flag).IgnoreError();  // start every step together
    const absl::Time start = absl::Now();
    forward_backward();
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
  // Modes interleaved step by step, so drift (frequency, caches, neighbours)
  // hits all three alike; 2 warm-up rounds.
  std::vector<double> times[3];
  for (int s = 0; s < steps + 2; ++s) {
    for (Mode mode : {kCompute, kPerParam, kEvenstep}) {
      const double ms = step(mode);
      if (s >= 2) times[mode].push_back(ms);
    }
  }
  const double a = MedianMs(times[kCompute]);
  const double b = MedianMs(times[kPerParam]);
  const double c = MedianMs(times[kEvenstep]);
  (*sync)->set_sync_enabled(true);
  const evenstep::SyncStats stats = (*sync)->last_stats();
  // The slowest rank sets the pace: reduce the medians with MAX.
  at::Tensor t = at::tensor({a, b, c}, at::kDouble);
  dist.AllReduce(t, evenstep::ReduceOp::kMax).IgnoreError();
  const double ma = t[0].item<double>(), mb = t[1].item<double>(), mc = t[2].item<double>();
  const double ratio = mb > ma ? (mc - ma) / (mb - ma) : 0;
  if (print) {
    std::cout << absl::StrFormat(
        "grad_sync: 2 ranks, Gloo, %d x Linear(%d, %d) = %.2fM params (%.1f MiB of gradients) in "
        "%d buckets, batch %d, %d steps, median step time (max over ranks)\n",
        layers, hidden, hidden, params / 1e6, params * 4 / 1048576.0, (*sync)->num_buckets(), batch,
        steps);
    std::cout << absl::StrFormat("  (a) compute only                       %8.2f ms\n", ma);
    std::cout << absl::StrFormat("  (b) per-parameter all_reduce after bwd %8.2f ms  (+%.2f)\n", mb,
                                 mb - ma);
    std::cout << absl::StrFormat("  (c) evenstep GradSync                  %8.2f ms  (+%.2f)\n", mc,
                                 mc - ma);
    std::cout << absl::StrFormat(
        "  buckets launched during backward: %d of %d; sync wait %.2f ms\n",
        stats.buckets_launched_during_backward, stats.buckets,
        absl::ToDoubleMilliseconds(stats.wait));
    std::cout << absl::StrFormat("  overhead_ratio (c-a)/(b-a) = %.3f; speedup b/c = %.3f\n", ratio,
                                 mb / mc);
    std::cout << absl::StrFormat(
        "SUMMARY {\"bench\": \"grad_sync\", \"overhead_ratio\": %.4f, \"speedup_vs_per_param\": "
        "%.4f, \"compute_ms\": %.3f, \"per_param_ms\": %.3f, \"evenstep_ms\": %.3f, "
        "\"buckets\": %d, \"params\": %d, \"quick\": %s}\n",
        ratio, mb / mc, ma, mb, mc, (*sync)->num_buckets(), params, quick ? "true" : "false");
  }
  return 0;
}

// Gradient sync benchmark: step time of (a) compute only, (b) the usual C++
// practice — all-reduce every parameter's gradient one by one after backward
// returns — (c) evenstep's GradSync (bucketed, launched from gradient hooks
// while backward runs) and (d) the same with PrepareForBackward's graph walk
// (what BalancedStep does every step), side by side in one run on 2 ranks
// over Gloo, for three model shapes: "blocks" (transformer-layer-shaped
// parameters: many tensors of mixed sizes), "mlp" (few large tensors,
// bandwidth-bound) and "branch" (the mlp with one more layer used on even
// steps only). Then PyTorch's DistributedDataParallel on the same shapes,
// batch, loss, optimizer and bucket cap (bench/ddp_grad_sync_peer.py, when
// /usr/bin/python3 has torch), timed the same way.
//
//   evenstep_bench_grad_sync [--quick] [--steps N] [--hidden H] [--layers L]
//                            [--device cuda --evenstep_backend=gloo] [--torch_python P]
//
// --device=cuda (scripts/gpu_check.sh) puts the models and batches on the
// GPU (rank r on cuda:r modulo the GPUs; two ranks sharing one GPU need
// --evenstep_backend=gloo, as NCCL refuses that) and ends every timed step
// with a device synchronisation; the DDP peer then runs on the GPU too.
// The DDP peer runs between the two halves of evenstep's measured steps (one
// window of the machine's load for both), and each mode's p10-p90 spread
// decides whether a ratio stands out of the noise (see main).
//
// Started without a launcher it re-runs itself under evenstep-run -n 2. The
// last line is SUMMARY {json} with overhead_ratio = (c - a) / (b - a), the
// share of the usual practice's communication overhead that remains, and
// overhead_vs_ddp = (d - a) / (DDP - DDP's compute), evenstep's exposed
// synchronisation cost over DDP's, for the worst shape and for each.
#include "evenstep/grad_sync.h"

#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <iostream>
#include <optional>
#include <string>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <tuple>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "bench/bench_device.h"
#include "bench/relaunch.h"
#include "evenstep/dist_context.h"
#include "evenstep/flags.h"
#include "evenstep/status_macros.h"
#include "nlohmann/json.hpp"

ABSL_FLAG(bool, quick, false, "Small models and few steps (seconds; the smoke test uses it).");
ABSL_FLAG(int, steps, 0, "Measured steps per mode (default 20, quick 5).");
ABSL_FLAG(int, hidden, 0,
          "Width of the models (default 1024 for mlp and 256 for blocks; quick 256/128).");
ABSL_FLAG(int, layers, 8, "Linear layers of the mlp model; residual blocks of the blocks model.");
ABSL_FLAG(int, batch, 64, "Samples per step and rank.");

ABSL_FLAG(std::string, device, "cpu", "Where the models and batches live: cpu or cuda.");
ABSL_FLAG(std::string, torch_python, "/usr/bin/python3",
          "The Python with torch that runs the DDP peer (bench/ddp_grad_sync_peer.py).");

namespace {

// The q-quantile of `v` (nearest rank; 0.5 is the upper middle, as before).
double QuantileMs(std::vector<double> v, double q) {
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, static_cast<size_t>(q * static_cast<double>(v.size())))];
}
double MedianMs(const std::vector<double>& v) { return QuantileMs(v, 0.5); }

// A difference of two medians means something only when it is larger than
// twice its standard error. Each median's error is estimated from its
// figure's p10-p90 spread over `n` steps (sigma ~ spread / 2.563 for a
// normal spread; the median's standard error ~ 1.2533 sigma / sqrt(n)); the
// difference's is the root of the sum of squares. On a loaded machine the
// spreads grow and the ratio over the difference is reported as noise.
bool Determined(double hi_median, double lo_median, double spread_hi, double spread_lo, int n) {
  const double k = 1.2533 / 2.563 / std::sqrt(static_cast<double>(std::max(n, 1)));
  const double se = k * std::sqrt(spread_hi * spread_hi + spread_lo * spread_lo);
  return hi_median - lo_median > 2 * se;
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

// The bench's model: a body, and for "branch" one more layer used on even
// steps only (the same in bench/ddp_grad_sync_peer.py).
struct NetImpl : torch::nn::Module {
  NetImpl(torch::nn::Sequential body, int width, bool with_branch)
      : body(register_module("body", body)) {
    if (with_branch) branch = register_module("branch", torch::nn::Linear(width, width));
  }
  torch::Tensor forward(torch::Tensor x, int step) {
    torch::Tensor h = body->forward(x);
    if (branch && step % 2 == 0) h = h + branch(h);
    return h;
  }
  torch::nn::Sequential body;
  torch::nn::Linear branch{nullptr};
};
TORCH_MODULE(Net);

struct Result {
  std::string model;
  int64_t params = 0;
  int tensors = 0;
  int buckets = 0;
  int width = 0;
  int64_t bucket_cap = 0;
  double a = 0, b = 0, c = 0, d = 0;  // median ms, max over ranks
  double walk_ms = 0;                 // PrepareForBackward alone, median
  double ddp_compute = -1, ddp = -1;  // the DDP peer's, when it ran
  // p10 and p90 of (a), (b), (c), (d), DDP's compute and DDP (max over ranks).
  double p10[6] = {0, 0, 0, 0, 0, 0}, p90[6] = {0, 0, 0, 0, 0, 0};
  evenstep::SyncStats stats;
  double spread(int i) const { return p90[i] - p10[i]; }
  // (b) - (a) stands out of the noise: the ratio over it means something.
  int steps = 0;  // measured steps per mode (the spreads' sample size)
  bool ratio_determined() const { return Determined(b, a, spread(1), spread(0), steps); }
  double ratio() const { return b > a ? (c - a) / (b - a) : 0; }
  bool ddp_ran() const { return ddp >= 0 && ddp_compute >= 0; }
  bool vs_ddp_determined() const {
    return ddp_ran() && Determined(ddp, ddp_compute, spread(5), spread(4), steps);
  }
  double vs_ddp() const { return (d - a) / (ddp - ddp_compute); }
};

enum Mode { kCompute, kPerParam, kEvenstep, kPrepared, kModes };

// One model's step times so far (this rank's), per mode.
struct Samples {
  std::vector<double> times[kModes];
  std::vector<double> walk;
};

// Times (a) compute only, (b) per-parameter all_reduce after backward,
// (c) GradSync and (d) GradSync with PrepareForBackward on one model for
// `steps` more steps into `samples`; modes interleaved step by step so drift
// (frequency, caches, neighbours) hits all alike; 2 warm-up rounds. `r`
// gets the model's shape and the last sync's stats.
absl::Status Measure(evenstep::DistContext& dist, const std::string& name, Net model, int width,
                     int steps, int batch, const torch::Device& device, Result& r,
                     Samples& samples) {
  model->to(device);
  r.model = name;  // the DDP figures RunDdpPeer filled in stay
  r.params = 0;
  r.tensors = 0;
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
  r.bucket_cap = sync_options.bucket_cap_bytes;
  EVENSTEP_ASSIGN_OR_RETURN(std::unique_ptr<evenstep::GradSync> sync,
                            evenstep::GradSync::Attach(*model, dist.data_group(), sync_options));
  r.buckets = sync->num_buckets();
  torch::manual_seed(1 + dist.rank());
  const torch::Tensor x = torch::randn({batch, width}).to(device);

  std::vector<double>& walk = samples.walk;
  auto step = [&](Mode mode, int s) -> double {
    sync->set_sync_enabled(mode == kEvenstep || mode == kPrepared);
    sync->SetStep(s);
    at::Tensor flag = at::zeros({1});
    dist.AllReduce(flag).IgnoreError();  // start every step together
    const absl::Time start = absl::Now();
    optimizer.zero_grad();
    torch::Tensor loss = model->forward(x, s).pow(2).mean();
    if (mode == kPrepared) {
      const absl::Time w = absl::Now();
      sync->PrepareForBackward(loss).IgnoreError();  // a failure shows in status()
      walk.push_back(absl::ToDoubleMilliseconds(absl::Now() - w));
    }
    loss.backward();
    if (mode == kPerParam) {
      // The usual pattern of C++ distributed examples: one blocking
      // all_reduce per parameter on the process group, after backward.
      for (auto& p : model->parameters()) {
        if (!p.grad().defined()) continue;  // unused on every rank alike
        std::vector<at::Tensor> grads{p.grad()};
        dist.data_group().allreduce(grads)->wait();
      }
    }
    optimizer.step();
    if (device.is_cuda()) torch::cuda::synchronize(device.index());
    return absl::ToDoubleMilliseconds(absl::Now() - start);
  };
  std::vector<double>* times = samples.times;
  for (int s = 0; s < steps + 2; ++s) {
    for (Mode mode : {kCompute, kPerParam, kEvenstep, kPrepared}) {
      const double ms = step(mode, s);
      if (s >= 2) times[mode].push_back(ms);
    }
  }
  r.stats = sync->last_stats();
  return sync->status();
}

// The figures of `samples` into `r`, over every rank.
absl::Status Summarise(evenstep::DistContext& dist, const Samples& samples, Result& r) {
  const std::vector<double>* times = samples.times;
  const std::vector<double>& walk = samples.walk;
  // The slowest rank sets the pace: reduce the medians (and spreads) with MAX.
  std::vector<double> figures = {MedianMs(times[kCompute]), MedianMs(times[kPerParam]),
                                 MedianMs(times[kEvenstep]), MedianMs(times[kPrepared]),
                                 MedianMs(walk)};
  for (Mode mode : {kCompute, kPerParam, kEvenstep, kPrepared}) {
    figures.push_back(QuantileMs(times[mode], 0.1));
    figures.push_back(QuantileMs(times[mode], 0.9));
  }
  at::Tensor t = at::tensor(figures, at::kDouble);
  EVENSTEP_RETURN_IF_ERROR(dist.AllReduce(t, evenstep::ReduceOp::kMax));
  r.a = t[0].item<double>();
  r.b = t[1].item<double>();
  r.c = t[2].item<double>();
  r.d = t[3].item<double>();
  r.walk_ms = t[4].item<double>();
  for (int m = 0; m < 4; ++m) {
    r.p10[m] = t[5 + 2 * m].item<double>();
    r.p90[m] = t[6 + 2 * m].item<double>();
  }
  r.steps = static_cast<int>(times[kCompute].size());
  return absl::OkStatus();
}

// Rank 0 runs the DDP peer on the same shapes (the other rank waits);
// fills ddp_compute / ddp, or leaves them at -1 with a line saying why.
void RunDdpPeer(std::vector<Result>& results, int layers, int batch, int steps) {
  const std::string python = absl::GetFlag(FLAGS_torch_python);
  if (evenstep::bench::RunLines(python + " -c 'import torch.distributed' 2>&1",
                                [](const std::string&) {}) != 0) {
    std::cout << "DDP peer skipped: " << python
              << " has no torch (apt install python3-torch, or pass --torch_python)\n";
    return;
  }
  std::string shapes, caps;
  for (const Result& r : results) {
    absl::StrAppend(&shapes, shapes.empty() ? "" : ",", r.model, ":", r.width);
    absl::StrAppend(&caps, caps.empty() ? "" : ",", r.model, "=", r.bucket_cap);
  }
  std::string json;
  const int rc = evenstep::bench::RunLines(
      absl::StrCat(python, " ", EVENSTEP_DDP_PEER, " --shapes ", shapes, " --layers ", layers,
                   " --batch ", batch, " --steps ", steps, " --bucket_bytes ", caps, " --device ",
                   absl::GetFlag(FLAGS_device)),
      [&](const std::string& line) {
        if (line.rfind("DDP_PEER ", 0) == 0) json = line.substr(9);
      });
  if (rc != 0 || json.empty()) {
    std::cout << "DDP peer failed (exit " << rc << "): no comparison with DDP\n";
    return;
  }
  const nlohmann::json peer = nlohmann::json::parse(json, nullptr, false);
  if (peer.is_discarded()) return;
  std::cout << "PyTorch " << peer.value("torch", "?") << " DDP, same shapes:\n";
  for (Result& r : results) {
    if (!peer["shapes"].contains(r.model)) continue;
    const nlohmann::json& s = peer["shapes"][r.model];
    r.ddp_compute = s.value("compute_ms", -1.0);
    r.ddp = s.value("ddp_ms", -1.0);
    r.p10[4] = s.value("compute_p10_ms", r.ddp_compute);
    r.p90[4] = s.value("compute_p90_ms", r.ddp_compute);
    r.p10[5] = s.value("ddp_p10_ms", r.ddp);
    r.p90[5] = s.value("ddp_p90_ms", r.ddp);
    std::cout << absl::StrFormat(
        "  %-6s compute %8.2f ms (p10-p90 %.2f-%.2f), DDP %8.2f ms (%.2f-%.2f; +%.2f)\n", r.model,
        r.ddp_compute, r.p10[4], r.p90[4], r.ddp, r.p10[5], r.p90[5], r.ddp - r.ddp_compute);
  }
}

void Print(const Result& r, int batch, int steps) {
  std::cout << absl::StrFormat(
      "%s: %.2fM params in %d tensors (%.1f MiB of gradients), %d buckets, width %d, batch %d, "
      "%d steps; median step time, max over ranks\n",
      r.model, r.params / 1e6, r.tensors, r.params * 4 / 1048576.0, r.buckets, r.width, batch,
      steps);
  std::cout << absl::StrFormat(
      "  (a) compute only                       %8.2f ms  p10-p90 %.2f-%.2f\n", r.a, r.p10[0],
      r.p90[0]);
  std::cout << absl::StrFormat(
      "  (b) per-parameter all_reduce after bwd %8.2f ms  p10-p90 %.2f-%.2f  (+%.2f)\n", r.b,
      r.p10[1], r.p90[1], r.b - r.a);
  std::cout << absl::StrFormat(
      "  (c) evenstep GradSync                  %8.2f ms  p10-p90 %.2f-%.2f  (+%.2f)\n", r.c,
      r.p10[2], r.p90[2], r.c - r.a);
  std::cout << absl::StrFormat(
      "  (d) evenstep + PrepareForBackward      %8.2f ms  p10-p90 %.2f-%.2f  (+%.2f; the graph "
      "walk %.3f ms)\n",
      r.d, r.p10[3], r.p90[3], r.d - r.a, r.walk_ms);
  std::cout << absl::StrFormat(
      "  buckets launched during backward: %d of %d; sync wait %.2f ms; overhead_ratio %s; "
      "speedup b/c %.3f\n",
      r.stats.buckets_launched_during_backward, r.stats.buckets,
      absl::ToDoubleMilliseconds(r.stats.wait),
      r.ratio_determined() ? absl::StrFormat("%.3f", r.ratio())
                           : std::string("undetermined: (b) - (a) is within their noise"),
      r.b / r.c);
  if (r.ddp_ran()) {
    std::cout << absl::StrFormat(
        "  DDP +%.2f ms over its compute, evenstep (d) +%.2f: overhead_vs_ddp %s\n",
        r.ddp - r.ddp_compute, r.d - r.a,
        r.vs_ddp_determined() ? absl::StrFormat("%.3f", r.vs_ddp())
                              : std::string("undetermined: DDP's overhead is within its noise"));
  }
}

}  // namespace

int main(int argc, char** argv) {
  // Flags are checked before the relaunch: a typo stops once, not on each rank.
  absl::ParseCommandLine(argc, argv);
  const std::string device_name = absl::GetFlag(FLAGS_device);
  if (!evenstep::bench::BenchDevice(device_name, 0)) return 2;
  if (int rc = evenstep::bench::RelaunchUnlessLaunched(2, argc, argv); rc != 0) return rc;
  const bool quick = absl::GetFlag(FLAGS_quick);
  const int steps = absl::GetFlag(FLAGS_steps) > 0 ? absl::GetFlag(FLAGS_steps) : (quick ? 5 : 20);
  const int layers = absl::GetFlag(FLAGS_layers);
  const int batch = absl::GetFlag(FLAGS_batch);
  torch::set_num_threads(1);

  auto ctx = evenstep::DistContextFromFlags();
  if (!ctx.ok()) {
    std::cerr << ctx.status() << "\n";
    return 1;
  }
  evenstep::DistContext& dist = **ctx;
  const bool print = dist.rank() == 0;
  const std::optional<torch::Device> device =
      evenstep::bench::BenchDevice(device_name, dist.rank());
  if (!device) return 2;

  const int d_mlp =
      absl::GetFlag(FLAGS_hidden) > 0 ? absl::GetFlag(FLAGS_hidden) : (quick ? 256 : 1024);
  const int d_blocks =
      absl::GetFlag(FLAGS_hidden) > 0 ? absl::GetFlag(FLAGS_hidden) : (quick ? 128 : 256);
  torch::manual_seed(0);
  torch::nn::Sequential blocks;
  for (int l = 0; l < layers; ++l) blocks->push_back(Block(d_blocks));
  auto mlp_body = [&] {
    torch::nn::Sequential mlp;
    for (int l = 0; l < layers; ++l) {
      mlp->push_back(torch::nn::Linear(d_mlp, d_mlp));
      mlp->push_back(torch::nn::ReLU());
    }
    return mlp;
  };
  const std::vector<std::tuple<const char*, Net, int>> models = {
      {"blocks", Net(blocks, d_blocks, false), d_blocks},
      {"mlp", Net(mlp_body(), d_mlp, false), d_mlp},
      {"branch", Net(mlp_body(), d_mlp, true), d_mlp}};
  std::vector<Result> results(models.size());
  std::vector<Samples> samples(models.size());
  // The DDP peer (its own processes) runs between the two halves of
  // evenstep's steps, so both are measured in the same window of the
  // machine's load.
  const int first_half = (steps + 1) / 2;
  for (int half = 0; half < 2; ++half) {
    for (size_t i = 0; i < models.size(); ++i) {
      const auto& [name, model, width] = models[i];
      const absl::Status s =
          Measure(dist, name, model, width, half == 0 ? first_half : steps - first_half, batch,
                  *device, results[i], samples[i]);
      if (!s.ok()) {
        std::cerr << "rank " << dist.rank() << ": " << name << ": " << s << "\n";
        return 1;
      }
    }
    if (half == 0) {
      if (print) RunDdpPeer(results, layers, batch, steps);
      at::Tensor done = at::zeros({1});
      if (absl::Status s = dist.AllReduce(done); !s.ok()) {
        std::cerr << s << "\n";
        return 1;
      }
    }
  }
  for (size_t i = 0; i < models.size(); ++i) {
    if (absl::Status s = Summarise(dist, samples[i], results[i]); !s.ok()) {
      std::cerr << s << "\n";
      return 1;
    }
    if (print) Print(results[i], batch, steps);
  }
  bool valid = true;
  if (print) {
    // The headline is the worst shape, so a good figure on one cannot hide a
    // bad one on another; a ratio whose denominator is within the noise is
    // "undetermined: noise", and the whole run is then not valid.
    const nlohmann::json noise = "undetermined: noise";
    nlohmann::json summary = {{"bench", "grad_sync"}};
    const Result* worst = nullptr;
    const Result* worst_ddp = nullptr;
    for (const Result& r : results) {
      valid &= r.ratio_determined() && (!r.ddp_ran() || r.vs_ddp_determined());
      if (r.ratio_determined() && (worst == nullptr || r.ratio() > worst->ratio())) worst = &r;
      if (r.vs_ddp_determined() && (worst_ddp == nullptr || r.vs_ddp() > worst_ddp->vs_ddp())) {
        worst_ddp = &r;
      }
    }
    auto spread = [](const Result& r, int i) {
      return nlohmann::json::array({r.p10[i], r.p90[i]});
    };
    summary["valid"] = valid;
    summary["overhead_ratio"] = valid && worst ? nlohmann::json(worst->ratio()) : nullptr;
    summary["worst_model"] = worst ? worst->model : "";
    summary["overhead_vs_ddp"] = valid && worst_ddp ? nlohmann::json(worst_ddp->vs_ddp()) : nullptr;
    summary["worst_vs_ddp_model"] = worst_ddp ? worst_ddp->model : "";
    for (const Result& r : results) {
      nlohmann::json m = {
          {"overhead_ratio", r.ratio_determined() ? nlohmann::json(r.ratio()) : noise},
          {"overhead_vs_ddp", !r.ddp_ran()            ? nlohmann::json(nullptr)
                              : r.vs_ddp_determined() ? nlohmann::json(r.vs_ddp())
                                                      : noise},
          {"speedup_vs_per_param", r.b / r.c},
          {"compute_ms", r.a},
          {"per_param_ms", r.b},
          {"evenstep_ms", r.c},
          {"evenstep_prepared_ms", r.d},
          {"p10_p90_ms",
           {{"compute", spread(r, 0)},
            {"per_param", spread(r, 1)},
            {"evenstep", spread(r, 2)},
            {"evenstep_prepared", spread(r, 3)}}},
          {"graph_walk_ms", r.walk_ms},
          {"tensors", r.tensors},
          {"buckets", r.buckets},
          {"params", r.params}};
      if (r.ddp_ran()) {
        m["ddp_compute_ms"] = r.ddp_compute;
        m["ddp_ms"] = r.ddp;
        m["p10_p90_ms"]["ddp_compute"] = spread(r, 4);
        m["p10_p90_ms"]["ddp"] = spread(r, 5);
      }
      summary[r.model] = m;
    }
    summary["device"] = device_name;
    summary["quick"] = quick;
    if (!valid) {
      std::cout << "NOT VALID: some differences are within the step times' spread (a loaded "
                   "machine?); rerun on a quiet one. The ratios marked undetermined are noise.\n";
    }
    std::cout << "SUMMARY " << summary.dump() << std::endl;
  }
  // Every rank exits alike: rank 0's verdict, shared.
  at::Tensor verdict = at::full({1}, valid ? 0.0 : 1.0, at::kDouble);
  if (absl::Status s = dist.Broadcast(verdict, 0); !s.ok()) {
    std::cerr << s << "\n";
    return 1;
  }
  return verdict.item<double>() == 0 ? 0 : 3;
}

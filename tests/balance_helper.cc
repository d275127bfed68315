// Rank program for the BalancedStep tests (started by balanced_step_test.cc
// with the torchrun convention). It trains a small per-token model on
// synthetic variable-length sequences with BalancedStep configured from the
// --evenstep_* flags on its command line, and after every sync compares the
// global gradient with the gradient one process computes over the whole
// global batch (mean loss, normalised by the global count).
//
//   balance_helper [--evenstep_*...] [--steps N] [--split_seed S] [--fail_rank R]
//                  [--outside_backward]
//
// --split_seed seeds random initial shares with one rank at zero (before the
// planner has measurements, so with a large --evenstep_warmup_steps they
// persist). --fail_rank makes that rank's loss callback throw on step 2.
// Prints one line per step: "step S rank R micro M samples N loss L err E".
// --device=cuda puts the model, the reference and the data on the GPU
// (tests/cuda_test.cc).
// Exit codes: 0 passed, 1 gradient mismatch, 2 BalancedStep error, 3 init.
#include <torch/torch.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <iostream>
#include <memory>
#include <optional>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "evenstep/balanced_step.h"
#include "evenstep/dist_context.h"
#include "evenstep/flags.h"
#include "evenstep/internal/build_config.h"
#include "evenstep/metrics.h"
#include "evenstep/timeline.h"
#include "evenstep/train_checkpointer.h"
#if EVENSTEP_HAVE_NCCL  // a CUDA libtorch
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <cuda_runtime_api.h>
#endif

ABSL_FLAG(int, steps, 3, "Optimizer steps.");
ABSL_FLAG(bool, sparse_embedding, false,
          "The model's input also gets a per-sample vector from an Embedding with sparse "
          "gradients (its id: the sample's index mod 17): the first layer, whose gradient "
          "backward produces last.");
ABSL_FLAG(bool, outside_backward, false,
          "After every step, rank 0 alone runs a backward through the model outside the step "
          "(a GAN generator's loss through the discriminator), checks that its gradients are "
          "this rank's own, then zeroes them as the single-process loop would.");
ABSL_FLAG(std::string, device, "cpu", "Where the model and the data live (cpu, cuda).");
ABSL_FLAG(bool, load_tensors, false,
          "The load function also returns each sample's input as a new CPU tensor, which the "
          "loss uses after checking it arrived on the model's device with the same values "
          "(with data workers and a model on a GPU: BalancedStep's pinned-buffer copies).");
ABSL_FLAG(int, split_seed, 0, "Seed of random initial shares (0 = equal).");
ABSL_FLAG(int, fail_rank, -1, "Rank whose loss callback throws on step 2.");
ABSL_FLAG(std::vector<std::string>, fail_at, {},
          "RANK:STEP,...: each RANK's loss callback throws on its STEP (1-based, failed steps "
          "counted), at --fail_micro_batch, besides --fail_rank's step 2.");
ABSL_FLAG(int, fail_micro_batch, 1,
          "With --fail_rank: the micro-batch of step 2 (1-based) whose callback throws (the "
          "last one when it has fewer).");
ABSL_FLAG(bool, continue_after_failure, false,
          "After a failed step: report whether the gradients were cleared and go on with the "
          "next step.");
ABSL_FLAG(bool, fail_by_exit, false,
          "With --fail_rank: the failing rank dies (_exit) instead of throwing.");
ABSL_FLAG(int, samples, 300, "Samples in the synthetic dataset.");
ABSL_FLAG(int, oom_rank, -1,
          "Rank that runs out of memory (c10::OutOfMemoryError) in every micro-batch (or piece "
          "of one) above --oom_tokens padded tokens (samples x longest length).");
ABSL_FLAG(bool, resume, false,
          "With --duty=evenstep: load the newest checkpoint of --evenstep_ckpt_dir first.");
ABSL_FLAG(int64_t, oom_tokens, 0, "With --oom_rank: the rank's memory budget in padded tokens.");
ABSL_FLAG(int64_t, cuda_oom_mb_per_token, 0,
          "With --oom_rank and --device=cuda: instead of injecting the error, the rank's loss "
          "allocates this many MiB per padded token on the GPU, under a per-process memory limit "
          "of --oom_tokens x that + 160 MiB (the caching allocator's memory fraction): the real "
          "allocator runs out of memory.");
ABSL_FLAG(std::string, oom_where, "forward",
          "With --oom_rank: forward (the loss throws), backward (backward throws, after the "
          "last layers' gradients accumulated) or synced (backward throws, only in the step's "
          "last micro-batch: the synchronised backward).");
ABSL_FLAG(int, load_jitter_ms, 0,
          "The load function sleeps 0..N ms (fixed per micro-batch), so that with data workers "
          "later micro-batches often finish loading first.");
ABSL_FLAG(bool, owned_loader, false,
          "Load through an evenstep::Loader made before the loop (data workers and the next "
          "step's loads by default) instead of a function passed to each Step.");
ABSL_FLAG(int, fail_load_rank, -1, "Rank whose load function throws on step 2's last micro-batch.");
ABSL_FLAG(std::string, trace_dir, "", "Write this rank's timeline there.");
ABSL_FLAG(int, scripted_memory_rank, -1,
          "Rank whose micro-steps report scripted peak memory (BalanceConfig::micro_peak_bytes).");
ABSL_FLAG(std::vector<std::string>, scripted_memory, {},
          "With --scripted_memory_rank: BASE_MIB,MIB_PER_PADDED_TOKEN: a micro-step's peak.");
ABSL_FLAG(int, extra_buffer_rank, -1, "Rank that holds an extra buffer through the run.");
ABSL_FLAG(int, extra_buffer_mb, 0, "With --extra_buffer_rank: its size (MiB, touched).");
ABSL_FLAG(std::string, duty, "none",
          "Extra duty after every step: none; rank0 (rank 0 alone blocks for --duty_ms, like a "
          "synchronous torch::save or evaluation on rank 0); evenstep (every rank saves its share "
          "through the TrainCheckpointer, in the background)");
ABSL_FLAG(int, duty_ms, 60, "Length of the rank0 duty.");
ABSL_FLAG(int, duty_every, 1, "The duty comes after every this many steps.");
ABSL_FLAG(std::string, metrics_dir, "", "Log loss and rank through a MetricsLogger there.");
ABSL_FLAG(bool, evaluate, false, "Evaluate on a held-out set after the last step.");
ABSL_FLAG(int, sleep_ms_per_micro, 0, "Sleep in every micro-batch (stable step times).");
ABSL_FLAG(std::string, degrade, "",
          "RANK:STEP:FACTOR: from STEP on, RANK sleeps FACTOR x --sleep_ms_per_micro (online "
          "health).");
ABSL_FLAG(bool, virtual_time, false,
          "Time the micro-steps on a virtual clock that only --sleep_ms_per_micro advances, "
          "instead of sleeping: cost fits and health figures that do not depend on the "
          "machine's load.");

namespace {

constexpr int kDim = 6, kHidden = 10;

struct Data {
  std::vector<int64_t> lengths;
  std::vector<torch::Tensor> x, y;    // [L, kDim], [L, 1]
  std::vector<torch::Tensor> x_host;  // x on the CPU (what --load_tensors loads)
};

// What the load function returns: the samples and, with --load_tensors,
// each one's input.
using Loaded = std::pair<std::vector<int64_t>, std::vector<torch::Tensor>>;

Data MakeData(int n) {
  Data d;
  std::mt19937 rng(77);
  std::uniform_int_distribution<int> len(1, 24);
  torch::manual_seed(123);
  for (int i = 0; i < n; ++i) {
    const int l = len(rng);
    d.lengths.push_back(l);
    const torch::Device device(absl::GetFlag(FLAGS_device));
    d.x_host.push_back(torch::randn({l, kDim}));
    d.x.push_back(d.x_host.back().to(device));
    d.y.push_back(torch::randn({l, 1}).to(device));
  }
  return d;
}

torch::nn::Sequential MakeModel() {
  torch::manual_seed(0);
  torch::nn::Sequential model(torch::nn::Linear(kDim, kHidden), torch::nn::Tanh(),
                              torch::nn::Linear(kHidden, kHidden), torch::nn::Tanh(),
                              torch::nn::Linear(kHidden, 1));
  if (absl::GetFlag(FLAGS_sparse_embedding)) {
    // Not in the Sequential's chain: Predict adds it (GradSync finds it).
    model->register_module(
        "embed", torch::nn::Embedding(torch::nn::EmbeddingOptions(17, kDim).sparse(true)));
  }
  model->to(torch::Device(absl::GetFlag(FLAGS_device)));
  return model;
}

// The model's output for sample i's input x (with --sparse_embedding, x
// plus the sample's embedded vector).
torch::Tensor Predict(torch::nn::Sequential& model, const torch::Tensor& x, int64_t i) {
  if (auto* embed = model->named_children().find("embed")) {
    const torch::Tensor id = torch::full({1}, i % 17, torch::kLong).to(x.device());
    return model->forward(x + (*embed)->as<torch::nn::Embedding>()->forward(id));
  }
  return model->forward(x);
}

// Sum over `samples` of each sample's loss: the mean squared error over its
// tokens (normalise=samples) or the sum (normalise=tokens).
// `inputs`: the samples' inputs as loaded (else d.x).
// `oom_in_backward`: backward throws c10::OutOfMemoryError when it reaches
// the first sample's first hidden layer: after the gradients of the last
// layers (which every sample's path reaches first) have accumulated, before
// the first layer's.
torch::Tensor LossSum(torch::nn::Sequential& model, const Data& d,
                      const std::vector<int64_t>& samples, bool per_token,
                      const std::vector<torch::Tensor>* inputs = nullptr,
                      bool oom_in_backward = false) {
  torch::Tensor total = torch::zeros({}, d.x[0].options());
  for (size_t k = 0; k < samples.size(); ++k) {
    const int64_t i = samples[k];
    const torch::Tensor& x = inputs != nullptr ? (*inputs)[k] : d.x[i];
    torch::Tensor prediction;
    if (oom_in_backward && k == 0) {
      prediction = x;
      for (auto& layer : *model) {
        prediction = layer.forward(prediction);
        if (prediction.dim() > 0 && &layer == &*model->begin()) {
          prediction.register_hook([](const torch::Tensor&) {
            C10_THROW_ERROR(OutOfMemoryError, "injected: out of memory in backward");
          });
        }
      }
    } else {
      prediction = Predict(model, x, i);
    }
    const torch::Tensor err = (prediction - d.y[i]).pow(2);
    total = total + (per_token ? err.sum() : err.mean());
  }
  return total;
}

// The same losses written the usual way, reduction=mean over the
// micro-batch: the mean over all its tokens (normalise=tokens) or the mean of
// its samples' losses (normalise=samples). Used with
// --evenstep_loss_reduction=mean.
torch::Tensor LossMean(torch::nn::Sequential& model, const Data& d,
                       const std::vector<int64_t>& samples, bool per_token,
                       const std::vector<torch::Tensor>* inputs = nullptr) {
  std::vector<torch::Tensor> parts;
  for (size_t k = 0; k < samples.size(); ++k) {
    const int64_t i = samples[k];
    const torch::Tensor& x = inputs != nullptr ? (*inputs)[k] : d.x[i];
    const torch::Tensor err = (Predict(model, x, i) - d.y[i]).pow(2);
    parts.push_back(per_token ? err.reshape({-1}) : err.mean().reshape({1}));
  }
  return torch::cat(parts).mean();
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  torch::set_num_threads(1);
  auto ctx = evenstep::DistContext::CreateFromFlags();
  if (!ctx.ok()) {
    std::cerr << ctx.status() << "\n";
    return 3;
  }
  const int rank = (*ctx)->rank(), world = (*ctx)->world_size();
  absl::StatusOr<evenstep::BalanceConfig> config = evenstep::BalanceConfig::FromFlags();
  if (!config.ok()) {
    std::cerr << config.status() << "\n";
    return 3;
  }
  const bool per_token = config->sampler.normalization == evenstep::Normalization::kTokens;
  const Data data = MakeData(absl::GetFlag(FLAGS_samples));
  torch::nn::Sequential model = MakeModel();
  torch::nn::Sequential reference = MakeModel();
  torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(0.05));

  if (const int seed = absl::GetFlag(FLAGS_split_seed); seed != 0 && world > 1) {
    std::mt19937 rng(seed);
    std::uniform_real_distribution<double> u(0.1, 1.0);
    config->initial_shares.resize(world);
    for (double& s : config->initial_shares) s = u(rng);
    config->initial_shares[seed % world] = 0;
  }
  if (rank == absl::GetFlag(FLAGS_scripted_memory_rank)) {
    const std::vector<std::string> figures = absl::GetFlag(FLAGS_scripted_memory);
    double base_mb = 0, per_token_mb = 0;
    if (figures.size() != 2 || !absl::SimpleAtod(figures[0], &base_mb) ||
        !absl::SimpleAtod(figures[1], &per_token_mb)) {
      std::cerr << "--scripted_memory: expected BASE_MIB,MIB_PER_PADDED_TOKEN\n";
      return 3;
    }
    config->micro_peak_bytes = [base_mb, per_token_mb](const evenstep::MicroBatch& mb) {
      return static_cast<int64_t>((base_mb + per_token_mb * mb.padded_tokens()) * (1 << 20));
    };
  }
  evenstep::BalancedStep* step_ptr = nullptr;
  const bool virtual_time = absl::GetFlag(FLAGS_virtual_time);
  std::atomic<int64_t> virtual_us{0};
  if (virtual_time) {
    config->now = [&virtual_us] {
      return absl::UnixEpoch() + absl::Microseconds(virtual_us.load());
    };
  }
  double max_err = 0;
  config->after_sync = [&] {
    // Reference: one process, the whole global batch, mean loss.
    torch::NoGradGuard no_grad;
    auto params = model->parameters(), ref_params = reference->parameters();
    for (size_t i = 0; i < params.size(); ++i) ref_params[i].copy_(params[i]);
    for (auto& p : ref_params) p.mutable_grad() = torch::Tensor();
    {
      torch::AutoGradMode enable(true);
      const evenstep::GlobalBatch& batch = step_ptr->global_batch();
      (LossSum(reference, data, batch.samples, per_token) / batch.count).backward();
    }
    for (size_t i = 0; i < params.size(); ++i) {
      auto dense = [](const torch::Tensor& g) { return g.is_sparse() ? g.to_dense() : g; };
      const torch::Tensor ref = dense(ref_params[i].grad());
      const double scale = ref.abs().max().item<double>();
      const double err = (dense(params[i].grad()) - ref).abs().max().item<double>() / scale;
      max_err = std::max(max_err, err);
    }
  };
  auto step = evenstep::BalancedStep::Create(**ctx, *model, optimizer, data.lengths, *config);
  if (!step.ok()) {
    std::cerr << step.status() << "\n";
    return 3;
  }
  step_ptr = step->get();
  std::unique_ptr<evenstep::Timeline> timeline;
  if (!absl::GetFlag(FLAGS_trace_dir).empty()) {
    auto opened = evenstep::Timeline::Open(absl::GetFlag(FLAGS_trace_dir), rank);
    if (!opened.ok()) {
      std::cerr << opened.status() << "\n";
      return 3;
    }
    timeline = *std::move(opened);
  }
  // A real out-of-memory limit on the GPU for --cuda_oom_mb_per_token.
  const int64_t real_oom_mb = absl::GetFlag(FLAGS_cuda_oom_mb_per_token);
  if (real_oom_mb > 0 && rank == absl::GetFlag(FLAGS_oom_rank)) {
#if EVENSTEP_HAVE_NCCL
    const c10::DeviceIndex index = c10::cuda::current_device();
    size_t free_bytes = 0, total = 0;
    C10_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total));
    const double limit =
        static_cast<double>((absl::GetFlag(FLAGS_oom_tokens) * real_oom_mb + 160) << 20);
    c10::cuda::CUDACachingAllocator::setMemoryFraction(limit / static_cast<double>(total), index);
    std::cout << "cuda memory limit " << static_cast<int64_t>(limit) / (1 << 20) << " MiB of "
              << total / (1 << 20) << std::endl;
#else
    std::cerr << "--cuda_oom_mb_per_token needs a CUDA libtorch\n";
    return 3;
#endif
  }
  // A planted memory asymmetry: this rank holds (and has touched) a buffer
  // the others do not.
  std::vector<char> extra_buffer;
  if (rank == absl::GetFlag(FLAGS_extra_buffer_rank)) {
    extra_buffer.assign(static_cast<size_t>(absl::GetFlag(FLAGS_extra_buffer_mb)) << 20, 1);
  }
  const std::string duty = absl::GetFlag(FLAGS_duty);
  std::unique_ptr<evenstep::TrainCheckpointer> checkpointer;
  int64_t resumed_step = 0;  // saves go on from the loaded step
  if (duty == "evenstep") {
    auto options = evenstep::CheckpointOptionsFromFlags();
    auto created =
        options.ok()
            ? evenstep::TrainCheckpointer::Create(**ctx, *options)
            : absl::StatusOr<std::unique_ptr<evenstep::TrainCheckpointer>>(options.status());
    if (!created.ok()) {
      std::cerr << created.status() << "\n";
      return 3;
    }
    checkpointer = *std::move(created);
    if (absl::GetFlag(FLAGS_resume)) {
      auto loaded = checkpointer->Load({model.ptr().get(), &optimizer, step_ptr, "{}"});
      if (!loaded.ok()) {
        std::cerr << loaded.status() << "\n";
        return 3;
      }
      resumed_step = loaded->step;
      std::cout << "resumed from step " << loaded->step << " memory caps:";
      for (int64_t c : (*step)->state().memory_caps) std::cout << " " << c;
      std::cout << std::endl;
    }
  }
  const int sleep_ms = absl::GetFlag(FLAGS_sleep_ms_per_micro);
  int degrade_rank = -1, degrade_step = 0;
  double degrade_factor = 1;
  if (!absl::GetFlag(FLAGS_degrade).empty()) {
    std::vector<std::string> f = absl::StrSplit(absl::GetFlag(FLAGS_degrade), ':');
    if (f.size() != 3 || !absl::SimpleAtoi(f[0], &degrade_rank) ||
        !absl::SimpleAtoi(f[1], &degrade_step) || !absl::SimpleAtod(f[2], &degrade_factor)) {
      std::cerr << "--degrade=" << absl::GetFlag(FLAGS_degrade) << ": expected RANK:STEP:FACTOR\n";
      return 3;
    }
  }
  std::unique_ptr<evenstep::MetricsLogger> metrics;
  if (!absl::GetFlag(FLAGS_metrics_dir).empty()) {
    auto created = evenstep::MetricsLogger::Create(**ctx, {absl::GetFlag(FLAGS_metrics_dir), 2});
    if (!created.ok()) {
      std::cerr << created.status() << "\n";
      return 3;
    }
    metrics = *std::move(created);
  }
  // What the loads count; shared with the Loader, which may still run a
  // load for the next step when this loop ends (its copies own this).
  struct LoadCounters {
    std::atomic<int> ahead{0}, max_ahead{0};  // loaded and not yet used
    std::atomic<int> loads{0}, worker_loads{0};
  };
  auto counters = std::make_shared<LoadCounters>();
  auto load_samples = [counters, x_host = data.x_host,
                       main_thread = std::this_thread::get_id()](const evenstep::MicroBatch& mb) {
    if (const int jitter = absl::GetFlag(FLAGS_load_jitter_ms); jitter > 0) {
      const int64_t first = mb.samples.empty() ? 0 : mb.samples.front();
      std::this_thread::sleep_for(std::chrono::milliseconds((first * 7919) % (jitter + 1)));
    }
    if (std::this_thread::get_id() != main_thread) ++counters->worker_loads;
    ++counters->loads;
    const int now = ++counters->ahead;
    int seen = counters->max_ahead.load();
    while (now > seen && !counters->max_ahead.compare_exchange_weak(seen, now)) {
    }
    Loaded loaded{mb.samples, {}};
    if (absl::GetFlag(FLAGS_load_tensors)) {
      for (int64_t i : mb.samples) loaded.second.push_back(x_host[i].clone());
    }
    return loaded;
  };
  // --owned_loader: an evenstep::Loader (made once, owned by evenstep).
  std::optional<evenstep::Loader<Loaded>> owned;
  if (absl::GetFlag(FLAGS_owned_loader)) owned.emplace(load_samples);
  for (int s = 1; s <= absl::GetFlag(FLAGS_steps); ++s) {
    max_err = 0;
    int calls = 0;
    auto load = [&](const evenstep::MicroBatch& mb) {
      if (s == 2 && rank == absl::GetFlag(FLAGS_fail_load_rank) &&
          &mb == &(*step)->micro_batches().back()) {
        throw std::runtime_error("injected failure in the load function");
      }
      return load_samples(mb);
    };
    auto loss = [&](const Loaded& batch) {
      const std::vector<int64_t>& samples = batch.first;
      const std::vector<torch::Tensor>* inputs = nullptr;
      if (absl::GetFlag(FLAGS_load_tensors)) {
        for (size_t k = 0; k < samples.size(); ++k) {
          const torch::Tensor& t = batch.second[k];
          if (t.device() != data.x[0].device() || !torch::equal(t, data.x[samples[k]])) {
            std::cout << "FEED MISMATCH at step " << s << ": sample " << samples[k] << " on "
                      << t.device() << std::endl;
            throw std::runtime_error("a loaded tensor did not arrive intact");
          }
        }
        inputs = &batch.second;
      }
      --counters->ahead;
      ++calls;
      bool oom_in_backward = false;
      if (rank == absl::GetFlag(FLAGS_oom_rank) && real_oom_mb > 0) {
        // The real allocator's error, under the memory limit set at start.
        int64_t longest = 0;
        for (int64_t i : samples) longest = std::max(longest, data.lengths[i]);
        const int64_t padded = static_cast<int64_t>(samples.size()) * longest;
        const torch::Tensor block =
            torch::empty({static_cast<int64_t>(padded * real_oom_mb) << 20},
                         torch::TensorOptions(torch::kByte).device(torch::kCUDA));
        (void)block;
      } else if (rank == absl::GetFlag(FLAGS_oom_rank)) {
        int64_t longest = 0;
        for (int64_t i : samples) longest = std::max(longest, data.lengths[i]);
        const int64_t padded = static_cast<int64_t>(samples.size()) * longest;
        const std::string where = absl::GetFlag(FLAGS_oom_where);
        const std::vector<int64_t>& last = (*step)->micro_batches().back().samples;
        const bool in_last = std::all_of(samples.begin(), samples.end(), [&](int64_t i) {
          return std::find(last.begin(), last.end(), i) != last.end();
        });
        if (padded > absl::GetFlag(FLAGS_oom_tokens) && (where != "synced" || in_last)) {
          std::cout << "injected oom step " << s << " padded " << padded << " " << where
                    << std::endl;
          if (where == "forward") {
            C10_THROW_ERROR(OutOfMemoryError, "injected: out of memory in the loss");
          }
          oom_in_backward = true;
        }
      }
      // The data must be this micro-batch's, in order, whoever loaded it
      // (a retried piece of one after an out-of-memory error: not checked).
      if (absl::GetFlag(FLAGS_oom_rank) < 0 &&
          samples != (*step)->micro_batches()[calls - 1].samples) {
        std::cout << "ORDER MISMATCH at step " << s << " micro-batch " << calls << std::endl;
        throw std::runtime_error("data of another micro-batch");
      }
      const int fail_at = std::min<int>(absl::GetFlag(FLAGS_fail_micro_batch),
                                        static_cast<int>((*step)->micro_batches().size()));
      const std::string here = absl::StrCat(rank, ":", s);
      const std::vector<std::string> fail_steps = absl::GetFlag(FLAGS_fail_at);
      const bool failing_step =
          (s == 2 && rank == absl::GetFlag(FLAGS_fail_rank)) ||
          std::find(fail_steps.begin(), fail_steps.end(), here) != fail_steps.end();
      if (failing_step && calls >= fail_at) {
        if (absl::GetFlag(FLAGS_fail_by_exit)) std::_Exit(5);
        throw std::runtime_error("injected failure in the loss callback");
      }
      if (sleep_ms > 0) {
        const double f = rank == degrade_rank && s >= degrade_step ? degrade_factor : 1.0;
        const auto us = static_cast<int64_t>(1000 * sleep_ms * f);
        if (virtual_time) {
          virtual_us += us;
        } else {
          std::this_thread::sleep_for(std::chrono::microseconds(us));
        }
      }
      return config->loss_reduction == evenstep::LossReduction::kMean
                 ? LossMean(model, data, samples, per_token, inputs)
                 : LossSum(model, data, samples, per_token, inputs, oom_in_backward);
    };
    auto report = owned ? (*step)->Step(*owned, loss) : (*step)->Step(load, loss);
    if (!report.ok()) {
      std::cerr << report.status() << "\n";
      if (!absl::GetFlag(FLAGS_continue_after_failure)) return 2;
      bool cleared = true;
      for (const auto& p : model->parameters()) {
        cleared &= !p.grad().defined() || p.grad().abs().max().item<double>() == 0;
      }
      std::cout << "step " << s << " failed; gradients " << (cleared ? "cleared" : "LEFT")
                << std::endl;
      continue;
    }
    if (timeline) timeline->AddStep(*report);
    if (absl::GetFlag(FLAGS_outside_backward) && rank == 0) {
      // No collective may start (rank 1 would never join it): the gradient
      // must be rank 0's local one, exactly.
      const std::vector<int64_t> few = {0, 1, 2};
      LossSum(model, data, few, per_token, nullptr).backward();
      std::vector<torch::Tensor> local;
      for (const auto& p : model->parameters()) local.push_back(p.grad().clone());
      optimizer.zero_grad();
      LossSum(model, data, few, per_token, nullptr).backward();
      double diff = 0;
      size_t k = 0;
      for (const auto& p : model->parameters()) {
        diff = std::max(diff, (p.grad() - local[k++]).abs().max().item<double>());
      }
      std::cout << "outside backward: local gradient, difference " << diff << std::endl;
      if (diff != 0) return 1;
      optimizer.zero_grad();
    }
    if (metrics) {
      metrics->Log(s, "loss", report->loss);
      metrics->Log(s, "rank", rank);
      metrics->Log(s, "rank_tensor", torch::full({2}, static_cast<double>(rank)));
      if (s == 4 && rank == 1) {
        // Rank 1 reaches the interval boundary late, only after rank 0 has
        // passed it: rank 0's EndStep must not have waited for it.
        (*ctx)->store().wait({"evenstep-test/rank0-passed"});
      }
      if (absl::Status m = metrics->EndStep(s); !m.ok()) {
        std::cerr << m << "\n";
        return 2;
      }
      if (s == 4 && rank == 0) {
        std::cout << "after EndStep: reduction in flight " << metrics->reduction_in_flight()
                  << std::endl;
        (*ctx)->store().set("evenstep-test/rank0-passed", std::vector<uint8_t>{1});
      }
    }
    const absl::Time duty_begin = absl::Now();
    const bool duty_now = s % absl::GetFlag(FLAGS_duty_every) == 0;
    if (duty == "rank0" && rank == 0 && duty_now) {
      std::this_thread::sleep_for(std::chrono::milliseconds(absl::GetFlag(FLAGS_duty_ms)));
    } else if (duty == "evenstep") {
      auto ticket =
          checkpointer->Save(s + resumed_step, {model.ptr().get(), &optimizer, step_ptr, "{}"});
      if (!ticket.ok()) {
        std::cerr << ticket.status() << "\n";
        return 2;
      }
    }
    if (timeline && duty != "none" && duty_now) {
      timeline->Span("checkpoint", duty_begin, absl::Now(), s);
    }
    std::cout << absl::StrFormat(
        "step %d rank %d micro %d samples %d loss %.6f eff %.3f err %.3g oom_splits %d shares", s,
        rank, report->micro_batches, report->samples, report->loss, report->balance_efficiency,
        max_err, report->oom_splits);
    for (double share : report->shares) std::cout << absl::StrFormat(" %.3f", share);
    std::cout << " health";
    for (double h : report->rank_health) std::cout << absl::StrFormat(" %.3f", h);
    std::cout << std::endl;
    for (const std::string& alert : report->health_alerts) std::cout << "HEALTH " << alert << "\n";
    std::cout << absl::StrFormat("memory step %d peak_mb %.1f device %d largest %d\n", s,
                                 report->memory.peak_bytes / double{1 << 20},
                                 report->memory.device ? 1 : 0, report->largest_micro_batch);
    if (rank == 0) {
      for (const std::string& line : report->oom_recoveries) std::cout << "OOM " << line << "\n";
    }
    // What a checkpoint taken now would hold (a step planned ahead for
    // prefetching must not show in it).
    const evenstep::BalanceState state = (*step)->state();
    std::cout << absl::StrFormat("state after step %d: epoch %d batch %d steps %d next epoch %d", s,
                                 state.sampler.epoch, state.sampler.step, state.steps,
                                 (*step)->epoch())
              << std::endl;
    if (!state.memory_caps.empty()) {
      std::cout << "memory caps after step " << s << ":";
      for (int64_t c : state.memory_caps) std::cout << " " << c;
      std::cout << std::endl;
    }
    // fp32 sums in another order: ~1e-6 typical, up to ~2e-5 over a few
    // dozen steps on a parameter with small gradients; a wrong scale or a
    // missing micro-batch is 1e-2 or more.
    if (!(max_err <= 5e-5)) {
      std::cerr << "gradient mismatch: max relative error " << max_err << " > 5e-5\n";
      return 1;
    }
  }
  if (metrics) {
    if (absl::Status m = metrics->Close(); !m.ok()) {
      std::cerr << m << "\n";
      return 2;
    }
    for (const auto& [name, mean] : metrics->last_means()) {
      std::cout << "metric " << name << " " << mean << std::endl;
    }
  }
  if (absl::GetFlag(FLAGS_evaluate)) {
    // A held-out set: the last 100 samples' lengths; metrics = (loss sum, tokens).
    std::vector<int64_t> eval_lengths(data.lengths.end() - 100, data.lengths.end());
    evenstep::SamplerOptions eval_options;
    eval_options.micro_batch_samples = 8;
    eval_options.shuffle = false;
    auto eval_set = evenstep::Sampler::Create(eval_lengths, eval_options);
    const int64_t offset = static_cast<int64_t>(data.lengths.size()) - 100;
    auto result = evenstep::Evaluate(**ctx, *eval_set, [&](const evenstep::MicroBatch& mb) {
      torch::NoGradGuard no_grad;
      std::vector<int64_t> samples;
      for (int64_t i : mb.samples) samples.push_back(offset + i);
      return torch::stack({LossSum(model, data, samples, true),
                           torch::tensor(static_cast<float>(mb.tokens)).to(data.x[0].device())});
    });
    if (!result.ok()) {
      std::cerr << result.status() << "\n";
      return 2;
    }
    std::cout << absl::StrFormat("eval loss_sum %.6f tokens %.0f", (*result)[0], (*result)[1])
              << std::endl;
  }
  if (checkpointer) {
    if (absl::Status w = checkpointer->WaitAll(); !w.ok()) {
      std::cerr << w << "\n";
      return 2;
    }
  }
  if (timeline) {
    if (absl::Status c = timeline->Close(); !c.ok()) {
      std::cerr << c << "\n";
      return 2;
    }
  }
  std::cout << "max_ahead " << counters->max_ahead.load() << " loads " << counters->loads.load()
            << " on workers " << counters->worker_loads.load() << std::endl;
  std::cout << "balance ok" << std::endl;
  return 0;
}

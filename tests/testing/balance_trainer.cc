#include "tests/testing/balance_trainer.h"

#include <torch/torch.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <iostream>
#include <memory>
#include <optional>
#include <random>
#include <stdexcept>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "evenstep/flags.h"
#include "evenstep/internal/build_config.h"
#include "evenstep/metrics.h"
#include "evenstep/timeline.h"
#include "evenstep/train_checkpointer.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/flag_args.h"
#include "tests/testing/on_ranks.h"
#include "tests/testing/subprocess.h"
#include "tests/testing/sync_net.h"
#if EVENSTEP_HAVE_NCCL  // a CUDA libtorch
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <cuda_runtime_api.h>
#endif

namespace evenstep::testing {
namespace {

constexpr int kDim = 6, kHidden = 10;
// fp32 sums in another order: ~1e-6 typical, up to ~2e-5 over a few dozen
// steps on a parameter with small gradients; a wrong scale or a missing
// micro-batch is 1e-2 or more.
constexpr double kGradTolerance = 5e-5;

struct Data {
  std::vector<int64_t> lengths;
  std::vector<torch::Tensor> x, y;    // [L, kDim], [L, 1]
  std::vector<torch::Tensor> x_host;  // x on the CPU (what load_tensors loads)
};

// What the load function returns: the samples and, with load_tensors, each
// one's input.
using Loaded = std::pair<std::vector<int64_t>, std::vector<torch::Tensor>>;

Data MakeData(int n, const torch::Device& device) {
  Data d;
  std::mt19937 rng(77);
  std::uniform_int_distribution<int> len(1, 24);
  torch::manual_seed(123);
  for (int i = 0; i < n; ++i) {
    const int l = len(rng);
    d.lengths.push_back(l);
    d.x_host.push_back(torch::randn({l, kDim}));
    d.x.push_back(d.x_host.back().to(device));
    d.y.push_back(torch::randn({l, 1}).to(device));
  }
  return d;
}

torch::nn::Sequential MakeModel(const BalanceScenario& s) {
  torch::manual_seed(0);
  torch::nn::Sequential model(torch::nn::Linear(kDim, kHidden), torch::nn::Tanh(),
                              torch::nn::Linear(kHidden, kHidden), torch::nn::Tanh(),
                              torch::nn::Linear(kHidden, 1));
  if (s.sparse_embedding) {
    // Not in the Sequential's chain: Predict adds it (GradSync finds it).
    model->register_module(
        "embed", torch::nn::Embedding(torch::nn::EmbeddingOptions(17, kDim).sparse(true)));
  }
  model->to(torch::Device(s.device));
  return model;
}

// The model's output for sample i's input x (with an embedding, x plus the
// sample's embedded vector).
torch::Tensor Predict(torch::nn::Sequential& model, const torch::Tensor& x, int64_t i) {
  if (auto* embed = model->named_children().find("embed")) {
    const torch::Tensor id = torch::full({1}, i % 17, torch::kLong).to(x.device());
    return model->forward(x + (*embed)->as<torch::nn::Embedding>()->forward(id));
  }
  return model->forward(x);
}

// The first layer's output with a hook that throws c10::OutOfMemoryError when
// backward reaches it: after the gradients of the last layers (which every
// sample's path reaches first) have accumulated, before the first layer's.
torch::Tensor PredictThrowingInBackward(torch::nn::Sequential& model, const torch::Tensor& x) {
  torch::Tensor prediction = x;
  for (auto& layer : *model) {
    prediction = layer.forward(prediction);
    if (prediction.dim() > 0 && &layer == &*model->begin()) {
      prediction.register_hook([](const torch::Tensor&) {
        C10_THROW_ERROR(OutOfMemoryError, "injected: out of memory in backward");
      });
    }
  }
  return prediction;
}

// Sum over `samples` of each sample's loss: the mean squared error over its
// tokens (per_token=false) or the sum (per_token=true). `inputs`: the
// samples' inputs as loaded (else d.x). `oom_in_backward`: the first
// sample's backward throws (PredictThrowingInBackward).
torch::Tensor LossSum(torch::nn::Sequential& model, const Data& d,
                      const std::vector<int64_t>& samples, bool per_token,
                      const std::vector<torch::Tensor>* inputs = nullptr,
                      bool oom_in_backward = false) {
  torch::Tensor total = torch::zeros({}, d.x[0].options());
  for (size_t k = 0; k < samples.size(); ++k) {
    const int64_t i = samples[k];
    const torch::Tensor& x = inputs != nullptr ? (*inputs)[k] : d.x[i];
    const torch::Tensor prediction =
        oom_in_backward && k == 0 ? PredictThrowingInBackward(model, x) : Predict(model, x, i);
    const torch::Tensor err = (prediction - d.y[i]).pow(2);
    total = total + (per_token ? err.sum() : err.mean());
  }
  return total;
}

// The same losses written the usual way, reduction=mean over the
// micro-batch: the mean over all its tokens or the mean of its samples'
// losses (--evenstep_loss_reduction=mean).
torch::Tensor LossMean(torch::nn::Sequential& model, const Data& d,
                       const std::vector<int64_t>& samples, bool per_token,
                       const std::vector<torch::Tensor>* inputs) {
  std::vector<torch::Tensor> parts;
  for (size_t k = 0; k < samples.size(); ++k) {
    const int64_t i = samples[k];
    const torch::Tensor& x = inputs != nullptr ? (*inputs)[k] : d.x[i];
    const torch::Tensor err = (Predict(model, x, i) - d.y[i]).pow(2);
    parts.push_back(per_token ? err.reshape({-1}) : err.mean().reshape({1}));
  }
  return torch::cat(parts).mean();
}

// The scenario's --evenstep_* flags; anything else in them is an error.
absl::Status SetFlags(const std::vector<std::string>& flags) {
  std::vector<std::string> rest;
  EVENSTEP_RETURN_IF_ERROR(ParseEvenstepArgs(flags, &rest));
  if (!rest.empty()) return absl::InvalidArgumentError(absl::StrCat("not a flag: ", rest[0]));
  return absl::OkStatus();
}

// What the loads count; shared with the Loader, which may still run a load
// for the next step when the loop ends (its copies own this).
struct LoadCounters {
  std::atomic<int> ahead{0}, max_ahead{0};  // loaded and not yet used
  std::atomic<int> loads{0}, worker_loads{0};
};

// The load function: copyable, owning what it reads (an evenstep::Loader
// may still run it for the next step after the loop has ended).
struct LoadSamples {
  std::shared_ptr<LoadCounters> counters = std::make_shared<LoadCounters>();
  std::vector<torch::Tensor> x_host;
  int jitter_ms = 0;
  bool load_tensors = false;
  std::thread::id main_thread = std::this_thread::get_id();

  Loaded operator()(const MicroBatch& mb) const {
    if (jitter_ms > 0) {
      const int64_t first = mb.samples.empty() ? 0 : mb.samples.front();
      std::this_thread::sleep_for(std::chrono::milliseconds((first * 7919) % (jitter_ms + 1)));
    }
    LoadCounters& c = *counters;
    if (std::this_thread::get_id() != main_thread) ++c.worker_loads;
    ++c.loads;
    const int now = ++c.ahead;
    int seen = c.max_ahead.load();
    while (now > seen && !c.max_ahead.compare_exchange_weak(seen, now)) {
    }
    Loaded loaded{mb.samples, {}};
    if (load_tensors) {
      for (int64_t i : mb.samples) loaded.second.push_back(x_host[i].clone());
    }
    return loaded;
  }
};

int64_t PaddedTokens(const Data& d, const std::vector<int64_t>& samples) {
  int64_t longest = 0;
  for (int64_t i : samples) longest = std::max(longest, d.lengths[i]);
  return static_cast<int64_t>(samples.size()) * longest;
}

class Trainer {
 public:
  Trainer(DistContext& ctx, const BalanceScenario& s)
      : ctx_(ctx),
        s_(s),
        rank_(ctx.launch_rank()),  // the scenario's ranks: those of the launch
        data_(MakeData(s.samples, torch::Device(s.device))),
        model_(MakeModel(s)),
        reference_(MakeModel(s)),
        optimizer_(model_->parameters(), torch::optim::SGDOptions(0.05).momentum(s.momentum)) {
    run_.rank = rank_;
    load_.x_host = data_.x_host;
    load_.jitter_ms = s.load_jitter_ms;
    load_.load_tensors = s.load_tensors;
  }

  BalanceRun Run() {
    run_.status = SetUp();
    if (!run_.status.ok()) return run_;
    int first = 1;
    if (ctx_.joined()) {
      run_.joined = true;
      if (s_.joiner_dies) {
        std::cout << "the replacement dies before the handover" << std::endl;
        std::_Exit(7);
      }
      ExpectNoStepBeforeHandOver();
      if (!HandOverOrRegroup()) return run_;
      first = static_cast<int>(step_->state().steps) + 1;
    }
    for (int s = first; s <= s_.steps; ++s) {
      if (s == s_.rejoin_step && !ctx_.joined()) WaitForJoinRequest();
      if (!RunStep(s)) return run_;
      // Admitted at rejoin_step exactly, however early the request came.
      const bool admit_now = s_.rejoin_step == 0 || s >= s_.rejoin_step;
      if (admit_now && step_->JoinWaiting() && !AdmitAndHandOver()) return run_;
    }
    run_.status = Finish();
    return run_;
  }

 private:
  absl::Status SetUp();
  absl::Status Configure();
  absl::Status OpenOutputs();
  void LimitCudaMemory();
  void CheckAgainstOneProcess();
  torch::Tensor Loss(const Loaded& batch, int s, int call);
  bool PlantedOom(const std::vector<int64_t>& samples, int s);
  int64_t cached_tokens_ = 0;  // Oom::cached_tokens: held by the simulated allocator
  void Sleep(int s);
  bool RunStep(int s);
  bool RegroupAndRedo(int s);
  // Rejoin (BalanceScenario::rejoin_step).
  void StartReplacements(const Regrouped& regrouped);
  void WaitForJoinRequest();
  bool AdmitAndHandOver();
  bool HandOverOrRegroup();
  void ExpectNoStepBeforeHandOver();
  std::vector<double> Digests();
  std::unique_ptr<Subprocess> replacement_;
  std::vector<int64_t> redo_batch_;  // the failed step's global batch, until it runs again
  absl::Status AfterStep(int s, const StepReport& report);
  void CheckOutsideBackward();
  absl::Status LogMetrics(int s, const StepReport& report);
  void Print(const BalanceStepRecord& record) const;
  absl::Status Finish();

  DistContext& ctx_;
  const BalanceScenario& s_;
  const int rank_;
  const Data data_;
  torch::nn::Sequential model_, reference_;
  torch::optim::SGD optimizer_;
  BalanceConfig config_;
  bool per_token_ = false;
  std::atomic<int64_t> virtual_us_{0};
  double max_err_ = 0;
  std::unique_ptr<BalancedStep> step_;
  std::unique_ptr<Timeline> timeline_;
  std::unique_ptr<TrainCheckpointer> checkpointer_;
  std::unique_ptr<MetricsLogger> metrics_;
  std::vector<char> extra_buffer_;
  LoadSamples load_;
  std::optional<Loader<Loaded>> owned_;
  BalanceRun run_;
};

absl::Status Trainer::Configure() {
  EVENSTEP_RETURN_IF_ERROR(SetFlags(s_.flags));
  EVENSTEP_ASSIGN_OR_RETURN(config_, BalanceConfigFromFlags());
  per_token_ = config_.sampler.normalization == Normalization::kTokens;
  const int world = ctx_.world_size();
  if (s_.split_seed != 0 && world > 1) {
    std::mt19937 rng(s_.split_seed);
    std::uniform_real_distribution<double> u(0.1, 1.0);
    config_.initial_shares.resize(world);
    for (double& share : config_.initial_shares) share = u(rng);
    config_.initial_shares[s_.split_seed % world] = 0;
  }
  if (rank_ == s_.scripted_memory.rank) {
    const double base = s_.scripted_memory.base_mb, per = s_.scripted_memory.mb_per_padded_token;
    config_.micro_peak_bytes = [base, per](const MicroBatch& mb) {
      return static_cast<int64_t>((base + per * mb.padded_tokens()) * (1 << 20));
    };
  }
  if (s_.virtual_time) {
    config_.now = [this] { return absl::UnixEpoch() + absl::Microseconds(virtual_us_.load()); };
  }
  if (s_.oom.cached_tokens > 0) {
    if (rank_ == s_.oom.rank) cached_tokens_ = s_.oom.cached_tokens;  // earlier steps' blocks
    config_.release_cache = [this]() -> int64_t {
      ++run_.cache_releases;
      const int64_t released = s_.oom.release ? cached_tokens_ : 0;
      cached_tokens_ -= released;
      return released << 20;
    };
  }
  config_.after_sync = [this] { CheckAgainstOneProcess(); };
  return absl::OkStatus();
}

// The reference: one process, the whole global batch, mean loss.
void Trainer::CheckAgainstOneProcess() {
  torch::NoGradGuard no_grad;
  auto params = model_->parameters(), ref_params = reference_->parameters();
  for (size_t i = 0; i < params.size(); ++i) ref_params[i].copy_(params[i]);
  for (auto& p : ref_params) p.mutable_grad() = torch::Tensor();
  {
    torch::AutoGradMode enable(true);
    const GlobalBatch& batch = step_->global_batch();
    (LossSum(reference_, data_, batch.samples, per_token_) / batch.count).backward();
  }
  auto dense = [](const torch::Tensor& g) { return g.is_sparse() ? g.to_dense() : g; };
  for (size_t i = 0; i < params.size(); ++i) {
    max_err_ =
        std::max(max_err_, MaxRelError(dense(params[i].grad()), dense(ref_params[i].grad())));
  }
}

absl::Status Trainer::OpenOutputs() {
  if (!s_.trace_dir.empty()) {
    EVENSTEP_ASSIGN_OR_RETURN(timeline_, Timeline::Open(s_.trace_dir, rank_));
  }
  if (s_.duty == BalanceScenario::Duty::kCheckpoint) {
    EVENSTEP_ASSIGN_OR_RETURN(CheckpointOptions options, CheckpointOptionsFromFlags());
    EVENSTEP_ASSIGN_OR_RETURN(checkpointer_, TrainCheckpointer::Create(ctx_, options));
    if (s_.resume) {
      EVENSTEP_ASSIGN_OR_RETURN(
          auto loaded, checkpointer_->Load({model_.ptr().get(), &optimizer_, step_.get(), "{}"}));
      run_.resumed_step = loaded.step;
      run_.resumed_memory_caps = step_->state().memory_caps;
    }
  }
  if (!s_.metrics_dir.empty()) {
    EVENSTEP_ASSIGN_OR_RETURN(metrics_, MetricsLogger::Create(ctx_, {s_.metrics_dir, 2}));
  }
  return absl::OkStatus();
}

// A real out-of-memory limit on the GPU (Oom::cuda_mb_per_token).
void Trainer::LimitCudaMemory() {
  if (s_.oom.cuda_mb_per_token <= 0 || rank_ != s_.oom.rank) return;
#if EVENSTEP_HAVE_NCCL
  const c10::DeviceIndex index = c10::cuda::current_device();
  size_t free_bytes = 0, total = 0;
  C10_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total));
  const double limit = static_cast<double>((s_.oom.tokens * s_.oom.cuda_mb_per_token + 160) << 20);
  c10::cuda::CUDACachingAllocator::setMemoryFraction(limit / static_cast<double>(total), index);
  std::cout << "cuda memory limit " << static_cast<int64_t>(limit) / (1 << 20) << " MiB of "
            << total / (1 << 20) << std::endl;
#else
  ADD_FAILURE() << "Oom::cuda_mb_per_token needs a CUDA libtorch";
#endif
}

absl::Status Trainer::SetUp() {
  EVENSTEP_RETURN_IF_ERROR(Configure());
  EVENSTEP_ASSIGN_OR_RETURN(
      step_, BalancedStep::Create(ctx_, *model_, optimizer_, data_.lengths, config_));
  EVENSTEP_RETURN_IF_ERROR(OpenOutputs());
  LimitCudaMemory();
  // A planted memory asymmetry: this rank holds (and has touched) a buffer
  // the others do not.
  if (rank_ == s_.extra_buffer_rank) {
    extra_buffer_.assign(static_cast<size_t>(s_.extra_buffer_mb) << 20, 1);
  }
  if (s_.owned_loader) owned_.emplace(load_);
  return absl::OkStatus();
}

// Whether this rank's planted out-of-memory error hits `samples`: throws it
// (Oom::where "forward"), or returns true for backward to throw.
bool Trainer::PlantedOom(const std::vector<int64_t>& samples, int s) {
  if (rank_ != s_.oom.rank) return false;
  const int64_t padded = PaddedTokens(data_, samples);
  if (s_.oom.cuda_mb_per_token > 0) {
    // The real allocator's error, under the memory limit set at start.
    const torch::Tensor block =
        torch::empty({(padded * s_.oom.cuda_mb_per_token) << 20},
                     torch::TensorOptions(torch::kByte).device(torch::kCUDA));
    (void)block;
    return false;
  }
  const std::vector<int64_t>& last = step_->micro_batches().back().samples;
  const bool in_last = std::all_of(samples.begin(), samples.end(), [&](int64_t i) {
    return std::find(last.begin(), last.end(), i) != last.end();
  });
  if (padded <= s_.oom.tokens - cached_tokens_ || (s_.oom.where == "synced" && !in_last)) {
    return false;
  }
  std::cout << "injected oom step " << s << " padded " << padded << " " << s_.oom.where
            << std::endl;
  run_.injected_oom_steps.push_back(s);
  cached_tokens_ = s_.oom.cached_tokens;  // what the failed attempt left cached
  if (s_.oom.where == "forward") {
    C10_THROW_ERROR(OutOfMemoryError, "injected: out of memory in the loss");
  }
  return true;
}

void Trainer::Sleep(int s) {
  if (s_.sleep_ms_per_micro <= 0) return;
  const double f = rank_ == s_.degrade.rank && s >= s_.degrade.step ? s_.degrade.factor : 1.0;
  const auto us = static_cast<int64_t>(1000 * s_.sleep_ms_per_micro * f);
  if (s_.virtual_time) {
    virtual_us_ += us;
  } else {
    std::this_thread::sleep_for(std::chrono::microseconds(us));
  }
}

torch::Tensor Trainer::Loss(const Loaded& batch, int s, int call) {
  const std::vector<int64_t>& samples = batch.first;
  const std::vector<torch::Tensor>* inputs = nullptr;
  if (s_.load_tensors) {
    for (size_t k = 0; k < samples.size(); ++k) {
      const torch::Tensor& t = batch.second[k];
      const bool intact = t.device() == data_.x[0].device() && torch::equal(t, data_.x[samples[k]]);
      EXPECT_TRUE(intact) << "rank " << rank_ << " step " << s << ": sample " << samples[k]
                          << " arrived on " << t.device() << " not intact";
      if (!intact) throw std::runtime_error("a loaded tensor did not arrive intact");
    }
    inputs = &batch.second;
  }
  --load_.counters->ahead;
  const bool oom_in_backward = PlantedOom(samples, s);
  // The data must be this micro-batch's, in order, whoever loaded it (a
  // retried piece of one after an out-of-memory error: not checked).
  if (s_.oom.rank < 0) {
    const std::vector<int64_t>& planned = step_->micro_batches()[call - 1].samples;
    EXPECT_EQ(samples, planned) << "rank " << rank_ << " step " << s << " micro-batch " << call
                                << ": the data of another micro-batch";
    if (samples != planned) throw std::runtime_error("data of another micro-batch");
  }
  const int fail_from =
      std::min<int>(s_.fail_micro_batch, static_cast<int>(step_->micro_batches().size()));
  const bool failing_step =
      std::find(s_.fail_at.begin(), s_.fail_at.end(), std::make_pair(rank_, s)) != s_.fail_at.end();
  if (failing_step && call >= fail_from) {
    if (s_.fail_by_exit) {
      std::cout.flush();
      std::_Exit(5);
    }
    throw std::runtime_error("injected failure in the loss callback");
  }
  Sleep(s);
  return config_.loss_reduction == LossReduction::kMean
             ? LossMean(model_, data_, samples, per_token_, inputs)
             : LossSum(model_, data_, samples, per_token_, inputs, oom_in_backward);
}

bool Trainer::RunStep(int s) {
  max_err_ = 0;
  int calls = 0;
  auto load = [&](const MicroBatch& mb) {
    if (s == 2 && rank_ == s_.fail_load_rank && &mb == &step_->micro_batches().back()) {
      throw std::runtime_error("injected failure in the load function");
    }
    return load_(mb);
  };
  auto loss = [&](const Loaded& batch) { return Loss(batch, s, ++calls); };
  absl::StatusOr<StepReport> report = owned_ ? step_->Step(*owned_, loss) : step_->Step(load, loss);
  BalanceStepRecord record;
  record.step = s;
  if (!report.ok()) {
    record.status = report.status();
    std::cout << "step " << s << " failed: " << report.status() << std::endl;
    if (s_.regroup_on_loss &&
        (absl::IsUnavailable(report.status()) || absl::IsDeadlineExceeded(report.status()))) {
      run_.steps.push_back(std::move(record));
      return RegroupAndRedo(s);
    }
    if (!s_.continue_after_failure) {
      run_.status = report.status();
      run_.steps.push_back(std::move(record));
      return false;
    }
    record.cleared = true;
    for (const auto& p : model_->parameters()) {
      record.cleared &= !p.grad().defined() || p.grad().abs().max().item<double>() == 0;
    }
    run_.steps.push_back(std::move(record));
    return true;
  }
  record.report = *report;
  record.max_grad_error = max_err_;
  if (!redo_batch_.empty()) {
    EXPECT_EQ(step_->global_batch().samples, redo_batch_)
        << "rank " << rank_ << " step " << s << ": the step run again after the regroup drew "
        << "another global batch than the failed one";
    redo_batch_.clear();
  }
  EXPECT_LE(max_err_, kGradTolerance)
      << "rank " << rank_ << " step " << s << ": the applied gradient is not one process's";
  record.state = step_->state();
  record.next_epoch = step_->epoch();
  Print(record);
  run_.steps.push_back(std::move(record));
  run_.status = AfterStep(s, *report);
  return run_.status.ok();
}

// After a lost rank: the survivors regroup and run step `s` again, on the
// global batch the failed step drew.
bool Trainer::RegroupAndRedo(int s) {
  const std::vector<int64_t> failed_batch = step_->global_batch().samples;
  absl::StatusOr<Regrouped> regrouped = step_->Regroup();
  if (!regrouped.ok()) {
    std::cout << "regroup after step " << s << " failed: " << regrouped.status() << std::endl;
    run_.status = regrouped.status();
    return false;
  }
  std::cout << "step " << s << ": " << regrouped->Describe() << "; now rank " << ctx_.rank()
            << " of " << ctx_.world_size() << std::endl;
  run_.regroups.push_back(*regrouped);
  StartReplacements(*regrouped);
  redo_batch_ = failed_batch;
  return RunStep(s);
}

void Trainer::StartReplacements(const Regrouped& regrouped) {
  if (s_.rejoin_step <= 0 || ctx_.rank() != 0 || replacement_ != nullptr) return;
  ASSERT_EQ(regrouped.lost.size(), 1u) << "one replacement per test";
  // The first regroup's old ranks are launch ranks.
  replacement_ = std::make_unique<Subprocess>(ReplacementOf(regrouped.lost[0]));
  std::cout << "started a replacement for launch rank " << regrouped.lost[0] << std::endl;
}

void Trainer::WaitForJoinRequest() {
  const absl::Time deadline = absl::Now() + HangBound(1);
  while (!ctx_.JoinPending() && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(20));
  EXPECT_TRUE(ctx_.JoinPending()) << "rank " << rank_ << ": no replacement asked to join";
}

bool Trainer::AdmitAndHandOver() {
  absl::StatusOr<Regrouped> admitted = step_->Admit();
  if (!admitted.ok()) {
    std::cout << "admit failed: " << admitted.status() << std::endl;
    run_.status = admitted.status();
    return false;
  }
  std::cout << "admitted: " << admitted->Describe() << "; now rank " << ctx_.rank() << " of "
            << ctx_.world_size() << std::endl;
  run_.admissions.push_back(*admitted);
  if (!admitted->joined.empty()) ExpectNoStepBeforeHandOver();
  return HandOverOrRegroup();
}

// A step before the handover is refused on this rank, by name, before any
// collective (the joiner would train on its initial weights otherwise).
void Trainer::ExpectNoStepBeforeHandOver() {
  EXPECT_TRUE(step_->HandoverDue()) << "rank " << rank_;
  const absl::Status early = step_->BeginStep();
  EXPECT_EQ(early.code(), absl::StatusCode::kFailedPrecondition)
      << "rank " << rank_ << ": " << early;
  EXPECT_THAT(std::string(early.message()), ::testing::HasSubstr("call evenstep::HandOver"))
      << "rank " << rank_;
}

// The handover, on every rank; where a joiner is lost during it, the
// survivors regroup and end the handover among themselves.
bool Trainer::HandOverOrRegroup() {
  const TrainState state{model_.ptr().get(), &optimizer_, step_.get(), "{}"};
  absl::StatusOr<HandOverResult> handed = HandOver(ctx_, state);
  if (!handed.ok() && s_.regroup_on_loss &&
      (absl::IsUnavailable(handed.status()) || absl::IsDeadlineExceeded(handed.status()))) {
    std::cout << "handover failed: " << handed.status() << std::endl;
    absl::StatusOr<Regrouped> regrouped = step_->Regroup();
    if (!regrouped.ok()) {
      run_.status = regrouped.status();
      return false;
    }
    run_.regroups.push_back(*regrouped);
    handed = HandOver(ctx_, state);
  }
  if (!handed.ok()) {
    run_.status = handed.status();
    return false;
  }
  std::cout << "handover: " << handed->bytes << " bytes from " << handed->senders.size()
            << " rank(s) to " << handed->receivers.size() << std::endl;
  run_.handovers.push_back(*handed);
  run_.digests.push_back(Digests());
  return true;
}

std::vector<double> Trainer::Digests() {
  double sum = 0;
  double weight = 1;
  for (const auto& p : model_->parameters()) {
    sum += weight * p.detach().to(torch::kDouble).sum().item<double>();
    weight += 1;
  }
  for (const auto& [key, state] : optimizer_.state()) {
    const auto& sgd = static_cast<const torch::optim::SGDParamState&>(*state);
    if (sgd.momentum_buffer().defined()) {
      sum += weight * sgd.momentum_buffer().to(torch::kDouble).sum().item<double>();
    }
  }
  std::vector<torch::Tensor> all;
  EXPECT_TRUE(ctx_.AllGather(torch::full({1}, sum, torch::kDouble), &all).ok());
  std::vector<double> out;
  for (const torch::Tensor& t : all) out.push_back(t.item<double>());
  return out;
}

// Rank 0 alone runs a backward outside the step: no collective may start
// (rank 1 would never join it), the gradient must be its local one, exactly.
void Trainer::CheckOutsideBackward() {
  const std::vector<int64_t> few = {0, 1, 2};
  LossSum(model_, data_, few, per_token_).backward();
  std::vector<torch::Tensor> local;
  // Dense copies: a sparse embedding's gradient has no torch::equal.
  auto dense = [](const torch::Tensor& g) { return g.is_sparse() ? g.to_dense() : g.clone(); };
  for (const auto& p : model_->parameters()) local.push_back(dense(p.grad()));
  optimizer_.zero_grad();
  LossSum(model_, data_, few, per_token_).backward();
  size_t k = 0;
  for (const auto& item : model_->named_parameters()) {
    EXPECT_TRUE(torch::equal(dense(item.value().grad()), local[k++]))
        << "rank 0: a backward outside the step changed " << item.key() << "'s local gradient";
  }
  optimizer_.zero_grad();
}

absl::Status Trainer::LogMetrics(int s, const StepReport& report) {
  metrics_->Log(s, "loss", report.loss);
  metrics_->Log(s, "rank", rank_);
  metrics_->Log(s, "rank_tensor", torch::full({2}, static_cast<double>(rank_)));
  if (s == 4 && rank_ == 1) {
    // Rank 1 reaches the interval boundary late, only after rank 0 has passed
    // it: rank 0's EndStep must not have waited for it.
    ctx_.store().wait({"evenstep-test/rank0-passed"});
  }
  EVENSTEP_RETURN_IF_ERROR(metrics_->EndStep(s));
  if (s == 4 && rank_ == 0) {
    run_.reduction_in_flight_after_step4 = metrics_->reduction_in_flight();
    ctx_.store().set("evenstep-test/rank0-passed", std::vector<uint8_t>{1});
  }
  return absl::OkStatus();
}

absl::Status Trainer::AfterStep(int s, const StepReport& report) {
  if (timeline_) timeline_->AddStep(report);
  if (s_.outside_backward && rank_ == 0) CheckOutsideBackward();
  if (metrics_) EVENSTEP_RETURN_IF_ERROR(LogMetrics(s, report));
  const absl::Time duty_begin = absl::Now();
  if (s_.duty == BalanceScenario::Duty::kRank0 && rank_ == 0) {
    std::this_thread::sleep_for(std::chrono::milliseconds(s_.duty_ms));
  } else if (s_.duty == BalanceScenario::Duty::kCheckpoint) {
    EVENSTEP_RETURN_IF_ERROR(
        checkpointer_
            ->Save(s + run_.resumed_step, {model_.ptr().get(), &optimizer_, step_.get(), "{}"})
            .status());
  }
  if (timeline_ && s_.duty != BalanceScenario::Duty::kNone) {
    timeline_->Span("checkpoint", duty_begin, absl::Now(), s);
  }
  return absl::OkStatus();
}

void Trainer::Print(const BalanceStepRecord& record) const {
  const StepReport& r = record.report;
  std::cout << absl::StrFormat("step %d rank %d micro %d samples %d loss %.6f eff %.3f err %.3g",
                               record.step, rank_, r.micro_batches, r.samples, r.loss,
                               r.balance_efficiency, record.max_grad_error)
            << std::endl;
}

absl::Status Trainer::Finish() {
  if (metrics_) EVENSTEP_RETURN_IF_ERROR(metrics_->Close());
  if (s_.evaluate) {
    // A held-out set: the last 100 samples; metrics = (loss sum, tokens).
    std::vector<int64_t> eval_lengths(data_.lengths.end() - 100, data_.lengths.end());
    SamplerOptions eval_options;
    eval_options.micro_batch_samples = 8;
    eval_options.shuffle = false;
    auto eval_set = Sampler::Create(eval_lengths, eval_options);
    EVENSTEP_RETURN_IF_ERROR(eval_set.status());
    const int64_t offset = static_cast<int64_t>(data_.lengths.size()) - 100;
    EVENSTEP_ASSIGN_OR_RETURN(
        std::vector<double> result, Evaluate(ctx_, *eval_set, [&](const MicroBatch& mb) {
          torch::NoGradGuard no_grad;
          std::vector<int64_t> samples;
          for (int64_t i : mb.samples) samples.push_back(offset + i);
          return torch::stack(
              {LossSum(model_, data_, samples, true),
               torch::tensor(static_cast<float>(mb.tokens)).to(data_.x[0].device())});
        }));
    run_.eval_loss_sum = result.at(0);
    run_.eval_tokens = result.at(1);
  }
  if (checkpointer_) EVENSTEP_RETURN_IF_ERROR(checkpointer_->WaitAll());
  if (timeline_) EVENSTEP_RETURN_IF_ERROR(timeline_->Close());
  if (replacement_ != nullptr) {
    const ProcessResult ended = replacement_->Wait(HangBound(1));
    run_.replacement_exit = ended.timed_out ? -1 : ended.exit_code;
    run_.replacement_output = ended.output;
  }
  run_.max_ahead = load_.counters->max_ahead.load();
  run_.loads = load_.counters->loads.load();
  run_.worker_loads = load_.counters->worker_loads.load();
  return absl::OkStatus();
}

}  // namespace

const BalanceStepRecord* BalanceRun::at(int step) const {
  for (const BalanceStepRecord& r : steps) {
    if (r.step == step) return &r;
  }
  return nullptr;
}

BalanceRun TrainBalanced(DistContext& ctx, const BalanceScenario& scenario) {
  return Trainer(ctx, scenario).Run();
}

void ExpectAllStepsRan(const BalanceRun& run, const BalanceScenario& scenario) {
  EXPECT_TRUE(run.status.ok()) << "rank " << run.rank << ": " << run.status;
  EXPECT_EQ(static_cast<int>(run.steps.size()), scenario.steps) << "rank " << run.rank;
  for (const BalanceStepRecord& r : run.steps) {
    EXPECT_TRUE(r.status.ok()) << "rank " << run.rank << " step " << r.step << ": " << r.status;
  }
}

std::string StepLines(const BalanceRun& run) {
  std::string lines;
  for (const BalanceStepRecord& r : run.steps) {
    absl::StrAppendFormat(&lines, "step %d rank %d micro %d samples %d loss %.6f", r.step, run.rank,
                          r.report.micro_batches, r.report.samples, r.report.loss);
    absl::StrAppendFormat(&lines, "; state: epoch %d batch %d steps %d next epoch %d\n",
                          r.state.sampler.epoch, r.state.sampler.step, r.state.steps, r.next_epoch);
  }
  return lines;
}

}  // namespace evenstep::testing

// BalancedStep: drives the micro-steps of one optimizer step; see
// balanced_step.h for the contract.
//
// Timing: data wait runs from the start of a micro-step to DataReady();
// compute from DataReady() to the end of backward, minus the time backward
// spent waiting for the gradient collectives on the last micro-step (that is
// sync wait). For CUDA losses the current stream is synchronised before the
// clock is read, so compute covers the kernels, not just their launch.
// (c10::Event has no elapsed-time query in libtorch 1.13, so events are not
// used for this.)
#include "evenstep/balanced_step.h"

#include <c10/core/impl/VirtualGuardImpl.h>
#include <torch/nn/module.h>
#include <torch/nn/utils/clip_grad.h>
#include <torch/optim/optimizer.h>

#include <algorithm>
#include <cmath>
#include <numeric>

#include "evenstep/internal/error_text.h"

namespace evenstep {
namespace {

// Doubles each rank contributes to the exchange after a step.
enum ExchangeField {
  kFitFixed,
  kFitPerUnit,
  kFitObservations,
  kBusy,
  kLossSum,
  kMicroBatches,
  kExchangeFields
};

void WaitForDevice(const at::Tensor& t) {
  if (!t.defined() || t.device().is_cpu()) return;
  c10::impl::VirtualGuardImpl guard(t.device().type());
  guard.synchronizeStream(guard.getStream(t.device()));
}

}  // namespace

absl::StatusOr<std::unique_ptr<BalancedStep>> BalancedStep::Create(
    DistContext& ctx, torch::nn::Module& model, torch::optim::Optimizer& optimizer,
    std::vector<int64_t> lengths, BalanceConfig config, std::vector<double> counts) {
  if (config.plan_interval < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("BalancedStep: plan_interval=", config.plan_interval, ": must be >= 1"));
  }
  if (config.clip_grad_norm < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("BalancedStep: clip_grad_norm=", config.clip_grad_norm, ": must be >= 0"));
  }
  EVENSTEP_ASSIGN_OR_RETURN(Sampler sampler, Sampler::Create(std::move(lengths), config.sampler,
                                                             config.cost, std::move(counts)));
  // A failed gradient bucket names the ranks that never reached the sync.
  config.grad_sync.diagnosis.arrive = [&ctx] { return ctx.MarkArrival(); };
  config.grad_sync.diagnosis.diagnose = [&ctx](int64_t seq, const std::string& what,
                                               absl::Duration elapsed, const std::string& error) {
    return ctx.Diagnose(seq, what, elapsed, error);
  };
  EVENSTEP_ASSIGN_OR_RETURN(std::unique_ptr<GradSync> sync,
                            GradSync::Attach(model, ctx.data_group(), config.grad_sync));
  std::unique_ptr<BalancedStep> step(new BalancedStep(ctx, model, optimizer, std::move(sampler),
                                                      std::move(config), std::move(sync)));
  if (!step->config_.initial_shares.empty()) {
    EVENSTEP_RETURN_IF_ERROR(step->planner_.SetShares(step->config_.initial_shares));
  }
  return step;
}

BalancedStep::BalancedStep(DistContext& ctx, torch::nn::Module& model,
                           torch::optim::Optimizer& optimizer, Sampler sampler,
                           BalanceConfig config, std::unique_ptr<GradSync> sync)
    : ctx_(ctx),
      model_(model),
      optimizer_(optimizer),
      sampler_(std::move(sampler)),
      config_(std::move(config)),
      sync_(std::move(sync)),
      cost_model_(config_.cost_model),
      planner_(ctx.world_size(), config_.planner) {}

BalancedStep::~BalancedStep() = default;

absl::Status BalancedStep::BeginStep() {
  if (in_step_) {
    return absl::FailedPreconditionError(absl::StrCat("BalancedStep: rank ", ctx_.rank(),
                                                      ": BeginStep while step ", steps_ + 1,
                                                      " is still open (call FinishStep first)"));
  }
  report_ = StepReport{};
  report_.begin = absl::Now();
  cost_model_.BeginStep();
  batch_ = sampler_.Next();
  if (!fits_.empty() && steps_ % config_.plan_interval == 0) {
    planner_.Update(fits_, batch_.cost, sampler_.micro_batch_cost_cap());
  }
  const Plan& plan = planner_.plan();
  std::vector<std::vector<int64_t>> parts = SplitGlobalBatch(sampler_, batch_, plan);
  micro_ = sampler_.Pack(std::move(parts[ctx_.rank()]));
  next_micro_ = 0;
  scale_ = batch_.count > 0 ? 1.0 / batch_.count : 0.0;
  loss_sum_ = 0;
  data_marked_ = false;
  in_step_ = true;
  micro_begin_ = absl::Now();
  report_.epoch = batch_.epoch;
  report_.epoch_step = batch_.step;
  report_.micro_batches = static_cast<int>(micro_.size());
  report_.global_count = batch_.count;
  report_.global_tokens = batch_.tokens;
  report_.shares = plan.shares;
  for (const MicroBatch& mb : micro_) {
    report_.samples += static_cast<int64_t>(mb.samples.size());
    report_.tokens += mb.tokens;
    report_.units += mb.cost;
  }
  return absl::OkStatus();
}

void BalancedStep::DataReady() {
  data_end_ = absl::Now();
  data_marked_ = true;
}

absl::Status BalancedStep::Backward(const at::Tensor& loss_sum) {
  if (!in_step_ || next_micro_ >= micro_.size()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "BalancedStep: rank ", ctx_.rank(), ": Backward without a pending micro-batch (step ",
        steps_ + 1, " has ", micro_.size(), ")"));
  }
  if (!data_marked_) DataReady();
  const size_t index = next_micro_++;
  const bool last = next_micro_ == micro_.size();
  sync_->set_sync_enabled(last);
  try {
    if (loss_sum.dim() != 0) {
      return Abandon(index, absl::StrCat("the loss must be a scalar (the sum of the micro-batch's "
                                         "losses); got shape ",
                                         c10::str(loss_sum.sizes())));
    }
    (loss_sum * scale_).backward();
    WaitForDevice(loss_sum);
    loss_sum_ += loss_sum.detach().to(at::kDouble).item<double>() * scale_;
  } catch (const std::exception& e) {
    return Abandon(index, internal::ErrorText(e));
  }
  const absl::Time end = absl::Now();
  absl::Duration compute = end - data_end_;
  if (last) {
    const SyncStats stats = sync_->last_stats();
    compute -= stats.wait;
    report_.sync_wait += stats.wait;
    report_.arrived = stats.arrived;
    report_.synced = stats.done;
  }
  report_.micro.push_back({micro_begin_, data_end_, end, micro_[index].cost});
  const absl::Duration data = data_end_ - micro_begin_;
  report_.data += data;
  report_.compute += compute;
  cost_model_.Record(micro_[index].cost, absl::ToDoubleSeconds(data),
                     absl::ToDoubleSeconds(compute));
  micro_begin_ = end;
  data_marked_ = false;
  return absl::OkStatus();
}

absl::Status BalancedStep::Abandon(size_t micro_batch, const std::string& what) {
  in_step_ = false;
  sync_->set_sync_enabled(true);
  return absl::InternalError(absl::StrCat("BalancedStep: rank ", ctx_.rank(), ", step ", steps_ + 1,
                                          ", micro-batch ", micro_batch + 1, " of ", micro_.size(),
                                          ": ", what));
}

absl::StatusOr<StepReport> BalancedStep::FinishStep() {
  if (!in_step_) {
    return absl::FailedPreconditionError(
        absl::StrCat("BalancedStep: rank ", ctx_.rank(), ": FinishStep without BeginStep"));
  }
  if (next_micro_ != micro_.size()) {
    return Abandon(next_micro_, absl::StrCat("FinishStep after ", next_micro_, " of ",
                                             micro_.size(), " micro-batches"));
  }
  in_step_ = false;
  report_.busy = report_.data + report_.compute;
  if (micro_.empty()) {
    // No work on this rank this step: join the collectives with zeros.
    report_.arrived = absl::Now();
    absl::Status synced = sync_->SyncNow();
    report_.synced = absl::Now();
    report_.sync_wait = report_.synced - report_.arrived;
    if (!synced.ok()) {
      return absl::Status(synced.code(),
                          absl::StrCat("BalancedStep: rank ", ctx_.rank(), ", step ", steps_ + 1,
                                       " (no micro-batch "
                                       "on this rank): ",
                                       synced.message()));
    }
  } else if (absl::Status s = sync_->status(); !s.ok()) {
    return absl::Status(s.code(), absl::StrCat("BalancedStep: rank ", ctx_.rank(), ", step ",
                                               steps_ + 1, ": ", s.message()));
  }
  const absl::Time optimizer_begin = absl::Now();
  report_.optimizer_begin = optimizer_begin;
  try {
    if (config_.after_sync) config_.after_sync();
    if (config_.clip_grad_norm > 0) {
      torch::nn::utils::clip_grad_norm_(model_.parameters(), config_.clip_grad_norm);
    }
    optimizer_.step();
    optimizer_.zero_grad();
  } catch (const std::exception& e) {
    return absl::InternalError(absl::StrCat("BalancedStep: rank ", ctx_.rank(), ", step ",
                                            steps_ + 1,
                                            ", optimizer step: ", internal::ErrorText(e)));
  }
  report_.optimizer = absl::Now() - optimizer_begin;
  ++steps_;
  report_.step = steps_;
  EVENSTEP_RETURN_IF_ERROR(Exchange());
  report_.end = absl::Now();
  return report_;
}

absl::Status BalancedStep::Exchange() {
  const CostFit fit = cost_model_.total_fit();
  at::Tensor mine = at::zeros({kExchangeFields}, at::kDouble);
  double* m = mine.data_ptr<double>();
  m[kFitFixed] = fit.fixed_s;
  m[kFitPerUnit] = fit.per_unit_s;
  m[kFitObservations] = static_cast<double>(fit.observations);
  m[kBusy] = absl::ToDoubleSeconds(report_.busy);
  m[kLossSum] = loss_sum_;
  m[kMicroBatches] = static_cast<double>(micro_.size());
  std::vector<at::Tensor> all;
  absl::Status s = ctx_.AllGather(mine, &all);
  if (!s.ok()) {
    return absl::Status(s.code(), absl::StrCat("BalancedStep: step ", steps_,
                                               ", exchange of cost fits: ", s.message()));
  }
  const int world = ctx_.world_size();
  fits_.assign(world, CostFit{});
  report_.rank_busy_s.assign(world, 0);
  report_.rank_micro_batches.assign(world, 0);
  double loss = 0, busy_sum = 0, busy_max = 0;
  for (int r = 0; r < world; ++r) {
    const double* v = all[r].data_ptr<double>();
    fits_[r].fixed_s = v[kFitFixed];
    fits_[r].per_unit_s = v[kFitPerUnit];
    fits_[r].observations = static_cast<int64_t>(v[kFitObservations]);
    report_.rank_busy_s[r] = v[kBusy];
    report_.rank_micro_batches[r] = static_cast<int>(v[kMicroBatches]);
    loss += v[kLossSum];
    busy_sum += v[kBusy];
    busy_max = std::max(busy_max, v[kBusy]);
  }
  report_.loss = loss;
  report_.balance_efficiency = busy_max > 0 ? busy_sum / world / busy_max : 1.0;
  return absl::OkStatus();
}

BalanceState BalancedStep::state() const {
  BalanceState state;
  state.sampler = sampler_.state();
  state.shares = planner_.plan().shares;
  state.steps = steps_;
  return state;
}

absl::Status BalancedStep::Restore(const BalanceState& state) {
  if (in_step_) {
    return absl::FailedPreconditionError("BalancedStep::Restore: a step is open");
  }
  EVENSTEP_RETURN_IF_ERROR(sampler_.Restore(state.sampler));
  if (static_cast<int>(state.shares.size()) == ctx_.world_size()) {
    EVENSTEP_RETURN_IF_ERROR(planner_.SetShares(state.shares));
  }
  steps_ = state.steps;
  fits_.clear();
  cost_model_.Reset();
  return absl::OkStatus();
}

}  // namespace evenstep

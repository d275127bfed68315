// BalancedStep: the step's accounting and its one exchange (costs, losses,
// sums, memory caps, agreement slots, rank health), and the balance state
// saved in checkpoints (balanced_step.h).
#include <ATen/Context.h>
#include <c10/util/Exception.h>
#include <torch/nn/module.h>
#include <torch/nn/utils/clip_grad.h>
#include <torch/optim/optimizer.h>
#include <xxhash.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <iostream>
#include <limits>
#include <map>
#include <numeric>
#include <set>
#include <stdexcept>
#include <thread>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "evenstep/balanced_step.h"
#include "evenstep/internal/error_text.h"
#include "evenstep/internal/memory_caps.h"
#include "evenstep/internal/micro_step_clock.h"
#include "evenstep/internal/rank_health.h"
#include "evenstep/internal/split_record.h"
#include "evenstep/internal/step_sums.h"
#include "evenstep/log.h"
#include "evenstep/status_macros.h"

namespace evenstep {
namespace {

// Doubles each rank contributes to the exchange after a step.
enum ExchangeField {
  kFitFixed,
  kFitPerUnit,
  kFitObservations,
  kBusy,
  kMicroBatches,
  kOomSplits,
  kMemoryCap,
  kOomFailed,
  kPeakMemory,
  kLargestMicro,
  kLateFailure,  // 1: an exception after this rank's gradients were all synchronised
  kAgreed,       // kAgreementSlots values follow
  kPartLosses = kAgreed + kAgreementSlots,  // one loss sum per part follows
};

}  // namespace

absl::Status BalancedStep::Account() {
  // Blocks until the device has finished the last micro-step (not the
  // optimizer step queued after it).
  internal::MicroStepTimes times;
  try {
    times = clock_->Read();
    for (size_t k = 0; k < parts_.size(); ++k) {
      const at::Tensor& sum = run_.loss_on_device[k];
      run_.part_loss_sums[k] = sum.defined() ? sum.item<double>() : 0.0;
    }
    sums_->Collect();
  } catch (const std::exception& e) {
    return absl::InternalError(
        absl::StrCat("BalancedStep: rank ", ctx_.rank(), ", step ", steps_ + 1,
                     ", reading the micro-step times and losses: ", internal::ErrorText(e)));
  }
  // Micro-step j is micro-batch j % n of part j / n: the cost model learns
  // each micro-batch's time summed over the parts.
  const size_t n = run_.micro.size();
  std::vector<absl::Duration> data(n), compute(n);
  absl::Time at = clock_->begun();
  for (size_t j = 0; j < times.data.size() && j < n * parts_.size(); ++j) {
    const absl::Time data_end = at + times.data[j];
    const bool last = j + 1 == times.data.size();
    const absl::Time end = data_end + times.compute[j] + (last ? times.sync : absl::ZeroDuration());
    report_.micro.push_back({at, data_end, end, run_.micro[j % n].cost});
    data[j % n] += times.data[j];
    compute[j % n] += times.compute[j];
    at = end;
  }
  for (size_t k = 0; k < n; ++k) {
    report_.data += data[k];
    report_.compute += compute[k];
    cost_model_.Record(run_.micro[k].cost, absl::ToDoubleSeconds(data[k]),
                       absl::ToDoubleSeconds(compute[k]));
  }
  if (!run_.micro.empty()) report_.sync_wait += times.sync;
  report_.busy = report_.data + report_.compute;
  return absl::OkStatus();
}

absl::Status BalancedStep::Exchange() {
  const CostFit fit = cost_model_.total_fit();
  const int sums_at = kPartLosses + static_cast<int>(parts_.size());
  const int fields = sums_at + static_cast<int>(sums_->size());
  at::Tensor mine = at::zeros({fields}, at::kDouble);
  double* m = mine.data_ptr<double>();
  m[kFitFixed] = fit.fixed_s;
  m[kFitPerUnit] = fit.per_unit_s;
  m[kFitObservations] = static_cast<double>(fit.observations);
  m[kBusy] = absl::ToDoubleSeconds(report_.busy);
  for (size_t k = 0; k < parts_.size(); ++k) m[kPartLosses + k] = run_.part_loss_sums[k];
  for (size_t k = 0; k < sums_->size(); ++k) m[sums_at + k] = sums_->value(k);
  m[kMicroBatches] = static_cast<double>(run_.micro.size());
  m[kLateFailure] = run_.late_failure.empty() ? 0 : 1;
  m[kOomSplits] = report_.oom_splits;
  m[kMemoryCap] = static_cast<double>(caps_->cap());
  m[kOomFailed] = static_cast<double>(caps_->step_failed_max());
  m[kPeakMemory] = static_cast<double>(report_.memory.peak_bytes);
  m[kLargestMicro] = static_cast<double>(report_.largest_micro_batch);
  shared_[kJoinWaiting] = ctx_.JoinPending() ? 1 : 0;
  for (int i = 0; i < kAgreementSlots; ++i) m[kAgreed + i] = shared_[i];
  std::vector<at::Tensor> all;
  EVENSTEP_RETURN_IF_ERROR(ctx_.AllGather(mine, &all), "BalancedStep: step ", steps_,
                           ", exchange of cost fits");
  const int world = ctx_.world_size();
  fits_.assign(world, CostFit{});
  report_.rank_busy_s.assign(world, 0);
  report_.rank_micro_batches.assign(world, 0);
  report_.rank_oom_splits.assign(world, 0);
  report_.rank_memory_caps.assign(world, 0);
  report_.rank_oom_failed.assign(world, 0);
  report_.rank_peak_memory.assign(world, 0);
  report_.rank_largest_micro_batch.assign(world, 0);
  report_.part_losses.assign(parts_.size(), 0.0);
  for (const std::string& name : sums_->names()) report_.sums[name] = 0;
  double busy_sum = 0, busy_max = 0;
  report_.agreed.fill(-std::numeric_limits<double>::infinity());
  for (int r = 0; r < world; ++r) {
    const double* v = all[r].data_ptr<double>();
    for (int i = 0; i < kAgreementSlots; ++i) {
      report_.agreed[i] = std::max(report_.agreed[i], v[kAgreed + i]);
    }
    fits_[r].fixed_s = v[kFitFixed];
    fits_[r].per_unit_s = v[kFitPerUnit];
    fits_[r].observations = static_cast<int64_t>(v[kFitObservations]);
    report_.rank_busy_s[r] = v[kBusy];
    report_.rank_micro_batches[r] = static_cast<int>(v[kMicroBatches]);
    if (v[kLateFailure] != 0) report_.late_failures.push_back(r);
    report_.rank_oom_splits[r] = static_cast<int>(v[kOomSplits]);
    report_.rank_memory_caps[r] = static_cast<int64_t>(v[kMemoryCap]);
    report_.rank_oom_failed[r] = static_cast<int64_t>(v[kOomFailed]);
    report_.rank_peak_memory[r] = static_cast<int64_t>(v[kPeakMemory]);
    report_.rank_largest_micro_batch[r] = static_cast<int64_t>(v[kLargestMicro]);
    if (report_.rank_oom_splits[r] > 0) {
      report_.oom_recoveries.push_back(absl::StrFormat(
          "rank %d, step %d: %d micro-batch(es) ran out of memory (the largest %d padded tokens) "
          "and were split and retried within the step; rank %d's micro-batches are now capped at "
          "%d padded tokens",
          r, steps_, report_.rank_oom_splits[r], report_.rank_oom_failed[r], r,
          report_.rank_memory_caps[r]));
    }
    for (size_t k = 0; k < parts_.size(); ++k) report_.part_losses[k] += v[kPartLosses + k];
    for (size_t k = 0; k < sums_->size(); ++k) report_.sums[sums_->names()[k]] += v[sums_at + k];
    busy_sum += v[kBusy];
    busy_max = std::max(busy_max, v[kBusy]);
  }
  report_.loss = report_.part_losses[0];
  caps_->set_all(report_.rank_memory_caps);
  report_.balance_efficiency = busy_max > 0 ? busy_sum / world / busy_max : 1.0;
  UpdateHealth();
  return absl::OkStatus();
}

void BalancedStep::UpdateHealth() {
  // A typical micro-batch: the cap's cost units (or the mean global batch's
  // share of one rank when uncapped).
  double units = sampler_.micro_batch_cost_cap();
  if (!std::isfinite(units)) units = run_.batch.cost / std::max<size_t>(fits_.size(), 1);
  internal::RankHealth::Figures f = health_->Update(fits_, units, config_.health_warn, steps_ + 1);
  report_.rank_health = std::move(f.health);
  report_.rank_relative_speed = std::move(f.relative_speed);
  report_.health_alerts = std::move(f.alerts);
}

BalanceState BalancedStep::state() const {
  BalanceState state;
  state.stream_shares = planned_ ? planned_->stream_shares_before : stream_shares_;
  // A step planned ahead (for prefetching) has not run: the state is the
  // one before it.
  state.sampler = planned_ ? planned_->sampler_before : sampler_.state();
  state.shares = planned_ ? planned_->shares_before : planner_.plan().shares;
  state.steps = steps_;
  const std::vector<int64_t>& caps = caps_->all();
  if (std::any_of(caps.begin(), caps.end(), [](int64_t c) { return c > 0; })) {
    state.memory_caps = caps;
  }
  return state;
}

absl::Status BalancedStep::CheckRestore(const BalanceState& state) const {
  if (run_.in_step) return absl::FailedPreconditionError("BalancedStep::Restore: a step is open");
  if (state.steps < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("BalancedStep::Restore: ", state.steps, " steps done"));
  }
  Sampler trial = sampler_;
  EVENSTEP_RETURN_IF_ERROR(trial.Restore(state.sampler), "the sampler's position");
  if (static_cast<int>(state.shares.size()) == ctx_.world_size()) {
    Planner planner = planner_;
    EVENSTEP_RETURN_IF_ERROR(planner.SetShares(state.shares), "the saved shares of the ranks");
  }
  return absl::OkStatus();
}

absl::Status BalancedStep::Restore(const BalanceState& state) {
  EVENSTEP_RETURN_IF_ERROR(CheckRestore(state));
  if (run_.in_step) {
    return absl::FailedPreconditionError("BalancedStep::Restore: a step is open");
  }
  CancelPrefetch();
  planned_.reset();
  EVENSTEP_RETURN_IF_ERROR(sampler_.Restore(state.sampler));
  if (static_cast<int>(state.shares.size()) == ctx_.world_size()) {
    EVENSTEP_RETURN_IF_ERROR(planner_.SetShares(state.shares));
  }
  steps_ = state.steps;
  // Another world size: the streams are dealt anew (stream state is saved
  // whole, so any rank can take any stream).
  stream_shares_ = static_cast<int>(state.stream_shares.size()) == ctx_.world_size()
                       ? state.stream_shares
                       : planner_.plan().shares;
  fits_.clear();
  cost_model_.Reset();
  // Each rank's learned memory cap, when the world is the same (ranks of
  // another world may sit on other devices).
  caps_->Restore(static_cast<int>(state.memory_caps.size()) == ctx_.world_size()
                     ? state.memory_caps
                     : std::vector<int64_t>(),
                 ctx_.rank());
  return absl::OkStatus();
}

}  // namespace evenstep

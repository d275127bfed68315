// BalancedStep::Regroup: after a rank was lost, the survivors go on with
// the failed step's global batch, re-planned over themselves
// (balanced_step.h).
#include <ATen/ATen.h>
#include <torch/optim/optimizer.h>

#include <algorithm>
#include <numeric>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "balanced_step_internal.h"
#include "evenstep/balanced_step.h"
#include "evenstep/internal/memory_caps.h"
#include "evenstep/internal/rank_health.h"
#include "evenstep/log.h"
#include "evenstep/status_macros.h"

namespace evenstep {
namespace {

// The survivors' entries of a per-rank list of the old world (empty where
// the list was not per rank of it).
template <typename T>
std::vector<T> OfSurvivors(const std::vector<T>& per_rank, const Regrouped& regrouped) {
  const size_t old_world = regrouped.survivors.size() + regrouped.lost.size();
  if (per_rank.size() != old_world) return {};
  std::vector<T> kept;
  for (int r : regrouped.survivors) kept.push_back(per_rank[r]);
  return kept;
}

// Shares that still give some rank work (the survivors may all have had
// none); empty = equal shares.
std::vector<double> UsableShares(std::vector<double> shares) {
  const double sum = std::accumulate(shares.begin(), shares.end(), 0.0);
  return sum > 0 ? shares : std::vector<double>();
}

// `state`'s per-rank lists (shares, memory caps) of the ranks a regroup
// kept.
void KeepSurvivors(BalanceState* state, const Regrouped& regrouped) {
  state->shares = UsableShares(OfSurvivors(state->shares, regrouped));
  state->stream_shares = UsableShares(OfSurvivors(state->stream_shares, regrouped));
  state->memory_caps = OfSurvivors(state->memory_caps, regrouped);
}

// FailedPrecondition where the world may not change now: `what` ("Regroup
// while step N is open; ...") with a step open, `replay` (what a split
// record being replayed makes impossible) while one is.
absl::Status WorldMayChange(int rank, bool in_step, const std::string& what, bool replaying,
                            const std::string& replay) {
  if (in_step) {
    return absl::FailedPreconditionError(absl::StrCat("BalancedStep: rank ", rank, ": ", what));
  }
  if (replaying) {
    return absl::FailedPreconditionError(
        absl::StrCat("BalancedStep: rank ", rank, ": ", replay,
                     " while replaying a split record (--evenstep_replay) is not supported"));
  }
  return absl::OkStatus();
}

// A split record being written holds the old world's splits: it ends with
// the last step before the change (a replay of this run stops there, naming
// the step).
template <typename Record>
void EndSplitRecord(Record& split_log, int rank, int64_t steps, int world) {
  if (split_log == nullptr) return;
  if (rank == 0) {
    Log(LogLevel::kInfo, absl::StrCat("the split record (--evenstep_split_record) ends at step ",
                                      steps, ": the world changed to ", world, " ranks"));
  }
  split_log.reset();
}

}  // namespace

absl::StatusOr<Regrouped> BalancedStep::Regroup() {
  if (parts_.size() > 1) {
    return absl::FailedPreconditionError(absl::StrCat(
        "BalancedStep: rank ", ctx_.rank(), ": going on after a lost rank with ", parts_.size(),
        " model parts is not supported (an earlier part's optimizer step of the failed step "
        "cannot be undone): restart from the last checkpoint"));
  }
  EVENSTEP_RETURN_IF_ERROR(WorldMayChange(
      ctx_.rank(), run_.in_step,
      absl::StrCat("Regroup while step ", steps_ + 1, " is open; call it after the step failed"),
      split_log_ != nullptr && !split_log_->replay_file.empty(),
      "going on after a lost rank (the record is of the old world)"));
  CancelPrefetch();
  // A step that failed in the exchange was applied (steps_ counts it): go
  // on from after it. Otherwise from where the failed step began.
  BalanceState from = run_.before.steps == steps_ ? run_.before : state();
  planned_.reset();
  EVENSTEP_ASSIGN_OR_RETURN(Regrouped regrouped, ctx_.Regroup());
  const std::string where = absl::StrCat("BalancedStep: rank ", ctx_.rank(), " (launch rank ",
                                         ctx_.launch_rank(), "), after ", regrouped.Describe());
  // Every survivor must stand at the same step: one that completed the
  // failed step's synchronisation (the lost rank died after sending its
  // last bucket) has applied it, and the others have not.
  at::Tensor steps =
      at::tensor({static_cast<double>(steps_), -static_cast<double>(steps_)}, at::kDouble);
  EVENSTEP_RETURN_IF_ERROR(ctx_.AllReduce(steps, ReduceOp::kMax), where,
                           ": agreeing on the steps done");
  const auto most = static_cast<int64_t>(steps[0].item<double>());
  const auto least = static_cast<int64_t>(-steps[1].item<double>());
  if (most != least) {
    return absl::FailedPreconditionError(absl::StrCat(
        where, ": the survivors disagree on whether step ", most,
        " was applied (some completed its gradient synchronisation before the rank was lost, "
        "some did not); going on would leave the replicas apart: restart from the last "
        "checkpoint"));
  }
  KeepSurvivors(&from, regrouped);
  planner_ = Planner(ctx_.world_size(), config_.planner);
  health_ = std::make_unique<internal::RankHealth>();
  fits_.clear();
  abandoned_ = absl::OkStatus();
  for (Part& part : parts_) {
    // The failed step's gradients (partly reduced, perhaps) never reach a
    // step.
    for (at::Tensor& p : part.spec.module->parameters()) p.mutable_grad() = at::Tensor();
  }
  EndSplitRecord(split_log_, ctx_.rank(), from.steps, ctx_.world_size());
  EVENSTEP_RETURN_IF_ERROR(AttachSyncs(), where);
  EVENSTEP_RETURN_IF_ERROR(Restore(from), where);
  return regrouped;
}

namespace {

// A per-rank list of fractions of the old world (summing to 1) for the
// world grown by `joiners`: each joiner gets the old ranks' mean, the old
// ranks keep their proportions. Empty stays empty (equal shares).
std::vector<double> WithJoiners(std::vector<double> shares, size_t joiners) {
  if (shares.empty()) return shares;
  const double n = static_cast<double>(shares.size());
  const double grown = n + static_cast<double>(joiners);
  for (double& share : shares) share *= n / grown;
  shares.insert(shares.end(), joiners, 1.0 / grown);
  return shares;
}

}  // namespace

bool BalancedStep::JoinWaiting() const {
  return ctx_.options().on_rank_loss == DistOptions::OnRankLoss::kContinue &&
         report_.agreed[kJoinWaiting] > 0;
}

absl::StatusOr<Regrouped> BalancedStep::Admit() {
  EVENSTEP_RETURN_IF_ERROR(WorldMayChange(
      ctx_.rank(), run_.in_step,
      absl::StrCat("Admit while step ", steps_ + 1, " is open; call it between steps"),
      split_log_ != nullptr && !split_log_->replay_file.empty(),
      "admitting a replacement (the record is of this world)"));
  CancelPrefetch();
  planned_.reset();
  BalanceState from = state();
  report_.agreed[kJoinWaiting] = 0;
  EVENSTEP_ASSIGN_OR_RETURN(Regrouped admitted, ctx_.Admit(), "BalancedStep: rank ", ctx_.rank(),
                            ", after step ", steps_);
  // Every member, unless a rank was lost during the admission and the
  // survivors' regroup won (Regroup's case, between steps: nothing to redo).
  KeepSurvivors(&from, admitted);
  from.shares = WithJoiners(from.shares, admitted.joined.size());
  from.stream_shares = WithJoiners(from.stream_shares, admitted.joined.size());
  if (!from.memory_caps.empty()) from.memory_caps.resize(ctx_.world_size(), 0);
  planner_ = Planner(ctx_.world_size(), config_.planner);
  health_ = std::make_unique<internal::RankHealth>();
  fits_.clear();
  EndSplitRecord(split_log_, ctx_.rank(), from.steps, ctx_.world_size());
  // The joiners get the parameters with the rest of the state (HandOver),
  // not from one rank at Attach.
  handover_due_ = handover_due_ || !admitted.joined.empty();
  const std::string where =
      absl::StrCat("BalancedStep: rank ", ctx_.rank(), ", after ", admitted.Describe());
  EVENSTEP_RETURN_IF_ERROR(AttachSyncs(), where);
  EVENSTEP_RETURN_IF_ERROR(Restore(from), where);
  if (ctx_.rank() == 0) {
    Log(LogLevel::kWarning,
        absl::StrCat("after step ", from.steps, ": ", admitted.Describe(),
                     admitted.joined.empty() ? ""
                                             : "; the running ranks hand the state over "
                                               "(HandOver), and the next step runs over all"));
  }
  return admitted;
}

absl::Status BalancedStep::HandedOver(const BalanceState* received) {
  if (lacks_state_) {
    if (received == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat("BalancedStep: rank ", ctx_.rank(),
                                                     " joined and lacks the balancing state"));
    }
    EVENSTEP_RETURN_IF_ERROR(Restore(*received), "BalancedStep: rank ", ctx_.rank(),
                             ": the balancing state handed over");
  }
  lacks_state_ = handover_due_ = false;
  return absl::OkStatus();
}

}  // namespace evenstep

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

}  // namespace

absl::StatusOr<Regrouped> BalancedStep::Regroup() {
  if (parts_.size() > 1) {
    return absl::FailedPreconditionError(absl::StrCat(
        "BalancedStep: rank ", ctx_.rank(), ": going on after a lost rank with ", parts_.size(),
        " model parts is not supported (an earlier part's optimizer step of the failed step "
        "cannot be undone): restart from the last checkpoint"));
  }
  if (split_log_ != nullptr && !split_log_->replay_file.empty()) {
    return absl::FailedPreconditionError(
        absl::StrCat("BalancedStep: rank ", ctx_.rank(),
                     ": going on after a lost rank while replaying a split record "
                     "(--evenstep_replay) is not supported: the record is of the old world"));
  }
  if (run_.in_step) {
    return absl::FailedPreconditionError(absl::StrCat("BalancedStep: rank ", ctx_.rank(),
                                                      ": Regroup while step ", steps_ + 1,
                                                      " is open; call it after the step failed"));
  }
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
  from.shares = UsableShares(OfSurvivors(from.shares, regrouped));
  from.stream_shares = UsableShares(OfSurvivors(from.stream_shares, regrouped));
  from.memory_caps = OfSurvivors(from.memory_caps, regrouped);
  planner_ = Planner(ctx_.world_size(), config_.planner);
  health_ = std::make_unique<internal::RankHealth>();
  fits_.clear();
  abandoned_ = absl::OkStatus();
  for (Part& part : parts_) {
    // The failed step's gradients (partly reduced, perhaps) never reach a
    // step.
    for (at::Tensor& p : part.spec.module->parameters()) p.mutable_grad() = at::Tensor();
  }
  if (split_log_ != nullptr) {
    // The record holds the old world's splits: it ends with the last step
    // before the loss (a replay of this run stops there, naming the step).
    if (ctx_.rank() == 0) {
      Log(LogLevel::kInfo,
          absl::StrCat("the split record (--evenstep_split_record) ends at step ", from.steps,
                       ": the world changed to ", ctx_.world_size(), " ranks"));
    }
    split_log_.reset();
  }
  EVENSTEP_RETURN_IF_ERROR(AttachSyncs(), where);
  EVENSTEP_RETURN_IF_ERROR(Restore(from), where);
  return regrouped;
}

}  // namespace evenstep

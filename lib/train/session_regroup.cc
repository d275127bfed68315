// Session after a lost rank (DistOptions::on_rank_loss kContinue): the
// survivors regroup and redo the step, and the run's files follow the new
// world (session.h, Around).
#include <cmath>
#include <limits>
#include <optional>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "evenstep/internal/save_tracker.h"
#include "evenstep/log.h"
#include "evenstep/metrics.h"
#include "evenstep/session.h"
#include "evenstep/status_macros.h"
#include "evenstep/timeline.h"
#include "evenstep/train_checkpointer.h"
#include "session_internal.h"

namespace evenstep {

bool Session::RankLost(const absl::Status& failure) const {
  if (ctx_.options().on_rank_loss != DistOptions::OnRankLoss::kContinue) return false;
  // A peer that left its collective for a regroup already marked it; else
  // the failure itself names a rank that is gone or too late.
  return ctx_.RegroupBegun() || absl::IsUnavailable(failure) || absl::IsDeadlineExceeded(failure);
}

absl::StatusOr<std::optional<StepReport>> Session::GoOnAfterLoss(const absl::Status& failure,
                                                                 int64_t epoch,
                                                                 StepReport* losses) {
  const absl::Time begin = absl::Now();
  const int64_t step = last_step_ + 1;
  if (step_->sampler().options().streams > 0) {
    // Every survivor refuses alike, before any collective.
    return absl::FailedPreconditionError(absl::StrCat(
        "rank ", ctx_.rank(), ", step ", step,
        ": going on after a lost rank in stream mode (--evenstep_streams) is not supported: each "
        "rank's streams, and the loop's rows of them (OwnRows, KeptRows), would move to other "
        "ranks; restart from the last checkpoint (the step failed: ",
        failure.message(), ")"));
  }
  EVENSTEP_ASSIGN_OR_RETURN(
      const Regrouped regrouped, step_->Regroup(), "rank ", ctx_.rank(), ", step ", step,
      ": going on after a lost rank (the step failed: ", failure.message(), ")");
  const bool applied = step_->state().steps == step;
  // KeepSum's variables as they were before the step: a redo adds again.
  for (SumBinding& k : loop_vars_.sums) {
    if (k.bound) internal::Write(k.value, k.added = k.start);
  }
  // Saves that finished before the loss are reported as usual; those the
  // lost rank never reported on can never commit.
  saves_->Poll();
  EVENSTEP_ASSIGN_OR_RETURN(const int abandoned,
                            checkpointer_->Regroup(absl::AbortedError(absl::StrCat(
                                "abandoned when ", regrouped.Describe(), " at step ", step,
                                ": not every rank wrote its shard (the survivors save again)"))),
                            "rank ", ctx_.rank(), ", step ", step);
  saves_ = std::make_unique<internal::SaveTracker>(ctx_.rank());
  metrics_->AfterRegroup();
  if (timeline_) timeline_->Renumber(ctx_.rank(), absl::Now(), step);
  const double seconds = absl::ToDoubleSeconds(absl::Now() - begin);
  losses->lost_ranks.insert(losses->lost_ranks.end(), regrouped.lost.begin(), regrouped.lost.end());
  losses->regroup_seconds += seconds;
  if (ctx_.rank() == 0) {
    std::string line = absl::StrFormat("rank loss in step %d: %s; regrouped in %.2f s; ", step,
                                       regrouped.Describe(), seconds);
    absl::StrAppend(&line, applied
                               ? absl::StrCat("step ", step,
                                              " was applied on every survivor before the loss "
                                              "was known (in its exchange): its loss and sums "
                                              "are lost with the rank")
                               : absl::StrCat("step ", step, " is redone over ", ctx_.world_size(),
                                              " rank(s) with its global batch"));
    if (abandoned > 0) {
      absl::StrAppend(&line, "; ", abandoned, " checkpoint save(s) in flight abandoned");
    }
    Log(LogLevel::kWarning, line);
  }
  // The newest save can never commit: the state it held (the step before
  // this one) is the state now, unless this step was applied.
  if (abandoned > 0 && !applied) EVENSTEP_RETURN_IF_ERROR(Checkpoint());
  if (!applied) return std::optional<StepReport>();
  StepReport report;
  report.step = step;
  report.epoch = epoch;
  report.figures_lost = true;
  constexpr double kUnknown = std::numeric_limits<double>::quiet_NaN();
  report.loss = report.balance_efficiency = kUnknown;
  report.part_losses.assign(parts_.size(), kUnknown);
  return std::optional<StepReport>(std::move(report));
}

}  // namespace evenstep

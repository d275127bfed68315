// The Session's saves in flight and their outcomes.
#include "evenstep/internal/save_tracker.h"

#include <chrono>

#include "absl/strings/str_cat.h"
#include "evenstep/log.h"

namespace evenstep::internal {

void SaveTracker::Observe(int64_t step, const absl::Status& outcome) {
  if (outcome.ok()) {
    run_ = 0;
    return;
  }
  ++failures_;
  if (++run_ == 1) run_first_step_ = step;
  if (run_ > longest_run_) {
    longest_run_ = run_;
    longest_first_step_ = run_first_step_;
  }
  last_error_ = outcome;
  Log(LogLevel::kWarning,
      absl::StrCat("rank ", rank_, ": the checkpoint of step ", step, " FAILED (", failures_,
                   " failed saves so far): ", outcome.message()));
}

absl::Status SaveTracker::Drain(int64_t* last_step) {
  absl::Status outcome;
  while (!pending_.empty()) {
    if (last_step != nullptr) *last_step = pending_.front().step;
    outcome = pending_.front().done.get();
    Observe(pending_.front().step, outcome);
    pending_.pop_front();
  }
  return outcome;
}

void SaveTracker::Poll() {
  while (!pending_.empty() &&
         pending_.front().done.wait_for(std::chrono::seconds(0)) == std::future_status::ready) {
    Observe(pending_.front().step, pending_.front().done.get());
    pending_.pop_front();
  }
}

}  // namespace evenstep::internal

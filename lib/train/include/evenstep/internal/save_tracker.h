// The Session's checkpoint saves in flight and their outcomes: each save's
// ticket is kept until it ends, a failed save is said in one line naming
// the step and rank, and the runs of consecutive failures are counted (the
// step exchange agrees on the longest, so every rank stops together under
// --evenstep_ckpt_on_error / --evenstep_ckpt_max_failures).
#pragma once

#include <cstdint>
#include <deque>
#include <future>

#include "absl/status/status.h"

namespace evenstep::internal {

class SaveTracker {
 public:
  explicit SaveTracker(int rank) : rank_(rank) {}

  // A save of `step` started; `done` is its outcome.
  void Started(int64_t step, std::shared_future<absl::Status> done) {
    pending_.push_back({step, std::move(done)});
  }
  bool empty() const { return pending_.empty(); }
  size_t in_flight() const { return pending_.size(); }
  int64_t oldest_step() const { return pending_.front().step; }

  // Observes the saves that have finished, oldest first.
  void Poll();
  // Waits for every save in flight and observes it, oldest first; the last
  // one's outcome (OK if none) and, in `last_step` when given, its step.
  absl::Status Drain(int64_t* last_step);

  int64_t failures() const { return failures_; }    // failed saves this rank has seen
  int longest_run() const { return longest_run_; }  // consecutive failed saves
  int64_t longest_first_step() const { return longest_first_step_; }
  const absl::Status& last_error() const { return last_error_; }

 private:
  void Observe(int64_t step, const absl::Status& outcome);
  struct Pending {
    int64_t step;
    std::shared_future<absl::Status> done;
  };
  int rank_;
  std::deque<Pending> pending_;  // oldest first
  int64_t failures_ = 0;
  int run_ = 0;  // consecutive failed saves, the latest ones
  int longest_run_ = 0;
  absl::Status last_error_;
  int64_t run_first_step_ = 0;      // the first failed save of the current run
  int64_t longest_first_step_ = 0;  // ... of the longest run
};

}  // namespace evenstep::internal

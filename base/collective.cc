#include "evenstep/internal/collective.h"

#include <algorithm>
#include <string>
#include <torch/csrc/distributed/c10d/Work.hpp>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace evenstep::internal {

namespace {

// Polls `work` until it completes (true), or until the deadline or
// abandon() ends the wait (false, with why in *error).
bool PollUntilDone(c10d::Work* work, absl::Duration timeout, const std::function<bool()>& abandon,
                   std::string* error) {
  const absl::Time deadline = absl::Now() + timeout;
  absl::Time next_ask = absl::Now() + absl::Milliseconds(100);
  absl::Duration nap = absl::Microseconds(20);
  while (!work->isCompleted()) {
    const absl::Time now = absl::Now();
    if (now >= deadline) {
      *error =
          absl::StrCat("timed out after ", absl::FormatDuration(timeout), " (evenstep's wait)");
      return false;
    }
    if (now >= next_ask) {
      if (abandon()) {
        *error = kAbandonedWait;
        return false;
      }
      next_ask = now + absl::Milliseconds(100);
    }
    absl::SleepFor(nap);
    nap = std::min(nap * 2, absl::Milliseconds(2));
  }
  return true;
}

}  // namespace

CollectiveWait WaitCollective(c10d::Work* work, absl::Duration timeout, absl::Time since,
                              const std::function<bool()>& abandon) {
  if (work == nullptr) return {};
  if (abandon) {
    std::string error;
    if (!PollUntilDone(work, timeout, abandon, &error)) {
      return {true, std::move(error), absl::Now() - since};
    }
  }
  try {
    work->wait(ToChronoMillis(timeout));
  } catch (const std::exception& e) {
    return {true, ErrorText(e), absl::Now() - since};
  }
  return {false, "", absl::Now() - since};
}

// Gloo words its own deadline in several ways ("Timed out waiting ... for
// recv", "Application timeout caused pair closure"), and may fire a moment
// before ours: each is a timeout.
bool TimedOut(absl::Duration elapsed, absl::Duration timeout, absl::string_view error) {
  return elapsed >= timeout || absl::StrContains(error, "Timed out") ||
         absl::StrContains(error, "timed out") || absl::StrContains(error, "timeout");
}

absl::Status CollectiveFailed(int rank, absl::string_view what, const CollectiveWait& outcome,
                              absl::Duration timeout) {
  const std::string message =
      absl::StrCat("rank ", rank, ": ", what, " failed after ",
                   absl::FormatDuration(absl::Trunc(outcome.elapsed, absl::Milliseconds(1))), ": ",
                   outcome.error);
  return TimedOut(outcome.elapsed, timeout, outcome.error) ? absl::DeadlineExceededError(message)
                                                           : absl::UnavailableError(message);
}

}  // namespace evenstep::internal

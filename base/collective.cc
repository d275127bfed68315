#include "evenstep/internal/collective.h"

#include <torch/csrc/distributed/c10d/Work.hpp>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace evenstep::internal {

CollectiveWait WaitCollective(c10d::Work* work, absl::Duration timeout, absl::Time since) {
  if (work == nullptr) return {};
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

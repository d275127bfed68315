#include "evenstep/internal/collective.h"

#include <torch/csrc/distributed/c10d/Work.hpp>

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

absl::Status CollectiveFailed(int rank, absl::string_view what, const CollectiveWait& outcome,
                              absl::Duration timeout) {
  const std::string message =
      absl::StrCat("rank ", rank, ": ", what, " failed after ",
                   absl::FormatDuration(absl::Trunc(outcome.elapsed, absl::Milliseconds(1))), ": ",
                   outcome.error);
  return outcome.elapsed >= timeout ? absl::DeadlineExceededError(message)
                                    : absl::UnavailableError(message);
}

}  // namespace evenstep::internal

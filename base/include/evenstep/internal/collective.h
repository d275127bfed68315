// Waiting for a c10d collective with a deadline: the one way hooks/
// (GradSync) and lib/distributed/ (DistContext) start a collective, wait for it and
// turn what c10d throws into one line. Callers build their own status from
// the outcome (DistContext names the ranks that never arrived; GradSync may
// hand the outcome to that diagnosis). Stateless.
#pragma once

#include <chrono>
#include <functional>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "evenstep/internal/error_text.h"

namespace c10d {
class Work;
}

namespace evenstep::internal {

// c10d's timeouts. absl::InfiniteDuration() becomes the largest count.
inline std::chrono::milliseconds ToChronoMillis(absl::Duration d) {
  return std::chrono::milliseconds(absl::ToInt64Milliseconds(d));
}

// What a collective came to.
struct CollectiveWait {
  bool failed = false;
  std::string error;       // ErrorText of what c10d threw (launching or waiting)
  absl::Duration elapsed;  // from the start (launch, or the `since` given) to the end of the wait
};

// Waits up to `timeout` for `work` (nothing to wait for when null).
//
// With `abandon` (a rank that may go on after a lost peer), the wait polls
// the work instead of blocking in it, and asks abandon() every 100 ms: when
// it says true (a peer began regrouping, DistContext::Regroup), the wait
// ends as failed with kAbandonedWait in its error, leaving the collective to
// c10d (its group is not used again). Polling adds up to 2 ms to a wait.
CollectiveWait WaitCollective(c10d::Work* work, absl::Duration timeout,
                              absl::Time since = absl::Now(),
                              const std::function<bool()>& abandon = nullptr);

// In a wait's error: it was abandoned (see WaitCollective).
inline constexpr char kAbandonedWait[] =
    "abandoned: another rank began regrouping after a lost rank";

// Starts a collective with launch() (returns its c10::intrusive_ptr<Work>;
// may throw) and waits up to `timeout` for it.
template <typename Launch>
CollectiveWait RunCollective(Launch&& launch, absl::Duration timeout,
                             const std::function<bool()>& abandon = nullptr) {
  const absl::Time start = absl::Now();
  try {
    auto work = launch();
    return WaitCollective(work.get(), timeout, start, abandon);
  } catch (const std::exception& e) {
    return {true, ErrorText(e), absl::Now() - start};
  }
}

// A collective that failed by its deadline: the wait took the whole
// timeout, or c10d/Gloo says it timed out (its own clock may have started
// before the wait was measured from: a bucket launched during backward).
bool TimedOut(absl::Duration elapsed, absl::Duration timeout, absl::string_view error);

// The plain status of a failed collective: "rank R: WHAT failed after T:
// ERROR", DeadlineExceeded when the wait took the whole timeout (a peer
// never came), Unavailable otherwise (a peer's connection broke).
absl::Status CollectiveFailed(int rank, absl::string_view what, const CollectiveWait& outcome,
                              absl::Duration timeout);

}  // namespace evenstep::internal

// MicroStepClock: times one optimizer step's micro-steps for the cost model
// without stalling the device between them.
//
// Marks, in order: Begin() when the step starts; per micro-step, Start() when
// its data is ready and End() when its backward has returned; on a
// micro-step whose backward synchronises (the last one of each model part)
// also Arrive() when backward has produced every gradient (the arrival at
// the gradient sync, before its wait); Resume() between micro-steps when
// the time since the previous End (a part's optimizer step) is no data
// wait. Read() then gives, per micro-step,
//     data    = Start_k - (Resume before k, else End_{k-1}; End_{-1} = Begin)
//     compute = End_k - Start_k            (synchronising: Arrive_k - Start_k)
//     sync    = sum of End_k - Arrive_k    (over the synchronising ones)
// On the CPU the marks are host times. On a device whose events can measure
// elapsed time (CUDA with libtorch 2.x) each mark is a timing event on the
// device's current stream, read once at the end of the step: the host keeps
// queueing the next micro-step while the device runs this one, and `data` is
// the time the device sat idle waiting for it (a load hidden behind the
// previous micro-step's kernels costs nothing, as it should). Where events
// cannot (libtorch 1.13's c10::Event has no elapsed-time query), every mark
// synchronises the current stream and reads the host clock.
//
// Thread-safety: one thread at a time (Arrive() may come from the autograd
// engine's callback while the training thread is blocked in backward).
#pragma once

#include <c10/core/Device.h>

#include <functional>
#include <memory>
#include <vector>

#include "absl/time/time.h"

namespace evenstep {
namespace internal {

struct MicroStepTimes {
  std::vector<absl::Duration> data, compute;
  absl::Duration sync;  // the waits for the gradient syncs
};

class MicroStepClock {
 public:
  // `now` replaces the host clock on the CPU (for tests); null = absl::Now.
  explicit MicroStepClock(c10::Device device, std::function<absl::Time()> now = nullptr);
  ~MicroStepClock();

  void Begin();
  void Start();
  void Arrive();
  void End();
  void Resume();
  // Blocks until every mark has completed. Micro-steps without an End() are
  // left out; a micro-step without Arrive() has no sync part. Throws
  // what the device's event API throws.
  MicroStepTimes Read();
  // Whether marks are device events read at the end of the step.
  bool deferred() const;
  // Host time of Begin().
  absl::Time begun() const;

 private:
  struct Mark;
  Mark Take();
  static absl::Duration Between(const Mark& from, const Mark& to);

  c10::Device device_;
  std::function<absl::Time()> now_;
  struct Marks;
  std::unique_ptr<Marks> marks_;
};

}  // namespace internal
}  // namespace evenstep

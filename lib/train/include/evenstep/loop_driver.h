// LoopDriver: runs a loop-shaped epoch's steps (Session::Batches) on a stack
// of their own, so that the trainer's `for` loop keeps its body: the steps
// run as usual (Session::Step with a Loader), and each micro-batch's loss
// callback hands the loaded data to the loop and waits for the loss the
// loop passes to Session::Backward. Both sides run on the calling thread,
// one at a time (Boost.Context switches between them); nothing here is
// concurrent.
#pragma once

#include <functional>
#include <memory>
#include <string>

#include "absl/status/status.h"

namespace at {
class Tensor;
}

namespace evenstep::internal {

class LoopDriver {
 public:
  // `give(data)` hands a micro-batch to the loop and returns its loss (the
  // first part's); `give(nullptr)` resumes the loop's body on the same
  // micro-batch and returns its next part's loss; `boundary()` pauses after
  // a step (the loop's code after it runs) and returns false when the loop
  // has left.
  using Give = std::function<at::Tensor(void* data)>;
  using Boundary = std::function<bool()>;
  using Run = std::function<absl::Status(const Give& give, const Boundary& boundary)>;

  // `parts`: the losses the body passes to Backward per micro-batch (one
  // per model part), for the messages that name a body that passed fewer.
  explicit LoopDriver(Run run, int parts = 1);
  // Ends the run if the loop left it early (a `break`, an exception): an
  // open step is abandoned on every rank, naming `why` (see Abort).
  ~LoopDriver();
  LoopDriver(const LoopDriver&) = delete;
  LoopDriver& operator=(const LoopDriver&) = delete;

  // The next micro-batch's data (the Loader's Data), or nullptr when the
  // run has ended (status() says how). A micro-batch whose loss the loop
  // did not pass to Backward abandons its step on every rank.
  void* Next();
  // The current micro-batch's loss (its mean or sum, as the objective
  // says; with several parts, the next part's). Runs its backward (and,
  // after the step's last micro-batch, the part's sync and optimizer step,
  // and after the last part's, the exchange) before it returns.
  void Backward(const at::Tensor& loss);
  // The loop left: an open step is abandoned on every rank naming `why`;
  // between steps the run just ends.
  void Abort(const std::string& why);
  // Right after Backward of a step's last micro-batch: the step is done.
  bool at_boundary() const;
  bool done() const;
  // How the run ended: OK, the step's error, or a misuse of Backward.
  absl::Status status() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace evenstep::internal

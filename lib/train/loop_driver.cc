// The loop-shaped form's two stacks (see loop_driver.h).
#include "evenstep/loop_driver.h"

#include <ATen/ATen.h>

#include <boost/context/fiber.hpp>
#include <boost/context/protected_fixedsize_stack.hpp>
#include <stdexcept>
#include <utility>

#include "absl/strings/str_cat.h"

namespace evenstep::internal {

namespace ctx = boost::context;

// The engine's stack: it runs backward passes (autograd on the calling
// thread for CPU tensors) and the step's collectives; a thread's default.
constexpr size_t kEngineStack = 8 << 20;

struct LoopDriver::Impl {
  Run run;
  int parts = 1;
  ctx::fiber engine;  // suspended engine side (on the loop's stack)
  ctx::fiber loop;    // suspended loop side (on the engine's stack)
  bool started = false, done = false;
  void* handed = nullptr;  // the micro-batch the body has (or is given next)
  bool consumed = false;   // ... handed to the loop by Next
  int backwards = 0;       // ... losses the loop passed for it
  bool waiting = false;    // the engine waits for a loss (in Give)
  bool boundary = false;   // the engine paused after a step
  at::Tensor loss;
  std::string abort;        // the engine's give() throws this
  bool stop = false;        // the engine's boundary() returns false
  int64_t micro_batch = 0;  // handed in this run (for messages)
  absl::Status status;

  void Resume() {
    if (!started) {
      started = true;
      engine =
          ctx::fiber(std::allocator_arg, ctx::protected_fixedsize_stack(kEngineStack),
                     [this](ctx::fiber&& from) {
                       loop = std::move(from);
                       absl::Status s;
                       try {
                         s = run([this](void* d) { return Give(d); }, [this] { return Pause(); });
                       } catch (const std::exception& e) {
                         s = absl::InternalError(e.what());
                       } catch (...) {
                         s = absl::InternalError("an unknown exception in a loop-shaped step");
                       }
                       if (status.ok()) status = s;
                       done = true;
                       handed = nullptr;
                       return std::move(loop);
                     });
    }
    engine = std::move(engine).resume();
  }
  // On the engine's stack: `data` is a new micro-batch, or null for the
  // current one's next part.
  at::Tensor Give(void* data) {
    if (data != nullptr) {
      handed = data;
      consumed = false;
      backwards = 0;
      ++micro_batch;
    }
    boundary = false;
    waiting = true;
    loop = std::move(loop).resume();
    waiting = false;
    if (!abort.empty()) {
      std::string why = std::move(abort);
      abort.clear();
      throw std::runtime_error(why);
    }
    return std::move(loss);
  }
  bool Pause() {
    handed = nullptr;
    boundary = true;
    loop = std::move(loop).resume();
    boundary = false;
    return !stop;
  }
};

LoopDriver::LoopDriver(Run run, int parts) : impl_(std::make_unique<Impl>()) {
  impl_->run = std::move(run);
  impl_->parts = parts;
}

LoopDriver::~LoopDriver() {
  // The engine's stack must not be dropped in the middle of a step.
  Abort("the loop over Session::Batches was left");
}

void* LoopDriver::Next() {
  Impl& d = *impl_;
  for (;;) {
    if (d.done) return nullptr;
    if (d.handed != nullptr && !d.consumed) {
      d.consumed = true;
      return d.handed;
    }
    if (d.waiting && d.consumed) {
      // The engine still waits for a loss of the micro-batch the body had.
      d.abort =
          d.backwards == 0
              ? absl::StrCat("the loop's body did not call Session::Backward for micro-batch ",
                             d.micro_batch,
                             " of this run (a `continue` that skips a batch?); every micro-batch "
                             "evenstep hands out is part of the global batch")
              : absl::StrCat("the loop's body called Session::Backward ", d.backwards,
                             " time(s) for micro-batch ", d.micro_batch,
                             " of this run, but the "
                             "Session has ",
                             d.parts,
                             " model parts: call it once per part, in "
                             "the parts' order, with that part's loss");
    }
    d.Resume();
  }
}

void LoopDriver::Backward(const at::Tensor& loss) {
  Impl& d = *impl_;
  if (d.done) return;
  if (!d.waiting || !d.consumed) {
    // The current micro-batch's losses were passed already (the engine
    // holds the next one, or ended the step).
    const std::string why =
        d.parts == 1 ? std::string("Session::Backward called twice for one micro-batch")
                     : absl::StrCat("Session::Backward called more than once per model part (",
                                    d.parts, ") for one micro-batch");
    if (!d.waiting && d.status.ok()) d.status = absl::FailedPreconditionError(why);
    Abort(why);  // mid-step: abandoned on every rank, naming it
    return;
  }
  d.loss = loss;
  ++d.backwards;
  d.Resume();
}

void LoopDriver::Abort(const std::string& why) {
  Impl& d = *impl_;
  if (!d.started || d.done) return;
  if (d.waiting) {
    d.abort = why;
  } else {
    d.stop = true;
  }
  while (!d.done) d.Resume();
}

bool LoopDriver::at_boundary() const { return impl_->boundary; }
bool LoopDriver::done() const { return impl_->done; }
absl::Status LoopDriver::status() const { return impl_->status; }

}  // namespace evenstep::internal

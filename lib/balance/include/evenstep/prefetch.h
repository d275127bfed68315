// Prefetching micro-batches on worker threads.
//
// WorkerPool: a fixed set of threads that run jobs in submission order.
// Prefetcher<Data>: loads items 0..n-1 with `load(i)` on a pool, at most
// `depth` items ahead of the consumer, and hands them out in order with
// Take(i), whatever the number of workers and whichever finishes first: the
// result is the same as loading on the consumer's thread, as long as
// `load(i)` depends only on i (and is safe to call from several threads at
// once). An exception from `load(i)` comes back from Take(i) as a status
// with its message (one line, no backtrace); items after it are still
// loaded. Memory: at most `depth` loaded items wait in the Prefetcher, plus
// the one the consumer holds.
//
// BalancedStep::Step uses it when --evenstep_data_workers > 0.
// Thread-safety: one consumer thread per Prefetcher; a WorkerPool is shared.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"

namespace evenstep {

class WorkerPool {
 public:
  // `threads` >= 1.
  explicit WorkerPool(int threads);
  // Runs the jobs already submitted, then joins the threads.
  ~WorkerPool();
  WorkerPool(const WorkerPool&) = delete;
  WorkerPool& operator=(const WorkerPool&) = delete;

  void Submit(std::function<void()> job);
  int size() const { return static_cast<int>(threads_.size()); }

 private:
  void Run();
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> jobs_;
  bool stop_ = false;
  std::vector<std::thread> threads_;
};

namespace prefetch_internal {
// One line for an exception (c10::Error without its backtrace).
std::string Describe(const std::exception& e);
}  // namespace prefetch_internal

template <typename Data>
class Prefetcher {
 public:
  Prefetcher(WorkerPool& pool, int depth, size_t n, std::function<Data(size_t)> load)
      : pool_(pool),
        depth_(depth < 1 ? 1 : static_cast<size_t>(depth)),
        state_(std::make_shared<State>()) {
    state_->load = std::move(load);
    state_->slots.resize(n);
    for (size_t i = 0; i < n && i < depth_; ++i) Submit(i);
  }
  // Jobs not started are skipped; running ones are waited for (they use
  // `load`, which may refer to the caller's stack).
  ~Prefetcher() {
    std::unique_lock<std::mutex> lock(state_->mu);
    state_->cancelled = true;
    state_->cv.wait(lock, [&] { return state_->running == 0; });
  }
  Prefetcher(const Prefetcher&) = delete;
  Prefetcher& operator=(const Prefetcher&) = delete;

  // Item i (the next one: 0, 1, ... in order): waits for its load and
  // starts loading item i + depth.
  absl::StatusOr<Data> Take(size_t i) {
    if (i != next_ || i >= state_->slots.size()) {
      return absl::FailedPreconditionError(absl::StrCat("Prefetcher: Take(", i, ") out of order (",
                                                        "next ", next_, " of ",
                                                        state_->slots.size(), ")"));
    }
    ++next_;
    if (i + depth_ < state_->slots.size()) Submit(i + depth_);
    std::unique_lock<std::mutex> lock(state_->mu);
    state_->cv.wait(lock, [&] { return state_->slots[i].has_value(); });
    absl::StatusOr<Data> out = std::move(*state_->slots[i]);
    state_->slots[i].reset();
    return out;
  }

 private:
  struct State {
    std::mutex mu;
    std::condition_variable cv;
    std::function<Data(size_t)> load;
    std::vector<std::optional<absl::StatusOr<Data>>> slots;
    bool cancelled = false;
    int running = 0;
  };

  void Submit(size_t i) {
    {
      std::lock_guard<std::mutex> lock(state_->mu);
      ++state_->running;
    }
    pool_.Submit([state = state_, i] {
      std::optional<absl::StatusOr<Data>> result;
      bool cancelled;
      {
        std::lock_guard<std::mutex> lock(state->mu);
        cancelled = state->cancelled;
      }
      if (!cancelled) {
        try {
          result.emplace(state->load(i));
        } catch (const std::exception& e) {
          result.emplace(absl::InternalError(prefetch_internal::Describe(e)));
        } catch (...) {
          result.emplace(absl::InternalError("an exception that is no std::exception"));
        }
      }
      std::lock_guard<std::mutex> lock(state->mu);
      if (result) state->slots[i] = std::move(result);
      --state->running;
      state->cv.notify_all();
    });
  }

  WorkerPool& pool_;
  const size_t depth_;
  std::shared_ptr<State> state_;
  size_t next_ = 0;
};

}  // namespace evenstep

// IoRuntime: a Boost.Fiber scheduler thread plus a pool of blocking-I/O
// threads, connected by fiber-aware channels.
#include "evenstep/io_runtime.h"

#include <boost/fiber/all.hpp>
#include <exception>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "evenstep/internal/error_text.h"

namespace evenstep {

namespace {
constexpr size_t kFiberStack = 1 << 20;
}  // namespace

struct IoRuntime::Impl {
  using Task = std::function<void()>;
  boost::fibers::buffered_channel<Task> fibers{64};
  boost::fibers::buffered_channel<Task> blocking{64};
  std::thread scheduler;
  std::vector<std::thread> workers;

  explicit Impl(int io_threads) {
    for (int i = 0; i < std::max(io_threads, 1); ++i) {
      workers.emplace_back([this] {
        Task call;
        while (blocking.pop(call) == boost::fibers::channel_op_status::success) call();
      });
    }
    scheduler = std::thread([this] {
      std::vector<boost::fibers::fiber> running;
      Task task;
      while (fibers.pop(task) == boost::fibers::channel_op_status::success) {
        // 1 MiB stacks with a guard page: manifests are built in fibers, and
        // an overflow must fault, not corrupt a neighbour.
        running.emplace_back(std::allocator_arg,
                             boost::fibers::protected_fixedsize_stack(kFiberStack),
                             std::move(task));
      }
      for (auto& f : running) f.join();
    });
  }
  ~Impl() {
    fibers.close();
    scheduler.join();
    blocking.close();
    for (auto& w : workers) w.join();
  }
};

IoRuntime::IoRuntime(int io_threads) : impl_(std::make_unique<Impl>(io_threads)) {}
IoRuntime::~IoRuntime() = default;

namespace {

absl::Status Guarded(const std::function<absl::Status()>& f) {
  try {
    return f();
  } catch (const std::exception& e) {
    return absl::InternalError(absl::StrCat("I/O task threw: ", internal::ErrorText(e)));
  }
}

}  // namespace

std::future<absl::Status> IoRuntime::Spawn(std::function<absl::Status()> task) {
  auto promise = std::make_shared<std::promise<absl::Status>>();
  std::future<absl::Status> future = promise->get_future();
  const auto status =
      impl_->fibers.push([promise, task = std::move(task)] { promise->set_value(Guarded(task)); });
  if (status != boost::fibers::channel_op_status::success) {
    std::promise<absl::Status> closed;
    closed.set_value(absl::FailedPreconditionError("IoRuntime is shutting down"));
    return closed.get_future();
  }
  return future;
}

absl::Status IoRuntime::Blocking(std::function<absl::Status()> call) {
  // The promise is shared with the worker: it must outlive set_value's
  // notification even after this fiber has woken up and returned.
  auto promise = std::make_shared<boost::fibers::promise<absl::Status>>();
  boost::fibers::future<absl::Status> future = promise->get_future();
  const auto status = impl_->blocking.push(
      [promise, call = std::move(call)] { promise->set_value(Guarded(call)); });
  if (status != boost::fibers::channel_op_status::success) {
    return absl::FailedPreconditionError("IoRuntime is shutting down");
  }
  return future.get();  // suspends this fiber only
}

}  // namespace evenstep

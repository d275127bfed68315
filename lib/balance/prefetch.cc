#include "evenstep/prefetch.h"

#include "evenstep/internal/error_text.h"

namespace evenstep {

WorkerPool::WorkerPool(int threads) {
  for (int t = 0; t < (threads < 1 ? 1 : threads); ++t) threads_.emplace_back([this] { Run(); });
}

WorkerPool::~WorkerPool() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  for (std::thread& t : threads_) t.join();
}

void WorkerPool::Submit(std::function<void()> job) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    jobs_.push_back(std::move(job));
  }
  cv_.notify_one();
}

void WorkerPool::Run() {
  for (;;) {
    std::function<void()> job;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return stop_ || !jobs_.empty(); });
      if (jobs_.empty()) return;  // stopping, and nothing left to run
      job = std::move(jobs_.front());
      jobs_.pop_front();
    }
    job();
  }
}

namespace prefetch_internal {
std::string Describe(const std::exception& e) { return internal::ErrorText(e); }
}  // namespace prefetch_internal

}  // namespace evenstep

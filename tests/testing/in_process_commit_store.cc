#include "tests/testing/in_process_commit_store.h"

#include <chrono>

namespace evenstep::testing {

absl::Status InProcessCommitStore::Set(const std::string& key, const std::string& value) {
  std::lock_guard<std::mutex> lock(mu_);
  values_[key] = value;
  cv_.notify_all();
  return absl::OkStatus();
}

absl::StatusOr<std::string> InProcessCommitStore::Get(const std::string& key) {
  std::unique_lock<std::mutex> lock(mu_);
  if (!cv_.wait_for(lock, std::chrono::seconds(60), [&] { return values_.count(key) > 0; })) {
    return absl::DeadlineExceededError("commit store: no value for " + key);
  }
  return values_[key];
}

absl::StatusOr<int64_t> InProcessCommitStore::Add(const std::string& key, int64_t delta) {
  std::lock_guard<std::mutex> lock(mu_);
  return counters_[key] += delta;
}

}  // namespace evenstep::testing

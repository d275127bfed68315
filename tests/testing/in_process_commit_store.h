// A CommitStore for ranks that are threads of one test process (the
// checkpoint protocol tests without processes): values and counters in a
// map, Get waits up to 60 s for a key. Thread-safe.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>

#include "evenstep/checkpoint_writer.h"

namespace evenstep::testing {

class InProcessCommitStore : public CommitStore {
 public:
  absl::Status Set(const std::string& key, const std::string& value) override;
  absl::StatusOr<std::string> Get(const std::string& key) override;
  absl::StatusOr<int64_t> Add(const std::string& key, int64_t delta) override;

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::map<std::string, std::string> values_;
  std::map<std::string, int64_t> counters_;
};

}  // namespace evenstep::testing

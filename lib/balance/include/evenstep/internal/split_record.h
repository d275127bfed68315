// The split record: what decided each step's split of the global batch
// across ranks and into micro-batches (the plan: shares, fits, predicted
// times; this rank's memory cap), one JSON line per step in a file per rank,
// so that a rerun can replay a dynamic-balance run's splits bit for bit
// (BalanceConfig::split_record / split_replay).
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "evenstep/planner.h"
#include "evenstep/sampler.h"

namespace evenstep::internal {

struct SplitRecord {
  int64_t step = 0;  // 1-based optimizer step
  // The global batch the plan split (a replay checks it is the same).
  int64_t epoch = 0;
  int64_t batch_step = 0;
  int64_t batch_samples = 0;
  uint64_t batch_hash = 0;
  Plan plan;
  int64_t memory_cap = 0;  // this rank's cap on a micro-batch's padded tokens (0 = none)
};

// The record of `plan` splitting `batch` at `step`.
SplitRecord RecordOf(int64_t step, const GlobalBatch& batch, const Plan& plan, int64_t memory_cap);

// One line (no newline) and back; doubles round-trip exactly.
std::string SplitRecordLine(const SplitRecord& record);

// A rank's record file: the latest line of each step (a resumed run records
// the steps after its checkpoint again). NotFound naming the file when it
// does not exist; InvalidArgument naming the file and line for a bad line
// or a plan for another number of ranks than `world_size`.
absl::StatusOr<std::map<int64_t, SplitRecord>> ReadSplitRecord(const std::string& path,
                                                               int world_size);

// Appends lines to a rank's record file, one write(2) per line (a killed run
// loses no recorded step).
class SplitRecorder {
 public:
  static absl::StatusOr<std::unique_ptr<SplitRecorder>> Open(const std::string& path);
  ~SplitRecorder();
  absl::Status Append(const SplitRecord& record);

 private:
  SplitRecorder(std::string path, int fd) : path_(std::move(path)), fd_(fd) {}
  std::string path_;
  int fd_ = -1;
};

// Rank `rank`'s record file in `dir`: DIR/rank-RRRRR.jsonl.
std::string SplitRecordFile(const std::string& dir, int rank);

}  // namespace evenstep::internal

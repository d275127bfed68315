// What BalancedStep's source files share (not installed).
#pragma once

#include <torch/nn/module.h>

#include <map>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "evenstep/balanced_step.h"
#include "evenstep/internal/split_record.h"

namespace evenstep {

// The split record being written, or replayed (--evenstep_split_record,
// --evenstep_replay).
struct BalancedStep::SplitLog {
  std::unique_ptr<internal::SplitRecorder> recorder;  // null: not recording
  std::string replay_file;                            // "": not replaying
  std::map<int64_t, internal::SplitRecord> replay;
  absl::Status error;  // the first failure, returned by the next BeginStep

  // Replaces `plan` and `cap` by the record's for `step` of `batch`.
  absl::Status Replay(int64_t step, const GlobalBatch& batch, Plan* plan, int64_t* cap) const {
    auto it = replay.find(step);
    if (it == replay.end()) {
      return absl::OutOfRangeError(absl::StrCat(
          "step ", step, ": the split record ", replay_file, " has no such step (it holds ",
          replay.empty()
              ? std::string("none")
              : absl::StrCat("steps ", replay.begin()->first, "-", replay.rbegin()->first),
          ")"));
    }
    const internal::SplitRecord& r = it->second;
    const internal::SplitRecord now = internal::RecordOf(step, batch, *plan, *cap);
    if (r.epoch != now.epoch || r.batch_step != now.batch_step ||
        r.batch_samples != now.batch_samples || r.batch_hash != now.batch_hash) {
      return absl::FailedPreconditionError(absl::StrCat(
          "step ", step, ": the global batch (epoch ", now.epoch, ", step ", now.batch_step, ", ",
          now.batch_samples, " samples) is not the one ", replay_file, " split (epoch ", r.epoch,
          ", step ", r.batch_step, ", ", r.batch_samples,
          " samples, or other samples): replay with the recorded run's seed, global batch and "
          "data"));
    }
    *plan = r.plan;
    *cap = r.memory_cap;
    return absl::OkStatus();
  }
};

}  // namespace evenstep

namespace evenstep::internal {

// The device the model trains on (its first parameter's; CPU without any).
inline c10::Device ModelDevice(torch::nn::Module& model) {
  for (const at::Tensor& p : model.parameters()) return p.device();
  return c10::Device(c10::kCPU);
}

}  // namespace evenstep::internal

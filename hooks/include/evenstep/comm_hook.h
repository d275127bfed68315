// Communication hooks: how one bucket of flattened gradients is reduced across
// ranks. A hook takes the bucket and returns a future of the reduced bucket
// (a ReducedBucket); GradSync waits for it at the end of backward.
//
// Built-ins (SUM is the default: exact weighting is done by loss scaling):
//   SumHook()           all_reduce SUM
//   AvgHook()           all_reduce SUM, then divide by the world size
//   Fp16CompressHook()  divide by the world size, cast to fp16, all_reduce,
//                       cast back, multiply by the world size (an approximate SUM)
//   Bf16CompressHook()  the same in bf16. Gloo cannot reduce bf16, so on Gloo
//                       the bf16 payloads are all-gathered and summed locally
//                       in fp32 (same bytes on the wire for 2 ranks, more for
//                       larger worlds); NCCL reduces bf16 natively.
// A user hook is any callable with the CommHook signature.
//
// Thread-safety: hooks are called from the autograd thread, one bucket at a
// time, in bucket order; they must not block on the collective they start.
#pragma once

#include <ATen/ATen.h>

#include <chrono>
#include <functional>
#include <string>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace evenstep {

// A future of a reduced bucket: pending c10d work plus the step that turns its
// output into the reduced bucket.
class ReducedBucket {
 public:
  ReducedBucket() = default;
  // `finish` runs after `work` completed and returns the reduced bucket.
  ReducedBucket(c10::intrusive_ptr<c10d::Work> work, std::function<at::Tensor()> finish);
  // An already reduced bucket (e.g. a world of one).
  static ReducedBucket Ready(at::Tensor value);
  // `inner` followed by `fn` on its result: for hooks built on other hooks.
  static ReducedBucket Then(ReducedBucket inner, std::function<at::Tensor(at::Tensor)> fn);

  bool valid() const { return finish_ != nullptr; }
  // Blocks until the reduction is done and returns it. Throws what c10d
  // throws when the collective fails or `timeout` passes.
  at::Tensor Wait(std::chrono::milliseconds timeout);

 private:
  c10::intrusive_ptr<c10d::Work> work_;
  std::function<at::Tensor()> finish_;
};

struct CommHookContext {
  c10d::ProcessGroup* group = nullptr;
  int rank = 0;
  int world_size = 1;
  int bucket_index = 0;
};

// `bucket` is the flat, contiguous gradient buffer of one bucket; the hook
// may modify it in place or return another tensor of the same shape and dtype.
using CommHook = std::function<ReducedBucket(const CommHookContext&, at::Tensor& bucket)>;

CommHook SumHook();
CommHook AvgHook();
CommHook Fp16CompressHook();
CommHook Bf16CompressHook();

// "sum", "avg", "fp16" or "bf16". InvalidArgument naming --evenstep_comm_hook
// otherwise.
absl::StatusOr<CommHook> CommHookByName(absl::string_view name);

}  // namespace evenstep

// Communication hooks: how one bucket of flattened gradients is reduced across
// ranks. A hook takes the bucket and returns a future of the reduced bucket
// (a BucketFuture); GradSync waits for it at the end of backward.
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
#include <memory>
#include <string>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace evenstep {

// A future of a reduced bucket: pending c10d work plus the step that turns its
// output into the reduced bucket.
class BucketFuture {
 public:
  BucketFuture() = default;
  // `finish` runs after `work` completed and returns the reduced bucket.
  BucketFuture(c10::intrusive_ptr<c10d::Work> work, std::function<at::Tensor()> finish);
  // An already reduced bucket (e.g. a world of one).
  static BucketFuture Ready(at::Tensor value);
  // `inner` followed by `fn` on its result: for hooks built on other hooks.
  static BucketFuture Then(BucketFuture inner, std::function<at::Tensor(at::Tensor)> fn);

  bool valid() const { return finish_ != nullptr; }
  // Blocks until the reduction is done and returns it. Throws what c10d
  // throws when the collective fails or `timeout` passes.
  at::Tensor Wait(std::chrono::milliseconds timeout);
  // The same, polling: `abandon()` (asked every 100 ms) ends the wait by
  // throwing (internal::WaitCollective's abandon).
  at::Tensor Wait(std::chrono::milliseconds timeout, const std::function<bool()>& abandon);

 private:
  c10::intrusive_ptr<c10d::Work> work_;
  std::function<at::Tensor()> finish_;
};

// One gradient inside a bucket (what DDP's GradBucket gives a hook).
struct BucketParam {
  std::string name;
  int64_t offset = 0;  // first element in the bucket
  int64_t numel = 0;
  std::vector<int64_t> sizes;
};

struct CommHookContext {
  c10d::ProcessGroup* group = nullptr;
  int rank = 0;
  int world_size = 1;
  int bucket_index = 0;
  int num_buckets = 1;
  bool is_last = false;  // the last bucket of this synchronisation
  // The bucket's gradients in bucket order; valid during the call.
  const std::vector<BucketParam>* params = nullptr;
  // This synchronisation's number (from 1), e.g. for a hook's warm-up.
  int64_t seq = 0;
};

// `bucket` is the flat, contiguous gradient buffer of one bucket; the hook
// may modify it in place or return another tensor of the same shape and dtype.
// Collectives started in the hook, and in the finish step of the
// BucketFuture it returns, must be the same on every rank: GradSync waits
// for the buckets in index order, so a two-phase hook (PowerSGD) may start
// its second collective from the finish step.
using CommHook = std::function<BucketFuture(const CommHookContext&, at::Tensor& bucket)>;

CommHook SumHook();
CommHook AvgHook();
CommHook Fp16CompressHook();
CommHook Bf16CompressHook();

// PowerSGD (Vogels et al. 2019) with error feedback and warm start, as in
// PyTorch's powerSGD_hook: each gradient of a bucket with at least two
// dimensions is viewed as a matrix M (sizes[0] x rest) and, when rank <
// min(rows, cols), sent as the rank-`rank` factors P = M Q and Q = M^T P
// (two all_reduces per bucket); the rest (biases, small matrices) and the
// first `start_seq - 1` synchronisations are reduced exactly. The
// approximation error stays on each rank and is added to its next gradient.
// A SUM hook: the result approximates the exact SUM. Stateful: one hook per
// GradSync.
struct PowerSgdOptions {
  int rank = 1;
  int64_t start_seq = 1;
  uint64_t seed = 0;
};
CommHook PowerSgdHook(PowerSgdOptions options = {});

// Hierarchical reduction of each bucket (Horovod's hierarchical allreduce),
// for clusters whose link between nodes is slower than the paths inside a
// node: within the node a reduce-scatter (each of the node's L ranks sums
// 1/L of the bucket over the node's copies), across nodes `cross_node` on
// that part among the ranks with the same place in their node, within the
// node an all-gather. The result is the same SUM as one all-reduce over
// every rank (summed in another order: equal up to rounding, identical on
// every rank), and only the bucket's bytes S cross the link between two
// nodes in each direction instead of a flat ring's 2(n-1)/n S.
//
// The three phases of a bucket run on two threads of the hook, bucket after
// bucket in launch order (the within-node scatters on one, the cross-node
// reduction and the gather on the other), so they overlap with backward and
// with each other's buckets as a flat all-reduce does. Each group is used by
// one thread only, in bucket order, so every rank issues the same sequence
// on it.
struct HierarchicalGroups {
  // Within the node (L ranks; both null when L == 1): one group for the
  // scatters, another for the gathers.
  c10d::ProcessGroup* scatter = nullptr;
  c10d::ProcessGroup* gather = nullptr;
  int local_rank = 0;
  int local_size = 1;
  // Across nodes: the ranks with this rank's place in their node (null when
  // there is one node).
  c10d::ProcessGroup* across = nullptr;
  int node = 0;
  int nodes = 1;
  // Longest each phase may take.
  absl::Duration timeout = absl::Minutes(10);
  // Keeps the groups alive as long as any copy of the hook.
  std::shared_ptr<void> owner;
};

// `cross_node` must be a built-in hook other than powersgd (sum, avg, fp16
// or bf16: they work element by element, so they apply to a part of a
// bucket; avg divides the SUM by the whole world). InvalidArgument
// otherwise, saying why.
absl::StatusOr<CommHook> HierarchicalHook(HierarchicalGroups groups, CommHook cross_node);

// "sum", "avg", "fp16", "bf16" or "powersgd" (rank 1). InvalidArgument naming --evenstep_comm_hook
// otherwise.
absl::StatusOr<CommHook> CommHookByName(absl::string_view name);

namespace internal {
// True for the built-in hooks whose result keeps zeros exactly zero and
// non-negative values positive (sum, avg, fp16, bf16): GradSync then carries
// its per-synchronisation bitmap in the last bucket instead of a separate
// collective.
bool IsZeroPreservingHook(const CommHook& hook);
// True for the hooks HierarchicalHook accepts as its cross-node part.
bool IsElementwiseHook(const CommHook& hook);
}  // namespace internal

}  // namespace evenstep

// GradSync: DDP-style gradient synchronisation for libtorch, which has no
// DistributedDataParallel module.
//
//   auto sync = evenstep::GradSync::Attach(model, ctx.data_group());  // checks + broadcast
//   for (int m = 0; m < micro_steps; ++m) {
//     (*sync)->set_sync_enabled(m == micro_steps - 1);   // local accumulation until the last
//     loss_of(m).backward();                            // last one: buckets reduce while
//   }                                                   // backward runs
//   if (micro_steps == 0) (*sync)->SyncNow();           // a rank without work joins with zeros
//   optimizer.step();
//
// Parameters are grouped in reverse registration order into buckets of at
// most `bucket_cap_bytes` (the first `first_bucket_cap_bytes`); one parameter
// larger than the cap gets a bucket of its own. A post hook on each
// parameter's gradient accumulator copies the gradient into its bucket; when
// a bucket is complete and every earlier bucket was launched, the comm hook
// starts its collective, while backward still runs. A callback queued on the
// autograd engine waits for all buckets at the end of backward and writes the
// results into param.grad(), which afterwards share the bucket buffers' storage
// (no copy on the next step; not autograd views, so Optimizer::zero_grad works). Buckets always
// launch in index order, and parameters without a gradient count as zeros, so
// every rank issues the same collectives in the same order.
//
// Failure: Attach returns a status; a failed collective during backward makes
// backward() throw (std::runtime_error with the status text) and is kept in
// status(); SyncNow returns it.
// Thread-safety: one training thread drives a GradSync; the hooks it installs
// synchronise with it internally.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "evenstep/comm_hook.h"

namespace torch::nn {
class Module;
}

namespace evenstep {

namespace internal {
struct GradSyncState;
}

// Failure diagnosis supplied by the layer that owns the process group
// (lib/'s BalancedStep wires in DistContext::MarkArrival and Diagnose, so a
// failed bucket names the ranks that never reached this synchronisation).
// `arrive` is called once per synchronisation on every rank, before its
// first bucket is launched; `diagnose(seq, what, elapsed, error)` builds the
// status of a bucket that failed. Either may be empty.
struct SyncDiagnosis {
  std::function<int64_t()> arrive;
  std::function<absl::Status(int64_t seq, const std::string& what, absl::Duration elapsed,
                             const std::string& error)>
      diagnose;
};

struct GradSyncOptions {
  // Called on a synchronising step when backward has produced every gradient,
  // before the wait for the buckets (from the autograd engine's end-of-
  // backward callback), e.g. to mark the arrival on a device timeline.
  std::function<void()> on_arrival;
  int64_t bucket_cap_bytes = 25 << 20;
  int64_t first_bucket_cap_bytes = 1 << 20;
  // Rank whose parameters and buffers every replica starts from.
  int broadcast_root = 0;
  bool broadcast_buffers = true;
  // Longest a bucket's reduction may take.
  absl::Duration timeout = absl::Minutes(10);
  CommHook comm_hook = SumHook();
  SyncDiagnosis diagnosis;
};

// What the last synchronisation did (for the timeline and the tests).
struct SyncStats {
  int buckets = 0;
  // Buckets whose collective started from a gradient hook, i.e. before
  // backward had produced every gradient.
  int buckets_launched_during_backward = 0;
  int64_t bytes = 0;
  absl::Time arrived;   // end of backward: arrival at the sync
  absl::Time done;      // every bucket reduced and written back
  absl::Duration wait;  // time blocked waiting for the collectives
};

using NamedTensor = std::pair<std::string, at::Tensor>;

class GradSync {
 public:
  // Syncs the parameters of `module` (recursively) that require grad. Every
  // rank starts from rank `broadcast_root`'s values of all of them, of the
  // frozen parameters (requires_grad false: fingerprinted and broadcast,
  // never synced) and, with broadcast_buffers, of its buffers. Collective
  // over `group`: all ranks call it. FailedPrecondition naming the first
  // differing tensor (name, dtype, shape, device) and the ranks when the
  // replicas do not match. A requires_grad change after Attach is not seen:
  // attach again.
  static absl::StatusOr<std::unique_ptr<GradSync>> Attach(torch::nn::Module& module,
                                                          c10d::ProcessGroup& group,
                                                          GradSyncOptions options = {});
  static absl::StatusOr<std::unique_ptr<GradSync>> Attach(std::vector<NamedTensor> parameters,
                                                          std::vector<NamedTensor> buffers,
                                                          c10d::ProcessGroup& group,
                                                          GradSyncOptions options = {});
  ~GradSync();
  GradSync(const GradSync&) = delete;
  GradSync& operator=(const GradSync&) = delete;

  // When false, backward only accumulates gradients locally (no collective).
  void set_sync_enabled(bool enabled);
  bool sync_enabled() const;

  // Reduces the current local gradients now (zeros where a parameter has
  // none): for a rank with no micro-batch in a step, or after a backward run
  // with sync disabled. Issues the same collectives as a synced backward.
  absl::Status SyncNow();

  void set_comm_hook(CommHook hook);

  // The error of the last synchronisation, OK if none.
  absl::Status status() const;
  SyncStats last_stats() const;
  // Total collectives started since Attach (one per bucket per sync).
  int64_t collectives_started() const;
  int num_buckets() const;
  // Parameter names per bucket, in launch order.
  std::vector<std::vector<std::string>> bucket_layout() const;

 private:
  explicit GradSync(std::shared_ptr<internal::GradSyncState> state);
  std::shared_ptr<internal::GradSyncState> state_;
};

}  // namespace evenstep

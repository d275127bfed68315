// GradSync: DDP-style gradient synchronisation for libtorch, which has no
// DistributedDataParallel module.
//
//   auto sync = evenstep::GradSync::Attach(model, ctx.data_group());  // checks + broadcast
//   (*sync)->SetStep(step);                              // each step (required): a skipped one is
//   named for (int m = 0; m < micro_steps; ++m) {
//     (*sync)->set_sync_enabled(m == micro_steps - 1);   // local accumulation until the last
//     at::Tensor loss = loss_of(m);
//     (*sync)->PrepareForBackward(loss);                 // optional: unused parameters early
//     loss.backward();                                   // last one: buckets reduce while
//   }                                                    // backward runs
//   // An exception before the last backward: (*sync)->AbandonStep(why) (see there).
//   if (micro_steps == 0) (*sync)->SyncNow();           // a rank without work joins with zeros
//   optimizer.step();
//
// What is synchronised (PyTorch DDP's semantics unless said otherwise):
// - Attach fingerprints (name, dtype, shape, device) and broadcasts from
//   `broadcast_root` every parameter, trainable or frozen, and every buffer.
//   A Parameter registered under two names (tied weights) is one parameter,
//   reduced once, named by its first name.
// - Dense gradients are reduced in buckets: parameters grouped in reverse
//   registration order into buckets of at most `bucket_cap_bytes` (the first
//   `first_bucket_cap_bytes`; a larger parameter gets a bucket of its own).
//   After the first synchronisation the buckets are rebuilt once in the order
//   rank 0's gradients became ready (`rebuild_buckets`), so a model whose
//   layers run in another order than they were registered still overlaps.
//   A post hook on each parameter's gradient accumulator copies the gradient
//   into its bucket; a complete bucket starts its collective (in index order)
//   while backward still runs. At the end of backward param.grad() of every
//   used parameter shares its bucket's storage with the parameter's own
//   strides (channels-last and other dense layouts included; a non-dense
//   parameter gets a contiguous gradient), so the next step copies nothing.
// - bf16 and fp16 parameters on a backend other than NCCL are reduced in an
//   fp32 bucket (Gloo has no bf16 reduction); their param.grad() is a copy
//   in the parameter's dtype.
// - Sparse gradients (Embedding/EmbeddingBag with sparse(true), found
//   automatically, or names in `sparse_parameters`) are all-reduced as sparse
//   COO tensors after the dense buckets. A sparse gradient on a parameter not
//   declared sparse is an error naming it.
// - Unused parameters: a parameter counts as used on a rank when its
//   gradient accumulator ran since the last synchronisation. Every
//   synchronisation agrees, in a per-rank bitmap carried by the last bucket
//   (a separate small all_reduce under a user comm hook), which parameters
//   were used anywhere; the last bucket starts only once every parameter,
//   sparse ones included, is ready, so the bitmap is final when it is
//   reduced. A parameter unused on every rank keeps its gradient
//   untouched (undefined stays undefined, so optimizers skip it exactly as a
//   single process would); one used elsewhere counts as zeros here.
//   PrepareForBackward(loss) walks the autograd graph from the loss (DDP's
//   find_unused_parameters) so unreachable parameters are ready at once and
//   do not hold their buckets back; without it they are found at the end of
//   backward (same numbers, less overlap).
// - Buffers (BatchNorm statistics): with `buffers_from_root_every_step`
//   (default), every synchronisation also broadcasts rank 0's buffers (their
//   values after the step's forward), so the replicas' buffers never drift.
//
// - Gradients kept between synchronisations (no zero_grad, as in DDP's
//   test_ddp_ignore_params_arg and create_graph cases, or two synchronised
//   backwards in one step): a gradient that is still exactly the tensor the
//   last synchronisation wrote, unchanged (same tensor, same version), when
//   its accumulator next runs (or the next synchronisation starts) is the
//   same on every rank; each rank contributes only what was added on top and
//   the kept value is added back once, so param.grad() accumulates as in one
//   process. A gradient zeroed, reset or replaced since counts as this rank's
//   own. Not told apart: a kept gradient changed in place but not zeroed
//   (scaled, clipped) also counts as this rank's own, i.e. once per rank;
//   zero or reset it between synchronisations. Refused by name: a kept
//   gradient that a backward with sync disabled added to (and so recorded
//   as kept) and that the program then changed in place.
// - Backwards with sync disabled between synchronisations (an input-gradient
//   probe after a step, a GAN's generator loss through the discriminator):
//   what they recorded (the parameters' use, a kept copy) is forgotten when
//   the program zeroes those gradients or sets them to none before the next
//   synchronisation, as one process forgets them.
// - Sparse gradients in any layout (libtorch 1.13's zero_grad leaves one with
//   every dimension sparse and no rows) are reduced as rows of the first
//   dimension; a rank without one sends no rows.
//
// Refused, with an error naming the parameter: a requires_grad change after
// Attach (attach again); a gradient that becomes ready twice in one
// synchronisation (reentrant activation checkpointing).
//
// One GradSync per process group: c10d pairs collectives by their order on a
// group, so a second GradSync over a group another one synchronises over is
// refused at Attach (a second model gets DistContext::NewDataGroup()'s
// group). Every rank's synchronisation number rides in the control values;
// ranks found at different synchronisations (the program's own collective
// on the group shifted the pairing) end it with FailedPrecondition naming
// each rank's number, nothing applied, and the group is marked unusable for
// every component, DistContext's collectives included.
//
// Failure. A local failure (one of the refusals above, an exception thrown
// inside a synchronised backward, or one before it reported with
// AbandonStep) is carried to every rank as a failure mark in the same
// synchronisation: all ranks' synchronisation then fails with ABORTED naming
// the failed ranks, every gradient of the step is reset to undefined (never
// applied), and the next synchronisation starts clean. An exception inside a
// synchronised backward needs no help: the autograd engine drops that
// backward without running its end-of-backward callback, and GradSync then
// joins with the failure mark itself, so no rank finishes with a gradient
// that lacks this rank's part and no later backward lands in this
// synchronisation. A failed or timed-out collective is fatal: fatal_status()
// keeps it and every later synchronisation returns it without a collective.
// A failure inside a synchronised backward makes backward() throw
// std::runtime_error with the status text.
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
#include "evenstep/named_tensor.h"

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
// status of a bucket that failed. `abandon`, where set, is asked every
// 100 ms while a wait lasts; true ends the wait as failed (a peer began
// regrouping after a lost rank: DistContext::Regroup). Any may be empty.
struct SyncDiagnosis {
  std::function<int64_t()> arrive;
  std::function<absl::Status(int64_t seq, const std::string& what, absl::Duration elapsed,
                             const std::string& error)>
      diagnose;
  std::function<bool()> abandon;
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
  // Attach broadcasts them (DDP's init_sync). Off only where every rank
  // holds them already or gets them otherwise: BalancedStep turns it off
  // when a replacement joins, whose state the survivors send it sharded
  // (evenstep::HandOver) instead of all from one rank.
  bool broadcast_at_attach = true;
  // Every synchronisation also broadcasts broadcast_root's buffers (DDP's
  // broadcast_buffers=True). Off: buffers are only broadcast at Attach.
  bool buffers_from_root_every_step = true;
  // Rebuild the buckets once, after the first synchronisation, in the order
  // rank 0's gradients became ready.
  bool rebuild_buckets = true;
  // Parameters (by name) whose gradients are sparse, beside the
  // Embedding/EmbeddingBag modules with sparse(true) that Attach(module)
  // finds itself.
  std::vector<std::string> sparse_parameters;
  // Longest a bucket's reduction may take.
  absl::Duration timeout = absl::Minutes(10);
  CommHook comm_hook = SumHook();
  SyncDiagnosis diagnosis;
};

// What the last synchronisation did (for the timeline and the tests).
struct SyncStats {
  int64_t seq = 0;  // this synchronisation's number, from 1
  int buckets = 0;
  int sparse = 0;             // sparse gradients all-reduced
  int unused_everywhere = 0;  // parameters no rank used: gradient untouched
  int unused_here = 0;        // parameters this rank did not use (zeros)
  // Buckets whose collective started from a gradient hook, i.e. before
  // backward had produced every gradient.
  int buckets_launched_during_backward = 0;
  int64_t bytes = 0;
  absl::Time arrived;   // end of backward: arrival at the sync
  absl::Time done;      // every bucket reduced and written back
  absl::Duration wait;  // time blocked waiting for the collectives
};

class GradSync {
 public:
  // Syncs the gradients of the parameters of `module` (recursively) that
  // require grad. Every rank starts from rank `broadcast_root`'s values of
  // every parameter (frozen ones included: fingerprinted and broadcast,
  // never synced) and every buffer. Collective over `group`: all ranks call
  // it. FailedPrecondition naming the first differing tensor (name, dtype,
  // shape, device) and the ranks when the replicas do not match.
  // InvalidArgument naming the parameter for what cannot be synced (a
  // trainable parameter that is not a leaf, a sparse parameter tensor).
  static absl::StatusOr<std::unique_ptr<GradSync>> Attach(torch::nn::Module& module,
                                                          c10d::ProcessGroup& group,
                                                          GradSyncOptions options = {});
  // The same for explicit lists: `parameters` (trainable and frozen, by
  // requires_grad) and `buffers`.
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
  // Forgets which parameters a backward used since the last
  // synchronisation (a backward with sync disabled marks them): for a model
  // part whose gradients from another part's backward were just zeroed, so
  // that only its own backward counts as use in its next synchronisation.
  // No effect while a synchronisation is open.
  void ForgetUse();
  // Rank `broadcast_root`'s buffers (BatchNorm statistics) to every rank
  // now, outside a synchronisation (collective over the group): for buffers
  // that a forward after this sync's broadcast changed per rank (another
  // model part's loss run through this module in train mode). BalancedStep
  // does it for its earlier parts at the end of each step. A failure is
  // fatal, as a failed synchronisation's.
  absl::Status BroadcastBuffers();
  // The caller's number of the step whose synchronisation comes next (any
  // increasing count, the same on every rank). Required before every
  // synchronisation (a synchronised backward or SyncNow): one that begins
  // without SetStep since the last one fails with FAILED_PRECONDITION
  // naming the call, before anything is exchanged. The number rides in the
  // control values beside the synchronisation number, so that a rank that
  // left a step before its first gradient without AbandonStep (its
  // synchronisation never began, so its next one would pair with its
  // peers' current one under the same number) is named on every rank with
  // both steps instead of reducing two steps together. BalancedStep sets it
  // for its parts; a loop over a raw GradSync calls it at the start of each
  // step (and again before a second synchronisation in one step).
  void SetStep(int64_t step);
  // A new step begins: a synchronisation that failed inside a backward and
  // was never followed by AbandonStep is settled, so an AbandonStep from now
  // on joins the next synchronisation (with a failure mark) instead of
  // referring to that one. For a caller that settles a failed step without
  // AbandonStep (BalancedStep, at the start of each step's part); without it
  // a rank that witnessed a peer's failure in its synchronised backward and
  // then fails before its next synchronisation would start nothing, and its
  // peers would reduce that step with its following one.
  void ForgetFailure();

  // Reduces the current local gradients now (zeros where a parameter has
  // none): for a rank with no micro-batch in a step, or after a backward run
  // with sync disabled. Issues the same collectives as a synced backward.
  absl::Status SyncNow();

  // Before a synchronised backward of `loss`: marks the parameters its
  // autograd graph cannot reach as ready at once, so their buckets are not
  // held back until the end of backward. No effect with sync disabled.
  // Fails (and abandons it on every rank) when the previous synchronised
  // backward never completed on this rank.
  absl::Status PrepareForBackward(const at::Tensor& loss);

  // This rank cannot complete the current synchronisation (an exception
  // before its synchronised backward): joins it with a failure mark, so
  // every rank's synchronisation fails with ABORTED naming this rank and
  // `why`, and resets this step's gradients. Called after a synchronised
  // backward threw (here or, through the failure mark, on a peer) and before
  // the next synchronisation begins, it returns that synchronisation's
  // failure and starts nothing, so `catch (...) { AbandonStep(why); }` around
  // a whole step is right on every rank. Returns the synchronisation's status.
  absl::Status AbandonStep(const absl::Status& why);

  // Synchronisations completed on this rank (successfully or not).
  int64_t syncs_completed() const;

  void set_comm_hook(CommHook hook);

  // fatal_status() if set, else the result of the last synchronisation (OK
  // before the first).
  absl::Status status() const;
  // A failed or timed-out collective: every later synchronisation fails
  // with it. OK otherwise.
  absl::Status fatal_status() const;
  SyncStats last_stats() const;
  // Total collectives started since Attach (one per bucket per sync).
  int64_t collectives_started() const;
  int num_buckets() const;

 private:
  explicit GradSync(std::shared_ptr<internal::GradSyncState> state);
  std::shared_ptr<internal::GradSyncState> state_;
};

}  // namespace evenstep

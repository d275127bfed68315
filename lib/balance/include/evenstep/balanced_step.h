// BalancedStep: one optimizer step of balanced data-parallel training.
//
// It wraps the user's model and any torch::optim::Optimizer. Every step it
// takes the next global batch from the Sampler (the same on every rank),
// splits it across ranks by the Planner's shares, packs this rank's part into
// micro-batches (their number is this rank's accumulation count), and drives
// them: local accumulation for all but the last, GradSync's overlapped
// bucketed all-reduce on the last (a rank without micro-batches joins with
// zeros). Each micro-batch's loss is the SUM of its per-sample (or
// per-token) losses, or with LossReduction::kMean (--evenstep_loss_reduction
// =mean) their MEAN over the micro-batch's count (MicroBatch::count: its
// samples, or its tokens with --evenstep_normalize=tokens), which
// BalancedStep multiplies by that count; it scales the sum by 1 / (the global
// batch's total count), so the SUM-reduced gradient equals the gradient of the mean loss
// over the whole global batch, for any split and any world size. (Averaging
// per micro-batch and then averaging the averages is the classic mistake this
// avoids.) Then optional clipping on the synced global gradient, the
// optimizer step and zero_grad; one small all-gather shares every rank's
// cost fit, busy time and loss, and the next plan follows from them.
//
//   auto step = evenstep::BalancedStep::Create(*ctx, *model, optimizer, lengths, *config);
//   for (int s = 0; s < steps; ++s) {
//     auto report = (*step)->Step(
//         [&](const evenstep::MicroBatch& mb) { return dataset.Collate(mb.samples); },
//         [&](const Batch& b) { return LossSum(model, b); });
//     if (!report.ok()) { std::cerr << report.status() << "\n"; return 1; }
//   }
//
// Failures come back as a status naming the rank, the step and the
// micro-batch, and the step is abandoned: its gradients are cleared (never
// applied). An exception from the user's callbacks (or a bad loss) on one
// rank is carried to every rank in the step's gradient synchronisation (the
// failing rank joins it with a failure mark): every rank abandons the same
// step with ABORTED naming the failed rank, and the next step may run (the
// abandoned global batch is skipped on every rank). A failed collective (a
// timeout, a peer that died) leaves the ranks out of step: every later
// BeginStep/Step on this rank fails saying so (restart from the last
// checkpoint) instead of mixing steps.
// Outside a step the model's gradients are not synchronised: a backward
// through its parameters between steps (a GAN generator's loss through the
// discriminator) accumulates into their .grad on this rank only, as in one
// process, and starts no collective; zero them before the next Step (as
// the single-process loop does) unless that step should include them.
//
// Several models in one step (a GAN's discriminator and generator,
// actor-critic, teacher-student): Create with named ModelParts, each with its
// own optimizer and GradSync. A step runs the parts in order over the SAME
// micro-batches: part k's micro-batches (its gradients zeroed first, as the
// plain loop's zero_grad does), its sync, clipping and optimizer step, then
// part k+1's — so a generator's loss sees the discriminator its own loop
// would see (already stepped). A backward of one part through another part's
// parameters (the generator's loss through the discriminator) accumulates
// into the other part's .grad locally and is never synchronised: that part's
// gradients are zeroed before its own micro-batches. Such a forward in train
// mode also changes the other part's buffers (BatchNorm statistics) per
// rank: at the end of the step every earlier part's buffers are made rank
// 0's on every rank (GradSync::BroadcastBuffers), so a checkpoint or an
// evaluation sees one value.
// Thread-safety: one training thread drives a BalancedStep.
#pragma once

#include <array>
#include <cstdint>
#include <exception>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <typeinfo>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "evenstep/cost_model.h"
#include "evenstep/device_feed.h"
#include "evenstep/dist_context.h"
#include "evenstep/grad_sync.h"
#include "evenstep/loader.h"
#include "evenstep/memory_probe.h"
#include "evenstep/planner.h"
#include "evenstep/prefetch.h"
#include "evenstep/sampler.h"
#include "evenstep/status_macros.h"
#include "evenstep/sync_topology.h"
#include "evenstep/torch_fwd.h"

namespace evenstep {
namespace internal {
class MemoryCaps;
class MicroStepClock;
class RankHealth;
class StepSums;
}  // namespace internal

// How the loss a micro-batch's function returns is reduced over its samples
// (or tokens, by SamplerOptions::normalization).
enum class LossReduction {
  kSum,   // the sum of the per-sample (per-token) losses
  kMean,  // their mean over MicroBatch::count (what reduction=mean computes)
};

// Which gradient a step applies (--evenstep_objective), whatever the split.
enum class Objective {
  // The mean loss over the global batch: the loss functions' sums (or
  // means, times their count) divided by GlobalBatch::count.
  kMean,
  // The SUM over the global batch, with no division: a loop whose loss is a
  // batch sum (a VAE's ELBO summed over its batch), or a loss that divides
  // its terms itself by MicroBatch::global_samples / global_tokens (terms
  // over different denominators).
  kSum,
};

struct BalanceConfig {
  // What the user's loss is; evenstep turns either into the exact mean
  // (or, with Objective::kSum, the sum) over the global batch.
  LossReduction loss_reduction = LossReduction::kSum;
  Objective objective = Objective::kMean;
  SamplerOptions sampler;
  PlannerOptions planner;
  CostModelOptions cost_model;
  GradSyncOptions grad_sync;
  // The shape of the gradient all-reduce across nodes (sync_topology.h):
  // applied to grad_sync.comm_hook by Create, said on rank 0 when there is
  // more than one node.
  SyncTopology sync_topology = SyncTopology::kAuto;
  // Cost units of a sample from its length; null = the length (tokens).
  CostFunction cost;
  // Re-plan every this many optimizer steps.
  int plan_interval = 1;
  // Clip the global gradient's norm to this value after the sync; 0 = off.
  double clip_grad_norm = 0;
  // A micro-step that runs out of memory (c10::OutOfMemoryError, in the
  // loss function or in backward) under the Step forms that own the loop:
  // kSplit splits that micro-batch (halves, then quarters, ... down to one
  // sample) and retries it within the step, with the exact gradient of the
  // unsplit step (see Step); the rank keeps the largest piece that fitted
  // as its memory cap, which later plans respect. kFail abandons the step,
  // as any other error does.
  enum class OomPolicy { kSplit, kFail };
  OomPolicy oom = OomPolicy::kSplit;
  // Memory caps predicted before anything runs out of memory: each
  // micro-step's peak memory (micro_peak_bytes) is fitted against its padded
  // tokens (MemoryFit, per part); once a fit is identified the rank's
  // micro-batches are capped at the size predicted to peak within
  // memory_headroom x the limit (never below the largest that did, never at
  // a size that ran out of memory), beside the caps its recoveries learned.
  // The limit: > 0 = these bytes; 0 = the device's (MemoryProbe::
  // DeviceLimit: CUDA's capacity times the allocator's memory fraction);
  // < 0 = no predicted caps. On the CPU there are no per-micro-step figures
  // (the resident set keeps freed memory), so nothing is predicted there.
  int64_t memory_limit_bytes = 0;
  double memory_headroom = 0.9;
  // Frees what the device allocator holds cached but unallocated (the
  // blocks a failed attempt left, fragments) before an out-of-memory retry;
  // returns the bytes it released. When it released any, the micro-batch
  // (or piece) that ran out of memory is first retried as it was, and split
  // (or, for one sample, judged too large) only if it fails again. Null =
  // MemoryProbe::ReleaseCache (CUDA's emptyCache; nothing on the CPU). A
  // test or a simulation may script it.
  std::function<int64_t()> release_cache;
  // A micro-step's peak bytes, asked as it ends (after its backward, with the
  // micro-batch or piece that ran); -1 = not known. Null = the device
  // allocator's (MemoryProbe::Lap). A test or a simulation may script it.
  std::function<int64_t(const MicroBatch&)> micro_peak_bytes;
  // dynamic: the shares used until every rank has measurements (e.g. known
  // device speeds); empty = equal.
  std::vector<double> initial_shares;
  // Threads that run the micro-batch load function ahead of the training
  // thread (BalancedStep::Step). kAutoDataWorkers (the default): a Loader
  // (loader.h) runs on DefaultDataWorkers(local ranks) threads and a plain
  // load function on the training thread (nothing says it is thread-safe);
  // N > 0: both run on N threads; 0: everything loads on the training thread.
  int data_workers = kAutoDataWorkers;
  static constexpr int kAutoDataWorkers = -1;
  // Micro-batches loaded ahead of the one computing (with data workers).
  int prefetch = 4;
  // With data workers and a Loader: Step also loads the next step's
  // micro-batches ahead: with static and work balance from the start of this
  // step (queued behind its own loads; the next plan does not depend on the
  // exchange), with dynamic balance once this step's exchange ends. The
  // Loader is called after Step returns (it owns what it reads); a plain
  // load function never is. Memory: up to twice `prefetch` loaded
  // micro-batches wait.
  bool prefetch_next_step = true;
  // With data_workers and a model on an accelerator: the workers also move
  // each loaded micro-batch's CPU tensors (those TensorWalk<Data> finds) to
  // the model's device, through reusable page-locked buffers and
  // non-blocking copies on a side stream (DeviceFeeder), so the training
  // thread finds them there. Off, or on a CPU model: the data stays as the
  // load function returns it.
  bool pin_memory = true;
  // Online health: a rank whose micro-steps have become slower than this
  // fraction of its own best so far (StepReport::rank_health) is named in
  // StepReport::health_alerts once per crossing (Session prints it on rank
  // 0); 0 = off.
  double health_warn = 0.8;
  // The host clock that times the micro-steps of a CPU model (what the cost
  // model and the health figures learn from); null = absl::Now. A test or a
  // simulation may drive a virtual one. On an accelerator the micro-steps
  // are timed with device events instead.
  std::function<absl::Time()> now;
  // Before each micro-batch on the training thread (before its load without
  // data workers), seed torch's default generators with MicroBatchSeed(
  // sampler seed, step, rank, micro-batch): random draws differ between
  // ranks and repeat after a resume. Every part's micro-batch i gets the
  // same seed. Loads on data workers are not reseeded.
  bool reseed = false;
  // Called after the sync with the global gradient in param.grad(), before
  // clipping and the optimizer step (e.g. to log gradient norms).
  std::function<void()> after_sync;
  // The split record: a directory (it must exist) where each rank appends
  // what split each step, one JSON line per step (DIR/rank-RRRRR.jsonl: the
  // plan's shares, fits and predicted times, the rank's memory cap, the
  // global batch's hash); "" = none.
  std::string split_record;
  // A directory holding a split record: each step is split as recorded
  // (the same plan and memory caps, so the same micro-batches on every
  // rank) instead of as this run's measurements say: a dynamic-balance run
  // replayed bit for bit. Create fails naming the file when it is missing
  // or was recorded at another world size; a step the record lacks, or
  // whose global batch differs from the record's (another seed, batch size
  // or data), fails naming the step. "" = none.
  std::string split_replay;
};

// One model of a step with several (BalancedStep::Create with parts): a
// name (in errors, checkpoints and reports: letters, digits, '_' and '-'),
// the module and its optimizer; the parts' parameters must not overlap.
struct ModelPart {
  ModelPart(std::string name, torch::nn::Module& module, torch::optim::Optimizer& optimizer)
      : name(std::move(name)), module(&module), optimizer(&optimizer) {}
  std::string name;
  torch::nn::Module* module;
  torch::optim::Optimizer* optimizer;
};

// A part's loss for one micro-batch (BalancedStep::Step with one per part):
// loads what it needs and returns the SUM (or with LossReduction::kMean the
// MEAN) of the micro-batch's losses.
using PartLoss = std::function<at::Tensor(const MicroBatch&)>;

// The seed of the default generators for micro-batch `micro_batch` (0-based)
// of step `step` (1-based) on `rank` (BalanceConfig::reseed): a hash of the
// four, stable across platforms and versions.
uint64_t MicroBatchSeed(uint64_t seed, int64_t step, int rank, int64_t micro_batch);

// The data workers of a Loader by default (BalanceConfig::kAutoDataWorkers):
// the machine's hardware threads per local rank, at least 8 (loads mostly
// wait on storage or a decoder, so threads beyond the cores still help: on
// bench/input_pipeline's slow rank 4 workers left 6-13 % of the step
// waiting for data, 8 left 0.3 %) and at most 32.
int DefaultDataWorkers(int local_world_size);

// One micro-step's timestamps (for the timeline).
struct MicroTiming {
  absl::Time begin;     // the micro-step starts: data loading
  absl::Time data_end;  // DataReady(): forward + backward start
  absl::Time end;       // backward returned (on the last: after the sync wait)
  double units = 0;
};

// Slots of the per-step agreement (BalancedStep::ShareAtNextExchange).
enum AgreementSlot : int {
  kSaveFailureRun,  // Session: the longest run of consecutive failed saves seen
  kPreemptSignal,   // Session: a preemption signal this rank received (0 = none)
  kJoinWaiting,     // BalancedStep: a replacement asked to join (DistContext::JoinPending)
  kAgreementSlots
};

struct StepReport {
  int64_t step = 0;  // optimizer steps completed, this one included
  int64_t epoch = 0;
  int64_t epoch_step = 0;  // index of the global batch within its epoch
  int micro_batches = 0;   // this rank's accumulation count
  int64_t samples = 0;     // this rank's
  int64_t tokens = 0;
  double units = 0;
  double global_count = 0;    // the normaliser: samples or tokens of the global batch
  int64_t global_tokens = 0;  // tokens of the global batch (all ranks)
  // Mean loss over the global batch (sum of every rank's scaled losses); with
  // several parts, the first part's, and every part's in part_losses.
  double loss = 0;
  std::vector<double> part_losses;
  // The step's sums over every rank of what the loop counted (AddToSum),
  // by declared name: correct predictions, tokens, ...
  std::map<std::string, double> sums;
  // sums.at(name); std::out_of_range naming `name` for one not declared.
  double sum(const std::string& name) const {
    const auto it = sums.find(name);
    if (it == sums.end()) {
      throw std::out_of_range("StepReport::sum('" + name + "'): no such sum (DeclareSum it)");
    }
    return it->second;
  }
  // mean / max over ranks of the busy time (data + compute) before the sync.
  double balance_efficiency = 1;
  absl::Duration data, compute, sync_wait, optimizer;
  absl::Duration busy;              // data + compute of this rank
  absl::Time begin, arrived, end;   // step start, arrival at the sync, step end
  absl::Time synced;                // the gradients are reduced
  absl::Time optimizer_begin;       // after the sync: clipping, optimizer, zero_grad
  std::vector<MicroTiming> micro;   // this rank's micro-steps
  std::vector<double> shares;       // the plan this step used
  std::vector<double> rank_busy_s;  // every rank's busy time
  std::vector<int> rank_micro_batches;
  // Ranks whose step threw after its gradients were all synchronised: the
  // step was applied on every rank, and Step/FinishStep returned ABORTED
  // naming them on every rank.
  std::vector<int> late_failures;
  // Out-of-memory recoveries (BalanceConfig::oom): the micro-batches this
  // rank split and retried in this step, and every rank's count and learned
  // memory cap (padded tokens; 0 = none).
  int oom_splits = 0;
  std::vector<int> rank_oom_splits;
  std::vector<int64_t> rank_memory_caps;
  // Peak memory during this step (MemoryProbe: the device allocator's peak
  // allocated bytes on an accelerator, the resident set on the CPU), this
  // rank's and every rank's; and the largest micro-batch (padded tokens:
  // samples x longest length) each rank ran whole, the work its memory held
  // at once.
  MemoryPeak memory;
  int64_t largest_micro_batch = 0;
  std::vector<int64_t> rank_peak_memory;
  std::vector<int64_t> rank_largest_micro_batch;
  // Recoveries per rank this step: the largest micro-batch (padded tokens)
  // that ran out of memory there (0: none).
  std::vector<int64_t> rank_oom_failed;
  // One line per rank that recovered this step (the same on every rank;
  // Session prints them on rank 0): "rank 1, step 3: 1 micro-batch(es) ran
  // out of memory (the largest 96 padded tokens) and were split and retried
  // within the step; rank 1's micro-batches are now capped at 48 padded
  // tokens".
  std::vector<std::string> oom_recoveries;
  // The maximum over ranks of each AgreementSlot, from this step's exchange.
  std::array<double, kAgreementSlots> agreed{};
  // Every rank's health, two views of its cost fit's time for a typical
  // micro-batch (fixed + per-unit x the micro-batch cap): individual = its
  // best (lowest) time since this BalancedStep started, counted once its fit
  // holds 32 micro-steps / its time now (1 = at its best; a rank slowly
  // degrading by heat or a noisy neighbour falls below 1); relative = the
  // median rank's time (of two, the faster) / its time. 1 until a rank has
  // measurements.
  std::vector<double> rank_health;
  std::vector<double> rank_relative_speed;
  // Ranks that fell below BalanceConfig::health_warn this step, one line each
  // ("rank 3's micro-steps take 1.39x its own best (0.72x speed) at step
  // 120: ..."); a rank is named again only after it recovered.
  std::vector<std::string> health_alerts;
  // Session with DistOptions::on_rank_loss kContinue: the ranks (numbered as
  // in the world before) lost during this step, the seconds the survivors
  // took to regroup, and whether the step had been applied on every
  // survivor before the loss was known (the rank was lost in the step's
  // exchange): its loss and sums were still to be gathered, so loss,
  // part_losses and balance_efficiency are NaN and sums is empty.
  std::vector<int> lost_ranks;
  double regroup_seconds = 0;
  bool figures_lost = false;
  // Session: saves whose failure this rank has seen (each reported in one
  // line as it was seen).
  int64_t checkpoint_failures = 0;
};

// Where the balancing stands, for checkpoints.
struct BalanceState {
  SamplerState sampler;
  std::vector<double> shares;
  int64_t steps = 0;
  // Stream mode: the shares that assigned the streams of the current epoch.
  std::vector<double> stream_shares;
  // Per rank: the largest micro-batch (padded tokens: samples x longest
  // length) it may be given, learned from its out-of-memory recoveries; 0 =
  // no cap learned. Empty when none was.
  std::vector<int64_t> memory_caps;
};

class BalancedStep {
 public:
  // Attaches GradSync to `model` (a collective: every rank calls Create).
  // `lengths[i]` is sample i's length in tokens; `counts`, when not empty,
  // overrides each sample's normalisation count.
  static absl::StatusOr<std::unique_ptr<BalancedStep>> Create(
      DistContext& ctx, torch::nn::Module& model, torch::optim::Optimizer& optimizer,
      std::vector<int64_t> lengths, BalanceConfig config, std::vector<double> counts = {});
  // Several models stepped in order over the same micro-batches (see the
  // top of this file). InvalidArgument for no part, a null module or
  // optimizer, a bad or repeated name, or a parameter in two parts (naming
  // it).
  static absl::StatusOr<std::unique_ptr<BalancedStep>> Create(DistContext& ctx,
                                                              std::vector<ModelPart> parts,
                                                              std::vector<int64_t> lengths,
                                                              BalanceConfig config,
                                                              std::vector<double> counts = {});
  ~BalancedStep();

  // One optimizer step of every part: `losses[k]` is part k's loss of a
  // micro-batch (it loads what it needs; timed as compute). A failure in
  // part k abandons part k of this step on every rank (ABORTED naming the
  // rank, the part and the micro-batch); the parts before it have stepped,
  // as in a plain loop that throws there.
  absl::StatusOr<StepReport> Step(const std::vector<PartLoss>& losses);

  // One optimizer step. `load(const MicroBatch&)` returns the micro-batch's
  // data (timed as data wait); `loss_sum(data)` returns the SUM of its
  // per-sample (or per-token) losses as a scalar tensor (timed as compute,
  // with backward); `loss_sum(data, micro_batch)` when it takes both (for
  // draws keyed by MicroBatch::epoch or ::index).
  //
  // Where `load` runs (BalanceConfig::data_workers): a Loader (loader.h),
  // which evenstep owns, on the data workers by default (on unless
  // --evenstep_data_workers=0), up to --evenstep_prefetch micro-batches ahead
  // of the training thread, and also the next step's micro-batches while
  // this one finishes (--evenstep_prefetch_next_step); a plain function on
  // the training thread, or on the workers with --evenstep_data_workers=N > 0
  // (never after Step returns). On workers the data time is what the
  // training thread waits, and `load` must be safe to call from several
  // threads at once (a Loader runs a copy per thread) and depend only on its
  // micro-batch: the results are used in order, so the step is the same for
  // any number of workers. A load that throws fails the step like a
  // throwing callback, naming the micro-batch's samples.
  template <typename Load, typename LossSum>
  absl::StatusOr<StepReport> Step(Load&& load, LossSum&& loss_sum) {
    return OnePartStep(std::forward<Load>(load), std::forward<LossSum>(loss_sum), true);
  }
  // The same without out-of-memory recovery, for a loss function that
  // cannot run again (Session::Batches hands each micro-batch to the loop's
  // own body): an out-of-memory error abandons the step on every rank.
  template <typename Load, typename LossSum>
  absl::StatusOr<StepReport> StepOnce(Load&& load, LossSum&& loss_sum) {
    return OnePartStep(std::forward<Load>(load), std::forward<LossSum>(loss_sum), false);
  }
  // A step of every part with one Loader: each micro-batch is loaded once
  // (as above) and `losses[k](data)` is part k's loss of it. The step's
  // loaded micro-batches are kept until the last part has used them (the
  // rank's share of the global batch in memory, as a plain loop holds its
  // batch).
  template <typename Data>
  absl::StatusOr<StepReport> Step(
      const Loader<Data>& loader,
      const std::vector<std::function<at::Tensor(const Data&)>>& losses) {
    EVENSTEP_RETURN_IF_ERROR(PartCount(losses.size()));
    std::vector<Data> kept;
    return PartsStep(
        loader,
        [&](size_t, Data& data) {
          kept.push_back(std::move(data));
          return losses[0](kept.back());
        },
        [&](size_t k, size_t i) { return losses[k](kept[i]); },
        [&](size_t k) -> std::function<at::Tensor(const MicroBatch&)> {
          return [&, k](const MicroBatch& mb) { return losses[k](loader(mb)); };
        });
  }
  // A step of every part without out-of-memory recovery, for a loop's body
  // that runs every part's loss of its micro-batch (Session::Batches with
  // several parts): `first(i, data)` is part 0's loss of micro-batch i,
  // `later(k, i)` part k's, asked for after part k - 1 has stepped.
  template <typename Data, typename First, typename Later>
  absl::StatusOr<StepReport> StepPartsOnce(const Loader<Data>& loader, First&& first,
                                           Later&& later) {
    return PartsStep(loader, std::forward<First>(first), std::forward<Later>(later),
                     [](size_t) { return std::function<at::Tensor(const MicroBatch&)>(); });
  }
  // Each rank's share of every later step as one micro-batch, whatever the
  // caps, for a loop whose body runs once per step (Session::Batches with
  // several parts: the body runs part k + 1's loss after part k stepped;
  // Session::Positions in stream mode). A step planned already is packed
  // again, and a part's gradients that the body zeroes before its one
  // backward are accepted. FailedPrecondition when a micro-batch cap or
  // minimum is set (they could not be kept): "<what>, but <flag> would cut
  // it into several ...", where `what` says which loop and why.
  absl::Status SetWholeShare(const std::string& what);
  // Stream mode: each rank keeps the streams it owns now (or, before the
  // first step, those of the current plan) for the rest of the run, where
  // it would otherwise take new ones at each epoch's start; its range.
  std::pair<int64_t, int64_t> PinStreams();
  // Sums over all ranks that every step reports (StepReport::sums) without
  // a collective of the loop's own: DeclareSum each name once, on every
  // rank in the same order, before the first step; inside a step's
  // callbacks AddToSum(name, value) adds this rank's part (a double, or a
  // scalar tensor summed on its device and read once per step). The sums
  // travel in the step's exchange. AddToSum with an undeclared name throws
  // (the step is abandoned naming it).
  absl::Status DeclareSum(const std::string& name);
  void AddToSum(const std::string& name, double value);
  void AddToSum(const std::string& name, const at::Tensor& value);
  // Drops loads started ahead for the next step (waiting for those running).
  void CancelPrefetch();

  // The same step, piece by piece, for loops that cannot be written as two
  // callbacks: BeginStep(); for each micro_batches()[i]: load it, DataReady(),
  // Backward(loss_sum); then FinishStep(). With several parts, EndPart()
  // after each part's micro-batches but the last's.
  absl::Status BeginStep();
  // The current part's sync, clipping and optimizer step; the next part
  // begins (its gradients zeroed). Not for the last part: FinishStep.
  absl::Status EndPart();
  // The part whose micro-batches run now, and the parts.
  const ModelPart& part(size_t k) const { return parts_[k].spec; }
  GradSync& grad_sync(size_t k) { return *parts_[k].sync; }
  const std::vector<MicroBatch>& micro_batches() const { return run_.micro; }
  // The global batch of the current step (every rank knows all of it).
  const GlobalBatch& global_batch() const { return run_.batch; }
  void DataReady();
  absl::Status Backward(const at::Tensor& loss_sum);
  absl::StatusOr<StepReport> FinishStep();

  // The epoch (0-based) the next step's global batch belongs to. The
  // sampler's position is part of every checkpoint, so a loop
  //   while (step->epoch() < epochs) step->Step(...);
  // trains whole epochs and, resumed, goes on mid-epoch exactly where the
  // checkpoint was taken.
  int64_t epoch() const;
  // The epoch of the last step taken (or restored from a checkpoint); 0
  // before any.
  int64_t last_step_epoch() const;
  // The next step's global batch's index within its epoch (epoch()): the
  // steps of that epoch done so far, 0 at an epoch's start.
  int64_t step_in_epoch() const;
  // Global batches in the epoch epoch() reports (with a token budget,
  // epochs may differ by a batch).
  int64_t steps_per_epoch() const { return sampler_.steps_in_epoch(epoch()); }
  const Plan& plan() const { return planner_.plan(); }
  const StepReport& last_report() const { return report_; }
  Sampler& sampler() { return sampler_; }
  // Stream mode (SamplerOptions::streams): the streams [first, last) this
  // rank owns in the current epoch ({0, 0} before the first step).
  std::pair<int64_t, int64_t> owned_streams() const;
  GradSync& grad_sync() { return *parts_[0].sync; }
  const CostModel& cost_model() const { return cost_model_; }
  DistContext& context() { return ctx_; }

  BalanceState state() const;
  // Continues from `state` (same dataset, seed and world size for the shares;
  // another world size starts from equal shares).
  absl::Status Restore(const BalanceState& state);
  // The error Restore(state) would return, without changing anything.
  absl::Status CheckRestore(const BalanceState& state) const;

  // After a step failed because a rank was lost (its error Unavailable or
  // DeadlineExceeded, naming the rank), with DistOptions::on_rank_loss
  // kContinue: the ranks still running call it. They regroup
  // (DistContext::Regroup), and this step goes on among them: new
  // gradient-sync groups, the shares and memory caps of the survivors, the
  // failed step's gradients cleared, and the sampler back where the failed
  // step began. The next Step draws the same global batch and splits it over
  // the survivors, so the gradient it applies is the uninterrupted run's.
  // FailedPrecondition, on every survivor alike, where that cannot be exact:
  // the survivors disagree on whether the failed step was applied (the lost
  // rank died inside the last synchronisation), several model parts, or a
  // split record being replayed. A split record being written ends with the
  // step before the loss (it holds the old world's splits). Collective over
  // the survivors.
  absl::StatusOr<Regrouped> Regroup();

  // A replacement process asked to join (DistOptions::join), as agreed in
  // the last step's exchange: the same on every rank after the same step.
  // Call Admit then (a Session does it by itself).
  bool JoinWaiting() const;
  // Admits the replacements waiting (DistContext::Admit) at this step
  // boundary: the world grows by them, with new gradient-sync groups and
  // the balancing state of the bigger world (each joiner starts with the
  // survivors' mean share). The joiners have no state yet: hand it to them
  // with evenstep::HandOver (evenstep/handover.h) before the next step,
  // which refuses to begin until then. Collective over this world; between
  // steps only.
  absl::StatusOr<Regrouped> Admit();
  // Whether a HandOver must come before the next step (after Admit, or on a
  // process that joined), and whether this rank is one that lacks the state
  // (a joiner until it received it).
  bool HandoverDue() const { return handover_due_; }
  bool LacksState() const { return lacks_state_; }
  // Called by HandOver on every rank once the state arrived: on a rank that
  // lacked it, `received` is the survivors' balancing state (restored here).
  absl::Status HandedOver(const BalanceState* received);

  // Values every rank contributes to the next step's exchange: after it,
  // StepReport::agreed holds each slot's maximum over the ranks. A decision
  // taken from them (stop after failed saves, ...) is the same on every rank
  // at the same step, with no extra collective.
  void ShareAtNextExchange(AgreementSlot slot, double value) { shared_[slot] = value; }

 private:
  struct Part {
    ModelPart spec;
    // The part's own connections (DistContext::NewDataGroup): its buckets
    // can pair only with its own, whatever another part, BalancedStep or
    // the program's collectives do. Declared first: outlives `sync`.
    std::unique_ptr<Subgroup> group;
    std::unique_ptr<GradSync> sync;
  };
  BalancedStep(DistContext& ctx, std::vector<Part> parts, Sampler sampler, BalanceConfig config,
               std::unique_ptr<internal::MicroStepClock> clock);
  // FailedPrecondition when there are several parts (the two-callback Step).
  absl::Status OnePart() const;
  // Starts the data workers (BalanceConfig::data_workers) unless running
  // or none are wanted.
  void StartWorkers();
  // Each part's data group and GradSync on the context's current world
  // (the sync topology chosen for it), replacing those it had.
  absl::Status AttachSyncs();
  // InvalidArgument unless `losses` is the number of parts.
  absl::Status PartCount(size_t losses) const;
  // A step whose micro-batches are loaded by `load` (see Step): `first(i,
  // data)` runs the first part's micro-batch i; `rest()` the later parts,
  // before the step finishes.
  template <typename Load, typename First, typename Rest, typename Recompute>
  absl::StatusOr<StepReport> LoadedStep(Load&& load, First&& first, Rest&& rest,
                                        Recompute&& recompute) {
    constexpr bool kOwned = IsLoader<std::decay_t<Load>>::value;
    if (kOwned) StartWorkers();
    const bool on_workers = workers_ != nullptr && (kOwned || config_.data_workers > 0);
    carry_.next_step_loads = kOwned && on_workers && config_.prefetch_next_step;
    using Data = std::decay_t<std::invoke_result_t<Load&, const MicroBatch&>>;
    // This step's loads, started by the previous Step for exactly these
    // micro-batches with the same Loader, or none.
    std::shared_ptr<Prefetcher<Data>> prefetch;
    if constexpr (kOwned) {
      if (carry_.prefetch != nullptr && *carry_.data == typeid(Data) &&
          carry_.loader == load.id()) {
        prefetch = std::static_pointer_cast<Prefetcher<Data>>(carry_.prefetch);
      }
    }
    CancelPrefetch();  // another load's leftovers: wait for them and drop them
    EVENSTEP_RETURN_IF_ERROR(BeginStep());
    RecomputeScope scope(this, std::forward<Recompute>(recompute));
    const std::vector<MicroBatch>& mbs = micro_batches();
    if (!on_workers) {
      for (size_t i = 0; i < mbs.size(); ++i) {
        try {
          Data data = load(mbs[i]);
          DataReady();
          EVENSTEP_RETURN_IF_ERROR(first(i, data));
        } catch (const c10::OutOfMemoryError& e) {
          EVENSTEP_RETURN_IF_ERROR(OutOfMemory(i, false, e.what_without_backtrace()));
        } catch (const std::exception& e) {
          return Abandon(i, e.what());
        }
      }
      EVENSTEP_RETURN_IF_ERROR(rest());
      return FinishStep();
    }
    if (prefetch == nullptr) {
      // Destroyed before `load` and `mbs` go: it waits for the loads in flight.
      prefetch = std::make_shared<Prefetcher<Data>>(
          *workers_, config_.prefetch, mbs.size(),
          [&, feeder = feeder_.get()](size_t i) -> Data { return ToDevice(feeder, load(mbs[i])); });
    }
    // The next step's loads, queued behind this step's (static and work
    // plans are made at BeginStep; dynamic ones after the exchange). They
    // hold a copy of the Loader: what it owns lives while they run.
    auto start_next = [&] {
      if constexpr (kOwned) {
        if (!carry_.next_step_loads || !planned_ || carry_.prefetch != nullptr) return;
        auto next = std::make_shared<const std::vector<MicroBatch>>(planned_->micro);
        carry_.prefetch = std::make_shared<Prefetcher<Data>>(
            *workers_, config_.prefetch, next->size(),
            [next, copy = std::decay_t<Load>(load), feeder = feeder_.get()](size_t i) -> Data {
              return ToDevice(feeder, copy((*next)[i]));
            });
        carry_.data = &typeid(Data);
        carry_.loader = load.id();
      }
    };
    start_next();
    for (size_t i = 0; i < mbs.size(); ++i) {
      absl::StatusOr<Data> data = prefetch->Take(i);
      if (!data.ok()) return Abandon(i, LoadFailure(i, data.status()));
      try {
        if constexpr (TensorWalk<Data>::kKnown) {
          if (feeder_ != nullptr) feeder_->Adopt(TensorsIn(*data));
        }
        DataReady();
        EVENSTEP_RETURN_IF_ERROR(first(i, *data));
      } catch (const c10::OutOfMemoryError& e) {
        EVENSTEP_RETURN_IF_ERROR(OutOfMemory(i, false, e.what_without_backtrace()));
      } catch (const std::exception& e) {
        return Abandon(i, e.what());
      }
    }
    EVENSTEP_RETURN_IF_ERROR(rest());
    absl::StatusOr<StepReport> report = FinishStep();
    if (report.ok()) start_next();
    return report;
  }
  // A step of every part: `first(i, data)` is part 0's loss of micro-batch
  // i (as it is loaded), `later(k, i)` part k's after part k - 1 stepped;
  // `recompute_of(k)` is part k's out-of-memory recompute (empty: none).
  template <typename Load, typename First, typename Later, typename RecomputeOf>
  absl::StatusOr<StepReport> PartsStep(Load&& load, First&& first, Later&& later,
                                       RecomputeOf&& recompute_of) {
    return LoadedStep(
        std::forward<Load>(load), [&](size_t i, auto& data) { return Backward(first(i, data)); },
        [&]() -> absl::Status {
          for (size_t k = 1; k < parts_.size(); ++k) {
            EVENSTEP_RETURN_IF_ERROR(EndPart());
            recompute_ = recompute_of(k);
            for (size_t i = 0; i < run_.micro.size(); ++i) {
              try {
                DataReady();
                EVENSTEP_RETURN_IF_ERROR(Backward(later(k, i)));
              } catch (const c10::OutOfMemoryError& e) {
                EVENSTEP_RETURN_IF_ERROR(OutOfMemory(i, false, e.what_without_backtrace()));
              } catch (const std::exception& e) {
                return Abandon(i, e.what());
              }
            }
          }
          return absl::OkStatus();
        },
        recompute_of(0));
  }
  template <typename Load, typename LossSum>
  absl::StatusOr<StepReport> OnePartStep(Load&& load, LossSum&& loss_sum, bool recover) {
    EVENSTEP_RETURN_IF_ERROR(OnePart());
    const std::vector<MicroBatch>& mbs = run_.micro;
    std::function<at::Tensor(const MicroBatch&)> recompute;
    if (recover) {
      recompute = [&](const MicroBatch& mb) {
        auto data = load(mb);
        return CallLoss(loss_sum, data, mb);
      };
    }
    return LoadedStep(
        std::forward<Load>(load),
        [&](size_t i, auto& data) { return Backward(CallLoss(loss_sum, data, mbs[i])); },
        [] { return absl::OkStatus(); }, std::move(recompute));
  }
  template <typename LossSum, typename Data>
  static at::Tensor CallLoss(LossSum& loss_sum, Data& data, const MicroBatch& mb) {
    if constexpr (std::is_invocable_v<LossSum&, Data&, const MicroBatch&>) {
      return loss_sum(data, mb);
    } else {
      return loss_sum(data);
    }
  }
  absl::Status Abandon(size_t micro_batch, const std::string& what);

  // Out-of-memory recovery (BalanceConfig::oom). The Step forms that own the
  // loop set recompute_ for the running part: a micro-batch (or a piece of
  // one) -> its loss, loaded on the training thread; RecomputeScope clears
  // it when the step returns.
  std::function<at::Tensor(const MicroBatch&)> recompute_;
  struct RecomputeScope {
    template <typename F>
    RecomputeScope(BalancedStep* s, F&& f) : step(s) {
      step->recompute_ = std::forward<F>(f);
    }
    ~RecomputeScope() { step->recompute_ = nullptr; }
    BalancedStep* step;
  };
  // Micro-batch `slot` of the running part threw c10::OutOfMemoryError
  // (`backward_started`: in its backward, so its gradients may be partly
  // accumulated). Recovers (OK: the loop goes on with slot + 1) or returns
  // the step's failure.
  absl::Status OutOfMemory(size_t slot, bool backward_started, const std::string& what);
  // An out-of-memory error is split and retried: --evenstep_oom=split and a
  // Step form that can load a micro-batch again (recompute_).
  bool Recovers() const;
  // Runs the running part's micro-batches `from`..`until` again through
  // recompute_, each in its oom_.slot_pieces pieces, after doubling those of
  // `failed` (none when out of range); the part's gradients are zeroed
  // first when `from` is 0. A further out-of-memory doubles that
  // micro-batch's pieces and starts again from 0.
  absl::Status Replay(size_t from, size_t until, size_t failed);
  // Out-of-memory recovery in the running part.
  struct Recovery {
    // Pieces each micro-batch of the running part runs in (1: whole).
    std::vector<int> slot_pieces;
    // The (micro-batch, pieces) retried after releasing the allocator's
    // cache that have not fitted since: each is retried so once.
    std::set<std::pair<size_t, int>> released_for;
    int64_t released_bytes = 0;  // released in the running part
    int unsplit_retries = 0;     // retries after a release without a split, this part
    bool backward_started = false;
    int64_t syncs_before_micro = 0;  // the part's syncs before the running micro-step
    int64_t voted_at = -1;           // the part sync number already voted on
  };
  Recovery oom_;
  // Releases the allocator's cache before retrying `slot` at its current
  // pieces; true when that retry should run unsplit (bytes were released
  // and it was not retried so before).
  bool RetryAfterReleasingCache(size_t slot);
  // The error of a one-sample piece that ran out of memory after the cache
  // was released (or with nothing to release): it cannot fit.
  std::string TooLargeAlone(const MicroBatch& piece, const std::string& error) const;
  // After the part's synchronisation was abandoned (not timed out): every
  // rank says whether it ran out of memory and whether it failed otherwise;
  // true when some rank ran out of memory and none failed otherwise, on
  // every rank alike (a collective of every rank whose sync was abandoned).
  absl::StatusOr<bool> VoteToRetry(bool oom, bool other);
  // `e` is the running part's GradSync reporting a synchronisation another
  // rank abandoned (this rank's own code did not fail).
  bool Bystander(const std::exception& e) const;
  // The backward of one micro-step: `loss_sum` (of `mb`, or a piece of it)
  // scaled to its share of the global mean (mb.count, for mean losses),
  // synchronised when `sync`. Throws what backward throws.
  void MicroStep(const at::Tensor& loss_sum, const MicroBatch& mb, bool sync);
  // `mb` dealt into `pieces` pieces (alternately, so they hold similar
  // lengths).
  std::vector<MicroBatch> SplitMicroBatch(const MicroBatch& mb, int pieces) const;
  // The running micro-step's synchronisation completed, successfully, although
  // its backward threw afterwards: its gradient is whole on every rank.
  bool SyncedDespiteFailure() const;
  // After a step: the fits' cap, taken when it moved by more than 5 % (each
  // change said in one line on this rank).
  void PredictMemoryCap();
  // After a recovery lowered the cap: the next step's planned
  // micro-batches packed again under it.
  void RepackPlanned();
  // The current part's sync, clipping, optimizer step and zero_grad.
  absl::Status ApplyPart();
  // Zeroes part `k`'s gradients and forgets its use marks (a step of
  // several parts, as the part's micro-batches begin).
  void StartPart(size_t k);
  // Seeds the default generators for micro-batch `i` (BalanceConfig::reseed).
  void Reseed(size_t i);
  // The current part's trainable parameters and gradients as evenstep left
  // them (after its own backward, or as the part begins) ...
  void NoteGradients();
  // ... and whether the user's code since changed them: a loss function
  // that runs backward or steps the optimizer itself (the commonest porting
  // mistake) is named before evenstep's backward mixes it into the sync.
  // A changed parameter sets `replica_changed` (an optimizer step through
  // .data() leaves the version as it was, so the caller stops either way).
  absl::Status CheckUntouched(bool* replica_changed) const;
  // "rank R, step S" and, with several parts, ", part 'NAME'".
  std::string Where() const;
  // On a data worker: `data`'s CPU tensors moved to the model's device by
  // `feeder` (null: as it is).
  template <typename Data>
  static Data ToDevice(DeviceFeeder* feeder, Data data) {
    if constexpr (TensorWalk<Data>::kKnown) {
      if (feeder != nullptr) feeder->Feed(TensorsIn(data));
    }
    return data;
  }
  // "loading samples [3, 17, ...] on a data worker: <error>".
  std::string LoadFailure(size_t micro_batch, const absl::Status& error) const;
  // Reads the step's micro-step times and summed loss into the report and
  // the cost model.
  absl::Status Account();
  absl::Status Exchange();

  DistContext& ctx_;
  std::vector<Part> parts_;
  Sampler sampler_;
  BalanceConfig config_;
  std::unique_ptr<internal::MicroStepClock> clock_;
  MemoryProbe memory_probe_;                    // the step's peak memory (StepReport::memory)
  std::unique_ptr<internal::MemoryCaps> caps_;  // this rank's micro-batch cap
  std::unique_ptr<WorkerPool> workers_;         // data workers; null = load on this thread
  // Moves loaded data to the model's device on the workers; null = leave it.
  std::unique_ptr<DeviceFeeder> feeder_;
  // The next step, planned ahead when its loads start early (prefetch_next_step).
  struct NextStep {
    SamplerState sampler_before;        // where the sampler stood before it
    std::vector<double> shares_before;  // the plan before it
    std::vector<double> stream_shares_before;
    GlobalBatch batch;
    std::vector<MicroBatch> micro;
    std::vector<double> shares;  // the plan that split it (recorded or replayed)
  };
  // The split record being written and the one being replayed
  // (BalanceConfig::split_record, split_replay); null = neither.
  struct SplitLog;
  std::unique_ptr<SplitLog> split_log_;
  absl::Status OpenSplitLog();
  std::optional<NextStep> planned_;
  bool whole_share_ = false;     // SetWholeShare
  bool pinned_streams_ = false;  // PinStreams
  // Stream mode: the shares the current epoch's streams were assigned by
  // (fixed from the epoch's first step).
  std::vector<double> stream_shares_;
  // Draws and splits the next global batch into planned_; `steps_done`:
  // the steps completed when it runs (for plan_interval).
  void PlanNextStep(int64_t steps_done);
  // The next step's loads, started ahead.
  struct Carried {
    // A Prefetcher<Data> already loading the planned step, and its types.
    std::shared_ptr<void> prefetch;
    const std::type_info* data = nullptr;
    const void* loader = nullptr;  // the Loader it loads with
    // This Step loads the next step's micro-batches ahead (a Loader on the
    // data workers, BalanceConfig::prefetch_next_step).
    bool next_step_loads = false;
  };
  Carried carry_;
  CostModel cost_model_;
  Planner planner_;

  // The step in progress.
  struct Running {
    bool in_step = false;
    GlobalBatch batch;
    std::vector<MicroBatch> micro;
    size_t part = 0;  // the part whose micro-batches run now
    size_t next_micro = 0;
    double scale = 1;
    // Per part: the scaled micro-batch losses summed so far, and their sums.
    std::vector<at::Tensor> loss_on_device;
    std::vector<double> part_loss_sums;
    bool data_marked = false;
    int64_t syncs_at_begin = 0;  // GradSync::syncs_completed() when the step began
    // The state before this step (what Regroup goes back to).
    BalanceState before;
    // This step's exception that came after its synchronisation completed
    // on every rank (the gradient is whole): the step is applied on every
    // rank and, once the exchange has told every rank, fails on every rank.
    std::string late_failure;
  };
  Running run_;
  std::unique_ptr<internal::StepSums> sums_;      // DeclareSum's sums over all ranks
  std::vector<CostFit> fits_;                     // every rank's, from the last exchange
  std::unique_ptr<internal::RankHealth> health_;  // each rank's micro-step time against its best
  void UpdateHealth();
  int64_t steps_ = 0;
  StepReport report_;
  // A step abandoned without the peers knowing (a failed collective): no
  // step runs after it on this rank.
  absl::Status abandoned_;
  std::array<double, kAgreementSlots> shared_{};
  bool handover_due_ = false;  // HandoverDue()
  bool lacks_state_ = false;   // LacksState()
  // NoteGradients' record: per trainable parameter of the current part, its
  // version and its gradient's identity and version.
  struct Untouched {
    const void* grad;
    int64_t grad_version, version;
  };
  std::vector<Untouched> untouched_;
};

}  // namespace evenstep

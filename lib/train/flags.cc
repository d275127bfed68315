// Definitions of the --evenstep_* flags and their conversion to option structs.
#include "evenstep/flags.h"

#include <c10/core/Device.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <iostream>
#include <vector>

#include "absl/flags/commandlineflag.h"
#include "absl/flags/flag.h"
#include "absl/flags/reflection.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "evenstep/balanced_step.h"
#include "evenstep/dist_context.h"
#include "evenstep/grad_sync.h"
#include "evenstep/internal/choice.h"
#include "evenstep/internal/flag_checks.h"
#include "evenstep/log.h"
#include "evenstep/preflight.h"
#include "evenstep/status_macros.h"

ABSL_FLAG(std::string, evenstep_backend, "auto",
          "Process group for gradients: auto (NCCL when this libtorch has it and CUDA is "
          "available, else Gloo), gloo or nccl. Control messages always use Gloo.");
ABSL_FLAG(absl::Duration, evenstep_timeout, absl::Minutes(10),
          "Longest a collective may take before it fails with an error naming the ranks that "
          "never arrived (e.g. 30s, 10m; at least 1s).");
ABSL_FLAG(absl::Duration, evenstep_rendezvous_timeout, absl::Minutes(5),
          "Longest the start-up rendezvous may take: connecting to MASTER_ADDR:MASTER_PORT and "
          "waiting for every rank to join (at least 1s).");
ABSL_FLAG(std::string, evenstep_on_rank_loss, "stop",
          "What a lost rank (killed, its host gone, frozen past --evenstep_lost_after) does to "
          "the run: stop (every rank stops, naming it; the launcher restarts the job from the "
          "newest checkpoint) or continue (the survivors regroup, redo the interrupted step with "
          "its global batch over themselves, and go on; a Session's checkpoints, logs and "
          "evaluation follow the new world).");
ABSL_FLAG(absl::Duration, evenstep_lost_after, absl::Seconds(10),
          "With --evenstep_on_rank_loss=continue: a rank whose heartbeat has not moved for this "
          "long is lost (a killed rank is known at once). At least 1s.");
ABSL_FLAG(
    std::string, evenstep_comm_hook, "sum",
    "How gradient buckets are reduced: sum (exact; weighting comes from loss scaling), avg, "
    "fp16 or bf16 (compressed: scaled by 1/world before the cast, cast back after), or powersgd "
    "(rank-1 PowerSGD with error feedback: approximate, far fewer bytes).");
ABSL_FLAG(std::string, evenstep_sync_topology, "auto",
          "Shape of the gradient all-reduce across nodes: flat (one ring over every rank), "
          "hierarchical (reduce-scatter within each node, all-reduce across nodes, all-gather "
          "within: only the bucket's bytes cross the link between nodes; needs the same ranks "
          "per node, Gloo and an element-wise comm hook) or auto (hierarchical when the "
          "cross-node bandwidth measured at start-up is below half the within-node one).");
ABSL_FLAG(double, evenstep_bucket_cap_mb, 25,
          "Gradient bucket size cap in MiB; a bucket's all-reduce starts as soon as all its "
          "gradients are ready.");
ABSL_FLAG(double, evenstep_first_bucket_cap_mb, 1,
          "Cap in MiB of the first gradient bucket (the last layers' gradients), small so "
          "communication starts early in backward.");

ABSL_FLAG(std::string, evenstep_balance, "dynamic",
          "How each global batch is split across ranks: static (equal sample counts, the usual "
          "practice), work (equal cost units), dynamic (cost units in proportion to each rank's "
          "measured speed).");
ABSL_FLAG(int64_t, evenstep_global_batch, 64,
          "Global batch per optimizer step, over all ranks, in --evenstep_batch_unit units. The "
          "sequence of global batches depends only on the seed and the epoch.");
ABSL_FLAG(std::string, evenstep_batch_unit, "samples",
          "Unit of --evenstep_global_batch: samples or tokens.");
ABSL_FLAG(int64_t, evenstep_micro_batch_samples, 0,
          "Most samples in one micro-batch (the memory limit); 0 = no cap.");
ABSL_FLAG(int64_t, evenstep_micro_batch_tokens, 0,
          "Most padded tokens (samples x longest length) in one micro-batch; 0 = no cap.");
ABSL_FLAG(int, evenstep_min_micro_batches, 1,
          "Fewest micro-batches (accumulation steps) of a rank that has work.");
ABSL_FLAG(int, evenstep_max_micro_batches, 0,
          "Most micro-batches of one rank per optimizer step (bounds the planner; with "
          "--evenstep_micro_batch_samples, a global batch the ranks cannot hold within it is "
          "refused at Create); 0 = no bound.");
ABSL_FLAG(int, evenstep_plan_interval, 1, "Re-plan the ranks' shares every this many steps.");
ABSL_FLAG(double, evenstep_plan_damping, 0.3,
          "Fraction of the gap to the new plan applied per re-plan for small changes (0 < d <= "
          "1); changes over 20 % apply at once.");
ABSL_FLAG(int, evenstep_warmup_steps, 2,
          "Optimizer steps whose timings the cost model ignores (allocator and cache warm-up).");
ABSL_FLAG(uint64_t, evenstep_seed, 0, "Seed of the sample order (shuffle and batch order).");
ABSL_FLAG(int64_t, evenstep_sort_window, 1,
          "Samples per length-sorting window across global batches: 1 = none (every global "
          "batch a plain shuffle's: no cost in model quality; each rank's share is still packed "
          "longest first), 0 = 50 global batches, N = N samples. Larger windows pad less but "
          "make each global batch's lengths alike, which costs held-out quality at equal steps "
          "(docs/benchmarks.md#sorting-window).");
ABSL_FLAG(int64_t, evenstep_streams, 0,
          "Stream mode (truncated BPTT, online rollouts): the dataset is this many streams of "
          "equal length (sample s * positions + t is stream s's position t); each step takes "
          "the next position of every stream, and each stream stays on one rank, in order, for "
          "a whole epoch (streams move between ranks only at an epoch's start). 0 = off.");
ABSL_FLAG(bool, evenstep_shuffle, true,
          "Shuffle the samples each epoch (by --evenstep_seed and the epoch); false = dataset "
          "order, every epoch.");
ABSL_FLAG(bool, evenstep_reseed, true,
          "Before each micro-batch, seed torch's default generators (CPU and accelerators) from "
          "--evenstep_seed, the step, the rank and the micro-batch: dropout and augmentation "
          "drawn from them differ between ranks and repeat exactly after a resume. Every model "
          "part's micro-batch i starts from the same seed. false = leave the generators alone.");
ABSL_FLAG(bool, evenstep_split_record, true,
          "Under dynamic balance, record what split each step (the plan, each rank's memory cap) "
          "in RUN_DIR/splits/rank-RRRRR.jsonl, one line per step, for --evenstep_replay.");
ABSL_FLAG(std::string, evenstep_replay, "",
          "A run directory whose split record (RUN_DIR/splits) this run replays: every step is "
          "split across ranks and into micro-batches as recorded, so a dynamic-balance run "
          "repeats bit for bit (same world size, seed, global batch and data). Empty = off.");
ABSL_FLAG(bool, evenstep_drop_last, false,
          "Drop the smaller last global batch of each epoch instead of keeping it.");
ABSL_FLAG(std::string, evenstep_normalize, "samples",
          "Loss normalisation: each sample's (or token's) loss is divided by the global batch's "
          "total count of samples or tokens.");
ABSL_FLAG(int, evenstep_data_workers, -1,
          "Threads that load micro-batches ahead of the training thread. -1 = auto: an "
          "evenstep::Loader (LoaderOf a torch::data dataset) on the machine's hardware threads "
          "per local rank (8 to 32), a plain load function passed to Step on the training thread; "
          "N > 0: both on N threads (a plain function must then be thread-safe); 0 = everything "
          "on the training thread.");
ABSL_FLAG(int, evenstep_prefetch, 4,
          "With data workers: micro-batches loaded ahead of the one computing (at most this many "
          "wait in memory, plus the one in use).");
ABSL_FLAG(bool, evenstep_prefetch_next_step, true,
          "With data workers and an evenstep::Loader: load the next step's micro-batches while "
          "the current step finishes (as soon as its plan is known). The Loader owns what it "
          "reads; a plain load function passed to Step is never called after Step returns.");
ABSL_FLAG(double, evenstep_health_warn, 0.8,
          "Online health: name a rank (one line on rank 0, in the report) whose micro-steps have "
          "become slower than this fraction of its own best speed so far (heat, clocks, a noisy "
          "neighbour); 0 = off.");
ABSL_FLAG(bool, evenstep_pin_memory, true,
          "With data workers and a model on an accelerator: the workers move each "
          "loaded micro-batch's CPU tensors to the model's device (page-locked staging buffers, "
          "non-blocking copies on a side stream); false = the data stays where the load function "
          "put it. No effect on a CPU model.");
ABSL_FLAG(std::string, evenstep_loss_reduction, "sum",
          "What the micro-batch loss function returns: sum (of the per-sample or per-token "
          "losses) or mean (over the micro-batch's samples or tokens, by --evenstep_normalize; "
          "evenstep multiplies it by that count). Either gives the exact mean over the global "
          "batch.");
ABSL_FLAG(std::string, evenstep_objective, "mean",
          "The gradient a step applies: mean (of the loss over the global batch: evenstep "
          "divides by the global batch's count) or sum (over the global batch, no division: a "
          "loop whose loss is a batch sum, or one that divides its terms itself by "
          "MicroBatch::global_samples / global_tokens).");
ABSL_FLAG(double, evenstep_cost_quadratic, 0,
          "Cost units of a sample of length L are L + c*L^2 with this c (attention-heavy "
          "models); 0 = tokens.");
ABSL_FLAG(std::string, evenstep_oom, "split",
          "A micro-batch that runs out of device memory (in the loss or in backward): split "
          "(split it in halves, quarters, ... down to one sample and retry it within the step, "
          "with the exact gradient; the rank then keeps its micro-batches under the largest "
          "piece that fitted) or fail (abandon the step, as any other error).");
ABSL_FLAG(double, evenstep_memory_limit_mb, 0,
          "The device memory (MiB) each rank's micro-batches may peak at: its micro-batches are "
          "capped at the size its measured peaks predict within --evenstep_memory_headroom of "
          "it, before anything runs out of memory. 0 = the device's capacity (CUDA: times the "
          "allocator's memory fraction); -1 = no predicted caps. Needs the device allocator's "
          "figures: nothing is predicted on the CPU.");
ABSL_FLAG(double, evenstep_memory_headroom, 0.9,
          "The fraction of --evenstep_memory_limit_mb a predicted micro-batch may peak at (the "
          "rest for fragmentation and what the fit does not see).");
ABSL_FLAG(double, evenstep_clip_grad_norm, 0,
          "Clip the global gradient's norm (after the sync) to this value; 0 = off.");

ABSL_FLAG(std::string, evenstep_run_dir, "evenstep_run",
          "Where a Session created without a run directory keeps its checkpoints (RUN_DIR/ckpt), "
          "logs and timelines, and resumes from.");
ABSL_FLAG(std::string, evenstep_ckpt_dir, "",
          "Directory of sharded checkpoints (step-*/ with one HDF5 shard per rank and "
          "manifest.json, plus `latest`); empty = no checkpoints.");
ABSL_FLAG(int, evenstep_ckpt_keep, 3,
          "Committed checkpoints kept; older ones are removed (the newest never is).");
ABSL_FLAG(int, evenstep_ckpt_in_flight, 1,
          "Saves that may be writing at once (each holds one staging buffer).");
ABSL_FLAG(std::string, evenstep_ckpt_when_busy, "wait",
          "When a save is requested while --evenstep_ckpt_in_flight saves still write: wait (for "
          "the oldest) or skip (this one, and say so).");
ABSL_FLAG(double, evenstep_ckpt_slice_mb, 64,
          "Tensors larger than this (MiB) are split into slices owned by different ranks, so "
          "every rank writes about the same number of bytes.");

// Session (lib/session.cc).
ABSL_FLAG(int, evenstep_ckpt_every, 0,
          "Session: save a checkpoint every this many steps (and at Finish), when the loop next "
          "calls Step, Checkpoint or Finish (with the loop's state as its code after the step "
          "left it); 0 = only at Finish. Checkpoints need a directory: --evenstep_ckpt_dir, or "
          "RUN_DIR/ckpt.");
ABSL_FLAG(std::string, evenstep_resume, "newest",
          "Session: newest (resume from the newest committed checkpoint; if it cannot be "
          "loaded, stop with an error naming it), newest_valid (set an unusable newest "
          "checkpoint aside and resume from the newest one that loads, saying so) or off "
          "(start at step 1; saves of steps that already hold a committed checkpoint fail). "
          "Only a directory without any committed checkpoint starts from scratch.");
ABSL_FLAG(std::string, evenstep_ckpt_on_error, "warn",
          "Session: when a save fails (every rank reports it at the next step, one line naming "
          "the step, rank, file and error): warn (go on; stop after "
          "--evenstep_ckpt_max_failures failed saves in a row) or fail (stop at the first).");
ABSL_FLAG(int, evenstep_ckpt_max_failures, 3,
          "Session, with --evenstep_ckpt_on_error=warn: consecutive failed saves after which "
          "training stops with an error (0 = never stop).");
ABSL_FLAG(std::string, evenstep_preempt_signals, "TERM,USR1",
          "Session: signals that ask for a preemption stop (comma-separated names, empty = "
          "none): every rank agrees in the next step, which returns its report; the loop's next "
          "Step (or Finish) saves that step, waits for its commit and returns CANCELLED (exit "
          "with evenstep::kPreemptedExitCode); a signal reaching one rank suffices. Give the "
          "launcher a grace long enough for the loop's code between two steps and the save.");
ABSL_FLAG(bool, evenstep_timeline, true,
          "Session: write this rank's timeline (RUN_DIR/trace-RRRRR.json) for evenstep-report.");
ABSL_FLAG(int64_t, evenstep_eval_micro_batch_tokens, 0,
          "Session::Evaluate: most padded tokens (samples x longest length) per evaluation "
          "micro-batch; 0 = the training micro-batch caps, or without those a rank's share of "
          "one global batch.");
ABSL_FLAG(int, evenstep_log_every, 10,
          "Session: metrics interval in steps (one non-blocking all-reduce per interval); logs "
          "go to RUN_DIR/metrics-*.jsonl.");
ABSL_FLAG(std::string, evenstep_preflight, "off",
          "Session::Create: run the preflight on the job's ranks first (per-rank compute, copy, "
          "disk, memory and link figures; see evenstep-preflight): off, report (rank 0 prints the "
          "table), warn (rank 0 prints each outlier) or fail (stop naming the outliers). With "
          "--evenstep_balance=dynamic its compute figures seed the first shares.");
ABSL_FLAG(bool, evenstep_preflight_quick, false,
          "Preflight: a few seconds instead of up to ~30 (smaller sizes, fewer repeats).");
ABSL_FLAG(std::string, evenstep_preflight_data_dir, "",
          "Preflight: also measure the cold read bandwidth of this directory (where the "
          "training data lives); empty = not measured.");
ABSL_FLAG(std::string, evenstep_preflight_inject, "",
          "Preflight, for tests and rehearsals: figures these ranks report instead of measuring "
          "them, METRIC:RANK[,RANK...]=VALUE[;...] (e.g. matmul_fp32_gflops:0,1=10;"
          "matmul_fp32_gflops:2=3): the verdict on known figures; empty = all measured.");
ABSL_FLAG(std::string, evenstep_device, "",
          "Preflight: the training device (cpu, cuda, cuda:1, ...); empty = CUDA when present, "
          "else CPU.");

namespace evenstep {

namespace {

// A timeout below a second is no timeout a collective or a rendezvous of
// real ranks can meet (every one would fail, naming no flag): refused.
absl::Status CheckTimeout(absl::string_view flag, absl::Duration value) {
  if (value >= absl::Seconds(1) && value != absl::InfiniteDuration()) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      flag, "=", absl::FormatDuration(value),
      ": must be finite and at least 1s (it bounds every collective or the rendezvous, or "
      "tells a lost rank from a slow one; the default is ",
      flag == "--evenstep_timeout"      ? "10m"
      : flag == "--evenstep_lost_after" ? "10s"
                                        : "5m",
      ")"));
}

}  // namespace

absl::StatusOr<DistOptions> DistOptionsFromFlags() {
  DistOptions options;
  EVENSTEP_ASSIGN_OR_RETURN(
      options.backend,
      internal::Choose<CommBackend>("--evenstep_backend", absl::GetFlag(FLAGS_evenstep_backend),
                                    {{"auto", CommBackend::kAuto},
                                     {"gloo", CommBackend::kGloo},
                                     {"nccl", CommBackend::kNccl}}));
  options.collective_timeout = absl::GetFlag(FLAGS_evenstep_timeout);
  options.rendezvous_timeout = absl::GetFlag(FLAGS_evenstep_rendezvous_timeout);
  EVENSTEP_ASSIGN_OR_RETURN(
      options.on_rank_loss,
      internal::Choose<DistOptions::OnRankLoss>(
          "--evenstep_on_rank_loss", absl::GetFlag(FLAGS_evenstep_on_rank_loss),
          {{"stop", DistOptions::OnRankLoss::kStop},
           {"continue", DistOptions::OnRankLoss::kContinue}}));
  options.lost_after = absl::GetFlag(FLAGS_evenstep_lost_after);
  EVENSTEP_RETURN_IF_ERROR(internal::CheckDistOptions(options));
  return options;
}

absl::Status internal::CheckDistOptions(const DistOptions& options) {
  EVENSTEP_RETURN_IF_ERROR(CheckTimeout("--evenstep_timeout", options.collective_timeout));
  EVENSTEP_RETURN_IF_ERROR(CheckTimeout("--evenstep_lost_after", options.lost_after));
  return CheckTimeout("--evenstep_rendezvous_timeout", options.rendezvous_timeout);
}

absl::StatusOr<std::unique_ptr<DistContext>> DistContextFromFlags() {
  absl::StatusOr<DistOptions> options = DistOptionsFromFlags();
  if (!options.ok()) return options.status();
  return DistContext::Create(*options);
}

absl::StatusOr<GradSyncOptions> GradSyncOptionsFromFlags() {
  GradSyncOptions options;
  const std::string hook = absl::GetFlag(FLAGS_evenstep_comm_hook);
  absl::StatusOr<CommHook> comm_hook = CommHookByName(hook);
  if (!comm_hook.ok()) return comm_hook.status();
  options.comm_hook = *std::move(comm_hook);
  const double cap = absl::GetFlag(FLAGS_evenstep_bucket_cap_mb);
  const double first = absl::GetFlag(FLAGS_evenstep_first_bucket_cap_mb);
  EVENSTEP_RETURN_IF_ERROR(internal::InRange("evenstep_bucket_cap_mb", cap, 0, 1 << 20, true));
  EVENSTEP_RETURN_IF_ERROR(
      internal::InRange("evenstep_first_bucket_cap_mb", first, 0, 1 << 20, true));
  options.bucket_cap_bytes = static_cast<int64_t>(cap * (1 << 20));
  options.first_bucket_cap_bytes = static_cast<int64_t>(first * (1 << 20));
  options.timeout = absl::GetFlag(FLAGS_evenstep_timeout);
  return options;
}

namespace internal {

namespace {
// A bound or value as people write it: 1048576, not 1.04858e+06.
std::string Num(double v) {
  if (std::isfinite(v) && v == std::floor(v) && std::fabs(v) < 1e15) {
    return absl::StrCat(static_cast<int64_t>(v));
  }
  return absl::StrCat(v);
}
}  // namespace

absl::Status NotBelow(const char* flag, double value, double minimum) {
  if (value >= minimum && std::isfinite(value)) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("--", flag, "=", Num(value), ": must be >= ", Num(minimum), " (and finite)"));
}

absl::Status InRange(const char* flag, double value, double lo, double hi, bool lo_open) {
  const bool ok = std::isfinite(value) && (lo_open ? value > lo : value >= lo) && value <= hi;
  if (ok) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat("--", flag, "=", Num(value), ": must be in ",
                                                 lo_open ? "(" : "[", Num(lo), ", ", Num(hi), "]"));
}

}  // namespace internal

using internal::InRange;
using internal::NotBelow;

absl::StatusOr<PreflightOptions> PreflightOptionsFromFlags() {
  PreflightOptions options;
  const std::string inject = absl::GetFlag(FLAGS_evenstep_preflight_inject);
  for (absl::string_view entry : absl::StrSplit(inject, ';', absl::SkipWhitespace())) {
    const std::vector<absl::string_view> parts = absl::StrSplit(entry, absl::ByAnyChar(":="));
    PreflightOptions::Injected figure;
    bool ok = parts.size() == 3 && !parts[0].empty() && absl::SimpleAtod(parts[2], &figure.value);
    for (absl::string_view r : absl::StrSplit(ok ? parts[1] : "", ',')) {
      int rank = -1;
      ok = ok && absl::SimpleAtoi(r, &rank) && rank >= 0;
      figure.ranks.push_back(rank);
    }
    if (!ok) {
      return absl::InvalidArgumentError(absl::StrCat("--evenstep_preflight_inject=", inject, ": '",
                                                     entry,
                                                     "' is not METRIC:RANK[,RANK...]=VALUE"));
    }
    figure.metric = std::string(parts[0]);
    options.injected.push_back(std::move(figure));
  }
  options.quick = absl::GetFlag(FLAGS_evenstep_preflight_quick);
  options.ckpt_dir = absl::GetFlag(FLAGS_evenstep_ckpt_dir);
  options.data_dir = absl::GetFlag(FLAGS_evenstep_preflight_data_dir);
  options.device = absl::GetFlag(FLAGS_evenstep_device);
  if (!options.device.empty()) {
    try {
      (void)c10::Device(options.device);
    } catch (const std::exception&) {
      return absl::InvalidArgumentError(absl::StrCat("--evenstep_device=", options.device,
                                                     ": not a device (cpu, cuda, cuda:1, ...)"));
    }
  }
  return options;
}

namespace {

// --evenstep_oom, --evenstep_memory_limit_mb and --evenstep_memory_headroom.
absl::Status MemoryFromFlags(BalanceConfig* config) {
  EVENSTEP_ASSIGN_OR_RETURN(config->oom, internal::Choose<BalanceConfig::OomPolicy>(
                                             "--evenstep_oom", absl::GetFlag(FLAGS_evenstep_oom),
                                             {{"split", BalanceConfig::OomPolicy::kSplit},
                                              {"fail", BalanceConfig::OomPolicy::kFail}}));
  const double limit_mb = absl::GetFlag(FLAGS_evenstep_memory_limit_mb);
  EVENSTEP_RETURN_IF_ERROR(InRange("evenstep_memory_limit_mb", limit_mb, -1, 1 << 30));
  if (limit_mb < 0 && limit_mb != -1) {
    return absl::InvalidArgumentError(
        absl::StrCat("--evenstep_memory_limit_mb=", limit_mb,
                     ": expected MiB > 0, 0 (the device's) or -1 (off)"));
  }
  config->memory_limit_bytes = static_cast<int64_t>(limit_mb * (1 << 20));
  config->memory_headroom = absl::GetFlag(FLAGS_evenstep_memory_headroom);
  return absl::OkStatus();
}

// Stream mode's step is one position of every stream: a global batch given
// beside it (it used to be ignored without a word) is refused unless equal.
absl::Status CheckStreamBatch(const SamplerOptions& sampler) {
  if (sampler.streams <= 0 || sampler.global_batch == sampler.streams) return absl::OkStatus();
  const absl::CommandLineFlag* flag = absl::FindCommandLineFlag("evenstep_global_batch");
  if (flag == nullptr || flag->CurrentValue() == flag->DefaultValue()) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("--evenstep_global_batch=", sampler.global_batch, " with --evenstep_streams=",
                   sampler.streams, ": in stream mode a step is one position of every stream (",
                   sampler.streams, " samples); leave --evenstep_global_batch unset"));
}

}  // namespace

// The balance options' bounds, each error naming its flag.
absl::Status internal::CheckBalanceConfig(const BalanceConfig& config) {
  EVENSTEP_RETURN_IF_ERROR(InRange(
      "evenstep_bucket_cap_mb", static_cast<double>(config.grad_sync.bucket_cap_bytes) / (1 << 20),
      0, 1 << 20, true));
  EVENSTEP_RETURN_IF_ERROR(InRange(
      "evenstep_first_bucket_cap_mb",
      static_cast<double>(config.grad_sync.first_bucket_cap_bytes) / (1 << 20), 0, 1 << 20, true));
  EVENSTEP_RETURN_IF_ERROR(InRange("evenstep_memory_headroom", config.memory_headroom, 0, 1, true));
  if (!(config.health_warn >= 0 && config.health_warn < 1)) {
    return absl::InvalidArgumentError(absl::StrCat("--evenstep_health_warn=", config.health_warn,
                                                   ": expected a fraction in [0, 1) (0 = off)"));
  }
  EVENSTEP_RETURN_IF_ERROR(
      NotBelow("evenstep_global_batch", static_cast<double>(config.sampler.global_batch), 1));
  EVENSTEP_RETURN_IF_ERROR(NotBelow("evenstep_micro_batch_samples",
                                    static_cast<double>(config.sampler.micro_batch_samples), 0));
  EVENSTEP_RETURN_IF_ERROR(NotBelow("evenstep_micro_batch_tokens",
                                    static_cast<double>(config.sampler.micro_batch_tokens), 0));
  EVENSTEP_RETURN_IF_ERROR(
      NotBelow("evenstep_min_micro_batches", config.sampler.min_micro_batches, 0));
  EVENSTEP_RETURN_IF_ERROR(
      NotBelow("evenstep_max_micro_batches", config.planner.max_micro_batches, 0));
  EVENSTEP_RETURN_IF_ERROR(NotBelow("evenstep_plan_interval", config.plan_interval, 1));
  EVENSTEP_RETURN_IF_ERROR(NotBelow("evenstep_warmup_steps", config.cost_model.warmup_steps, 0));
  EVENSTEP_RETURN_IF_ERROR(
      NotBelow("evenstep_sort_window", static_cast<double>(config.sampler.sort_window), 0));
  EVENSTEP_RETURN_IF_ERROR(
      NotBelow("evenstep_streams", static_cast<double>(config.sampler.streams), 0));
  EVENSTEP_RETURN_IF_ERROR(NotBelow("evenstep_clip_grad_norm", config.clip_grad_norm, 0));
  // Upper bounds: a thread per worker, a micro-batch in memory per prefetch
  // slot, and costs that stay finite for lengths up to 1e6.
  EVENSTEP_RETURN_IF_ERROR(InRange("evenstep_data_workers", config.data_workers, -1, 256));
  EVENSTEP_RETURN_IF_ERROR(InRange("evenstep_prefetch", config.prefetch, 1, 1024));
  if (config.planner.max_micro_batches > 0 &&
      config.sampler.min_micro_batches > config.planner.max_micro_batches) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--evenstep_min_micro_batches=", config.sampler.min_micro_batches,
        " is more than --evenstep_max_micro_batches=", config.planner.max_micro_batches));
  }
  if (!(config.planner.damping > 0 && config.planner.damping <= 1)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--evenstep_plan_damping=", config.planner.damping, ": must be in (0, 1]"));
  }
  return absl::OkStatus();
}

absl::StatusOr<BalanceConfig> BalanceConfigFromFlags() {
  BalanceConfig config;
  EVENSTEP_ASSIGN_OR_RETURN(config.grad_sync, GradSyncOptionsFromFlags());
  EVENSTEP_ASSIGN_OR_RETURN(config.sync_topology,
                            SyncTopologyByName(absl::GetFlag(FLAGS_evenstep_sync_topology)));
  EVENSTEP_ASSIGN_OR_RETURN(
      config.planner.mode,
      BalanceModeByName(absl::GetFlag(FLAGS_evenstep_balance), "--evenstep_balance"));
  EVENSTEP_ASSIGN_OR_RETURN(
      config.sampler.budget_unit,
      internal::Choose<BatchUnit>(
          "--evenstep_batch_unit", absl::GetFlag(FLAGS_evenstep_batch_unit),
          {{"samples", BatchUnit::kSamples}, {"tokens", BatchUnit::kTokens}}));
  EVENSTEP_ASSIGN_OR_RETURN(
      config.sampler.normalization,
      internal::Choose<Normalization>(
          "--evenstep_normalize", absl::GetFlag(FLAGS_evenstep_normalize),
          {{"samples", Normalization::kSamples}, {"tokens", Normalization::kTokens}}));
  EVENSTEP_ASSIGN_OR_RETURN(
      config.loss_reduction,
      internal::Choose<LossReduction>(
          "--evenstep_loss_reduction", absl::GetFlag(FLAGS_evenstep_loss_reduction),
          {{"sum", LossReduction::kSum}, {"mean", LossReduction::kMean}}));
  EVENSTEP_ASSIGN_OR_RETURN(
      config.objective,
      internal::Choose<Objective>("--evenstep_objective", absl::GetFlag(FLAGS_evenstep_objective),
                                  {{"mean", Objective::kMean}, {"sum", Objective::kSum}}));
  config.sampler.global_batch = absl::GetFlag(FLAGS_evenstep_global_batch);
  config.sampler.micro_batch_samples = absl::GetFlag(FLAGS_evenstep_micro_batch_samples);
  config.sampler.micro_batch_tokens = absl::GetFlag(FLAGS_evenstep_micro_batch_tokens);
  config.sampler.min_micro_batches = absl::GetFlag(FLAGS_evenstep_min_micro_batches);
  config.sampler.seed = absl::GetFlag(FLAGS_evenstep_seed);
  config.sampler.sort_window = absl::GetFlag(FLAGS_evenstep_sort_window);
  config.sampler.drop_last = absl::GetFlag(FLAGS_evenstep_drop_last);
  config.sampler.shuffle = absl::GetFlag(FLAGS_evenstep_shuffle);
  config.sampler.streams = absl::GetFlag(FLAGS_evenstep_streams);
  config.reseed = absl::GetFlag(FLAGS_evenstep_reseed);
  config.planner.max_micro_batches = absl::GetFlag(FLAGS_evenstep_max_micro_batches);
  config.planner.damping = absl::GetFlag(FLAGS_evenstep_plan_damping);
  config.plan_interval = absl::GetFlag(FLAGS_evenstep_plan_interval);
  config.cost_model.warmup_steps = absl::GetFlag(FLAGS_evenstep_warmup_steps);
  config.clip_grad_norm = absl::GetFlag(FLAGS_evenstep_clip_grad_norm);
  EVENSTEP_RETURN_IF_ERROR(MemoryFromFlags(&config));
  config.data_workers = absl::GetFlag(FLAGS_evenstep_data_workers);
  config.prefetch = absl::GetFlag(FLAGS_evenstep_prefetch);
  config.prefetch_next_step = absl::GetFlag(FLAGS_evenstep_prefetch_next_step);
  config.pin_memory = absl::GetFlag(FLAGS_evenstep_pin_memory);
  config.health_warn = absl::GetFlag(FLAGS_evenstep_health_warn);
  const double quadratic = absl::GetFlag(FLAGS_evenstep_cost_quadratic);
  EVENSTEP_RETURN_IF_ERROR(InRange("evenstep_cost_quadratic", quadratic, 0, 1e6));
  EVENSTEP_RETURN_IF_ERROR(internal::CheckBalanceConfig(config));
  EVENSTEP_RETURN_IF_ERROR(CheckStreamBatch(config.sampler));
  if (quadratic > 0) {
    config.cost = [quadratic](int64_t l) {
      return static_cast<double>(l) + quadratic * static_cast<double>(l) * l;
    };
  }
  return config;
}

namespace {

absl::StatusOr<absl::CommandLineFlag*> FindEvenstepFlag(absl::string_view name) {
  absl::CommandLineFlag* flag = absl::FindCommandLineFlag(name);
  if (flag == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("--", name, ": no such evenstep flag (see --helpfull or docs/flags.md)"));
  }
  return flag;
}

absl::Status SetFlag(absl::CommandLineFlag& flag, absl::string_view value) {
  std::string error;
  if (!flag.ParseFrom(value, &error)) {
    return absl::InvalidArgumentError(absl::StrCat("--", flag.Name(), "=", value, ": ", error));
  }
  return absl::OkStatus();
}

absl::Status SetFlagDefault(absl::string_view setting) {
  const size_t eq = setting.find('=');
  std::string name(setting.substr(0, eq));
  if (!absl::StartsWith(name, "evenstep_")) name = absl::StrCat("evenstep_", name);
  if (eq == absl::string_view::npos) {
    return absl::InvalidArgumentError(
        absl::StrCat("--", name, ": wants NAME=VALUE, got \"", setting, "\""));
  }
  EVENSTEP_ASSIGN_OR_RETURN(absl::CommandLineFlag * flag, FindEvenstepFlag(name));
  // Called after the command line was parsed, a default would override
  // what the user gave (--evenstep_ckpt_every=13 silently became the
  // default): a flag no longer at its built-in default is refused.
  if (flag->CurrentValue() != flag->DefaultValue()) {
    const std::string before = flag->CurrentValue();
    EVENSTEP_RETURN_IF_ERROR(SetFlag(*flag, setting.substr(eq + 1)));
    const std::string after = flag->CurrentValue();
    if (after == before) return absl::OkStatus();
    EVENSTEP_RETURN_IF_ERROR(SetFlag(*flag, before));
    return absl::FailedPreconditionError(absl::StrCat(
        "\"", setting, "\" would override --", name, "=", before,
        " set before it (on the command line, or by the program): call SetFlagDefaults before "
        "absl::ParseCommandLine (a default yields to the command line)"));
  }
  return SetFlag(*flag, setting.substr(eq + 1));
}

}  // namespace

absl::Status ParseEvenstepFlags(int* argc, char** argv) {
  int kept = 1;
  for (int i = 1; i < *argc; ++i) {
    absl::string_view arg = argv[i];
    if (arg == "--") {  // everything after "--" belongs to the program
      while (i < *argc) argv[kept++] = argv[i++];
      break;
    }
    absl::string_view body = arg;
    if (!absl::ConsumePrefix(&body, "--") && !absl::ConsumePrefix(&body, "-")) {
      argv[kept++] = argv[i];
      continue;
    }
    const size_t eq = body.find('=');
    absl::string_view name = body.substr(0, eq);
    bool negated = false;
    if (absl::StartsWith(name, "noevenstep_")) {
      name.remove_prefix(2);
      negated = true;
    }
    if (!absl::StartsWith(name, "evenstep_")) {
      argv[kept++] = argv[i];
      continue;
    }
    EVENSTEP_ASSIGN_OR_RETURN(absl::CommandLineFlag * flag, FindEvenstepFlag(name));
    std::string value;
    if (eq != absl::string_view::npos) {
      value = std::string(body.substr(eq + 1));
    } else if (flag->IsOfType<bool>()) {
      value = negated ? "false" : "true";
    } else if (i + 1 < *argc) {
      value = argv[++i];
    } else {
      return absl::InvalidArgumentError(absl::StrCat("--", name, ": missing value"));
    }
    EVENSTEP_RETURN_IF_ERROR(SetFlag(*flag, value));
  }
  argv[kept] = nullptr;
  *argc = kept;
  return absl::OkStatus();
}

void SetFlagDefaults(absl::string_view settings) {
  for (absl::string_view setting : absl::StrSplit(settings, ' ', absl::SkipEmpty())) {
    if (absl::Status s = SetFlagDefault(setting); !s.ok()) {
      // A bug in the program, not bad input: stop as absl::ParseCommandLine does.
      Log(LogLevel::kWarning, absl::StrCat("SetFlagDefaults: ", s.message()));
      std::exit(2);
    }
  }
}

std::string FlagsMarkdownTable() {
  std::vector<const absl::CommandLineFlag*> flags;
  for (const auto& [name, flag] : absl::GetAllFlags()) {
    if (absl::StartsWith(name, "evenstep_")) flags.push_back(flag);
  }
  std::sort(flags.begin(), flags.end(),
            [](const auto* a, const auto* b) { return a->Name() < b->Name(); });
  std::string out = "| flag | default | meaning |\n|---|---|---|\n";
  for (const absl::CommandLineFlag* flag : flags) {
    const std::string help = absl::StrReplaceAll(flag->Help(), {{"|", "\\|"}, {"\n", " "}});
    absl::StrAppend(&out, "| `--", flag->Name(), "` | `", flag->DefaultValue(), "` | ", help,
                    " |\n");
  }
  return out;
}

}  // namespace evenstep

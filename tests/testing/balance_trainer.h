// BalancedStep's test trainer (balanced_step_test, metrics_test, report_test,
// cuda_test): a rank trains a small per-token model on synthetic
// variable-length sequences with BalancedStep configured from --evenstep_*
// flags and, after every sync, EXPECTs the applied gradient to equal the
// gradient one process computes over the whole global batch (mean loss,
// normalised by the global count), naming rank and step.
//
//   RunOnRanks(2, [](DistContext& ctx) {
//     BalanceScenario s;
//     s.flags = {"--evenstep_balance=dynamic", "--evenstep_global_batch=37"};
//     s.steps = 4;
//     const BalanceRun run = TrainBalanced(ctx, s);
//     ExpectAllStepsRan(run, s);
//     EXPECT_EQ(run.steps[0].report.micro_batches, ...);
//   });
//
// The scenario plants what a test needs: failures in the loss or the load
// function, out-of-memory errors, scripted memory figures, a slower rank on
// a virtual clock, an extra duty after each step. Each rank prints one line
// per step (its output shows in a failed test's message).
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "evenstep/balanced_step.h"
#include "evenstep/dist_context.h"
#include "evenstep/handover.h"

namespace evenstep::testing {

struct BalanceScenario {
  // --evenstep_* flags (ParseEvenstepFlags) set before the config is read.
  std::vector<std::string> flags;
  int steps = 3;        // optimizer steps
  double momentum = 0;  // SGD's (lr 0.05): with it the optimizer has state
  int samples = 300;    // in the synthetic dataset (lengths 1-24)
  // Where the model and the data live ("cpu", "cuda").
  std::string device = "cpu";
  // The model's input also gets a per-sample vector from an Embedding with
  // sparse gradients (id: the sample's index mod 17): the first layer, whose
  // gradient backward produces last.
  bool sparse_embedding = false;
  // After every step rank 0 alone runs a backward through the model outside
  // the step (a GAN generator's loss through the discriminator) and EXPECTs
  // its gradients to be its own, then zeroes them.
  bool outside_backward = false;
  // The load function also returns each sample's input as a new CPU tensor,
  // which the loss EXPECTs on the model's device with the same values (data
  // workers and a GPU model: BalancedStep's pinned-buffer copies).
  bool load_tensors = false;
  // Seeds random initial shares with rank seed % world at zero (0: equal).
  int split_seed = 0;
  // (rank, step): that rank's loss callback throws on that step (1-based,
  // failed steps counted) from micro-batch `fail_micro_batch` on (the last
  // one when it has fewer).
  std::vector<std::pair<int, int>> fail_at;
  int fail_micro_batch = 1;
  bool fail_by_exit = false;  // the failing rank dies (_exit 5) instead
  // A step that fails because a rank was lost (Unavailable or
  // DeadlineExceeded) is followed by BalancedStep::Regroup, and the same
  // step runs again among the survivors (EXPECTing the global batch the
  // failed step drew). Needs DistOptions::on_rank_loss kContinue.
  bool regroup_on_loss = false;
  // A lost rank comes back (with regroup_on_loss): after the first regroup
  // the new rank 0 starts a replacement for each lost launch rank (this
  // test's binary, its ranks' environment, EVENSTEP_JOIN=1); the survivors
  // wait before step `rejoin_step` until it asked to join, and after that
  // step Admit it and HandOver the state; it trains the remaining steps.
  int rejoin_step = 0;
  // The replacement dies (_exit 7) after its BalancedStep::Create, before
  // the handover: the survivors regroup and go on without it.
  bool joiner_dies = false;
  // A failed step ends the run (BalanceRun::status) unless this is set: then
  // the record says whether the gradients were cleared and the loop goes on.
  bool continue_after_failure = false;
  // The rank whose load function throws on step 2's last micro-batch.
  int fail_load_rank = -1;
  struct Oom {
    // The rank that runs out of memory (c10::OutOfMemoryError) in every
    // micro-batch (or piece of one) above `tokens` padded tokens.
    int rank = -1;
    int64_t tokens = 0;
    // "forward" (the loss throws), "backward" (backward throws after the
    // last layers' gradients accumulated) or "synced" (only in the step's
    // last micro-batch: the synchronised backward).
    std::string where = "forward";
    // With device "cuda": the loss allocates this many MiB per padded token
    // under a memory limit of tokens x that + 160 MiB (the real allocator's
    // error instead of an injected one).
    int64_t cuda_mb_per_token = 0;
    // A caching allocator, simulated: this many padded tokens' worth are
    // cached from the start (earlier steps' blocks) and again after each
    // injected error (the failed attempt's), lowering the budget until
    // BalanceConfig::release_cache (scripted here) frees them; with
    // `release` false that hook frees nothing.
    int64_t cached_tokens = 0;
    bool release = true;
  } oom;
  int load_jitter_ms = 0;     // the load sleeps 0..N ms, fixed per micro-batch
  bool owned_loader = false;  // an evenstep::Loader made before the loop
  std::string trace_dir;      // write this rank's timeline there
  struct ScriptedMemory {     // micro-steps report base + per token MiB
    int rank = -1;
    double base_mb = 0, mb_per_padded_token = 0;
  } scripted_memory;
  int extra_buffer_rank = -1;  // holds a touched buffer the others do not
  int extra_buffer_mb = 0;
  enum class Duty {
    kNone,
    kRank0,       // rank 0 alone blocks duty_ms (a synchronous save on rank 0)
    kCheckpoint,  // every rank saves its share through TrainCheckpointer
  };
  Duty duty = Duty::kNone;
  int duty_ms = 60;         // after every step
  bool resume = false;      // kCheckpoint: load the newest checkpoint first
  std::string metrics_dir;  // log loss and rank through a MetricsLogger
  bool evaluate = false;    // evaluate a held-out set after the last step
  int sleep_ms_per_micro = 0;
  // From `step` on, `rank` takes `factor` x sleep_ms_per_micro.
  struct Degrade {
    int rank = -1, step = 0;
    double factor = 1;
  } degrade;
  // Micro-steps timed on a virtual clock only sleep_ms_per_micro advances.
  bool virtual_time = false;
};

// One step of the loop on this rank.
struct BalanceStepRecord {
  int step = 0;          // 1-based, failed steps counted
  absl::Status status;   // the step's error
  bool cleared = false;  // after a failed step: every gradient zero or undefined
  StepReport report;
  double max_grad_error = 0;  // relative, against one process
  BalanceState state;         // after the step (what a checkpoint would hold)
  int64_t next_epoch = 0;
};

struct BalanceRun {
  int rank = 0;
  // A setup error, or the step error that ended the run.
  absl::Status status;
  std::vector<BalanceStepRecord> steps;
  int64_t resumed_step = 0;  // Duty::kCheckpoint with resume
  std::vector<int64_t> resumed_memory_caps;
  std::vector<int> injected_oom_steps;    // this rank's injected errors
  std::vector<Regrouped> regroups;        // regroup_on_loss: each regroup
  std::vector<Regrouped> admissions;      // rejoin_step: each BalancedStep::Admit
  std::vector<HandOverResult> handovers;  // ... each HandOver that completed
  bool joined = false;                    // this process was a replacement
  // rejoin_step, on the rank that started it: the replacement's end.
  int replacement_exit = -1;
  std::string replacement_output;
  // After each handover: the sum of every parameter and optimizer state
  // value, per rank (all equal when the replicas are).
  std::vector<std::vector<double>> digests;
  int cache_releases = 0;                        // calls of the scripted release_cache
  bool reduction_in_flight_after_step4 = false;  // rank 0 with metrics_dir
  double eval_loss_sum = 0, eval_tokens = 0;
  int max_ahead = 0, loads = 0, worker_loads = 0;

  // The record of `step` (nullptr when the loop did not reach it).
  const BalanceStepRecord* at(int step) const;
};

BalanceRun TrainBalanced(DistContext& ctx, const BalanceScenario& scenario);

// EXPECTs that every step of `scenario` ran and succeeded.
void ExpectAllStepsRan(const BalanceRun& run, const BalanceScenario& scenario);

// The run's step and state lines without timing-dependent figures: what two
// runs of one scenario must agree on.
std::string StepLines(const BalanceRun& run);

}  // namespace evenstep::testing

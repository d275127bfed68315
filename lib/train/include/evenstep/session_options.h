// SessionOptions: everything a Session is configured by, as one struct. The
// --evenstep_* flags are one way to fill it (SessionOptions::FromFlags, which
// Session::Create's run_dir forms call); a program with its own flag library,
// a config file or two Sessions with different settings fills it in code:
//
//   evenstep::SessionOptions options;        // the flags' defaults
//   options.run_dir = "runs/a";
//   options.balance.sampler.global_batch = 256;
//   options.ckpt_every = 100;
//   auto es = evenstep::Session::Create(ctx, model, optimizer, lengths, options);
//
// Each field names the flag that fills it; docs/flags.md holds their meaning.
// Create reads the options once: nothing changes them for a running Session.
#pragma once

#include <signal.h>

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "evenstep/balanced_step.h"
#include "evenstep/checkpoint_writer.h"
#include "evenstep/dist_context.h"
#include "evenstep/preflight.h"

namespace evenstep {

enum class ResumeMode {
  kNewest,       // the newest committed checkpoint; an error if it cannot be loaded
  kNewestValid,  // the newest that loads, skipping (and naming) damaged ones
  kOff,          // start at step 1 whatever the directory holds
};

enum class PreflightMode {
  kOff,
  kReport,  // the preflight's table on rank 0
  kWarn,    // its outliers on rank 0
  kFail,    // outliers stop Create (FailedPrecondition naming them)
};

enum class OnSaveError {
  kWarn,  // say so and go on, up to ckpt_max_failures failed saves in a row
  kFail,  // the first failed save stops training
};

struct SessionOptions {
  SessionOptions();

  // Checkpoints (RUN_DIR/ckpt unless checkpoint.dir), logs and timelines
  // (--evenstep_run_dir).
  std::string run_dir = "evenstep_run";
  // The DistContext a Session creates when it is given none (--evenstep_backend,
  // --evenstep_timeout, --evenstep_rendezvous_timeout).
  DistOptions dist;
  // Balanced steps, micro-batching, the data pipeline and the gradient sync
  // (--evenstep_balance, --evenstep_global_batch, ... --evenstep_comm_hook).
  // Its defaults are the flags' (reseed included, which BalanceConfig alone
  // leaves off).
  BalanceConfig balance;
  // --evenstep_ckpt_dir ("" = RUN_DIR/ckpt), --evenstep_ckpt_keep,
  // --evenstep_ckpt_in_flight, --evenstep_ckpt_when_busy, --evenstep_ckpt_slice_mb.
  CheckpointOptions checkpoint;
  int ckpt_every = 0;                              // --evenstep_ckpt_every; 0 = none
  ResumeMode resume = ResumeMode::kNewest;         // --evenstep_resume
  OnSaveError ckpt_on_error = OnSaveError::kWarn;  // --evenstep_ckpt_on_error
  int ckpt_max_failures = 3;                       // --evenstep_ckpt_max_failures; 0 = never
  // Signals that end training with a checkpoint at the next iteration
  // boundary (--evenstep_preempt_signals); empty = none handled.
  std::vector<int> preempt_signals = {SIGTERM, SIGUSR1};
  bool timeline = true;                 // --evenstep_timeline
  int log_every = 10;                   // --evenstep_log_every
  int64_t eval_micro_batch_tokens = 0;  // --evenstep_eval_micro_batch_tokens; 0 = training's
  PreflightMode preflight = PreflightMode::kOff;  // --evenstep_preflight
  // --evenstep_preflight_quick, --evenstep_preflight_data_dir,
  // --evenstep_device, --evenstep_preflight_inject (its ckpt_dir is the
  // checkpoints').
  PreflightOptions preflight_options;
  // Under dynamic balance, each step's split recorded in RUN_DIR/splits
  // (--evenstep_split_record; balance.split_record set in code wins).
  bool split_record = true;
  // A run directory whose split record this run replays (--evenstep_replay;
  // "" = none): see BalanceConfig::split_replay.
  std::string replay;

  // Every --evenstep_* flag, validated: InvalidArgument naming the first bad
  // flag and its valid values or range.
  static absl::StatusOr<SessionOptions> FromFlags();
  // The same checks for options filled in code (InvalidArgument naming the
  // field, with its flag). Session::Create calls it.
  absl::Status Validate() const;
};

}  // namespace evenstep

// Session: Create (options, preflight, the run directory's lock, resume)
// and destruction.
#include <ATen/ATen.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/file.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>
#include <torch/optim/schedulers/lr_scheduler.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <csignal>
#include <cstring>
#include <iostream>
#include <type_traits>
#include <variant>

#include "absl/strings/match.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"
#include "evenstep/internal/kept_values.h"
#include "evenstep/internal/save_tracker.h"
#include "evenstep/log.h"
#include "evenstep/metrics.h"
#include "evenstep/preflight.h"
#include "evenstep/session.h"
#include "evenstep/status_macros.h"
#include "evenstep/timeline.h"
#include "evenstep/train_checkpointer.h"
#include "nlohmann/json.hpp"
#include "session_internal.h"

namespace evenstep {

using internal::g_preempt_signal;
using internal::LearningRates;
using internal::OnPreemptSignal;
using internal::Read;
using internal::Write;

namespace {

// The preflight of --evenstep_preflight (a collective), before training:
// prints what the mode asks for on rank 0, fails with fail and outliers, and
// seeds dynamic balancing's first shares with the ranks' compute speeds.
absl::Status RunSessionPreflight(DistContext& ctx, PreflightMode mode, PreflightOptions options,
                                 const std::string& ckpt_dir, BalanceConfig* config) {
  options.ckpt_dir = ckpt_dir;
  EVENSTEP_ASSIGN_OR_RETURN(PreflightReport report, RunPreflight(ctx, options),
                            "Session::Create, rank ", ctx.rank(), ": preflight");
  std::vector<std::string> outliers;
  for (const PreflightFinding& f : report.findings) {
    if (f.metric != "note") outliers.push_back(f.text);
  }
  if (ctx.rank() == 0) {
    if (mode == PreflightMode::kReport) {
      Log(LogLevel::kReport, report.Table());
    } else {
      for (const std::string& o : outliers) Log(LogLevel::kWarning, "preflight: " + o);
    }
  }
  if (mode == PreflightMode::kFail && !outliers.empty()) {
    return absl::FailedPreconditionError(
        absl::StrCat("rank ", ctx.rank(), ": preflight (--evenstep_preflight=fail) named ",
                     outliers.size(), " outlier(s): ", absl::StrJoin(outliers, "; "),
                     ". Fix or exclude them, or start with --evenstep_preflight=warn"));
  }
  if (config->planner.mode == BalanceMode::kDynamic && config->initial_shares.empty()) {
    config->initial_shares = report.ComputeShares();
  }
  return absl::OkStatus();
}

// What a Session claims its DistContext as: a second Session on one would
// save under the same checkpoint agreement and never commit.
constexpr char kSessionClaim[] = "evenstep::Session";

}  // namespace

Session::~Session() {
  if (run_dir_lock_ >= 0) close(run_dir_lock_);  // releases the flock
  if (owns_context_) ctx_.Release(kSessionClaim);
  for (const auto& [sig, old] : old_handlers_) sigaction(sig, &old, nullptr);
  // A Session that was never finished (an error path) starts no new save;
  // it waits for the saves in flight and reports how they ended.
  if (created_ && !finished_) saves_->Drain(nullptr).IgnoreError();  // each was reported
}

absl::StatusOr<std::unique_ptr<Session>> Session::Create(DistContext& ctx, torch::nn::Module& model,
                                                         torch::optim::Optimizer& optimizer,
                                                         std::vector<int64_t> lengths,
                                                         const std::string& run_dir,
                                                         std::vector<double> counts) {
  return Create(ctx, {ModelPart("model", model, optimizer)}, std::move(lengths), run_dir,
                std::move(counts));
}

namespace {

// An evaluation cap below the longest training sample cannot be meant: say
// so at Create, not at the first evaluation after hours of training
// (Evaluate checks it again against the evaluation set's own lengths).
absl::Status CheckEvalCap(const std::vector<int64_t>& lengths, int64_t eval_cap) {
  if (eval_cap <= 0 || lengths.empty()) return absl::OkStatus();
  const int64_t longest = *std::max_element(lengths.begin(), lengths.end());
  if (eval_cap >= longest) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      "--evenstep_eval_micro_batch_tokens=", eval_cap, " is below the longest training sample (",
      longest, " tokens): an evaluation micro-batch must hold at least one sample"));
}

// --evenstep_resume=off where `dir` holds committed checkpoints: their steps
// cannot be saved again (rank 0 says so).
void SayCommittedCheckpoints(const std::string& dir) {
  absl::StatusOr<CheckpointListing> listing = ListCheckpoints(*Env::Default(), dir);
  if (listing.ok() && !listing->committed.empty()) {
    Log(LogLevel::kWarning,
        absl::StrCat("--evenstep_resume=off: ", dir,
                     " already holds committed checkpoints up to step ", listing->committed.back(),
                     "; saves of those steps will fail rather than overwrite them"));
  }
}

// No checkpoint in `dir` to resume from (rank 0 says so): a run killed
// during its very first save restarts here too, and its uncommitted step
// directory is the only trace of it.
void SayStartingFresh(const std::string& dir) {
  std::string uncommitted;
  if (absl::StatusOr<std::vector<std::string>> names = Env::Default()->List(dir); names.ok()) {
    for (const std::string& n : *names) {
      if (absl::StartsWith(n, "step-")) absl::StrAppend(&uncommitted, " ", n);
    }
  }
  Log(LogLevel::kInfo,
      absl::StrCat("no committed checkpoint in ", dir, ": starting at step 1",
                   uncommitted.empty() ? std::string()
                                       : absl::StrCat(" (never committed, a save that was "
                                                      "interrupted:",
                                                      uncommitted, ")")));
}

// RUN_DIR/splits records the splits of a dynamic-balance run; a replay
// reads REPLAY/splits.
absl::Status SplitRecordIn(const std::string& run_dir, const SessionOptions& options,
                           BalanceConfig* config) {
  if (!options.replay.empty() && config->split_replay.empty()) {
    config->split_replay = options.replay + "/splits";
  }
  if (!options.split_record || !config->split_record.empty() ||
      config->planner.mode != BalanceMode::kDynamic) {
    return absl::OkStatus();
  }
  config->split_record = run_dir + "/splits";
  return Env::Default()->CreateDirs(config->split_record);
}

// The flags' options, `run_dir` (when not empty) for --evenstep_run_dir.
absl::StatusOr<SessionOptions> OptionsWithRunDir(const std::string& run_dir) {
  EVENSTEP_ASSIGN_OR_RETURN(SessionOptions options, SessionOptions::FromFlags());
  if (!run_dir.empty()) options.run_dir = run_dir;
  return options;
}

}  // namespace

absl::StatusOr<std::unique_ptr<Session>> Session::Create(std::vector<ModelPart> parts,
                                                         std::vector<int64_t> lengths,
                                                         const std::string& run_dir,
                                                         std::vector<double> counts) {
  EVENSTEP_ASSIGN_OR_RETURN(SessionOptions options, OptionsWithRunDir(run_dir));
  return Create(std::move(parts), std::move(lengths), std::move(options), std::move(counts));
}

absl::StatusOr<std::unique_ptr<Session>> Session::Create(torch::nn::Module& model,
                                                         torch::optim::Optimizer& optimizer,
                                                         StreamLayout layout,
                                                         const std::string& run_dir) {
  EVENSTEP_ASSIGN_OR_RETURN(SessionOptions options, OptionsWithRunDir(run_dir));
  int64_t& streams = options.balance.sampler.streams;
  if (layout.streams <= 0 || layout.positions <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("Session::Create: a stream layout of ",
                                                   layout.streams, " streams x ", layout.positions,
                                                   " positions (StreamsOf: a [rows, tokens] tensor "
                                                   "with more than stride + 1 tokens per row)"));
  }
  if (streams != 0 && streams != layout.streams) {
    return absl::InvalidArgumentError(absl::StrCat(
        "Session::Create: --evenstep_streams=", streams, ", but the stream layout has ",
        layout.streams, " streams (StreamsOf's rows); leave the flag unset"));
  }
  streams = layout.streams;
  return Create({ModelPart("model", model, optimizer)},
                UniformLengths(layout.streams * layout.positions), std::move(options));
}

absl::StatusOr<std::unique_ptr<Session>> Session::Create(std::vector<ModelPart> parts,
                                                         std::vector<int64_t> lengths,
                                                         SessionOptions options,
                                                         std::vector<double> counts) {
  EVENSTEP_RETURN_IF_ERROR(options.Validate());
  EVENSTEP_ASSIGN_OR_RETURN(std::unique_ptr<DistContext> ctx, DistContext::Create(options.dist));
  DistContext& ref = *ctx;
  EVENSTEP_ASSIGN_OR_RETURN(
      std::unique_ptr<Session> s,
      Create(ref, std::move(parts), std::move(lengths), std::move(options), std::move(counts)));
  s->owned_ctx_ = std::move(ctx);
  return s;
}

absl::StatusOr<std::unique_ptr<Session>> Session::Create(DistContext& ctx,
                                                         std::vector<ModelPart> parts,
                                                         std::vector<int64_t> lengths,
                                                         const std::string& run_dir,
                                                         std::vector<double> counts) {
  EVENSTEP_ASSIGN_OR_RETURN(SessionOptions options, OptionsWithRunDir(run_dir));
  return Create(ctx, std::move(parts), std::move(lengths), std::move(options), std::move(counts));
}

namespace {

// One stage of Create that each rank runs alone, agreed on every rank
// (DistContext::Agree); a failure names its rank.
absl::Status AgreeOnSetUp(DistContext& ctx, absl::Status mine) {
  if (!mine.ok() && !absl::StrContains(mine.message(), absl::StrCat("rank ", ctx.rank()))) {
    mine = Annotate(mine, absl::StrCat("rank ", ctx.rank()));
  }
  return ctx.Agree("Session::Create", mine);
}

}  // namespace

absl::Status Session::ClaimRunDir(const SessionOptions& options) {
  EVENSTEP_RETURN_IF_ERROR(options.Validate());
  if (!ctx_.Claim(kSessionClaim)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "rank ", ctx_.rank(),
        ": a Session already runs on this DistContext; one Session per DistContext (a second "
        "one's checkpoints would never commit, and its steps would interleave with the first's "
        "collectives): finish or destroy the first Session before creating another"));
  }
  owns_context_ = true;
  return LockRunDir(options.run_dir);
}

absl::Status Session::OpenRunFiles(const SessionOptions& options,
                                   const std::vector<int64_t>& lengths,
                                   const CheckpointOptions& ckpt, BalanceConfig* config) {
  const std::string& run_dir = options.run_dir;
  EVENSTEP_RETURN_IF_ERROR(SplitRecordIn(run_dir, options, config), "Session::Create, rank ",
                           ctx_.rank());
  EVENSTEP_RETURN_IF_ERROR(CheckEvalCap(lengths, options.eval_micro_batch_tokens));
  EVENSTEP_ASSIGN_OR_RETURN(checkpointer_, TrainCheckpointer::Create(ctx_, ckpt),
                            "Session::Create, rank ", ctx_.rank(), ": checkpoints in ", ckpt.dir,
                            " (--evenstep_ckpt_dir; default RUN_DIR/ckpt)");
  if (options.timeline) {
    EVENSTEP_ASSIGN_OR_RETURN(timeline_, Timeline::Open(run_dir, ctx_.rank()),
                              "Session::Create, rank ", ctx_.rank(), ": the timeline in ", run_dir,
                              " (--evenstep_timeline)");
  }
  MetricsOptions metrics;
  metrics.dir = run_dir;
  metrics.interval = options.log_every;
  EVENSTEP_ASSIGN_OR_RETURN(metrics_, MetricsLogger::Create(ctx_, metrics),
                            "Session::Create, rank ", ctx_.rank(), ": metric logs in ", run_dir);
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<Session>> Session::Create(DistContext& ctx,
                                                         std::vector<ModelPart> parts,
                                                         std::vector<int64_t> lengths,
                                                         SessionOptions options,
                                                         std::vector<double> counts) {
  std::unique_ptr<Session> s(new Session(ctx, parts));
  const std::string run_dir = options.run_dir;
  BalanceConfig config = options.balance;
  CheckpointOptions ckpt = options.checkpoint;
  if (ckpt.dir.empty()) ckpt.dir = run_dir + "/ckpt";
  // What each rank sets up alone, agreed before the first collective: a
  // rank that fails here stops every rank at once, naming it, instead of
  // leaving the others waiting for it in a collective until the timeout.
  // The run directory is claimed (its lock) before any rank opens a file in
  // it: no file of another run's is touched.
  EVENSTEP_RETURN_IF_ERROR(AgreeOnSetUp(ctx, s->ClaimRunDir(options)));
  EVENSTEP_RETURN_IF_ERROR(AgreeOnSetUp(ctx, s->OpenRunFiles(options, lengths, ckpt, &config)));
  if (options.preflight != PreflightMode::kOff) {
    EVENSTEP_RETURN_IF_ERROR(
        RunSessionPreflight(ctx, options.preflight, options.preflight_options, ckpt.dir, &config));
  }
  s->options_ = options;  // read once: nothing changes a running Session's settings
  // KeepSum's additions join the step sums after each part's sync.
  config.after_sync = [session = s.get(), user = std::move(config.after_sync)] {
    if (user) user();
    session->AddKeptSums();
  };
  EVENSTEP_ASSIGN_OR_RETURN(s->step_,
                            BalancedStep::Create(ctx, std::move(parts), std::move(lengths),
                                                 std::move(config), std::move(counts)),
                            "Session::Create, rank ", ctx.rank(),
                            ": balanced steps and gradient sync");
  if (s->parts_.size() > 1) {
    // The parts' names are valid and distinct (BalancedStep checked them).
    s->parts_module_ = std::make_shared<torch::nn::Module>("ModelParts");
    for (const ModelPart& part : s->parts_) {
      // Not owned: the caller's module outlives the Session.
      s->parts_module_->register_module(
          part.name, std::shared_ptr<torch::nn::Module>(part.module, [](torch::nn::Module*) {}));
    }
  }
  if (options.resume != ResumeMode::kOff) {
    EVENSTEP_RETURN_IF_ERROR(s->Resume(ckpt.dir, options.resume == ResumeMode::kNewestValid));
  } else if (ctx.rank() == 0) {
    SayCommittedCheckpoints(ckpt.dir);
  }
  for (int sig : options.preempt_signals) {
    struct sigaction action {};
    action.sa_handler = OnPreemptSignal;
    sigemptyset(&action.sa_mask);
    action.sa_flags = SA_RESTART;
    struct sigaction old {};
    sigaction(sig, &action, &old);
    s->old_handlers_.emplace_back(sig, old);
  }
  g_preempt_signal = 0;
  s->created_ = true;
  return s;
}

absl::Status Session::Resume(const std::string& ckpt_dir, bool fallback) {
  LoadOptions load;
  load.fallback = fallback;
  const std::vector<std::vector<double>> set_by_program = LearningRates(parts_);
  absl::StatusOr<LoadResult> loaded = checkpointer_->Load(State(), load);
  if (absl::IsNotFound(loaded.status())) {
    if (ctx_.rank() == 0) SayStartingFresh(ckpt_dir);
    return absl::OkStatus();
  }
  if (!loaded.ok()) return loaded.status();
  if (const std::vector<std::vector<double>> saved = LearningRates(parts_);
      ctx_.rank() == 0 && saved != set_by_program) {
    // The trap of a loop that keeps its own copy of the rate (pytorch-cpp's
    // tutorials): the optimizer resumes at the saved rate, the copy does not.
    Log(LogLevel::kInfo,
        absl::StrCat("resume: the optimizers' learning rates are the checkpoint's (",
                     absl::StrJoin(saved[0], ", "), "), not the program's (",
                     absl::StrJoin(set_by_program[0], ", "),
                     "); if the loop keeps its own copy of the rate, keep that too "
                     "(Session::Keep(\"lr\", &lr))"));
  }
  if (ctx_.rank() == 0) {
    for (const std::string& skipped : loaded->skipped) {
      Log(LogLevel::kWarning, "resume: skipped unusable " + skipped);
    }
    Log(LogLevel::kInfo,
        absl::StrCat("resuming from ", loaded->path, " (step ", loaded->step, ")"));
  }
  first_step_ = loaded->step + 1;
  resumed_path_ = loaded->path;
  last_step_ = last_saved_ = loaded->step;
  // Checkpoints of earlier versions hold "{}" here.
  const nlohmann::json session = nlohmann::json::parse(loaded->user_json, nullptr, false);
  const bool boundary = session.is_object() && session.value("boundary", false);
  // Saved inside its step (earlier versions), the step's epoch end is not
  // in the checkpoint: the loop runs it again.
  first_epoch_ = boundary ? step_->epoch() : step_->last_step_epoch();
  loop_vars_.resumed_kept =
      session.is_object() && session.contains("kept") ? session["kept"].dump() : "{}";
  if (session.is_object() && session.contains("loop")) {
    loop_vars_.resumed_state =
        session["loop"].is_string() ? session["loop"].get<std::string>() : session["loop"].dump();
  }
  if (session.is_object() && session.contains("lr_schedulers") &&
      session["lr_schedulers"].is_array()) {
    for (const nlohmann::json& count : session["lr_schedulers"]) {
      schedules_.resumed_counts.push_back(count.is_number_integer() ? count.get<int64_t>() : 0);
    }
  }
  return absl::OkStatus();
}

// Two runs in one run directory would interleave their checkpoints, logs
// and timelines. Rank 0 holds an flock on RUN_DIR/.evenstep.lock (released
// by the kernel when the process ends, however it ends); every rank learns
// the outcome in one all-reduce, so none waits for a rank that stopped.
absl::Status Session::LockRunDir(const std::string& given) {
  // Rank 0 locks; the other ranks learn its outcome when Create's set-up is
  // agreed (DistContext::Agree).
  if (ctx_.rank() != 0) return absl::OkStatus();
  const std::string run_dir = given.empty() ? "." : given;
  const std::string where =
      absl::StrCat("Session::Create, rank ", ctx_.rank(), ": the run directory ", run_dir);
  const absl::Status made = Env::Default()->CreateDirs(run_dir);
  const std::string path = run_dir + "/.evenstep.lock";
  std::string why;
  if (!made.ok()) {
    why = absl::StrCat("cannot create it: ", made.message());
  } else if ((run_dir_lock_ = open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644)) < 0) {
    why = absl::StrCat("cannot open ", path, ": ", strerror(errno));
  } else if (flock(run_dir_lock_, LOCK_EX | LOCK_NB) != 0) {
    char pid[32] = {};
    const ssize_t n = pread(run_dir_lock_, pid, sizeof(pid) - 1, 0);
    close(run_dir_lock_);
    run_dir_lock_ = -1;
    return absl::FailedPreconditionError(
        absl::StrCat(where, " is in use by another run: another run (pid ",
                     n > 0 ? absl::StripAsciiWhitespace(pid) : "?", ") holds ", path,
                     "; wait for it to end, or give this run another directory"));
  } else {
    const std::string mine = absl::StrCat(getpid(), "\n");
    if (ftruncate(run_dir_lock_, 0) != 0 ||
        pwrite(run_dir_lock_, mine.data(), mine.size(), 0) < 0) {
      // Only the holder's pid in the message is lost; the lock holds.
    }
    return absl::OkStatus();
  }
  return absl::FailedPreconditionError(
      absl::StrCat(where, " cannot be used: ", why,
                   "; give this run a directory it may create and write (--evenstep_run_dir or "
                   "Session::Create's run_dir)"));
}

}  // namespace evenstep

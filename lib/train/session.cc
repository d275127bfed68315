// Session: BalancedStep + TrainCheckpointer + Timeline + MetricsLogger, from SessionOptions.
#include "evenstep/session.h"

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
#include <set>
#include <type_traits>
#include <variant>

#include "absl/strings/match.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"
#include "absl/synchronization/mutex.h"
#include "evenstep/internal/kept_values.h"
#include "evenstep/log.h"
#include "evenstep/metrics.h"
#include "evenstep/preflight.h"
#include "evenstep/status_macros.h"
#include "evenstep/timeline.h"
#include "evenstep/train_checkpointer.h"
#include "nlohmann/json.hpp"

namespace evenstep {
namespace {

// The last preemption signal received (0 = none), set by the handler.
volatile std::sig_atomic_t g_preempt_signal = 0;
extern "C" void OnPreemptSignal(int sig) { g_preempt_signal = sig; }

// A KeepSum variable, whatever its type, as a double and back.
using SumPointer = std::variant<double*, float*, int64_t*, size_t*, int*>;
double Read(const SumPointer& value) {
  return std::visit([](auto* p) { return static_cast<double>(*p); }, value);
}
void Write(const SumPointer& value, double v) {
  std::visit(
      [v](auto* p) {
        using T = std::remove_pointer_t<decltype(p)>;
        *p = std::is_floating_point_v<T> ? static_cast<T>(v) : static_cast<T>(std::llround(v));
      },
      value);
}

}  // namespace

// The preflight of --evenstep_preflight (a collective), before training:
// prints what the mode asks for on rank 0, fails with fail and outliers, and
// seeds dynamic balancing's first shares with the ranks' compute speeds.
namespace {
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

// The DistContexts a Session runs on: a second Session on one would save
// under the same checkpoint agreement and never commit.
absl::Mutex sessions_mu;
std::set<const DistContext*>& ContextsWithSession() {
  static auto* contexts = new std::set<const DistContext*>();
  return *contexts;
}
// Every part's optimizer's rate, by parameter group.
std::vector<std::vector<double>> LearningRates(const std::vector<ModelPart>& parts) {
  std::vector<std::vector<double>> rates;
  for (const ModelPart& part : parts) {
    rates.emplace_back();
    for (auto& g : part.optimizer->param_groups()) rates.back().push_back(g.options().get_lr());
  }
  return rates;
}

}  // namespace

Session::Session(DistContext& ctx, std::vector<ModelPart> parts)
    : ctx_(ctx), parts_(std::move(parts)), kept_(std::make_unique<internal::KeptValues>()) {}

TrainState Session::State() const {
  TrainState state;
  state.balance = step_.get();
  if (parts_module_ == nullptr) {
    state.model = parts_[0].module;
    state.optimizer = parts_[0].optimizer;
  } else {
    state.model = parts_module_.get();
    for (const ModelPart& part : parts_) state.optimizers.emplace_back(part.name, part.optimizer);
  }
  nlohmann::json session = {{"lr_schedulers", nlohmann::json::array()}};
  for (const LrSchedule& s : schedules_) {
    if (s.scheduler != nullptr) session["lr_schedulers"].push_back(s.count);
  }
  if (user_state_) {
    const std::string text = user_state_();
    nlohmann::json loop = nlohmann::json::parse(text, nullptr, false);
    // An invalid document is kept as a string: Save then stores it as is
    // rather than failing the checkpoint.
    session["loop"] = loop.is_discarded() ? nlohmann::json(text) : std::move(loop);
  }
  if (!kept_->empty()) session["kept"] = nlohmann::json::parse(kept_->Json());
  // Taken at an iteration boundary: the loop's code after the step ran
  // (first_epoch on resume).
  session["boundary"] = true;
  state.user_json = session.dump();
  return state;
}

absl::StatusOr<size_t> Session::PartIndex(const std::string& part) const {
  if (part.empty()) return 0;
  std::vector<std::string> names;
  for (size_t k = 0; k < parts_.size(); ++k) {
    if (parts_[k].name == part) return k;
    names.push_back(parts_[k].name);
  }
  return absl::InvalidArgumentError(
      absl::StrCat("no model part '", part, "' (the parts: ", absl::StrJoin(names, ", "), ")"));
}

void Session::ScheduleLearningRate(std::function<double(int64_t, int64_t)> lr,
                                   const std::string& part) {
  absl::StatusOr<size_t> index = PartIndex(part);
  if (!index.ok()) {
    KeepError(Annotate(index.status(), "Session::ScheduleLearningRate"));
  } else if (!lr) {
    KeepError(absl::InvalidArgumentError("Session::ScheduleLearningRate: no function"));
  } else {
    schedules_.push_back({std::move(lr), nullptr, *index, false, 0});
  }
}

void Session::Schedule(torch::optim::LRScheduler& scheduler, Every every) {
  KeepError(AddScheduler(scheduler, every));
}

absl::Status Session::AddScheduler(torch::optim::LRScheduler& scheduler, Every every) {
  size_t registered = 0;
  for (const LrSchedule& s : schedules_) registered += s.scheduler != nullptr ? 1 : 0;
  LrSchedule schedule{nullptr, &scheduler, 0, every == Every::kEpoch, 0};
  if (registered < resumed_counts_.size()) {
    // Replay its steps to restore its own count; the rates the replay sets
    // give way to the checkpoint's (already in the optimizers).
    const std::vector<std::vector<double>> rates = LearningRates(parts_);
    schedule.count = resumed_counts_[registered];
    try {
      for (int64_t i = 0; i < schedule.count; ++i) scheduler.step();
    } catch (const std::exception& e) {
      return absl::InternalError(absl::StrCat("Session::Schedule: replaying ", schedule.count,
                                              " scheduler steps: ", e.what()));
    }
    for (size_t k = 0; k < parts_.size(); ++k) {
      auto& groups = parts_[k].optimizer->param_groups();
      for (size_t g = 0; g < groups.size(); ++g) groups[g].options().set_lr(rates[k][g]);
    }
  }
  schedules_.push_back(std::move(schedule));
  return absl::OkStatus();
}

void Session::StepSchedulers(const StepReport& report) {
  const bool epoch_ended = step_->epoch() != report.epoch;
  for (LrSchedule& s : schedules_) {
    if (s.scheduler == nullptr || (s.per_epoch && !epoch_ended)) continue;
    s.scheduler->step();
    ++s.count;
  }
}

absl::StatusOr<StepReport> Session::Step(const std::vector<PartLoss>& losses) {
  return Around([&] { return step_->Step(losses); });
}

Session::~Session() {
  if (run_dir_lock_ >= 0) close(run_dir_lock_);  // releases the flock
  if (owns_context_) {
    absl::MutexLock lock(&sessions_mu);
    ContextsWithSession().erase(&ctx_);
  }
  for (const auto& [sig, old] : old_handlers_) sigaction(sig, &old, nullptr);
  // A Session that was never finished (an error path) starts no new save;
  // it waits for the saves in flight and reports how they ended.
  if (created_ && !finished_) DrainSaves(nullptr).IgnoreError();  // each was reported
}

absl::StatusOr<std::unique_ptr<Session>> Session::Create(DistContext& ctx, torch::nn::Module& model,
                                                         torch::optim::Optimizer& optimizer,
                                                         std::vector<int64_t> lengths,
                                                         const std::string& run_dir,
                                                         std::vector<double> counts) {
  return Create(ctx, {ModelPart("model", model, optimizer)}, std::move(lengths), run_dir,
                std::move(counts));
}

int Session::rank() const { return ctx_.rank(); }
int Session::world_size() const { return ctx_.world_size(); }

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

absl::StatusOr<std::unique_ptr<Session>> Session::Create(DistContext& ctx,
                                                         std::vector<ModelPart> parts,
                                                         std::vector<int64_t> lengths,
                                                         SessionOptions options,
                                                         std::vector<double> counts) {
  EVENSTEP_RETURN_IF_ERROR(options.Validate());
  std::unique_ptr<Session> s(new Session(ctx, parts));
  {
    absl::MutexLock lock(&sessions_mu);
    if (!ContextsWithSession().insert(&ctx).second) {
      return absl::FailedPreconditionError(absl::StrCat(
          "rank ", ctx.rank(),
          ": a Session already runs on this DistContext; one Session per DistContext (a second "
          "one's checkpoints would never commit, and its steps would interleave with the first's "
          "collectives): finish or destroy the first Session before creating another"));
    }
    s->owns_context_ = true;
  }
  const std::string run_dir = options.run_dir;
  EVENSTEP_RETURN_IF_ERROR(s->LockRunDir(run_dir));
  BalanceConfig config = options.balance;
  EVENSTEP_RETURN_IF_ERROR(SplitRecordIn(run_dir, options, &config), "Session::Create, rank ",
                           ctx.rank());
  CheckpointOptions ckpt = options.checkpoint;
  if (ckpt.dir.empty()) ckpt.dir = run_dir + "/ckpt";
  if (options.preflight != PreflightMode::kOff) {
    EVENSTEP_RETURN_IF_ERROR(
        RunSessionPreflight(ctx, options.preflight, options.preflight_options, ckpt.dir, &config));
  }
  EVENSTEP_RETURN_IF_ERROR(CheckEvalCap(lengths, options.eval_micro_batch_tokens));
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
  EVENSTEP_ASSIGN_OR_RETURN(s->checkpointer_, TrainCheckpointer::Create(ctx, ckpt),
                            "Session::Create, rank ", ctx.rank(), ": checkpoints in ", ckpt.dir,
                            " (--evenstep_ckpt_dir; default RUN_DIR/ckpt)");
  if (options.timeline) {
    EVENSTEP_ASSIGN_OR_RETURN(s->timeline_, Timeline::Open(run_dir, ctx.rank()),
                              "Session::Create, rank ", ctx.rank(), ": the timeline in ", run_dir,
                              " (--evenstep_timeline)");
  }
  MetricsOptions metrics;
  metrics.dir = run_dir;
  metrics.interval = options.log_every;
  EVENSTEP_ASSIGN_OR_RETURN(s->metrics_, MetricsLogger::Create(ctx, metrics),
                            "Session::Create, rank ", ctx.rank(), ": metric logs in ", run_dir);
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
  resumed_kept_ = session.is_object() && session.contains("kept") ? session["kept"].dump() : "{}";
  if (session.is_object() && session.contains("loop")) {
    resumed_user_state_ =
        session["loop"].is_string() ? session["loop"].get<std::string>() : session["loop"].dump();
  }
  if (session.is_object() && session.contains("lr_schedulers") &&
      session["lr_schedulers"].is_array()) {
    for (const nlohmann::json& count : session["lr_schedulers"]) {
      resumed_counts_.push_back(count.is_number_integer() ? count.get<int64_t>() : 0);
    }
  }
  return absl::OkStatus();
}

// Two runs in one run directory would interleave their checkpoints, logs
// and timelines. Rank 0 holds an flock on RUN_DIR/.evenstep.lock (released
// by the kernel when the process ends, however it ends); every rank learns
// the outcome in one all-reduce, so none waits for a rank that stopped.
absl::Status Session::LockRunDir(const std::string& given) {
  const std::string run_dir = given.empty() ? "." : given;
  // What rank 0 found: 0 the lock is ours, 1 another run holds it, 2 the
  // directory or its lock file cannot be made or opened (why says which).
  double verdict = 0;
  std::string why;
  if (ctx_.rank() == 0) {
    const absl::Status made = Env::Default()->CreateDirs(run_dir);
    const std::string path = run_dir + "/.evenstep.lock";
    if (!made.ok()) {
      verdict = 2;
      why = absl::StrCat("cannot create it: ", made.message());
    } else if ((run_dir_lock_ = open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644)) < 0) {
      verdict = 2;
      why = absl::StrCat("cannot open ", path, ": ", strerror(errno));
    } else if (flock(run_dir_lock_, LOCK_EX | LOCK_NB) != 0) {
      char pid[32] = {};
      const ssize_t n = pread(run_dir_lock_, pid, sizeof(pid) - 1, 0);
      verdict = 1;
      why = absl::StrCat("another run (pid ", n > 0 ? absl::StripAsciiWhitespace(pid) : "?",
                         ") holds ", path);
      close(run_dir_lock_);
      run_dir_lock_ = -1;
    } else {
      const std::string mine = absl::StrCat(getpid(), "\n");
      if (ftruncate(run_dir_lock_, 0) != 0 ||
          pwrite(run_dir_lock_, mine.data(), mine.size(), 0) < 0) {
        // Only the holder's pid in the message is lost; the lock holds.
      }
    }
  }
  at::Tensor shared = at::full({1}, verdict, at::kDouble);
  EVENSTEP_RETURN_IF_ERROR(ctx_.AllReduce(shared), "Session::Create, rank ", ctx_.rank(),
                           ": agreeing on the run directory ", run_dir);
  verdict = shared.item<double>();
  if (verdict == 0) return absl::OkStatus();
  const std::string said = why.empty() ? " (rank 0 says why)" : ": " + why;
  if (verdict == 2) {
    return absl::FailedPreconditionError(
        absl::StrCat("Session::Create, rank ", ctx_.rank(), ": the run directory ", run_dir,
                     " cannot be used", said,
                     "; give this run a directory it may create and write (--evenstep_run_dir or "
                     "Session::Create's run_dir)"));
  }
  return absl::FailedPreconditionError(
      absl::StrCat("Session::Create, rank ", ctx_.rank(), ": the run directory ", run_dir,
                   " is in use by another run", said,
                   "; wait for it to end, or give this run another directory"));
}

absl::Status Session::BeforeStep() {
  if (!setup_error_.ok()) return setup_error_;
  // The iteration boundary: the loop's code after the last step has run.
  if (preempt_signal_ > 0) return StopForPreemption(preempt_signal_, last_step_);
  if (save_due_) EVENSTEP_RETURN_IF_ERROR(Checkpoint());
  const int64_t step = last_step_ + 1, epoch = step_->epoch();
  for (const LrSchedule& s : schedules_) {
    if (!s.lr) continue;
    const double lr = s.lr(step, epoch);
    for (auto& g : parts_[s.part].optimizer->param_groups()) g.options().set_lr(lr);
  }
  // Shared in this step's exchange: after it, every rank knows.
  step_->ShareAtNextExchange(kPreemptSignal, static_cast<double>(g_preempt_signal));
  for (SumBinding& k : kept_sums_) {
    if (k.bound) k.start = k.added = Read(k.value);
  }
  return absl::OkStatus();
}

absl::Status Session::StopForPreemption(int signal, int64_t step) {
  if (ctx_.rank() == 0 && !preempted_) {
    std::string line =
        absl::StrCat("preemption (signal ", signal, ") at step ", step, ": ",
                     last_step_ > last_saved_ ? "saving" : "already saving", " step ", step);
    if (!pending_.empty()) {
      // Saves in flight complete (and commit) first; none is abandoned.
      absl::StrAppend(&line, " after ", pending_.size(), " save(s) in flight (from step ",
                      pending_.front().step, ")");
    }
    Log(LogLevel::kInfo, line + ", then stopping");
  }
  absl::Status s;
  if (last_step_ > last_saved_) s = Checkpoint();
  int64_t final_step = -1;
  const absl::Status outcome = DrainSaves(&final_step);
  if (s.ok()) s = outcome;
  EVENSTEP_RETURN_IF_ERROR(s, "rank ", ctx_.rank(), ": preemption at step ", step,
                           ": the checkpoint of step ", final_step, " failed");
  preempted_ = true;
  return absl::CancelledError(absl::StrCat(
      "rank ", ctx_.rank(), ": preempted by signal ", signal, " at step ", step,
      "; the checkpoint of step ", step, " is committed: the next run resumes at step ", step + 1));
}

void Session::Observe(int64_t step, const absl::Status& outcome) {
  if (outcome.ok()) {
    failure_run_ = 0;
    return;
  }
  ++save_failures_;
  if (++failure_run_ == 1) run_first_step_ = step;
  if (failure_run_ > longest_failure_run_) {
    longest_failure_run_ = failure_run_;
    longest_first_step_ = run_first_step_;
  }
  last_save_error_ = outcome;
  Log(LogLevel::kWarning,
      absl::StrCat("rank ", ctx_.rank(), ": the checkpoint of step ", step, " FAILED (",
                   save_failures_, " failed saves so far): ", outcome.message()));
}

absl::Status Session::DrainSaves(int64_t* last_step) {
  absl::Status outcome;
  while (!pending_.empty()) {
    if (last_step != nullptr) *last_step = pending_.front().step;
    outcome = pending_.front().done.get();
    Observe(pending_.front().step, outcome);
    pending_.pop_front();
  }
  return outcome;
}

void Session::PollSaves() {
  while (!pending_.empty() &&
         pending_.front().done.wait_for(std::chrono::seconds(0)) == std::future_status::ready) {
    Observe(pending_.front().step, pending_.front().done.get());
    pending_.pop_front();
  }
}

absl::Status Session::AfterStep(StepReport* report) {
  last_step_ = report->step;
  last_report_ = *report;
  StepSchedulers(*report);
  if (ctx_.world_size() > 1) {
    // Every rank's additions: the same value on every rank.
    for (const SumBinding& k : kept_sums_) {
      if (k.bound) Write(k.value, k.start + report->sum(k.sum));
    }
  }
  if (user_update_) user_update_(*report);
  if (timeline_) timeline_->AddStep(*report);
  if (ctx_.rank() == 0) {
    for (const std::string& alert : report->health_alerts) {
      Log(LogLevel::kWarning, "health: " + alert);
    }
    for (const std::string& line : report->oom_recoveries) {
      Log(LogLevel::kWarning, "out of memory: " + line);
    }
  }
  metrics_->Log(report->step, "loss", report->loss);
  for (size_t k = 1; k < parts_.size(); ++k) {
    metrics_->Log(report->step, "loss_" + parts_[k].name, report->part_losses[k]);
  }
  // The same on every rank: the cross-rank mean the logger writes is the sum.
  for (const auto& [name, sum] : report->sums) metrics_->Log(report->step, name, sum);
  metrics_->Log(report->step, "balance_efficiency", report->balance_efficiency);
  // This rank's peak memory (its own metrics file) and the largest rank's.
  constexpr double kMiB = 1 << 20;
  metrics_->Log(report->step, "peak_memory_mb", report->memory.peak_bytes / kMiB);
  if (!report->rank_peak_memory.empty()) {
    metrics_->Log(
        report->step, "peak_memory_max_mb",
        *std::max_element(report->rank_peak_memory.begin(), report->rank_peak_memory.end()) / kMiB);
  }
  EVENSTEP_RETURN_IF_ERROR(metrics_->EndStep(report->step), "rank ", ctx_.rank(), ", step ",
                           report->step, ": metrics");
  // Saves that finished since the last step are reported now; whether to
  // stop is decided from the agreed maximum, so every rank stops together.
  PollSaves();
  report->checkpoint_failures = save_failures_;
  step_->ShareAtNextExchange(kSaveFailureRun, longest_failure_run_);
  const double agreed_run = report->agreed[kSaveFailureRun];
  const bool fail_first = options_.ckpt_on_error == OnSaveError::kFail;
  const int stop_after = fail_first ? 1 : options_.ckpt_max_failures;  // 0: never
  if (stop_after > 0 && agreed_run >= stop_after) {
    // A save's outcome is known only when it ends, in the background: by the
    // step every rank agrees on it, later saves may have started and failed
    // too, so the count can exceed the limit.
    const std::string why =
        fail_first
            ? absl::StrCat("--evenstep_ckpt_on_error=fail stops at the first failed save (",
                           static_cast<int64_t>(agreed_run), " in a row by now)")
            : absl::StrCat(static_cast<int64_t>(agreed_run),
                           " checkpoint saves failed in a row (--evenstep_ckpt_on_error=warn, "
                           "--evenstep_ckpt_max_failures=",
                           options_.ckpt_max_failures, ")");
    return absl::DataLossError(absl::StrCat(
        "rank ", ctx_.rank(), ", step ", report->step, ": ", why,
        "; training stops rather than run on without checkpoints. ",
        last_save_error_.ok() ? "The failure was seen first by another rank (see its output)"
                              : absl::StrCat("The failed saves began at step ", longest_first_step_,
                                             "; the last failure: ", last_save_error_.message())));
  }
  // Both wait for the iteration boundary (BeforeStep, Finish).
  if (const double signal = report->agreed[kPreemptSignal]; signal > 0) {
    preempt_signal_ = static_cast<int>(signal);
    if (ctx_.rank() == 0) {
      Log(LogLevel::kInfo, absl::StrCat("preemption (signal ", preempt_signal_, ") at step ",
                                        report->step, ": step ", report->step,
                                        " is saved when the loop next calls Step or Finish, "
                                        "which then stop"));
    }
  }
  save_due_ = options_.ckpt_every > 0 && report->step % options_.ckpt_every == 0;
  return absl::OkStatus();
}

absl::Status Session::AddStreamState(const std::string& name, at::Tensor* state,
                                     int64_t stream_dim) {
  const std::string where =
      absl::StrCat("Session::AddStreamState('", name, "'), rank ", ctx_.rank());
  const int64_t streams = step_->sampler().options().streams;
  if (streams <= 0) {
    return absl::FailedPreconditionError(
        absl::StrCat(where, ": not in stream mode (--evenstep_streams=0)"));
  }
  if (state == nullptr || !state->defined() || stream_dim < 0 || stream_dim >= state->dim() ||
      state->size(stream_dim) != streams) {
    return absl::InvalidArgumentError(absl::StrCat(
        where, ": expected a tensor whose dimension ", stream_dim, " has the ", streams,
        " streams; got ",
        state != nullptr && state->defined() ? c10::str(state->sizes()) : std::string("none")));
  }
  for (const StreamState& s : stream_states_) {
    if (s.name == name)
      return absl::InvalidArgumentError(absl::StrCat(where, ": registered twice"));
  }
  stream_states_.push_back({name, state, stream_dim});
  if (resumed_path_.empty()) return absl::OkStatus();
  absl::Status loaded = LoadResumedTensor("stream/" + name, state);
  if (absl::IsNotFound(loaded)) {
    return absl::FailedPreconditionError(
        absl::StrCat(where, ": the resumed checkpoint ", resumed_path_,
                     " holds no stream state of that name (the run that saved it did not "
                     "register it)"));
  }
  EVENSTEP_RETURN_IF_ERROR(loaded, where, ": loading it from ", resumed_path_);
  return absl::OkStatus();
}

absl::Status Session::LoadResumedTensor(const std::string& name, at::Tensor* tensor) {
  TrainState only;
  only.tensors.push_back({name, *tensor});
  LoadOptions load;
  load.strict = false;
  load.path = resumed_path_;
  EVENSTEP_ASSIGN_OR_RETURN(LoadResult loaded, checkpointer_->Load(only, load));
  if (!loaded.missing.empty()) {
    return absl::NotFoundError(absl::StrCat(resumed_path_, " holds no tensor ", name));
  }
  return absl::OkStatus();
}

template <typename T>
void Session::KeepValue(const std::string& name, T* value) {
  if (last_step_ >= first_step_) {
    KeepError(absl::FailedPreconditionError(absl::StrCat(
        "Session::Keep('", name, "'), rank ", ctx_.rank(),
        ": called after the first step; keep the loop's variables before it, so that a resumed "
        "run restores them before using them")));
    return;
  }
  absl::Status s = kept_->Add(name, value, resumed_kept_,
                              [this](const std::string& tensor_name, at::Tensor* tensor) {
                                return LoadResumedTensor(tensor_name, tensor);
                              });
  if (!s.ok()) {
    KeepError(absl::Status(
        s.code(),
        absl::StrCat(s.message(), " (rank ", ctx_.rank(),
                     resumed_path_.empty() ? "" : ", resumed from " + resumed_path_, ")")));
  }
}

template <typename T>
void Session::KeepSumOf(const std::string& name, T* value) {
  KeepValue(name, value);
  if (!setup_error_.ok() || value == nullptr) return;
  SumBinding kept;
  kept.sum = "kept/" + name;
  kept.value = value;
  KeepError(step_->DeclareSum(kept.sum));
  kept_sums_.push_back(std::move(kept));
}

void Session::KeepSum(const std::string& name, double* value) { KeepSumOf(name, value); }
void Session::KeepSum(const std::string& name, float* value) { KeepSumOf(name, value); }
void Session::KeepSum(const std::string& name, int64_t* value) { KeepSumOf(name, value); }
void Session::KeepSum(const std::string& name, size_t* value) { KeepSumOf(name, value); }
void Session::KeepSum(const std::string& name, int* value) { KeepSumOf(name, value); }

void Session::AddKeptSums() {
  for (SumBinding& k : kept_sums_) {
    if (!k.bound) continue;
    const double now = Read(k.value);
    step_->AddToSum(k.sum, now - k.added);
    k.added = now;
  }
}

template <typename T>
void Session::BindKept(const std::string& name, T* value, bool sum) {
  if (!kept_->Has(name)) {
    if constexpr (std::is_arithmetic_v<T> && !std::is_same_v<T, bool>) {
      if (sum) return KeepSumOf(name, value);
    }
    return KeepValue(name, value);
  }
  absl::Status s = kept_->Rebind(name, value);
  const std::string key = "kept/" + name;
  auto binding = std::find_if(kept_sums_.begin(), kept_sums_.end(),
                              [&](const SumBinding& k) { return k.sum == key; });
  if (s.ok() && sum != (binding != kept_sums_.end())) {
    s = absl::InvalidArgumentError(
        absl::StrCat("evenstep::Kept('", name, "'): declared before as a Kept", sum ? "" : "Sum",
                     " and now as a Kept", sum ? "Sum" : "", "; keep one kind per name"));
  }
  if (!s.ok()) {
    KeepError(absl::Status(s.code(), absl::StrCat(s.message(), " (rank ", ctx_.rank(), ")")));
    return;
  }
  if constexpr (std::is_arithmetic_v<T> && !std::is_same_v<T, bool>) {
    if (sum) {
      binding->value = value;
      binding->start = binding->added = static_cast<double>(*value);
      binding->bound = true;
    }
  }
}

void Session::UnbindKept(const std::string& name) {
  kept_->Unbind(name);
  for (SumBinding& k : kept_sums_) {
    if (k.sum == "kept/" + name) k.bound = false;
  }
}

template void Session::BindKept(const std::string&, double*, bool);
template void Session::BindKept(const std::string&, float*, bool);
template void Session::BindKept(const std::string&, int64_t*, bool);
template void Session::BindKept(const std::string&, int*, bool);
template void Session::BindKept(const std::string&, size_t*, bool);
template void Session::BindKept(const std::string&, bool*, bool);
template void Session::BindKept(const std::string&, std::string*, bool);

void Session::Keep(const std::string& name, double* value) { KeepValue(name, value); }
void Session::Keep(const std::string& name, float* value) { KeepValue(name, value); }
void Session::Keep(const std::string& name, int64_t* value) { KeepValue(name, value); }
void Session::Keep(const std::string& name, int* value) { KeepValue(name, value); }
void Session::Keep(const std::string& name, size_t* value) { KeepValue(name, value); }
void Session::Keep(const std::string& name, bool* value) { KeepValue(name, value); }
void Session::Keep(const std::string& name, std::string* value) { KeepValue(name, value); }
void Session::Keep(const std::string& name, std::vector<double>* value) { KeepValue(name, value); }
void Session::Keep(const std::string& name, std::vector<int64_t>* value) { KeepValue(name, value); }
void Session::Keep(const std::string& name, at::Tensor* value) { KeepValue(name, value); }

absl::Status Session::Checkpoint() {
  save_due_ = false;
  const absl::Time begin = absl::Now();
  TrainState state = State();
  kept_->AddTensors(&state.tensors);
  // Each rank holds its own streams' rows: one all-reduce of each state with
  // the others' rows zeroed gives every rank the whole tensor.
  const auto [first, last] = step_->owned_streams();
  for (const StreamState& s : stream_states_) {
    at::Tensor whole = at::zeros_like(*s.tensor);
    if (last > first) {
      whole.narrow(s.dim, first, last - first).copy_(s.tensor->narrow(s.dim, first, last - first));
    }
    EVENSTEP_RETURN_IF_ERROR(ctx_.AllReduce(whole), "rank ", ctx_.rank(),
                             ": gathering the stream state '", s.name, "' for step ", last_step_);
    state.tensors.push_back({"stream/" + s.name, whole});
  }
  absl::StatusOr<SaveTicket> ticket = checkpointer_->Save(last_step_, state);
  if (timeline_) timeline_->Span("checkpoint", begin, absl::Now(), last_step_);
  if (!ticket.ok()) return ticket.status();
  if (ticket->skipped) {
    if (ctx_.rank() == 0) {
      Log(LogLevel::kInfo, absl::StrCat("checkpoint of step ", last_step_,
                                        " skipped: earlier saves are still writing "
                                        "(--evenstep_ckpt_when_busy=skip)"));
    }
    return absl::OkStatus();
  }
  pending_.push_back({last_step_, ticket->done});
  last_saved_ = last_step_;
  return absl::OkStatus();
}

namespace {

// The evaluation set's micro-batch caps (Session::Evaluate): the flag's
// padded-token cap, else the training caps, else a rank's share of one
// global batch; never below the longest evaluation sample (with the flag,
// that is an error naming it).
absl::Status SetEvalCaps(SamplerOptions& options, const std::vector<int64_t>& lengths, int world,
                         int64_t flag) {
  const int64_t longest = lengths.empty() ? 0 : *std::max_element(lengths.begin(), lengths.end());
  if (flag > 0) {
    if (flag < longest) {
      return absl::InvalidArgumentError(absl::StrCat("--evenstep_eval_micro_batch_tokens=", flag,
                                                     " is below the longest evaluation sample (",
                                                     longest, " tokens)"));
    }
    options.micro_batch_samples = 0;
    options.micro_batch_tokens = flag;
    return absl::OkStatus();
  }
  if (options.micro_batch_samples > 0 || options.micro_batch_tokens > 0) {
    if (options.micro_batch_tokens > 0) {
      options.micro_batch_tokens = std::max(options.micro_batch_tokens, longest);
    }
    return absl::OkStatus();
  }
  const int64_t share = std::max<int64_t>(1, (options.global_batch + world - 1) / world);
  if (options.budget_unit == BatchUnit::kTokens) {
    options.micro_batch_tokens = std::max(share, longest);
  } else {
    options.micro_batch_samples = share;
  }
  return absl::OkStatus();
}

// Puts a module and all its submodules in eval mode and restores each one's
// own mode (some may have been in eval mode already) when destroyed.
class EvalModeGuard {
 public:
  explicit EvalModeGuard(torch::nn::Module& model) {
    // apply() visits the module, then its children, depth-first: restoring
    // in the same order leaves every submodule in its own former mode.
    model.apply([this](torch::nn::Module& m) { modes_.emplace_back(&m, m.is_training()); });
    model.eval();
  }
  ~EvalModeGuard() {
    for (const auto& [module, training] : modes_) module->train(training);
  }
  EvalModeGuard(const EvalModeGuard&) = delete;
  EvalModeGuard& operator=(const EvalModeGuard&) = delete;

 private:
  std::vector<std::pair<torch::nn::Module*, bool>> modes_;
};

}  // namespace

int64_t Session::epoch() const { return step_->epoch(); }

void Session::Backward(const at::Tensor& loss) {
  if (loop_ != nullptr) return loop_->Backward(loss);
  if (loop_status_.ok()) {
    loop_status_ = absl::FailedPreconditionError(absl::StrCat(
        "rank ", ctx_.rank(),
        ": Session::Backward outside a loop over Session::Batches (the callback form's loss "
        "functions return their loss instead)"));
  }
}

absl::StatusOr<std::vector<double>> Session::Evaluate(
    const std::vector<int64_t>& lengths,
    const std::function<at::Tensor(const std::vector<int64_t>&)>& fn) {
  SamplerOptions options = step_->sampler().options();
  options.shuffle = false;
  options.min_micro_batches = 0;
  EVENSTEP_RETURN_IF_ERROR(
      SetEvalCaps(options, lengths, ctx_.world_size(), options_.eval_micro_batch_tokens),
      "Session::Evaluate, rank ", ctx_.rank());
  EVENSTEP_ASSIGN_OR_RETURN(Sampler set, Sampler::Create(lengths, options),
                            "Session::Evaluate: the evaluation set");
  const absl::Time begin = absl::Now();
  absl::StatusOr<std::vector<double>> result;
  {
    EvalModeGuard eval_mode(parts_module_ ? *parts_module_ : *parts_[0].module);
    result = evenstep::Evaluate(ctx_, set, [&](const MicroBatch& mb) { return fn(mb.samples); });
  }
  if (timeline_) timeline_->Span("eval", begin, absl::Now(), last_step_);
  return result;
}

absl::Status Session::Finish() {
  if (!created_ || finished_) return absl::OkStatus();
  finished_ = true;
  step_->CancelPrefetch();  // loads started for a step that will not run
  absl::Status s;
  if (preempt_signal_ > 0) {
    // The last step's preemption: saved (and waited for) here, CANCELLED.
    s = StopForPreemption(preempt_signal_, last_step_);
  } else {
    if (last_step_ > last_saved_) s = Checkpoint();
    int64_t final_step = -1;
    const absl::Status final_outcome = DrainSaves(&final_step);
    if (s.ok() && !final_outcome.ok()) {
      s = Annotate(final_outcome,
                   absl::StrCat("the last checkpoint (step ", final_step, ") failed (",
                                save_failures_, " failed saves in this run)"));
    }
  }
  // Every outcome was read through its ticket above.
  checkpointer_->WaitAll().IgnoreError();
  // A loop over Batches that ended early: its error is the run's.
  if (s.ok()) s = loop_status_;
  absl::Status m = metrics_->Close();
  if (s.ok()) s = m;
  if (timeline_) {
    absl::Status t = timeline_->Close();
    if (s.ok()) s = t;
  }
  return s;
}

}  // namespace evenstep

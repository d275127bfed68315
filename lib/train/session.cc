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
#include "evenstep/internal/save_tracker.h"
#include "evenstep/log.h"
#include "evenstep/metrics.h"
#include "evenstep/preflight.h"
#include "evenstep/status_macros.h"
#include "evenstep/timeline.h"
#include "evenstep/train_checkpointer.h"
#include "nlohmann/json.hpp"
#include "session_internal.h"

namespace evenstep {

using internal::LearningRates;
using internal::Read;
using internal::Write;

namespace internal {
volatile std::sig_atomic_t g_preempt_signal = 0;
extern "C" void OnPreemptSignal(int sig) { g_preempt_signal = sig; }
}  // namespace internal
using internal::g_preempt_signal;

Session::Session(DistContext& ctx, std::vector<ModelPart> parts)
    : ctx_(ctx),
      parts_(std::move(parts)),
      saves_(std::make_unique<internal::SaveTracker>(ctx.rank())) {
  loop_vars_.kept = std::make_unique<internal::KeptValues>();
}

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
  for (const LrSchedule& s : schedules_.list) {
    if (s.scheduler != nullptr) session["lr_schedulers"].push_back(s.count);
  }
  if (loop_vars_.save) {
    const std::string text = loop_vars_.save();
    nlohmann::json loop = nlohmann::json::parse(text, nullptr, false);
    // An invalid document is kept as a string: Save then stores it as is
    // rather than failing the checkpoint.
    session["loop"] = loop.is_discarded() ? nlohmann::json(text) : std::move(loop);
  }
  if (!loop_vars_.kept->empty()) session["kept"] = nlohmann::json::parse(loop_vars_.kept->Json());
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
    schedules_.list.push_back({std::move(lr), nullptr, *index, false, 0});
  }
}

void Session::Schedule(torch::optim::LRScheduler& scheduler, Every every) {
  KeepError(AddScheduler(scheduler, every));
}

absl::Status Session::AddScheduler(torch::optim::LRScheduler& scheduler, Every every) {
  size_t registered = 0;
  for (const LrSchedule& s : schedules_.list) registered += s.scheduler != nullptr ? 1 : 0;
  LrSchedule schedule{nullptr, &scheduler, 0, every == Every::kEpoch, 0};
  if (registered < schedules_.resumed_counts.size()) {
    // Replay its steps to restore its own count; the rates the replay sets
    // give way to the checkpoint's (already in the optimizers).
    const std::vector<std::vector<double>> rates = LearningRates(parts_);
    schedule.count = schedules_.resumed_counts[registered];
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
  schedules_.list.push_back(std::move(schedule));
  return absl::OkStatus();
}

void Session::StepSchedulers(const StepReport& report) {
  const bool epoch_ended = step_->epoch() != report.epoch;
  for (LrSchedule& s : schedules_.list) {
    if (s.scheduler == nullptr || (s.per_epoch && !epoch_ended)) continue;
    s.scheduler->step();
    ++s.count;
  }
}

absl::StatusOr<StepReport> Session::Step(const std::vector<PartLoss>& losses) {
  return Around([&] { return step_->Step(losses); });
}

int Session::rank() const { return ctx_.rank(); }
int Session::world_size() const { return ctx_.world_size(); }

absl::Status Session::BeforeStep() {
  if (!setup_error_.ok()) return setup_error_;
  // The iteration boundary: the loop's code after the last step has run.
  if (preempt_signal_ > 0) return StopForPreemption(preempt_signal_, last_step_);
  if (save_due_) EVENSTEP_RETURN_IF_ERROR(Checkpoint());
  const int64_t step = last_step_ + 1, epoch = step_->epoch();
  for (const LrSchedule& s : schedules_.list) {
    if (!s.lr) continue;
    const double lr = s.lr(step, epoch);
    for (auto& g : parts_[s.part].optimizer->param_groups()) g.options().set_lr(lr);
  }
  // Shared in this step's exchange: after it, every rank knows.
  step_->ShareAtNextExchange(kPreemptSignal, static_cast<double>(g_preempt_signal));
  for (SumBinding& k : loop_vars_.sums) {
    if (k.bound) k.start = k.added = Read(k.value);
  }
  return absl::OkStatus();
}

absl::Status Session::StopForPreemption(int signal, int64_t step) {
  if (ctx_.rank() == 0 && !preempted_) {
    std::string line =
        absl::StrCat("preemption (signal ", signal, ") at step ", step, ": ",
                     last_step_ > last_saved_ ? "saving" : "already saving", " step ", step);
    if (!saves_->empty()) {
      // Saves in flight complete (and commit) first; none is abandoned.
      absl::StrAppend(&line, " after ", saves_->in_flight(), " save(s) in flight (from step ",
                      saves_->oldest_step(), ")");
    }
    Log(LogLevel::kInfo, line + ", then stopping");
  }
  absl::Status s;
  if (last_step_ > last_saved_) s = Checkpoint();
  int64_t final_step = -1;
  const absl::Status outcome = saves_->Drain(&final_step);
  if (s.ok()) s = outcome;
  EVENSTEP_RETURN_IF_ERROR(s, "rank ", ctx_.rank(), ": preemption at step ", step,
                           ": the checkpoint of step ", final_step, " failed");
  preempted_ = true;
  return absl::CancelledError(absl::StrCat(
      "rank ", ctx_.rank(), ": preempted by signal ", signal, " at step ", step,
      "; the checkpoint of step ", step, " is committed: the next run resumes at step ", step + 1));
}

absl::Status Session::AfterStep(StepReport* report) {
  last_step_ = report->step;
  last_report_ = *report;
  StepSchedulers(*report);
  if (ctx_.world_size() > 1) {
    // Every rank's additions: the same value on every rank.
    // A step whose figures were lost with a rank adds nothing it knows of.
    for (const SumBinding& k : loop_vars_.sums) {
      if (k.bound && !report->figures_lost) Write(k.value, k.start + report->sum(k.sum));
    }
  }
  if (loop_vars_.update) loop_vars_.update(*report);
  if (timeline_ && !report->figures_lost) timeline_->AddStep(*report);
  if (!report->lost_ranks.empty()) {
    metrics_->Log(report->step, "regroup_seconds", report->regroup_seconds);
    metrics_->Log(report->step, "ranks_lost", static_cast<double>(report->lost_ranks.size()));
  }
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
  saves_->Poll();
  report->checkpoint_failures = saves_->failures();
  step_->ShareAtNextExchange(kSaveFailureRun, saves_->longest_run());
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
        saves_->last_error().ok()
            ? "The failure was seen first by another rank (see its output)"
            : absl::StrCat("The failed saves began at step ", saves_->longest_first_step(),
                           "; the last failure: ", saves_->last_error().message())));
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

absl::Status Session::Checkpoint() {
  save_due_ = false;
  const absl::Time begin = absl::Now();
  TrainState state = State();
  loop_vars_.kept->AddTensors(&state.tensors);
  EVENSTEP_RETURN_IF_ERROR(GatherStreamStates(&state));
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
  saves_->Started(last_step_, ticket->done);
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
    const absl::Status final_outcome = saves_->Drain(&final_step);
    if (s.ok() && !final_outcome.ok()) {
      s = Annotate(final_outcome,
                   absl::StrCat("the last checkpoint (step ", final_step, ") failed (",
                                saves_->failures(), " failed saves in this run)"));
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

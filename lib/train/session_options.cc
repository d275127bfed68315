// SessionOptions: the Session's configuration, from the --evenstep_* flags or
// from code, checked the same way.
#include "evenstep/session_options.h"

#include <signal.h>

#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "evenstep/flags.h"
#include "evenstep/internal/choice.h"
#include "evenstep/internal/flag_checks.h"
#include "evenstep/status_macros.h"
#include "evenstep/train_checkpointer.h"

namespace evenstep {
namespace {

// The signals --evenstep_preempt_signals may name.
constexpr std::pair<const char*, int> kSignals[] = {{"TERM", SIGTERM}, {"USR1", SIGUSR1},
                                                    {"USR2", SIGUSR2}, {"INT", SIGINT},
                                                    {"HUP", SIGHUP},   {"CONT", SIGCONT}};

absl::StatusOr<std::vector<int>> PreemptSignalsFromFlag() {
  const std::string value = absl::GetFlag(FLAGS_evenstep_preempt_signals);
  std::vector<int> signals;
  for (absl::string_view name : absl::StrSplit(value, ',', absl::SkipWhitespace())) {
    name = absl::StripAsciiWhitespace(name);
    if (absl::StartsWithIgnoreCase(name, "SIG")) name.remove_prefix(3);
    int sig = 0;
    for (const auto& [known, number] : kSignals) {
      if (name == known) sig = number;
    }
    if (sig == 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--evenstep_preempt_signals=", value, ": unknown signal '", name,
          "' (expected names from TERM, USR1, USR2, INT, HUP, CONT, comma-separated)"));
    }
    signals.push_back(sig);
  }
  return signals;
}

// The session-level fields' bounds (the structs below them check their own).
absl::Status CheckSessionFields(const SessionOptions& o) {
  if (o.run_dir.empty()) {
    return absl::InvalidArgumentError(
        "--evenstep_run_dir=: empty (a directory for checkpoints, logs and timelines)");
  }
  EVENSTEP_RETURN_IF_ERROR(internal::NotBelow("evenstep_ckpt_every", o.ckpt_every, 0));
  EVENSTEP_RETURN_IF_ERROR(internal::NotBelow("evenstep_log_every", o.log_every, 1));
  EVENSTEP_RETURN_IF_ERROR(internal::NotBelow("evenstep_eval_micro_batch_tokens",
                                              static_cast<double>(o.eval_micro_batch_tokens), 0));
  EVENSTEP_RETURN_IF_ERROR(
      internal::NotBelow("evenstep_ckpt_max_failures", o.ckpt_max_failures, 0));
  for (int sig : o.preempt_signals) {
    bool known = false;
    for (const auto& entry : kSignals) known = known || entry.second == sig;
    if (!known) {
      return absl::InvalidArgumentError(absl::StrCat(
          "preempt_signals: signal ", sig,
          " is not one a preemption is sent with (SIGTERM, SIGUSR1, SIGUSR2, SIGINT, SIGHUP, "
          "SIGCONT)"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

SessionOptions::SessionOptions() {
  // --evenstep_reseed's default: every micro-batch's random draws from
  // (seed, step, micro-batch), whatever the split.
  balance.reseed = true;
}

absl::Status SessionOptions::Validate() const {
  EVENSTEP_RETURN_IF_ERROR(CheckSessionFields(*this), "SessionOptions");
  EVENSTEP_RETURN_IF_ERROR(internal::CheckDistOptions(dist), "SessionOptions.dist");
  EVENSTEP_RETURN_IF_ERROR(internal::CheckBalanceConfig(balance), "SessionOptions.balance");
  EVENSTEP_RETURN_IF_ERROR(internal::CheckCheckpointOptions(checkpoint),
                           "SessionOptions.checkpoint");
  return absl::OkStatus();
}

absl::StatusOr<SessionOptions> SessionOptions::FromFlags() {
  SessionOptions o;
  o.run_dir = absl::GetFlag(FLAGS_evenstep_run_dir);
  EVENSTEP_ASSIGN_OR_RETURN(o.dist, DistOptionsFromFlags());
  EVENSTEP_ASSIGN_OR_RETURN(o.balance, BalanceConfigFromFlags());
  EVENSTEP_ASSIGN_OR_RETURN(o.checkpoint, CheckpointOptionsFromFlags());
  o.ckpt_every = absl::GetFlag(FLAGS_evenstep_ckpt_every);
  EVENSTEP_ASSIGN_OR_RETURN(o.resume, internal::Choose<ResumeMode>(
                                          "--evenstep_resume", absl::GetFlag(FLAGS_evenstep_resume),
                                          {{"newest", ResumeMode::kNewest},
                                           {"newest_valid", ResumeMode::kNewestValid},
                                           {"off", ResumeMode::kOff},
                                           {"true", ResumeMode::kNewest},
                                           {"1", ResumeMode::kNewest},
                                           {"false", ResumeMode::kOff},
                                           {"0", ResumeMode::kOff}}));
  EVENSTEP_ASSIGN_OR_RETURN(
      o.ckpt_on_error, internal::Choose<OnSaveError>(
                           "--evenstep_ckpt_on_error", absl::GetFlag(FLAGS_evenstep_ckpt_on_error),
                           {{"warn", OnSaveError::kWarn}, {"fail", OnSaveError::kFail}}));
  o.ckpt_max_failures = absl::GetFlag(FLAGS_evenstep_ckpt_max_failures);
  EVENSTEP_ASSIGN_OR_RETURN(o.preempt_signals, PreemptSignalsFromFlag());
  o.timeline = absl::GetFlag(FLAGS_evenstep_timeline);
  o.log_every = absl::GetFlag(FLAGS_evenstep_log_every);
  o.eval_micro_batch_tokens = absl::GetFlag(FLAGS_evenstep_eval_micro_batch_tokens);
  EVENSTEP_ASSIGN_OR_RETURN(o.preflight,
                            internal::Choose<PreflightMode>("--evenstep_preflight",
                                                            absl::GetFlag(FLAGS_evenstep_preflight),
                                                            {{"off", PreflightMode::kOff},
                                                             {"report", PreflightMode::kReport},
                                                             {"warn", PreflightMode::kWarn},
                                                             {"fail", PreflightMode::kFail},
                                                             {"false", PreflightMode::kOff},
                                                             {"0", PreflightMode::kOff}}));
  EVENSTEP_ASSIGN_OR_RETURN(o.preflight_options, PreflightOptionsFromFlags());
  o.split_record = absl::GetFlag(FLAGS_evenstep_split_record);
  o.replay = absl::GetFlag(FLAGS_evenstep_replay);
  EVENSTEP_RETURN_IF_ERROR(CheckSessionFields(o));
  return o;
}

absl::Status ValidateEvenstepFlags() { return SessionOptions::FromFlags().status(); }

}  // namespace evenstep

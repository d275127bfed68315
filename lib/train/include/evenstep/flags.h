// The --evenstep_* command-line flags (Abseil flags). A trainer that parses its
// command line with absl::ParseCommandLine gets them for free; the table in
// docs/flags.md is generated from their help texts (tools/evenstep_flags_md).
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "absl/flags/declare.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"

ABSL_DECLARE_FLAG(std::string, evenstep_backend);
ABSL_DECLARE_FLAG(absl::Duration, evenstep_timeout);
ABSL_DECLARE_FLAG(absl::Duration, evenstep_rendezvous_timeout);
ABSL_DECLARE_FLAG(std::string, evenstep_comm_hook);
ABSL_DECLARE_FLAG(std::string, evenstep_sync_topology);
ABSL_DECLARE_FLAG(double, evenstep_bucket_cap_mb);
ABSL_DECLARE_FLAG(double, evenstep_first_bucket_cap_mb);
ABSL_DECLARE_FLAG(std::string, evenstep_balance);
ABSL_DECLARE_FLAG(int64_t, evenstep_global_batch);
ABSL_DECLARE_FLAG(std::string, evenstep_batch_unit);
ABSL_DECLARE_FLAG(int64_t, evenstep_micro_batch_samples);
ABSL_DECLARE_FLAG(int64_t, evenstep_micro_batch_tokens);
ABSL_DECLARE_FLAG(int, evenstep_min_micro_batches);
ABSL_DECLARE_FLAG(int, evenstep_max_micro_batches);
ABSL_DECLARE_FLAG(int, evenstep_plan_interval);
ABSL_DECLARE_FLAG(double, evenstep_plan_damping);
ABSL_DECLARE_FLAG(int, evenstep_warmup_steps);
ABSL_DECLARE_FLAG(uint64_t, evenstep_seed);
ABSL_DECLARE_FLAG(int64_t, evenstep_sort_window);
ABSL_DECLARE_FLAG(int, evenstep_data_workers);
ABSL_DECLARE_FLAG(int, evenstep_prefetch);
ABSL_DECLARE_FLAG(bool, evenstep_prefetch_next_step);
ABSL_DECLARE_FLAG(bool, evenstep_drop_last);
ABSL_DECLARE_FLAG(bool, evenstep_shuffle);
ABSL_DECLARE_FLAG(int64_t, evenstep_streams);
ABSL_DECLARE_FLAG(bool, evenstep_reseed);
ABSL_DECLARE_FLAG(bool, evenstep_split_record);
ABSL_DECLARE_FLAG(std::string, evenstep_replay);
ABSL_DECLARE_FLAG(std::string, evenstep_normalize);
ABSL_DECLARE_FLAG(std::string, evenstep_loss_reduction);
ABSL_DECLARE_FLAG(std::string, evenstep_objective);
ABSL_DECLARE_FLAG(double, evenstep_cost_quadratic);
ABSL_DECLARE_FLAG(std::string, evenstep_oom);
ABSL_DECLARE_FLAG(double, evenstep_memory_limit_mb);
ABSL_DECLARE_FLAG(double, evenstep_memory_headroom);
ABSL_DECLARE_FLAG(double, evenstep_clip_grad_norm);
ABSL_DECLARE_FLAG(std::string, evenstep_run_dir);
ABSL_DECLARE_FLAG(std::string, evenstep_ckpt_dir);
ABSL_DECLARE_FLAG(int, evenstep_ckpt_keep);
ABSL_DECLARE_FLAG(int, evenstep_ckpt_in_flight);
ABSL_DECLARE_FLAG(std::string, evenstep_ckpt_when_busy);
ABSL_DECLARE_FLAG(double, evenstep_ckpt_slice_mb);
ABSL_DECLARE_FLAG(int, evenstep_ckpt_every);
ABSL_DECLARE_FLAG(std::string, evenstep_resume);
ABSL_DECLARE_FLAG(std::string, evenstep_ckpt_on_error);
ABSL_DECLARE_FLAG(int, evenstep_ckpt_max_failures);
ABSL_DECLARE_FLAG(bool, evenstep_timeline);
ABSL_DECLARE_FLAG(int64_t, evenstep_eval_micro_batch_tokens);
ABSL_DECLARE_FLAG(int, evenstep_log_every);
ABSL_DECLARE_FLAG(std::string, evenstep_preflight);
ABSL_DECLARE_FLAG(bool, evenstep_preflight_quick);
ABSL_DECLARE_FLAG(std::string, evenstep_preflight_data_dir);
ABSL_DECLARE_FLAG(std::string, evenstep_preflight_inject);
ABSL_DECLARE_FLAG(std::string, evenstep_device);
ABSL_DECLARE_FLAG(std::string, evenstep_preempt_signals);

namespace evenstep {

struct BalanceConfig;
struct CheckpointOptions;
class DistContext;
struct DistOptions;
struct GradSyncOptions;
struct PreflightOptions;

// Checks the value of every --evenstep_* flag, as the parts that use them
// would: InvalidArgument naming the flag and its valid values or range for
// the first bad one. Session::Create calls it first.
absl::Status ValidateEvenstepFlags();

// GradSync options from --evenstep_comm_hook, --evenstep_bucket_cap_mb,
// --evenstep_first_bucket_cap_mb and --evenstep_timeout. InvalidArgument
// naming the flag for a bad value.
absl::StatusOr<GradSyncOptions> GradSyncOptionsFromFlags();

// The flag adapters of the other option sets (SessionOptions::FromFlags
// fills the whole Session's): InvalidArgument naming the flag for a bad
// value.
// BalanceConfig: everything balancing and the gradient sync read.
absl::StatusOr<BalanceConfig> BalanceConfigFromFlags();
// --evenstep_ckpt_* flags: dir, keep, in_flight, when_busy, slice_mb.
absl::StatusOr<CheckpointOptions> CheckpointOptionsFromFlags();
// --evenstep_backend, --evenstep_timeout, --evenstep_rendezvous_timeout.
absl::StatusOr<DistOptions> DistOptionsFromFlags();
// DistOptionsFromFlags() then DistContext::Create: what a trainer's main
// calls after absl::ParseCommandLine.
absl::StatusOr<std::unique_ptr<DistContext>> DistContextFromFlags();
// --evenstep_preflight_quick, --evenstep_ckpt_dir,
// --evenstep_preflight_data_dir, --evenstep_device,
// --evenstep_preflight_inject.
absl::StatusOr<PreflightOptions> PreflightOptionsFromFlags();

// For programs with their own argument parsing: parses the --evenstep_*
// arguments of argv (--evenstep_x=v, --evenstep_x v, --[no]evenstep_bool)
// into the flags and removes them, leaving the rest (and everything after
// "--") in order; *argc is updated. InvalidArgument naming the flag for an
// unknown evenstep flag or a bad value.
absl::Status ParseEvenstepFlags(int* argc, char** argv);
// The same for main(int argc, const char* argv[]) (only the pointers move).
inline absl::Status ParseEvenstepFlags(int* argc, const char** argv) {
  return ParseEvenstepFlags(argc, const_cast<char**>(argv));
}

// A program's own defaults for evenstep flags, set before the command line is
// parsed so that the command line still overrides them:
//   evenstep::SetFlagDefaults("global_batch=32 normalize=tokens");  // then ParseCommandLine
// Space-separated NAME=VALUE, NAME with or without "evenstep_". An unknown
// flag or a bad value is a bug in the program: it prints the flag and exits
// with status 2, as absl::ParseCommandLine does for a bad command line.
void SetFlagDefaults(absl::string_view settings);

// Every --evenstep_* flag as a Markdown table (name, default, meaning), from
// the flags' own help texts, sorted by name.
std::string FlagsMarkdownTable();

}  // namespace evenstep

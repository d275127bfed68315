// Definitions of the --evenstep_* flags and their conversion to option structs.
#include "evenstep/flags.h"

#include <algorithm>
#include <vector>

#include "absl/flags/commandlineflag.h"
#include "absl/flags/flag.h"
#include "absl/flags/reflection.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "evenstep/dist_context.h"
#include "evenstep/grad_sync.h"

ABSL_FLAG(std::string, evenstep_backend, "auto",
          "Process group for gradients: auto (NCCL when this libtorch has it and CUDA is "
          "available, else Gloo), gloo or nccl. Control messages always use Gloo.");
ABSL_FLAG(absl::Duration, evenstep_timeout, absl::Minutes(10),
          "Longest a collective may take before it fails with an error naming the ranks that "
          "never arrived (e.g. 30s, 10m).");
ABSL_FLAG(absl::Duration, evenstep_rendezvous_timeout, absl::Minutes(5),
          "Longest the start-up rendezvous may take: connecting to MASTER_ADDR:MASTER_PORT and "
          "waiting for every rank to join.");
ABSL_FLAG(std::string, evenstep_comm_hook, "sum",
          "How gradient buckets are reduced: sum (exact; weighting comes from loss scaling), avg, "
          "fp16 or bf16 (compressed: scaled by 1/world before the cast, cast back after).");
ABSL_FLAG(double, evenstep_bucket_cap_mb, 25,
          "Gradient bucket size cap in MiB; a bucket's all-reduce starts as soon as all its "
          "gradients are ready.");
ABSL_FLAG(double, evenstep_first_bucket_cap_mb, 1,
          "Cap in MiB of the first gradient bucket (the last layers' gradients), small so "
          "communication starts early in backward.");

namespace evenstep {

absl::StatusOr<DistOptions> DistOptions::FromFlags() {
  DistOptions options;
  const std::string backend = absl::GetFlag(FLAGS_evenstep_backend);
  if (backend == "auto") {
    options.backend = CommBackend::kAuto;
  } else if (backend == "gloo") {
    options.backend = CommBackend::kGloo;
  } else if (backend == "nccl") {
    options.backend = CommBackend::kNccl;
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("--evenstep_backend=", backend, ": expected auto, gloo or nccl"));
  }
  options.collective_timeout = absl::GetFlag(FLAGS_evenstep_timeout);
  options.rendezvous_timeout = absl::GetFlag(FLAGS_evenstep_rendezvous_timeout);
  if (options.collective_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--evenstep_timeout=", absl::FormatDuration(options.collective_timeout),
                     ": must be positive"));
  }
  if (options.rendezvous_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--evenstep_rendezvous_timeout=", absl::FormatDuration(options.rendezvous_timeout),
        ": must be positive"));
  }
  return options;
}

absl::StatusOr<std::unique_ptr<DistContext>> DistContext::CreateFromFlags() {
  absl::StatusOr<DistOptions> options = DistOptions::FromFlags();
  if (!options.ok()) return options.status();
  return Create(*options);
}

absl::StatusOr<GradSyncOptions> GradSyncOptionsFromFlags() {
  GradSyncOptions options;
  const std::string hook = absl::GetFlag(FLAGS_evenstep_comm_hook);
  absl::StatusOr<CommHook> comm_hook = CommHookByName(hook);
  if (!comm_hook.ok()) return comm_hook.status();
  options.comm_hook = *std::move(comm_hook);
  const double cap = absl::GetFlag(FLAGS_evenstep_bucket_cap_mb);
  const double first = absl::GetFlag(FLAGS_evenstep_first_bucket_cap_mb);
  if (!(cap > 0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--evenstep_bucket_cap_mb=", cap, ": must be positive"));
  }
  if (!(first > 0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--evenstep_first_bucket_cap_mb=", first, ": must be positive"));
  }
  options.bucket_cap_bytes = static_cast<int64_t>(cap * (1 << 20));
  options.first_bucket_cap_bytes = static_cast<int64_t>(first * (1 << 20));
  options.timeout = absl::GetFlag(FLAGS_evenstep_timeout);
  return options;
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

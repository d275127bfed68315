// The --evenstep_* command-line flags (Abseil flags). A trainer that parses its
// command line with absl::ParseCommandLine gets them for free; the README's
// flag table is generated from their help texts (tools/evenstep_flags_md).
#pragma once

#include <string>

#include "absl/flags/declare.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"

ABSL_DECLARE_FLAG(std::string, evenstep_backend);
ABSL_DECLARE_FLAG(absl::Duration, evenstep_timeout);
ABSL_DECLARE_FLAG(absl::Duration, evenstep_rendezvous_timeout);
ABSL_DECLARE_FLAG(std::string, evenstep_comm_hook);
ABSL_DECLARE_FLAG(double, evenstep_bucket_cap_mb);
ABSL_DECLARE_FLAG(double, evenstep_first_bucket_cap_mb);

namespace evenstep {

struct GradSyncOptions;

// GradSync options from --evenstep_comm_hook, --evenstep_bucket_cap_mb,
// --evenstep_first_bucket_cap_mb and --evenstep_timeout. InvalidArgument
// naming the flag for a bad value.
absl::StatusOr<GradSyncOptions> GradSyncOptionsFromFlags();

// Every --evenstep_* flag as a Markdown table (name, default, meaning), from
// the flags' own help texts, sorted by name.
std::string FlagsMarkdownTable();

}  // namespace evenstep

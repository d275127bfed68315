// The --evenstep_* command-line flags (Abseil flags). A trainer that parses its
// command line with absl::ParseCommandLine gets them for free; the README's
// flag table is generated from their help texts (tools/evenstep_flags_md).
#pragma once

#include <string>

#include "absl/flags/declare.h"
#include "absl/time/time.h"

ABSL_DECLARE_FLAG(std::string, evenstep_backend);
ABSL_DECLARE_FLAG(absl::Duration, evenstep_timeout);
ABSL_DECLARE_FLAG(absl::Duration, evenstep_rendezvous_timeout);

namespace evenstep {

// Every --evenstep_* flag as a Markdown table (name, default, meaning), from
// the flags' own help texts, sorted by name.
std::string FlagsMarkdownTable();

}  // namespace evenstep

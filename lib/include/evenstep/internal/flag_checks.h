// Range checks of --evenstep_* flag values, shared by the files that turn
// flags into option structs (flags.cc, checkpointer.cc, session.cc), so every
// bad value is reported the same way.
#pragma once

#include "absl/status/status.h"

namespace evenstep::internal {

// OK when value >= minimum; otherwise InvalidArgument
// "--FLAG=VALUE: must be >= MINIMUM".
absl::Status NotBelow(const char* flag, double value, double minimum);

}  // namespace evenstep::internal

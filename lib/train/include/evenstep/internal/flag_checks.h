// Range checks of --evenstep_* flag values, shared by the files that turn
// flags into option structs (flags.cc, train_checkpointer.cc, session.cc), so every
// bad value is reported the same way.
#pragma once

#include "absl/status/status.h"

namespace evenstep {
struct BalanceConfig;
struct CheckpointOptions;
struct DistOptions;
}  // namespace evenstep

namespace evenstep::internal {

// OK when value >= minimum; otherwise InvalidArgument
// "--FLAG=VALUE: must be >= MINIMUM".
absl::Status NotBelow(const char* flag, double value, double minimum);
// OK when value is finite and lo < value <= hi (lo_open) or lo <= value <= hi;
// otherwise InvalidArgument "--FLAG=VALUE: must be in (LO, HI]" (or "[LO, HI]").
absl::Status InRange(const char* flag, double value, double lo, double hi, bool lo_open = false);

// The bounds of option structs that flags fill, each error naming the flag
// of the bad field (the same checks for options filled in code).
absl::Status CheckBalanceConfig(const BalanceConfig& config);
absl::Status CheckDistOptions(const DistOptions& options);
absl::Status CheckCheckpointOptions(const CheckpointOptions& options);

}  // namespace evenstep::internal

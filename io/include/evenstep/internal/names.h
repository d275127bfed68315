// Validation of names that become file-system or HDF5 paths: checkpoint
// tensor names and shard file names from (possibly untrusted) manifests.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "absl/status/status.h"

namespace evenstep::internal {

// '/'-separated segments of [A-Za-z0-9_.:-] and other printable characters
// except '@' and '\\'; no empty, "." or ".." segment, no leading '/'.
absl::Status ValidateTensorName(const std::string& name);

// "step-SSSSSSSSSS": a checkpoint's directory name (zero-padded to 10 digits).
std::string StepDirName(int64_t step);
// The step of a checkpoint directory name, exactly as StepDirName writes it;
// nullopt for any other name (quarantined ones, temporary files, ...).
std::optional<int64_t> StepOfDirName(const std::string& name);
// "shard-RRRRR-of-WWWWW.h5": the shard file of `rank` among `world` ranks.
std::string ShardFileName(int rank, int world);

}  // namespace evenstep::internal

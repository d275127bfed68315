// Validation of names that become file-system or HDF5 paths: checkpoint
// tensor names and shard file names from (possibly untrusted) manifests.
#pragma once

#include <string>

#include "absl/status/status.h"

namespace evenstep::internal {

// '/'-separated segments of [A-Za-z0-9_.:-] and other printable characters
// except '@' and '\\'; no empty, "." or ".." segment, no leading '/'.
absl::Status ValidateTensorName(const std::string& name);
// A plain file name: no '/', not "." or "..", not empty, printable.
absl::Status ValidateFileName(const std::string& name);

}  // namespace evenstep::internal

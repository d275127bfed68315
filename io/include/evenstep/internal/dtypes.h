// Torch dtypes <-> the names checkpoints store.
#pragma once

#include <c10/core/ScalarType.h>

#include <optional>
#include <string>

namespace evenstep::internal {

// "float32", "bfloat16", ...; nullopt for dtypes checkpoints do not hold
// (complex, quantized).
std::optional<std::string> DtypeName(c10::ScalarType type);
std::optional<c10::ScalarType> DtypeFromName(const std::string& name);

}  // namespace evenstep::internal

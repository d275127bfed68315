#include "evenstep/internal/dtypes.h"

#include <utility>

namespace evenstep::internal {
namespace {

constexpr std::pair<c10::ScalarType, const char*> kNames[] = {
    {c10::ScalarType::Float, "float32"}, {c10::ScalarType::Double, "float64"},
    {c10::ScalarType::Half, "float16"},  {c10::ScalarType::BFloat16, "bfloat16"},
    {c10::ScalarType::Char, "int8"},     {c10::ScalarType::Short, "int16"},
    {c10::ScalarType::Int, "int32"},     {c10::ScalarType::Long, "int64"},
    {c10::ScalarType::Byte, "uint8"},    {c10::ScalarType::Bool, "bool"},
};

}  // namespace

std::optional<std::string> DtypeName(c10::ScalarType type) {
  for (const auto& [t, name] : kNames) {
    if (t == type) return std::string(name);
  }
  return std::nullopt;
}

std::optional<c10::ScalarType> DtypeFromName(const std::string& name) {
  for (const auto& [t, n] : kNames) {
    if (name == n) return t;
  }
  return std::nullopt;
}

}  // namespace evenstep::internal

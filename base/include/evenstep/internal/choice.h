// One table per enumerated option (a string flag's values, a mode's names):
// the value by its name, and an error that names the option and lists its
// choices; a value's name from the same table (NameOf). Several names may share a value (aliases:
// "true" for "newest"); only the first name of each value is listed as a choice.
#pragma once

#include <initializer_list>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace evenstep::internal {

template <typename T>
using Choices = std::initializer_list<std::pair<absl::string_view, T>>;

// `what`'s value named `name` in `table`; InvalidArgument "WHAT=NAME:
// expected a, b or c" for any other name.
template <typename T>
absl::StatusOr<T> Choose(absl::string_view what, absl::string_view name, Choices<T> table) {
  std::vector<absl::string_view> listed;
  std::vector<T> seen;
  for (const auto& [n, value] : table) {
    if (n == name) return value;
    bool first = true;
    for (const T& s : seen) first = first && !(s == value);
    if (first) {
      seen.push_back(value);
      listed.push_back(n);
    }
  }
  std::string choices;
  for (size_t i = 0; i < listed.size(); ++i) {
    absl::StrAppend(&choices, i == 0 ? "" : i + 1 == listed.size() ? " or " : ", ", listed[i]);
  }
  return absl::InvalidArgumentError(absl::StrCat(what, "=", name, ": expected ", choices));
}

// The first name of `value` in `table` (a literal, so null-terminated),
// "?" for a value the table lacks.
template <typename T>
const char* NameOf(T value, Choices<T> table) {
  for (const auto& [n, v] : table) {
    if (v == value) return n.data();
  }
  return "?";
}

}  // namespace evenstep::internal

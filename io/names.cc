#include "evenstep/internal/names.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace evenstep::internal {

absl::Status ValidateTensorName(const std::string& name) {
  auto bad = [&](const std::string& why) {
    return absl::InvalidArgumentError(absl::StrCat("tensor name \"", name, "\": ", why));
  };
  if (name.empty()) return bad("empty");
  if (name.size() > 4096) return bad("longer than 4096 bytes");
  if (name.front() == '/') return bad("absolute (starts with '/')");
  for (char c : name) {
    if (static_cast<unsigned char>(c) < 0x20 || c == 0x7f || c == '@' || c == '\\') {
      return bad("holds a control character, '@' or '\\'");
    }
  }
  for (absl::string_view segment : absl::StrSplit(name, '/')) {
    if (segment.empty() || segment == "." || segment == "..") {
      return bad("has an empty, \".\" or \"..\" segment");
    }
  }
  return absl::OkStatus();
}

absl::Status ValidateFileName(const std::string& name) {
  if (name.empty() || name == "." || name == ".." || name.find('/') != std::string::npos ||
      name.find('\0') != std::string::npos) {
    return absl::InvalidArgumentError(absl::StrCat("file name \"", name, "\" is not a plain name"));
  }
  return absl::OkStatus();
}

}  // namespace evenstep::internal

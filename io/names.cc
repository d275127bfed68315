#include "evenstep/internal/names.h"

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
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

std::string StepDirName(int64_t step) { return absl::StrFormat("step-%010d", step); }

std::optional<int64_t> StepOfDirName(const std::string& name) {
  if (name.size() < 15 || name.size() > 24 || name.compare(0, 5, "step-") != 0) return std::nullopt;
  for (size_t i = 5; i < name.size(); ++i) {
    if (!absl::ascii_isdigit(static_cast<unsigned char>(name[i]))) return std::nullopt;
  }
  int64_t step = 0;
  if (!absl::SimpleAtoi(name.substr(5), &step) || StepDirName(step) != name) return std::nullopt;
  return step;
}

std::string ShardFileName(int rank, int world) {
  return absl::StrFormat("shard-%05d-of-%05d.h5", rank, world);
}

}  // namespace evenstep::internal

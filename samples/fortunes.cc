// Reader of the fortune-cookie files (plain text, "%" separator lines).
#include "samples/fortunes.h"

#include <algorithm>
#include <filesystem>
#include <fstream>

#include "absl/strings/str_cat.h"

namespace evenstep::samples {

absl::StatusOr<std::vector<std::string>> LoadFortunes(const std::string& dir) {
  std::error_code error;
  std::vector<std::filesystem::path> files;
  for (const auto& entry : std::filesystem::directory_iterator(dir, error)) {
    if (entry.is_regular_file() && !entry.path().has_extension()) files.push_back(entry.path());
  }
  if (error) {
    return absl::NotFoundError(absl::StrCat("fortunes: cannot list ", dir, ": ", error.message(),
                                            " (install Debian's `fortunes` package)"));
  }
  std::sort(files.begin(), files.end());
  std::vector<std::string> fortunes;
  for (const auto& path : files) {
    std::ifstream in(path);
    std::string line, current;
    auto flush = [&] {
      if (current.find_first_not_of(" \t\n") != std::string::npos) fortunes.push_back(current);
      current.clear();
    };
    while (std::getline(in, line)) {
      if (line == "%") {
        flush();
      } else {
        current += line;
        current += '\n';
      }
    }
    flush();
  }
  if (fortunes.empty()) {
    return absl::NotFoundError(
        absl::StrCat("fortunes: no fortunes in ", dir, " (install Debian's `fortunes` package)"));
  }
  return fortunes;
}

std::vector<int64_t> Lengths(const std::vector<std::string>& texts) {
  std::vector<int64_t> lengths;
  lengths.reserve(texts.size());
  for (const std::string& t : texts) lengths.push_back(static_cast<int64_t>(t.size()));
  return lengths;
}

}  // namespace evenstep::samples

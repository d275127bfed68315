// The fortune-cookie collection of Debian's `fortunes` package as a text
// dataset: every fortune is one sample (a few bytes to a few thousand), the
// variable-length data evenstep's samples and benchmarks train on.
// Thread-safety: free functions without shared state.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace evenstep::samples {

// Where Debian installs the collection.
inline constexpr char kFortunesDir[] = "/usr/share/games/fortunes";

// Every fortune of every data file in `dir` (files without an extension;
// fortunes are separated by lines holding only "%"), in file-name order,
// empty ones dropped. NotFound naming the folder and the package when it is
// missing or holds no fortunes.
absl::StatusOr<std::vector<std::string>> LoadFortunes(const std::string& dir = kFortunesDir);

// Their lengths in bytes.
std::vector<int64_t> Lengths(const std::vector<std::string>& texts);

}  // namespace evenstep::samples

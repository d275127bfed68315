// Benchmarks that need several ranks re-run themselves under evenstep-run when
// started without a launcher, so `./evenstep_bench_x` is all a user types.
#pragma once

#include <functional>
#include <map>
#include <optional>
#include <string>

namespace evenstep::bench {

// The path of this program (/proc/self/exe resolved); empty if unknown.
std::string SelfExecutable();

// When RANK is not set: execs `evenstep-run -n ranks -- <this program> args...`
// and does not return (returns 1 after printing why, if the exec fails).
// Under a launcher: returns 0 at once.
int RelaunchUnlessLaunched(int ranks, int argc, char** argv);

// Runs `command` with /bin/sh (stderr joined to stdout) and hands each output
// line to `on_line` as it comes; returns the command's exit status (-1 when
// it could not start or was killed by a signal).
int RunLines(const std::string& command, const std::function<void(const std::string&)>& on_line);

// A rank's measurements come back as one line "<tag>key=value key=value
// ..." (evenstep-run may put "[rank] " in front): the fields, or nullopt
// when `line` holds no `tag`.
std::optional<std::map<std::string, std::string>> TaggedFields(const std::string& line,
                                                               const std::string& tag = "RESULT ");
// The same fields that read as numbers.
std::map<std::string, double> NumericFields(const std::map<std::string, std::string>& fields);

}  // namespace evenstep::bench

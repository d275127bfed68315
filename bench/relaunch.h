// Benchmarks that need several ranks re-run themselves under evenstep-run when
// started without a launcher, so `./evenstep_bench_x` is all a user types.
#pragma once

#include <string>

namespace evenstep::bench {

// The path of this program (/proc/self/exe resolved); empty if unknown.
std::string SelfExecutable();

// When RANK is not set: execs `evenstep-run -n ranks -- <this program> args...`
// and does not return (returns 1 after printing why, if the exec fails).
// Under a launcher: returns 0 at once.
int RelaunchUnlessLaunched(int ranks, int argc, char** argv);

}  // namespace evenstep::bench

// Multi-rank scenarios written inside their TEST, with their EXPECTs: the
// test binary runs itself again as each rank (a gtest filter naming the
// running test, and EVENSTEP_TEST_RANK in the environment), as gtest's death
// tests and gloo's MultiProcTest do.
//
//   TEST(GradSyncTest, AnUnusedParameterIsZeroOnEveryRank) {
//     RunOnRanks(3, [](DistContext& ctx) {
//       ...                       // this rank's part of the scenario
//       EXPECT_EQ(grad.sum().item<double>(), 0) << "rank " << ctx.rank();
//     });
//   }
//
// In the test's own process RunOnRanks hosts a store, starts `world` copies
// of the binary against it and waits for them (testing::HangBound); a rank
// that failed an expectation, threw, timed out or died fails the test with
// that rank's output, whose gtest lines name the file and line. In a rank's
// process it creates the DistContext (Gloo; the collective timeout 60 s, so a
// lost peer fails the ranks well inside the hang bound), runs `body` and
// exits: 0 when no expectation failed, 1 otherwise. Code after RunOnRanks
// runs only in the test's own process.
//
// Keep separate programs only where a separate process image is the point
// (the launcher, signals, SIGPIPE, preemption, kill -9).
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "evenstep/dist_context.h"
#include "tests/testing/subprocess.h"

namespace evenstep::testing {

struct OnRanksOptions {
  // Extra environment of every rank.
  std::vector<std::pair<std::string, std::string>> env;
  absl::Duration timeout = HangBound(2);
};

// Runs `body` on `world` ranks (see above). Returns every rank's result (in
// the test's process; a rank's process never returns).
std::vector<ProcessResult> RunOnRanks(int world, const std::function<void(DistContext&)>& body,
                                      const OnRanksOptions& options = {});

// This process is one of RunOnRanks' ranks: its rank, else -1.
int RankOfThisProcess();

}  // namespace evenstep::testing

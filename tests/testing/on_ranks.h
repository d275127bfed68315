// Multi-rank scenarios written inside their TEST, with their EXPECTs: the
// test binary runs itself again as each rank (a gtest filter naming the
// running test, and EVENSTEP_TEST_AS_RANK in the environment), as gtest's death
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
// process it creates the DistContext (OnRanksOptions: Gloo, collective
// timeout 60 s, so a lost peer fails the ranks well inside the hang bound),
// runs `body` and exits: 0 when no expectation failed, 1 otherwise. Code
// after RunOnRanks runs only in the test's own process.
//
// A rank re-runs the whole TEST up to its RunOnRanks, so a TEST calls it
// once (a second call fails the test): a scenario over several worlds or
// layouts is a TEST_P. Code before the call runs in every rank too; keep it
// to setting up (GTEST_SKIP there skips the ranks as well). A sequence of
// runs of one scenario (a run preempted, then resumed) is RunOnRanksAgain:
// its ranks run the first call's body again, told apart by the env.
//
// What the ranks leave for the test's process to compare across runs (losses
// per step, a final checksum) goes into RanksDir(), which every rank of every
// run of the test shares.
//
// Keep separate programs only where a separate process image is the point
// (the launcher, signals, SIGPIPE, preemption, kill -9).
#pragma once

#include <functional>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "evenstep/dist_context.h"
#include "tests/testing/subprocess.h"

namespace evenstep::testing {

struct OnRanksOptions {
  // Extra environment of every rank.
  std::vector<std::pair<std::string, std::string>> env;
  // Nodes simulated on this host (RunProgramOnNodes' PlaceOnNodes): node k
  // holds the next nodes[k] ranks. Empty: all ranks on one node.
  std::vector<int> nodes;
  // The rank's DistContext.
  CommBackend backend = CommBackend::kGloo;
  absl::Duration collective_timeout = absl::Seconds(60);
  // DistOptions' rank-loss settings (Regroup's tests).
  DistOptions::OnRankLoss on_rank_loss = DistOptions::OnRankLoss::kStop;
  absl::Duration lost_after = absl::Seconds(10);
  absl::Duration timeout = HangBound(2);
  // Ranks that end on purpose with another exit code than 0 (a rank that
  // dies mid-step): rank -> the code it must end with.
  std::map<int, int> exit_codes;
};

using RankBody = std::function<void(DistContext&)>;

// Runs `body` on `world` ranks (see above). Returns every rank's result (in
// the test's process; a rank's process never returns).
std::vector<ProcessResult> RunOnRanks(int world, const RankBody& body,
                                      const OnRanksOptions& options = {});

// Another run of the TEST's ranks after its RunOnRanks: they run that call's
// body (and its backend and collective timeout) again, with this call's env,
// nodes and timeout; the body reads the env to tell the runs apart.
std::vector<ProcessResult> RunOnRanksAgain(int world, const OnRanksOptions& options);

// A directory the TEST's ranks share (the same path in every rank of every
// run), made empty when the test starts its first ranks, removed when the
// test ends.
std::string RanksDir();

// A file `name` in RanksDir(): written by a rank, read by the test's process
// after the ranks ended ("" when no rank wrote it).
void WriteRanksFile(const std::string& name, const std::string& text);
std::string ReadRanksFile(const std::string& name);

// For a test that starts its ranks itself (inside simulated hosts, under a
// launcher's conventions): ThisTestAsRank is the command (and the marker in
// its environment) that runs the current TEST as a rank, whose rank is the
// launcher's RANK; the TEST calls RunHereIfRank(body) before it
// starts them (in a rank's process it runs `body` and exits, as RunOnRanks
// does) and ExpectRanksPassed on their results.
ProcessSpec ThisTestAsRank();

// In a rank's process: the spec of a replacement for launch rank
// `launch_rank` (this TEST as that rank, this rank's launch environment,
// EVENSTEP_JOIN=1), which joins the running ranks (DistOptions::join).
ProcessSpec ReplacementOf(int launch_rank);
void RunHereIfRank(const RankBody& body, const OnRanksOptions& options = {});
// `exit_codes`: OnRanksOptions::exit_codes.
void ExpectRanksPassed(const std::vector<ProcessResult>& results,
                       const std::map<int, int>& exit_codes = {});

// This process is one of RunOnRanks' ranks: its rank, else -1.
int RankOfThisProcess();

}  // namespace evenstep::testing

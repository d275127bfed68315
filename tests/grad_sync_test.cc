// GradSync over real ranks (Gloo on 127.0.0.1): exactness for world sizes 1-4
// and random uneven splits, overlap ordering, no-sync accumulation, unused
// parameters, zero-work ranks, replica mismatch, comm hooks.
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/subprocess.h"

namespace evenstep {
namespace {

using ::evenstep::testing::Describe;
using ::evenstep::testing::ProcessResult;
using ::evenstep::testing::ProcessSpec;
using ::testing::HasSubstr;

std::vector<ProcessResult> RunRanks(int world, const std::vector<std::string>& scenario) {
  return evenstep::testing::RunProgramOnRanks(world, EVENSTEP_GRAD_SYNC_HELPER, scenario);
}

struct ExactCase {
  int world;
  int seed;
  friend void PrintTo(const ExactCase& c, std::ostream* os) {
    *os << "world " << c.world << " seed " << c.seed;
  }
};

class GradSyncExactTest : public ::testing::TestWithParam<ExactCase> {};

TEST_P(GradSyncExactTest, SyncedGradientEqualsSingleProcessGradient) {
  const ExactCase c = GetParam();
  auto results = RunRanks(c.world, {"exact", std::to_string(c.seed)});
  for (const ProcessResult& r : results) {
    EXPECT_EQ(r.exit_code, 0) << Describe(results);
    EXPECT_THAT(r.output, HasSubstr("exact ok"));
  }
  if (c.world > 1) {
    // The split leaves one rank without work; it joined through SyncNow.
    EXPECT_THAT(results[c.seed % c.world].output, HasSubstr(" 0 samples in 0 micro-batches"))
        << Describe(results);
  }
}

INSTANTIATE_TEST_SUITE_P(Splits, GradSyncExactTest,
                         ::testing::Values(ExactCase{1, 11}, ExactCase{2, 12}, ExactCase{2, 21},
                                           ExactCase{3, 13}, ExactCase{3, 31}, ExactCase{4, 14},
                                           ExactCase{4, 41}),
                         [](const auto& info) {
                           return absl::StrCat("world", info.param.world, "_seed", info.param.seed);
                         });

TEST(GradSyncTest, BucketsStartBeforeBackwardEnds) {
  auto results = RunRanks(2, {"exact", "3"});  // seed 3: rank 1 idle, rank 0 works
  ASSERT_EQ(results[0].exit_code, 0) << Describe(results);
  // Ordering, not timing: with >= 8 buckets at least one collective started
  // from a gradient hook before the last gradient existed.
  EXPECT_THAT(results[0].output,
              ::testing::ContainsRegex("launched during backward: [1-9][0-9]* of"))
      << Describe(results);
}

TEST(GradSyncTest, NoSyncAccumulatesLocally) {
  for (int world : {2, 3}) {
    auto results = RunRanks(world, {"nosync"});
    for (const ProcessResult& r : results) {
      EXPECT_EQ(r.exit_code, 0) << Describe(results);
      EXPECT_THAT(r.output, HasSubstr("nosync ok"));
    }
  }
}

TEST(GradSyncTest, UnusedParameterIsReducedAsZeros) {
  auto results = RunRanks(3, {"unused"});
  for (const ProcessResult& r : results) {
    EXPECT_EQ(r.exit_code, 0) << Describe(results);
    EXPECT_THAT(r.output, HasSubstr("unused ok"));
  }
}

TEST(GradSyncTest, FrozenParametersStartEqualOnEveryRank) {
  auto results = RunRanks(3, {"frozen"});
  for (const ProcessResult& r : results) {
    EXPECT_EQ(r.exit_code, 0) << Describe(results);
    EXPECT_THAT(r.output, HasSubstr("frozen ok"));
  }
}

TEST(GradSyncTest, ReplicaMismatchNamesParameterAndRanks) {
  auto results = RunRanks(3, {"mismatch"});
  for (const ProcessResult& r : results) {
    EXPECT_FALSE(r.timed_out) << Describe(results);
    EXPECT_EQ(r.exit_code, 4) << Describe(results);
    EXPECT_THAT(r.output, HasSubstr("FAILED_PRECONDITION"));
    // Rank 1's first layer has 17 rows instead of 16: named, with both
    // shapes and which ranks hold each.
    EXPECT_THAT(r.output, HasSubstr("model replicas differ at parameter #0: rank(s) 0,2 have "
                                    "'l1.weight' Float[16, 12] cpu; rank(s) 1 have 'l1.weight' "
                                    "Float[17, 12] cpu"));
  }
}

class CommHookTest : public ::testing::TestWithParam<std::string> {};

TEST_P(CommHookTest, MatchesSum) {
  auto results = RunRanks(3, {"hook", GetParam()});
  for (const ProcessResult& r : results) {
    EXPECT_EQ(r.exit_code, 0) << Describe(results);
    EXPECT_THAT(r.output, HasSubstr("hook " + GetParam() + " ok"));
  }
}

TEST(GradSyncTest, AUserHookSeesEveryGradientWithItsPlace) {
  auto results = RunRanks(2, {"hookinfo"});
  for (const ProcessResult& r : results) {
    EXPECT_EQ(r.exit_code, 0) << Describe(results);
    EXPECT_THAT(r.output, HasSubstr("hookinfo ok"));
  }
}

TEST(GradSyncTest, PowerSgdIsExactOnRankOneAndErrorFeedbackConverges) {
  for (int world : {2, 3}) {
    auto results = RunRanks(world, {"powersgd"});
    for (const ProcessResult& r : results) {
      EXPECT_EQ(r.exit_code, 0) << Describe(results);
      EXPECT_THAT(r.output, HasSubstr("powersgd ok"));
    }
  }
}

TEST(GradSyncTest, AnUndeclaredSparseGradientFailsOnEveryRankNamingIt) {
  auto results = RunRanks(2, {"sparse_undeclared"});
  for (const ProcessResult& r : results) {
    EXPECT_EQ(r.exit_code, 4) << Describe(results);
    EXPECT_THAT(r.output, HasSubstr("ABORTED"));
    EXPECT_THAT(r.output, HasSubstr("parameter 'embed.weight' received a sparse gradient"));
  }
}

TEST(GradSyncTest, AfterACollectiveTimesOutEveryLaterCollectiveFailsAtOnce) {
  // Rank 1 never joins the sync: rank 0's times out naming it; rank 0's
  // next sync, all_reduce and barrier return that failure without starting
  // (a started one would block on the timed-out all_reduce).
  auto results = RunRanks(2, {"forgotten_sync", "--evenstep_timeout=3s"});
  ASSERT_EQ(results[0].exit_code, 4) << Describe(results);
  EXPECT_EQ(results[1].exit_code, 0) << Describe(results);
  const std::string& out = results[0].output;
  EXPECT_THAT(out, ::testing::ContainsRegex("sync failed: .*DEADLINE_EXCEEDED.*rank\\(s\\) 1"))
      << Describe(results);
  EXPECT_THAT(out, ::testing::ContainsRegex("next sync: DEADLINE_EXCEEDED"));
  EXPECT_THAT(out, ::testing::ContainsRegex(
                       "next all_reduce: DEADLINE_EXCEEDED: rank 0: all_reduce .* not started: an "
                       "earlier collective failed"));
  EXPECT_THAT(out, ::testing::ContainsRegex("next barrier: DEADLINE_EXCEEDED: rank 0: barrier not "
                                            "started"));
}

INSTANTIATE_TEST_SUITE_P(Hooks, CommHookTest,
                         ::testing::Values("sum", "avg", "fp16", "bf16", "user"));

// The hierarchical sync (reduce-scatter within each node, all-reduce across,
// all-gather within) against one process's gradient, on nodes simulated on
// this host (GROUP_RANK): the same scenarios as the flat sync, every
// parameter its own bucket (so buckets smaller than the node's ranks and
// uneven chunks are covered), a rank without work joining through SyncNow.
struct TopologyCase {
  std::vector<int> nodes;
  std::vector<std::string> scenario;
  const char* expect;  // in every rank's output
  friend void PrintTo(const TopologyCase& c, std::ostream* os) {
    *os << absl::StrJoin(c.nodes, "+") << " " << absl::StrJoin(c.scenario, " ");
  }
};

class HierarchicalSyncTest : public ::testing::TestWithParam<TopologyCase> {};

TEST_P(HierarchicalSyncTest, EqualsTheSingleProcessGradient) {
  const TopologyCase& c = GetParam();
  std::vector<std::string> args = {"--evenstep_sync_topology=hierarchical"};
  args.insert(args.end(), c.scenario.begin(), c.scenario.end());
  auto results = evenstep::testing::RunProgramOnNodes(c.nodes, EVENSTEP_GRAD_SYNC_HELPER, args);
  for (const ProcessResult& r : results) {
    EXPECT_EQ(r.exit_code, 0) << Describe(results);
    EXPECT_THAT(r.output, HasSubstr(absl::StrCat("gradient sync: hierarchical (", c.nodes.size(),
                                                 c.nodes.size() == 1 ? " node x " : " nodes x ",
                                                 c.nodes[0], " rank")))
        << Describe(results);
    EXPECT_THAT(r.output, HasSubstr(c.expect)) << Describe(results);
  }
}

INSTANTIATE_TEST_SUITE_P(Layouts, HierarchicalSyncTest,
                         ::testing::Values(TopologyCase{{2, 2}, {"exact", "14"}, "exact ok"},
                                           TopologyCase{{2, 2}, {"exact", "41"}, "exact ok"},
                                           TopologyCase{{1, 1}, {"exact", "12"}, "exact ok"},
                                           TopologyCase{{3}, {"exact", "13"}, "exact ok"},
                                           TopologyCase{{2, 2}, {"unused"}, "unused ok"},
                                           TopologyCase{{2, 2}, {"hook", "avg"}, "hook avg ok"},
                                           TopologyCase{{2, 2}, {"hook", "fp16"}, "hook fp16 ok"},
                                           TopologyCase{
                                               {1, 1, 1}, {"hook", "bf16"}, "hook bf16 ok"}),
                         [](const auto& info) {
                           std::string name =
                               absl::StrCat(absl::StrJoin(info.param.nodes, "x"), "_",
                                            absl::StrJoin(info.param.scenario, "_"));
                           return name;
                         });

// What hierarchical cannot do is refused on every rank, naming the flag and
// the reason; auto stays flat there and says why.
TEST(HierarchicalSyncTest, UnevenNodesAndWholeGradientHooksAreRefusedAndAutoStaysFlat) {
  auto uneven = evenstep::testing::RunProgramOnNodes(
      {3, 1}, EVENSTEP_GRAD_SYNC_HELPER, {"--evenstep_sync_topology=hierarchical", "exact", "14"});
  for (const ProcessResult& r : uneven) {
    EXPECT_EQ(r.exit_code, 5) << Describe(uneven);
    EXPECT_THAT(r.output, HasSubstr("--evenstep_sync_topology=hierarchical: the nodes hold "
                                    "different numbers of ranks (node0: 3 ranks (0,1,2); node1: "
                                    "1 rank (3))"))
        << Describe(uneven);
  }
  auto user = evenstep::testing::RunProgramOnNodes(
      {1, 1}, EVENSTEP_GRAD_SYNC_HELPER, {"--evenstep_sync_topology=hierarchical", "hook", "user"});
  for (const ProcessResult& r : user) {
    EXPECT_EQ(r.exit_code, 5) << Describe(user);
    EXPECT_THAT(r.output, HasSubstr("powersgd or a user hook")) << Describe(user);
  }
  auto flat = evenstep::testing::RunProgramOnNodes(
      {3, 1}, EVENSTEP_GRAD_SYNC_HELPER, {"--evenstep_sync_topology=auto", "exact", "14"});
  for (const ProcessResult& r : flat) {
    EXPECT_EQ(r.exit_code, 0) << Describe(flat);
    EXPECT_THAT(r.output, HasSubstr("gradient sync: flat (hierarchical cannot run: the nodes "
                                    "hold different numbers of ranks"))
        << Describe(flat);
    EXPECT_THAT(r.output, HasSubstr("exact ok"));
  }
}

}  // namespace
}  // namespace evenstep

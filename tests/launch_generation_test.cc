// The launch generation of a torchrun job (internal::JoinLaunchGeneration)
// on one in-process store, ranks as threads: launches one after another
// each meet in a fresh generation, a launch after one that died half-way
// (one rank's claim left behind) still agrees on one generation, and the
// failures name what went wrong.
#include "evenstep/internal/launch_generation.h"

#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace evenstep::internal {
namespace {

using ::testing::HasSubstr;

// Ranks `ranks` of a world of `world` join at once (rank i of the list
// starting `stagger` after the one before it); their results in that order.
std::vector<absl::StatusOr<int64_t>> Launch(::c10d::Store& store, const std::vector<int>& ranks,
                                            int world, absl::Duration timeout = absl::Seconds(30),
                                            absl::Duration stagger = absl::ZeroDuration()) {
  std::vector<absl::StatusOr<int64_t>> results(ranks.size(), absl::UnknownError("not run"));
  std::vector<std::thread> threads;
  for (size_t i = 0; i < ranks.size(); ++i) {
    threads.emplace_back(
        [&, i] { results[i] = JoinLaunchGeneration(store, ranks[i], world, timeout); });
    absl::SleepFor(stagger);
  }
  for (std::thread& t : threads) t.join();
  return results;
}

TEST(LaunchGenerationTest, EachLaunchMeetsInAFreshGenerationWithEveryRank) {
  auto store = c10d_compat::MakeHashStore();
  for (int64_t launch = 0; launch < 3; ++launch) {
    const auto results = Launch(*store, {0, 1, 2}, 3);
    for (const auto& r : results) {
      ASSERT_TRUE(r.ok()) << r.status();
      EXPECT_EQ(*r, launch);
    }
  }
}

// Launch 0 completes; launch 1 dies half-way: only rank 1's process got
// to claim (it moved the generation to 1 and claimed there). Launch 2's
// rank 0 comes first and claims that half-used generation; rank 1 finds
// its claim taken and moves on; rank 0 follows. Both agree, on 2.
TEST(LaunchGenerationTest, ALaunchAfterOneThatDiedHalfWayAgreesOnOneGeneration) {
  auto store = c10d_compat::MakeHashStore();
  for (const auto& r : Launch(*store, {0, 1}, 2)) ASSERT_EQ(*r, 0);
  store->set("gen", std::vector<uint8_t>{'1'});
  store->add("gen/1/claim/1", 1);
  const auto results = Launch(*store, {0, 1}, 2, absl::Seconds(30), absl::Milliseconds(100));
  ASSERT_TRUE(results[0].ok()) << results[0].status();
  ASSERT_TRUE(results[1].ok()) << results[1].status();
  EXPECT_EQ(*results[0], 2);
  EXPECT_EQ(*results[1], 2);
}

TEST(LaunchGenerationTest, AMissingRankIsNamedAfterTheTimeout) {
  auto store = c10d_compat::MakeHashStore();
  const auto results = Launch(*store, {0, 2}, 3, absl::Milliseconds(300));
  for (const auto& r : results) {
    EXPECT_EQ(r.status().code(), absl::StatusCode::kDeadlineExceeded) << r.status();
    EXPECT_THAT(std::string(r.status().message()),
                HasSubstr("with 2 of 3 ranks joined; missing rank(s) 1"));
  }
}

// Rank 0 twice in a world of 2 (not a torchrun launch: its agents number
// the ranks): the two rank-0 processes never both join; each one that does
// not stops with a named error (the rank claimed twice, or the ranks missing
// when their claims kept moving the generation on) within the timeout.
TEST(LaunchGenerationTest, TwoLiveProcessesOfOneRankNeverBothJoin) {
  auto store = c10d_compat::MakeHashStore();
  const auto results = Launch(*store, {0, 0, 1}, 2, absl::Seconds(3));
  EXPECT_FALSE(results[0].ok() && results[1].ok());
  for (const auto& r : results) {
    if (r.ok()) continue;
    EXPECT_TRUE(absl::StrContains(r.status().message(), "two processes claim rank 0") ||
                absl::StrContains(r.status().message(), "missing rank(s)"))
        << r.status();
  }
}

}  // namespace
}  // namespace evenstep::internal

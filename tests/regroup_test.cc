// DistContext::Regroup: after ranks are lost, the survivors agree on who is
// left and go on among themselves with exact collectives; a rank frozen
// past lost_after is left out and told so.

#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <torch/torch.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <numeric>
#include <ostream>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "evenstep/balanced_step.h"
#include "evenstep/dist_context.h"
#include "evenstep/handover.h"
#include "tests/testing/balance_trainer.h"
#include "tests/testing/on_ranks.h"
#include "tests/testing/subprocess.h"

namespace evenstep {
namespace {

using ::evenstep::testing::BalanceRun;
using ::evenstep::testing::BalanceScenario;
using ::evenstep::testing::HangBound;
using ::evenstep::testing::OnRanksOptions;
using ::evenstep::testing::ProcessResult;
using ::evenstep::testing::ReadRanksFile;
using ::evenstep::testing::ReplacementOf;
using ::evenstep::testing::RunOnRanks;
using ::evenstep::testing::Subprocess;
using ::evenstep::testing::TrainBalanced;
using ::evenstep::testing::WriteRanksFile;
using ::testing::HasSubstr;

constexpr int kLostExit = 7;    // a lost rank's exit (as after kill -9, its sockets close)
constexpr int kFencedExit = 9;  // the frozen rank's, once told it was left out

struct LossCase {
  int world;
  std::vector<int> lost;  // launch ranks that exit after the first collective
  bool frozen = false;    // the first lost rank freezes (SIGSTOP) instead, and is woken later
};

void PrintTo(const LossCase& c, std::ostream* os) {
  *os << "world " << c.world << (c.frozen ? " frozen" : " lost");
  for (int r : c.lost) *os << " " << r;
}

std::string Name(const ::testing::TestParamInfo<LossCase>& info) {
  std::string name =
      absl::StrCat("world", info.param.world, info.param.frozen ? "_frozen" : "_lost");
  for (int r : info.param.lost) absl::StrAppend(&name, "_", r);
  return name;
}

class RegroupTest : public ::testing::TestWithParam<LossCase> {};

// Ranks that go on after a loss: a lost rank is known after 2 s of silence
// (at once when its process is gone); a frozen one after the collective
// timeout.
OnRanksOptions Continuing() {
  OnRanksOptions options;
  options.collective_timeout = absl::Seconds(8);
  options.on_rank_loss = DistOptions::OnRankLoss::kContinue;
  options.lost_after = absl::Seconds(2);
  return options;
}

// The survivors' checks: every collective after the regroup gives the exact
// result over the survivors, in their launch order.
void ExpectSurvivorsGoOn(DistContext& ctx, const LossCase& c) {
  const int me = ctx.launch_rank();
  at::Tensor failed = at::ones({4});
  const absl::Status interrupted = ctx.AllReduce(failed);
  ASSERT_FALSE(interrupted.ok()) << "rank " << me << ": the all-reduce without the lost ranks";

  absl::StatusOr<Regrouped> regrouped = ctx.Regroup();
  ASSERT_TRUE(regrouped.ok()) << "rank " << me << ": " << regrouped.status();
  std::vector<int> survivors;
  for (int r = 0; r < c.world; ++r) {
    if (std::find(c.lost.begin(), c.lost.end(), r) == c.lost.end()) survivors.push_back(r);
  }
  EXPECT_EQ(regrouped->survivors, survivors) << "rank " << me;
  EXPECT_EQ(regrouped->lost, c.lost) << "rank " << me;
  EXPECT_EQ(regrouped->generation, 1);
  EXPECT_THAT(regrouped->Describe(), HasSubstr("lost"));
  const int place =
      static_cast<int>(std::find(survivors.begin(), survivors.end(), me) - survivors.begin());
  EXPECT_EQ(ctx.rank(), place) << "launch rank " << me;
  EXPECT_EQ(ctx.world_size(), static_cast<int>(survivors.size()));
  EXPECT_EQ(ctx.launch_rank(), me);

  double expected = 0;
  for (int r : survivors) expected += r + 1;
  at::Tensor sum = at::full({4}, me + 1.0);
  ASSERT_TRUE(ctx.AllReduce(sum).ok()) << "rank " << me;
  EXPECT_TRUE(at::equal(sum, at::full({4}, expected))) << "rank " << me << ": " << sum;

  std::vector<at::Tensor> gathered;
  ASSERT_TRUE(ctx.AllGather(at::full({1}, static_cast<double>(me)), &gathered).ok());
  ASSERT_EQ(gathered.size(), survivors.size());
  for (size_t i = 0; i < survivors.size(); ++i) {
    EXPECT_EQ(gathered[i].item<double>(), survivors[i]) << "place " << i;
  }
  at::Tensor root = at::full({2}, ctx.rank() == 0 ? 42.0 : -1.0);
  ASSERT_TRUE(ctx.Broadcast(root, 0).ok());
  EXPECT_TRUE(at::equal(root, at::full({2}, 42.0)));
  EXPECT_TRUE(ctx.Agree("after the regroup", absl::OkStatus()).ok());

  // A data group made after the regroup is of the survivors' world.
  auto data = ctx.NewDataGroup();
  ASSERT_TRUE(data.ok()) << data.status();
  at::Tensor on_data = at::ones({3});
  ASSERT_TRUE((*data)->AllReduce(on_data).ok());
  EXPECT_TRUE(at::equal(on_data, at::full({3}, static_cast<double>(survivors.size()))));
}

TEST_P(RegroupTest, SurvivorsAgreeOnWhoIsLeftAndGoOnExactly) {
  const LossCase c = GetParam();
  OnRanksOptions options = Continuing();
  for (size_t i = 0; i < c.lost.size(); ++i) {
    options.exit_codes[c.lost[i]] = c.frozen && i == 0 ? kFencedExit : kLostExit;
  }
  RunOnRanks(
      c.world,
      [c](DistContext& ctx) {
        at::Tensor t = at::ones({4});
        ASSERT_TRUE(ctx.AllReduce(t).ok());
        EXPECT_TRUE(at::equal(t, at::full({4}, static_cast<double>(c.world))));
        const int me = ctx.launch_rank();
        const auto lost = std::find(c.lost.begin(), c.lost.end(), me);
        if (lost == c.lost.begin() && c.frozen) {
          WriteRanksFile("frozen.pid", std::to_string(getpid()));
          raise(SIGSTOP);  // the survivors wake it after they went on
          at::Tensor late = at::ones({4});
          EXPECT_FALSE(ctx.AllReduce(late).ok());
          absl::StatusOr<Regrouped> left_out = ctx.Regroup();
          ASSERT_FALSE(left_out.ok());
          EXPECT_THAT(std::string(left_out.status().message()),
                      HasSubstr(absl::StrCat("(launch rank ", me, "): left out of regroup 1")));
          std::_Exit(::testing::Test::HasFailure() ? 1 : kFencedExit);
        }
        if (lost != c.lost.end()) std::_Exit(kLostExit);
        ExpectSurvivorsGoOn(ctx, c);
        if (c.frozen && ctx.rank() == 0) {
          int pid = 0;
          ASSERT_TRUE(absl::SimpleAtoi(ReadRanksFile("frozen.pid"), &pid));
          kill(pid, SIGCONT);
        }
      },
      options);
}

INSTANTIATE_TEST_SUITE_P(Losses, RegroupTest,
                         ::testing::Values(LossCase{3, {1}}, LossCase{4, {1, 2}}, LossCase{3, {0}},
                                           LossCase{4, {3}, true}),
                         Name);

struct StepLossCase {
  int world;
  int lost;          // the launch rank that dies in the loss callback
  int step;          // ... of this step
  int micro = 1;     // ... from this micro-batch on
  std::string mode;  // --evenstep_balance
};

void PrintTo(const StepLossCase& c, std::ostream* os) {
  *os << "world " << c.world << " rank " << c.lost << " lost in step " << c.step << " micro-batch "
      << c.micro << " " << c.mode;
}

std::string StepName(const ::testing::TestParamInfo<StepLossCase>& info) {
  const StepLossCase& c = info.param;
  return absl::StrCat("world", c.world, "_rank", c.lost, "_step", c.step, "_micro", c.micro, "_",
                      c.mode);
}

class StepRegroupTest : public ::testing::TestWithParam<StepLossCase> {};

// `steps` steps in which launch rank `lost` dies in step `step`; the
// survivors regroup and redo it (29 samples a step, 4 per micro-batch).
BalanceScenario LossScenario(int lost, int step, const std::string& mode, int steps) {
  BalanceScenario s;
  s.flags = {"--evenstep_micro_batch_samples=4", "--evenstep_global_batch=29",
             absl::StrCat("--evenstep_balance=", mode)};
  s.steps = steps;
  s.fail_at = {{lost, step}};
  s.fail_by_exit = true;
  s.regroup_on_loss = true;
  return s;
}

// A rank dies in the middle of a step. The survivors' step fails naming it;
// they regroup and run that step again with the same global batch, and
// every step's applied gradient equals one process's over its whole global
// batch (the trainer EXPECTs it after every synchronisation): the run is
// the uninterrupted run's, step for step.
TEST_P(StepRegroupTest, SurvivorsRedoTheFailedStepExactly) {
  const StepLossCase c = GetParam();
  OnRanksOptions options = Continuing();
  options.exit_codes = {{c.lost, 5}};
  RunOnRanks(
      c.world,
      [c](DistContext& ctx) {
        BalanceScenario s = LossScenario(c.lost, c.step, c.mode, 4);
        s.fail_micro_batch = c.micro;
        const BalanceRun run = TrainBalanced(ctx, s);
        ASSERT_NE(ctx.launch_rank(), c.lost) << "the lost rank exits in its step";
        EXPECT_TRUE(run.status.ok()) << "launch rank " << ctx.launch_rank() << ": " << run.status;
        ASSERT_EQ(run.regroups.size(), 1u);
        EXPECT_EQ(run.regroups[0].lost, std::vector<int>{c.lost});
        EXPECT_EQ(ctx.world_size(), c.world - 1);
        // Steps 1..4 each applied once: the failed attempt, then the redo.
        std::vector<int> applied;
        for (const auto& record : run.steps) {
          if (record.status.ok()) applied.push_back(record.step);
        }
        EXPECT_EQ(applied, (std::vector<int>{1, 2, 3, 4}));
        ASSERT_FALSE(run.steps.empty());
        EXPECT_EQ(run.steps.back().state.steps, 4);
        for (const auto& record : run.steps) {
          if (record.step == c.step && !record.status.ok()) {
            EXPECT_THAT(std::string(record.status.message()),
                        ::testing::ContainsRegex(absl::StrCat("rank\\(s\\) ", c.lost, " ")))
                << "the failure names the lost rank";
          }
        }
      },
      options);
}

INSTANTIATE_TEST_SUITE_P(Losses, StepRegroupTest,
                         ::testing::Values(StepLossCase{3, 1, 2, 1, "static"},
                                           StepLossCase{3, 0, 3, 2, "work"},
                                           StepLossCase{4, 2, 2, 1, "dynamic"}),
                         StepName);

struct RejoinCase {
  int world;
  int lost;  // the launch rank that dies in step 2 and is replaced
  std::string mode;
  bool joiner_dies = false;  // the replacement dies before the handover
};

void PrintTo(const RejoinCase& c, std::ostream* os) {
  *os << "world " << c.world << " rank " << c.lost << " " << c.mode
      << (c.joiner_dies ? " joiner dies" : "");
}

std::string RejoinName(const ::testing::TestParamInfo<RejoinCase>& info) {
  const RejoinCase& c = info.param;
  return absl::StrCat("world", c.world, "_rank", c.lost, "_", c.mode,
                      c.joiner_dies ? "_joiner_dies" : "");
}

class RejoinTest : public ::testing::TestWithParam<RejoinCase> {};

// A rank dies in step 2; the survivors regroup and redo it, and the new
// rank 0 starts a replacement (EVENSTEP_JOIN=1), which asks to join. After
// step 5 the survivors admit it and hand it the state (parameters, SGD
// momentum, the balancing state: each survivor a part), and it trains steps
// 6-8 with them. Every step's applied gradient, on every rank, the
// replacement's included, is one process's over the global batch (the
// trainer EXPECTs it after each synchronisation), and after the handover
// every rank holds the same parameters and momentum. A replacement that
// dies before the handover leaves the survivors going on without it.
TEST_P(RejoinTest, AReplacementJoinsFromTheSurvivorsLiveState) {
  const RejoinCase c = GetParam();
  OnRanksOptions options = Continuing();
  options.exit_codes = {{c.lost, 5}};
  RunOnRanks(
      c.world,
      [c](DistContext& ctx) {
        BalanceScenario s = LossScenario(c.lost, 2, c.mode, 8);
        s.momentum = 0.9;
        s.rejoin_step = 5;
        s.joiner_dies = c.joiner_dies;
        const BalanceRun run = TrainBalanced(ctx, s);
        const std::string who =
            absl::StrCat("launch rank ", ctx.launch_rank(), run.joined ? " (the replacement)" : "");
        EXPECT_TRUE(run.status.ok()) << who << ": " << run.status;
        std::vector<int> applied;
        for (const auto& record : run.steps) {
          if (record.status.ok()) applied.push_back(record.step);
        }
        for (const auto& digests : run.digests) {
          for (double d : digests) {
            EXPECT_NEAR(d, digests[0], 1e-12 * std::abs(digests[0]))
                << who << ": the replicas differ after the handover";
          }
        }
        ASSERT_FALSE(run.handovers.empty()) << who;
        const HandOverResult& handed = run.handovers.back();
        std::vector<int> senders(c.world - 1);
        std::iota(senders.begin(), senders.end(), 0);
        if (run.joined) {
          EXPECT_EQ(ctx.launch_rank(), c.lost);
          EXPECT_TRUE(handed.received);
          EXPECT_EQ(handed.step, 5);
          EXPECT_EQ(handed.senders, senders) << "every survivor sends a part";
          EXPECT_EQ(handed.receivers, std::vector<int>{c.world - 1});
          EXPECT_GT(handed.bytes, 0);
          EXPECT_EQ(applied, (std::vector<int>{6, 7, 8}));
          EXPECT_EQ(ctx.world_size(), c.world);
          return;
        }
        EXPECT_EQ(applied, (std::vector<int>{1, 2, 3, 4, 5, 6, 7, 8}));
        ASSERT_EQ(run.admissions.size(), 1u) << who;
        EXPECT_EQ(run.admissions[0].joined, std::vector<int>{c.world - 1});
        EXPECT_EQ(run.regroups.size(), c.joiner_dies ? 2u : 1u) << who;
        EXPECT_EQ(ctx.world_size(), c.joiner_dies ? c.world - 1 : c.world);
        if (c.joiner_dies) {
          EXPECT_TRUE(handed.receivers.empty()) << "the handover after the joiner was lost";
        } else {
          EXPECT_EQ(handed.senders, senders);
          EXPECT_GT(handed.bytes_sent, 0) << who << " sent no part";
        }
        if (ctx.rank() == 0) {
          EXPECT_EQ(run.replacement_exit, c.joiner_dies ? 7 : 0) << "the replacement's output:\n"
                                                                 << run.replacement_output;
        }
      },
      options);
}

INSTANTIATE_TEST_SUITE_P(Rejoins, RejoinTest,
                         ::testing::Values(RejoinCase{3, 1, "static"}, RejoinCase{4, 2, "dynamic"},
                                           RejoinCase{3, 0, "static"},
                                           RejoinCase{3, 2, "work", true}),
                         RejoinName);

// A replacement for a rank that is still running is refused by name (two
// processes for one rank), and the ranks go on as they were.
TEST(RejoinRefusalTest, AReplacementOfALiveRankIsRefused) {
  OnRanksOptions options = Continuing();
  RunOnRanks(
      2,
      [](DistContext& ctx) {
        if (ctx.joined()) {
          ADD_FAILURE() << "the replacement of a live rank was admitted";
          return;
        }
        std::unique_ptr<Subprocess> twin;
        if (ctx.rank() == 0) twin = std::make_unique<Subprocess>(ReplacementOf(1));
        const absl::Time deadline = absl::Now() + HangBound(1);
        while (!ctx.JoinPending() && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(20));
        ASSERT_TRUE(ctx.JoinPending()) << "rank " << ctx.rank();
        absl::StatusOr<Regrouped> admitted = ctx.Admit();
        ASSERT_TRUE(admitted.ok()) << admitted.status();
        EXPECT_TRUE(admitted->joined.empty());
        EXPECT_TRUE(admitted->lost.empty());
        EXPECT_EQ(ctx.world_size(), 2);
        at::Tensor t = at::ones({4});
        ASSERT_TRUE(ctx.AllReduce(t).ok());
        EXPECT_TRUE(at::equal(t, at::full({4}, 2.0)));
        if (twin == nullptr) return;
        const ProcessResult ended = twin->Wait(HangBound(1));
        EXPECT_NE(ended.exit_code, 0) << ended.output;
        EXPECT_THAT(ended.output, HasSubstr("refused by the running ranks: launch rank 1 is still "
                                            "running: two processes for one rank"));
      },
      options);
}

// Joining needs the continue option and a job of more than one rank, and
// says so before it connects anywhere.
TEST(RejoinRefusalTest, JoiningNeedsContinueAndAJobToJoin) {
  DistOptions options;
  options.join = true;
  absl::StatusOr<std::unique_ptr<DistContext>> stop = DistContext::Create(LaunchEnv{}, options);
  ASSERT_FALSE(stop.ok());
  EXPECT_THAT(std::string(stop.status().message()),
              HasSubstr("joining needs --evenstep_on_rank_loss=continue"));
  options.on_rank_loss = DistOptions::OnRankLoss::kContinue;
  absl::StatusOr<std::unique_ptr<DistContext>> alone = DistContext::Create(LaunchEnv{}, options);
  ASSERT_FALSE(alone.ok());
  EXPECT_THAT(std::string(alone.status().message()),
              HasSubstr("a job of one rank has none to join"));
}

// Where going on cannot be exact, Regroup refuses by name before any
// collective: two model parts (the first part's optimizer step of the
// failed step cannot be undone), and a step still open.
TEST(StepRegroupTest, RefusesByNameWhereItCannotBeExact) {
  DistOptions options;
  options.on_rank_loss = DistOptions::OnRankLoss::kContinue;
  auto ctx = DistContext::Create(LaunchEnv{}, options);
  ASSERT_TRUE(ctx.ok()) << ctx.status();
  torch::nn::Linear d(3, 1), g(3, 3);
  torch::optim::SGD d_opt(d->parameters(), torch::optim::SGDOptions(0.1));
  torch::optim::SGD g_opt(g->parameters(), torch::optim::SGDOptions(0.1));
  {
    auto parts = BalancedStep::Create(**ctx, {{"D", *d, d_opt}, {"G", *g, g_opt}},
                                      std::vector<int64_t>(64, 1), BalanceConfig());
    ASSERT_TRUE(parts.ok()) << parts.status();
    absl::StatusOr<Regrouped> r = (*parts)->Regroup();
    EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_THAT(std::string(r.status().message()),
                HasSubstr("with 2 model parts is not supported"));
  }
  auto one = BalancedStep::Create(**ctx, *d, d_opt, std::vector<int64_t>(64, 1), BalanceConfig());
  ASSERT_TRUE(one.ok()) << one.status();
  ASSERT_TRUE((*one)->BeginStep().ok());
  absl::StatusOr<Regrouped> open = (*one)->Regroup();
  EXPECT_EQ(open.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(open.status().message()), HasSubstr("Regroup while step 1 is open"));
}

// Without kContinue there is no heartbeat to tell a lost rank from a slow
// one: Regroup refuses, naming the option.
TEST(RegroupTest, NeedsTheContinueOption) {
  auto ctx = DistContext::Create(LaunchEnv{}, DistOptions{});
  ASSERT_TRUE(ctx.ok()) << ctx.status();
  absl::StatusOr<Regrouped> r = (*ctx)->Regroup();
  ASSERT_FALSE(r.ok());
  EXPECT_THAT(std::string(r.status().message()),
              HasSubstr("Regroup needs DistOptions::on_rank_loss = kContinue"));
}

}  // namespace
}  // namespace evenstep

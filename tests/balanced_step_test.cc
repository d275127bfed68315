// BalancedStep over real ranks (Gloo on 127.0.0.1): the applied gradient
// equals the single-process gradient of the global batch's mean loss for
// every mode, world sizes 1-4, uneven and measured splits; the loss
// trajectory does not depend on the world size; failures name rank and step.
// Every rank trains tests/testing/balance_trainer.h's model, which EXPECTs
// each step's gradient against one process's; the TESTs below check what
// else their scenario promises, inside each rank.
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <string>
#include <tuple>
#include <vector>

#include "absl/flags/reflection.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "evenstep/flags.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/balance_trainer.h"
#include "tests/testing/flag_args.h"
#include "tests/testing/on_ranks.h"

namespace evenstep {
namespace {

using ::evenstep::testing::BalanceRun;
using ::evenstep::testing::BalanceScenario;
using ::evenstep::testing::BalanceStepRecord;
using ::evenstep::testing::ExpectAllStepsRan;
using ::evenstep::testing::OnRanksOptions;
using ::evenstep::testing::ProcessResult;
using ::evenstep::testing::RanksDir;
using ::evenstep::testing::ReadRanksFile;
using ::evenstep::testing::RunOnRanks;
using ::evenstep::testing::RunOnRanksAgain;
using ::evenstep::testing::StepLines;
using ::evenstep::testing::TrainBalanced;
using ::evenstep::testing::WriteRanksFile;
using ::testing::ContainsRegex;
using ::testing::HasSubstr;
using ::testing::Not;

// The environment variable that tells RunOnRanksAgain's runs apart.
constexpr char kRunVar[] = "BALANCE_RUN";
std::string RunName() {
  const char* v = std::getenv(kRunVar);
  return v != nullptr ? v : "";
}
OnRanksOptions RunNamed(const std::string& name) {
  OnRanksOptions options;
  options.env = {{kRunVar, name}};
  return options;
}

// Two runs of `body` on 2 ranks: "first", then "resumed" (RunName()).
void SavedThenResumed(const evenstep::testing::RankBody& body) {
  RunOnRanks(2, body, RunNamed("first"));
  RunOnRanksAgain(2, RunNamed("resumed"));
}

// `s` saving a checkpoint after every step into RanksDir() (the run
// "first"), or resumed from there for `resumed_steps` steps (the run
// "resumed"); EXPECTs every step to have run.
BalanceRun SaveOrResume(DistContext& ctx, BalanceScenario s, int resumed_steps) {
  s.flags.push_back("--evenstep_ckpt_dir=" + RanksDir() + "/ckpt");
  s.duty = BalanceScenario::Duty::kCheckpoint;
  s.resume = RunName() == "resumed";
  if (s.resume) s.steps = resumed_steps;
  BalanceRun run = TrainBalanced(ctx, s);
  ExpectAllStepsRan(run, s);
  return run;
}

// EXPECTs that `record` (a step that was abandoned) failed with its
// gradients cleared, its error naming `failed_ranks`.
void ExpectAbandoned(const BalanceRun& run, int step, const std::string& failed_ranks) {
  const BalanceStepRecord* r = run.at(step);
  ASSERT_NE(r, nullptr) << "rank " << run.rank << " never reached step " << step;
  EXPECT_FALSE(r->status.ok()) << "rank " << run.rank << " step " << step;
  EXPECT_TRUE(r->cleared) << "rank " << run.rank << " step " << step << ": gradients left over";
  EXPECT_THAT(std::string(r->status.message()), HasSubstr("rank(s) " + failed_ranks + " failed"))
      << "rank " << run.rank << " step " << step;
}

void ExpectStepRan(const BalanceRun& run, int step) {
  const BalanceStepRecord* r = run.at(step);
  ASSERT_NE(r, nullptr) << "rank " << run.rank << " never reached step " << step;
  EXPECT_TRUE(r->status.ok()) << "rank " << run.rank << " step " << step << ": " << r->status;
}

struct Case {
  std::string mode;
  int world;
  std::string normalize;
  std::string reduction = "sum";  // what the loss function returns
  std::vector<std::string> extra_flags = {};
  int load_jitter_ms = 0;
  friend void PrintTo(const Case& c, std::ostream* os) {
    *os << c.mode << " world " << c.world << " " << c.normalize << " " << c.reduction;
  }
};

class BalancedStepExactTest : public ::testing::TestWithParam<Case> {};

TEST_P(BalancedStepExactTest, AppliedGradientEqualsSingleProcessGradient) {
  const Case c = GetParam();
  RunOnRanks(c.world, [&](DistContext& ctx) {
    // Uneven random shares with one idle rank for the first steps (warm-up),
    // then the planner's own (measured) shares; several micro-batches per rank.
    BalanceScenario s;
    s.flags = {"--evenstep_balance=" + c.mode,
               "--evenstep_normalize=" + c.normalize,
               "--evenstep_loss_reduction=" + c.reduction,
               "--evenstep_global_batch=37",
               "--evenstep_micro_batch_samples=4",
               "--evenstep_warmup_steps=1"};
    s.flags.insert(s.flags.end(), c.extra_flags.begin(), c.extra_flags.end());
    s.steps = 4;
    s.split_seed = 7 * c.world + 1;
    s.load_jitter_ms = c.load_jitter_ms;
    const BalanceRun run = TrainBalanced(ctx, s);
    ExpectAllStepsRan(run, s);
    if (c.mode == "dynamic" && c.world > 1 && ctx.rank() == s.split_seed % c.world) {
      // The seeded split left this rank without work in step 1: it joined
      // the sync with zeros.
      ASSERT_FALSE(run.steps.empty());
      EXPECT_EQ(run.steps[0].report.micro_batches, 0);
      EXPECT_EQ(run.steps[0].report.samples, 0);
    }
  });
}

INSTANTIATE_TEST_SUITE_P(
    Modes, BalancedStepExactTest,
    ::testing::Values(Case{"static", 1, "samples"}, Case{"static", 3, "samples"},
                      Case{"work", 2, "tokens"}, Case{"work", 4, "samples"},
                      Case{"dynamic", 1, "tokens"}, Case{"dynamic", 2, "samples"},
                      Case{"dynamic", 3, "tokens"}, Case{"dynamic", 4, "tokens"},
                      // A loss written as a MEAN over the micro-batch (the usual way) with
                      // --evenstep_loss_reduction=mean: the same gradient as the SUM form.
                      Case{"work", 3, "tokens", "mean"}, Case{"dynamic", 2, "samples", "mean"},
                      // Loading on 3 data workers, finishing out of order.
                      Case{"dynamic", 3, "tokens", "sum", {"--evenstep_data_workers=3"}, 3}),
    [](const auto& info) {
      return absl::StrCat(info.param.mode, "_world", info.param.world, "_", info.param.normalize,
                          info.param.reduction == "sum" ? "" : "_mean",
                          info.param.extra_flags.empty() ? "" : "_prefetch");
    });

// Loading on data workers changes nothing but who loads: 0, 1 and 4 workers
// (loads finishing out of order), a plain load function or an
// evenstep::Loader (which also loads each next step's micro-batches while
// the current one finishes), give the same steps and losses. By default
// (--evenstep_data_workers=-1) a Loader loads on workers and a plain
// function on the training thread; at most --evenstep_prefetch loaded
// micro-batches wait per step loading (plus the one in use).
struct PrefetchRun {
  std::string workers;  // --evenstep_data_workers
  bool owned;           // an evenstep::Loader
  bool on_workers;      // every load runs on a worker (else none)
  bool next_step;       // the next step's loads start early
};
const std::vector<PrefetchRun> kPrefetchRuns = {
    {"0", false, false, false}, {"1", false, true, false}, {"4", false, true, false},
    {"4", true, true, true},    {"-1", true, true, true},  {"-1", false, false, false},
    {"0", true, false, false}};

TEST(BalancedStepTest, PrefetchGivesTheSameStepsForAnyNumberOfWorkers) {
  RunOnRanks(
      2,
      [](DistContext& ctx) {
        const int index = std::stoi(RunName());
        const PrefetchRun& p = kPrefetchRuns.at(index);
        // 30 samples and a global batch of 11 make epochs of 3 steps, so
        // steps cross epochs.
        BalanceScenario s;
        s.flags = {"--evenstep_balance=work", "--evenstep_global_batch=11",
                   "--evenstep_micro_batch_samples=2", "--evenstep_data_workers=" + p.workers,
                   "--evenstep_prefetch=2"};
        s.samples = 30;
        s.steps = 7;
        s.load_jitter_ms = 4;
        s.owned_loader = p.owned;
        const BalanceRun run = TrainBalanced(ctx, s);
        ExpectAllStepsRan(run, s);
        const std::string what = absl::StrCat("workers ", p.workers, p.owned ? " Loader" : "");
        // --evenstep_prefetch=2 waiting, plus as many for the next step when
        // it is loaded ahead, plus the one in use.
        EXPECT_LE(run.max_ahead, (p.next_step ? 2 * 2 : 2) + 1) << what;
        if (!p.on_workers) EXPECT_EQ(run.max_ahead, 1) << what;
        EXPECT_GT(run.loads, 0);
        EXPECT_EQ(run.worker_loads, p.on_workers ? run.loads : 0) << what;
        WriteRanksFile(absl::StrCat("steps-", index, "-rank", ctx.rank()), StepLines(run));
      },
      RunNamed("0"));
  for (size_t i = 1; i < kPrefetchRuns.size(); ++i) RunOnRanksAgain(2, RunNamed(std::to_string(i)));
  for (int rank = 0; rank < 2; ++rank) {
    const std::string first = ReadRanksFile(absl::StrCat("steps-0-rank", rank));
    for (size_t i = 1; i < kPrefetchRuns.size(); ++i) {
      EXPECT_EQ(ReadRanksFile(absl::StrCat("steps-", i, "-rank", rank)), first)
          << "workers " << kPrefetchRuns[i].workers << " Loader " << kPrefetchRuns[i].owned;
    }
    // What a checkpoint would hold after the last step of epoch 0, planned
    // ahead or not.
    EXPECT_THAT(first, ContainsRegex(absl::StrCat("step 3 rank ", rank,
                                                  " [^\n]*; state: epoch 0 "
                                                  "batch 3 steps 3 next epoch 1\n")));
  }
}

// A load that throws on a data worker fails its step on every rank like a
// throwing callback, naming the samples it was loading; the trainer may go on.
TEST(BalancedStepTest, ALoadFailureOnAWorkerNamesItsSamplesAndEveryRankGoesOn) {
  RunOnRanks(2, [](DistContext& ctx) {
    BalanceScenario s;
    s.flags = {"--evenstep_micro_batch_samples=4", "--evenstep_data_workers=2"};
    s.steps = 4;
    s.fail_load_rank = 1;
    s.continue_after_failure = true;
    const BalanceRun run = TrainBalanced(ctx, s);
    ExpectAbandoned(run, 2, "1");
    ExpectStepRan(run, 4);
    if (ctx.rank() == 1) {
      EXPECT_THAT(std::string(run.at(2)->status.message()),
                  ContainsRegex("rank 1, step 2, micro-batch [0-9]+ of [0-9]+: loading samples "
                                "\\[[0-9, .]+(in all)?\\] on a data worker: injected failure in "
                                "the load function"));
    }
  });
}

// Online health: a rank whose micro-steps become 2.5x slower mid-run is named
// against its own best (once), the steady rank never; the health figures
// of the last step show who degraded. The micro-steps are timed on a virtual
// clock that only the trainer's 15 ms "work" advances: with wall-clock sleeps
// a loaded machine (ctest -j12 on 2 cores) hid the slowdown behind the load
// falling away during the run.
TEST(BalancedStepTest, ARankThatSlowsDownMidRunIsNamedAgainstItsOwnBest) {
  RunOnRanks(2, [](DistContext& ctx) {
    BalanceScenario s;
    s.flags = {"--evenstep_micro_batch_samples=8", "--evenstep_balance=static"};
    s.steps = 30;
    s.sleep_ms_per_micro = 15;
    s.degrade = {1, 14, 2.5};
    s.virtual_time = true;
    const BalanceRun run = TrainBalanced(ctx, s);
    ExpectAllStepsRan(run, s);
    if (ctx.rank() != 0) return;
    std::vector<std::string> alerts;
    for (const BalanceStepRecord& r : run.steps) {
      alerts.insert(alerts.end(), r.report.health_alerts.begin(), r.report.health_alerts.end());
    }
    ASSERT_EQ(alerts.size(), 1u) << absl::StrJoin(alerts, "\n");
    EXPECT_THAT(alerts[0], HasSubstr("rank 1's micro-steps take 2.50x its own best"));
    // The last step: rank 0 at its best, rank 1 at 1/2.5 of it.
    const std::vector<double>& health = run.steps.back().report.rank_health;
    ASSERT_EQ(health.size(), 2u);
    EXPECT_NEAR(health[0], 1.0, 1e-3);
    EXPECT_NEAR(health[1], 0.4, 1e-3);
  });
}

// Same global batches and exact gradients at every world size: only float
// summation order differs.
TEST(BalancedStepTest, LossTrajectoryIsTheSameForWorldSizes1To3) {
  RunOnRanks(1, [](DistContext& ctx) {
    BalanceScenario s;
    s.flags = {"--evenstep_balance=dynamic", "--evenstep_global_batch=40",
               "--evenstep_micro_batch_samples=5"};
    s.steps = 6;
    const BalanceRun run = TrainBalanced(ctx, s);
    ExpectAllStepsRan(run, s);
    if (ctx.rank() != 0) return;
    std::string losses;
    for (const BalanceStepRecord& r : run.steps)
      absl::StrAppendFormat(&losses, "%.9g\n", r.report.loss);
    WriteRanksFile(absl::StrCat("losses-world", ctx.world_size()), losses);
  });
  RunOnRanksAgain(2, {});
  RunOnRanksAgain(3, {});
  std::vector<std::vector<double>> runs;
  for (int world : {1, 2, 3}) {
    runs.emplace_back();
    for (absl::string_view line : absl::StrSplit(ReadRanksFile(absl::StrCat("losses-world", world)),
                                                 '\n', absl::SkipEmpty())) {
      runs.back().push_back(std::stod(std::string(line)));
    }
    ASSERT_EQ(runs.back().size(), 6u) << "world " << world;
  }
  for (size_t w = 1; w < runs.size(); ++w) {
    for (size_t step = 0; step < runs[0].size(); ++step) {
      EXPECT_NEAR(runs[w][step], runs[0][step], 1e-5 * std::abs(runs[0][step]))
          << "world " << w + 1 << " step " << step + 1;
    }
  }
}

// Rank 1's callback throws in step 2 (in its first or third micro-batch): it
// joins the step's gradient sync with a failure mark, so rank 0 learns it in
// the same step (no timeout).
class CallbackFailureTest : public ::testing::TestWithParam<int> {};

TEST_P(CallbackFailureTest, NamesRankStepAndMicroBatchOnEveryRank) {
  const int fail_micro = GetParam();
  RunOnRanks(2, [&](DistContext& ctx) {
    BalanceScenario s;
    s.flags = {"--evenstep_micro_batch_samples=4"};
    s.fail_at = {{1, 2}};
    s.fail_micro_batch = fail_micro;
    const BalanceRun run = TrainBalanced(ctx, s);
    EXPECT_EQ(run.status.code(), absl::StatusCode::kAborted) << run.status;
    EXPECT_EQ(run.steps.size(), 2u) << "the run stops at the failed step";
    const std::string message(run.status.message());
    EXPECT_THAT(message, HasSubstr("step 2, micro-batch "));
    EXPECT_THAT(message, HasSubstr("abandoned on every rank: rank(s) 1 failed"));
    if (ctx.rank() == 1) {
      EXPECT_THAT(message, HasSubstr("injected failure in the loss callback"));
      EXPECT_THAT(message, HasSubstr("rank 1, step 2, micro-batch "));
    }
  });
}

INSTANTIATE_TEST_SUITE_P(MicroBatches, CallbackFailureTest, ::testing::Values(1, 3),
                         [](const auto& info) { return absl::StrCat("micro", info.param); });

// Rank 1 dies in step 2: rank 0's step fails naming it as never arrived
// within --evenstep_timeout, and rank 0 reports and exits (a signal, SIGPIPE
// from writing to the dead peer's socket, would end it without a word).
TEST(BalancedStepTest, APeerThatDiesIsNamedAsNeverArrived) {
  OnRanksOptions options;
  options.collective_timeout = absl::Seconds(10);
  options.exit_codes = {{1, 5}};
  RunOnRanks(
      2,
      [](DistContext& ctx) {
        BalanceScenario s;
        s.flags = {"--evenstep_micro_batch_samples=4"};
        s.fail_at = {{1, 2}};
        s.fail_by_exit = true;
        const BalanceRun run = TrainBalanced(ctx, s);
        ASSERT_EQ(ctx.rank(), 0) << "rank 1 exits in step 2";
        const std::string message(run.status.message());
        EXPECT_FALSE(run.status.ok());
        EXPECT_THAT(message, HasSubstr("rank 0: all_reduce of gradient bucket"));
        EXPECT_THAT(message, ContainsRegex("rank\\(s\\) 1 \\(last at #[0-9]+\\) never arrived"));
      },
      options);
}

// A trainer that catches the error and goes on: on both ranks step 2 is
// abandoned with its gradients cleared, and steps 3-4 run with the reference
// gradient (a leftover of step 2 would fail the trainer's check).
TEST(BalancedStepTest, EveryRankAbandonsTheSameStepAndGoesOn) {
  RunOnRanks(2, [](DistContext& ctx) {
    BalanceScenario s;
    s.flags = {"--evenstep_micro_batch_samples=4"};
    s.steps = 4;
    s.fail_at = {{0, 2}};
    s.fail_micro_batch = 3;
    s.continue_after_failure = true;
    const BalanceRun run = TrainBalanced(ctx, s);
    ExpectAbandoned(run, 2, "0");
    ExpectStepRan(run, 3);
    ExpectStepRan(run, 4);
  });
}

// Step 2: rank 1 fails in its first micro-batch, rank 0 learns it inside its
// synchronised backward. Step 3: rank 0 fails before its synchronisation.
// Rank 0 once carried step 2's failure over and did not join step 3's
// synchronisation: rank 1 reduced its step 3 with rank 0's step 4, the steps
// shifted by one from there (found by bench/oom's skip row, the way fairseq
// skips a batch). Both must abandon steps 2 and 3 and run 4-5 with the
// reference gradient.
TEST(BalancedStepTest, ARankThatFailsBeforeItsSyncAfterAStepItOnlyWitnessedStillAbandonsItsOwn) {
  RunOnRanks(2, [](DistContext& ctx) {
    BalanceScenario s;
    s.flags = {"--evenstep_micro_batch_samples=4"};
    s.steps = 5;
    s.fail_at = {{1, 2}, {0, 3}};
    s.continue_after_failure = true;
    const BalanceRun run = TrainBalanced(ctx, s);
    ExpectAbandoned(run, 2, "1");
    ExpectAbandoned(run, 3, "0");
    ExpectStepRan(run, 4);
    ExpectStepRan(run, 5);
  });
}

// One micro-batch per rank (no cap): the only backward is the synced one.
// The used-parameter bitmap once launched before the embedding's hook ran,
// and every rank kept its own sparse gradient (0.7-0.9 % off per step). The
// trainer checks every step's gradient against one process.
class SparseEmbeddingTest : public ::testing::TestWithParam<int> {};

TEST_P(SparseEmbeddingTest, OneMicroBatchPerRankGetsTheGlobalGradient) {
  RunOnRanks(GetParam(), [](DistContext& ctx) {
    BalanceScenario s;
    s.flags = {"--evenstep_global_batch=37", "--evenstep_balance=static"};
    s.steps = 4;
    s.sparse_embedding = true;
    const BalanceRun run = TrainBalanced(ctx, s);
    ExpectAllStepsRan(run, s);
    for (const BalanceStepRecord& r : run.steps) {
      EXPECT_EQ(r.report.micro_batches, 1) << "rank " << ctx.rank() << " step " << r.step;
    }
  });
}

INSTANTIATE_TEST_SUITE_P(Worlds, SparseEmbeddingTest, ::testing::Values(2, 3),
                         [](const auto& info) { return absl::StrCat("world", info.param); });

// The issue's first program class through BalancedStep: a sparse embedding
// beside a rank with no micro-batch in a step (seeded initial shares with
// one at zero, kept through warm-up), 1, 2 or 3 micro-batches per working
// rank, and rank 0's backward outside every step (a probe) then zero_grad:
// Gloo used to abort on the ranks' sparse layouts (zero_grad in place leaves
// every dimension sparse). Every step's gradient equals one process's.
class SparseIdleRankTest : public ::testing::TestWithParam<std::tuple<int, int>> {};

TEST_P(SparseIdleRankTest, EveryStepGetsTheGlobalGradient) {
  const auto [world, micro] = GetParam();
  RunOnRanks(world, [world = world, micro = micro](DistContext& ctx) {
    BalanceScenario s;
    s.flags = {"--evenstep_global_batch=37", "--evenstep_balance=dynamic",
               "--evenstep_warmup_steps=10",
               "--evenstep_min_micro_batches=" + std::to_string(micro),
               "--evenstep_max_micro_batches=" + std::to_string(micro)};
    s.steps = 3;
    s.sparse_embedding = true;
    s.outside_backward = true;
    s.split_seed = 5 * world + micro;
    const BalanceRun run = TrainBalanced(ctx, s);
    ExpectAllStepsRan(run, s);
    const bool idle = ctx.rank() == s.split_seed % world;
    for (const BalanceStepRecord& r : run.steps) {
      EXPECT_EQ(r.report.micro_batches, idle ? 0 : micro)
          << "rank " << ctx.rank() << " step " << r.step;
    }
  });
}

INSTANTIATE_TEST_SUITE_P(WorldsAndMicroBatches, SparseIdleRankTest,
                         ::testing::Combine(::testing::Values(2, 3), ::testing::Values(1, 2, 3)),
                         [](const auto& info) {
                           return absl::StrCat("world", std::get<0>(info.param), "_micro",
                                               std::get<1>(info.param));
                         });

// Rank 0 alone runs a backward through the model between steps (a GAN
// generator's loss through the discriminator): its gradients are its own (a
// collective started from the hooks would wait for rank 1 until the
// timeout), and after zero_grad every step's gradient is still exact.
TEST(BalancedStepTest, ABackwardOutsideAStepStaysLocalAndStartsNoCollective) {
  RunOnRanks(2, [](DistContext& ctx) {
    BalanceScenario s;
    s.flags = {"--evenstep_micro_batch_samples=4"};
    s.outside_backward = true;
    ExpectAllStepsRan(TrainBalanced(ctx, s), s);
  });
}

// Each bad value is refused with a message naming the flag, before any rank
// starts (flags_test tries every invalid value of every flag; these are the
// messages BalancedStep's users see).
TEST(BalancedStepTest, BadFlagsAreRejectedByName) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"--evenstep_balance=fast", "--evenstep_balance=fast: expected static, work or dynamic"},
      {"--evenstep_global_batch=0", "--evenstep_global_batch=0: must be >= 1"},
      {"--evenstep_batch_unit=bytes", "--evenstep_batch_unit=bytes: expected samples or tokens"},
      {"--evenstep_plan_damping=0", "--evenstep_plan_damping=0: must be in (0, 1]"},
      {"--evenstep_comm_hook=zip", "zip"},
      {"--evenstep_memory_headroom=0", "--evenstep_memory_headroom=0: must be in (0, 1]"},
      {"--evenstep_memory_limit_mb=-2", "--evenstep_memory_limit_mb=-2: must be in [-1, "},
      {"--evenstep_memory_limit_mb=-0.5",
       "--evenstep_memory_limit_mb=-0.5: expected MiB > 0, 0 (the device's) or -1 (off)"},
  };
  for (const auto& [flag, message] : cases) {
    absl::FlagSaver saver;
    absl::Status status = evenstep::testing::ParseEvenstepArgs({flag});
    if (status.ok()) status = BalanceConfigFromFlags().status();
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << flag << ": " << status;
    EXPECT_THAT(std::string(status.message()), HasSubstr(message)) << flag;
  }
}

// Out-of-memory recovery (--evenstep_oom=split, the default): rank 1 runs
// out of memory (the real c10::OutOfMemoryError, injected) in every
// micro-batch, or piece of one, above a budget of padded tokens: in the loss
// function, in an unsynchronised backward after the last layers' gradients
// accumulated, or in the synchronised backward (every rank abandons that
// synchronisation and all run the part again). Every step's applied
// gradient equals one process's over the whole global batch (the trainer
// checks it after every sync), each recovery is said once, and after the
// first recovery the rank's learned cap keeps every later micro-batch under
// the budget: no out-of-memory after the step of the first.
struct OomCase {
  std::string where;
  int world;
  std::string mode;
  bool owned_loader = false;
  std::string reduction = "sum";
  friend void PrintTo(const OomCase& c, std::ostream* os) {
    *os << c.where << " world " << c.world << " " << c.mode;
  }
};

// The scenario of the out-of-memory tests: rank 1 holds 24 padded tokens.
BalanceScenario OomScenario(int steps) {
  BalanceScenario s;
  s.flags = {"--evenstep_global_batch=37", "--evenstep_micro_batch_samples=4"};
  s.steps = steps;
  s.oom.rank = 1;
  s.oom.tokens = 24;
  return s;
}

class OutOfMemoryTest : public ::testing::TestWithParam<OomCase> {};

TEST_P(OutOfMemoryTest, TheMicroBatchIsSplitAndRetriedWithTheExactGradient) {
  const OomCase& c = GetParam();
  const std::vector<ProcessResult> results = RunOnRanks(c.world, [&](DistContext& ctx) {
    BalanceScenario s = OomScenario(5);
    s.flags.push_back("--evenstep_balance=" + c.mode);
    s.flags.push_back("--evenstep_loss_reduction=" + c.reduction);
    s.oom.where = c.where;
    s.owned_loader = c.owned_loader;
    const BalanceRun run = TrainBalanced(ctx, s);
    ExpectAllStepsRan(run, s);
    ASSERT_EQ(run.steps.size(), 5u);
    // Every rank knows rank 1's learned cap (the budget or below).
    const std::vector<int64_t>& caps = run.steps.back().state.memory_caps;
    ASSERT_EQ(static_cast<int>(caps.size()), c.world);
    EXPECT_EQ(caps[0], 0);
    EXPECT_GE(caps[1], 10);
    EXPECT_LE(caps[1], 24);
    // Every rank says every recovery, once: one line, for rank 1's step.
    std::vector<std::string> said;
    for (const BalanceStepRecord& r : run.steps) {
      said.insert(said.end(), r.report.oom_recoveries.begin(), r.report.oom_recoveries.end());
    }
    ASSERT_EQ(said.size(), 1u) << absl::StrJoin(said, "\n");
    if (ctx.rank() != 1) return;
    const std::vector<int>& injected = run.injected_oom_steps;
    ASSERT_FALSE(injected.empty());
    for (int step : injected) EXPECT_EQ(step, injected.front()) << "an out-of-memory after the cap";
    EXPECT_THAT(said[0],
                ContainsRegex(absl::StrCat(
                    "^rank 1, step ", injected.front(),
                    ": [0-9]+ micro-batch\\(es\\) ran out of memory \\(the largest [0-9]+ "
                    "padded tokens\\) and were split and retried within the step; rank 1's "
                    "micro-batches are now capped at (1[0-9]|2[0-4]) padded tokens$")));
  });
  ASSERT_EQ(static_cast<int>(results.size()), c.world);
  // What the library logs on rank 1 at its first recovery.
  EXPECT_THAT(results[1].output,
              ContainsRegex("\\[evenstep\\] rank 1, step 1: out of memory in micro-batch [0-9]+ "
                            "of [0-9]+ \\([0-9]+ samples, [0-9]+ padded tokens\\): split in "));
}

INSTANTIATE_TEST_SUITE_P(
    Placements, OutOfMemoryTest,
    ::testing::Values(OomCase{"forward", 2, "static"}, OomCase{"forward", 3, "dynamic"},
                      OomCase{"backward", 2, "static"}, OomCase{"backward", 3, "dynamic"},
                      OomCase{"synced", 3, "static"}, OomCase{"synced", 3, "dynamic"},
                      // An evenstep::Loader on data workers, loading ahead (the
                      // next step's micro-batches packed again under the cap),
                      // and a MEAN loss.
                      OomCase{"backward", 2, "work", true},
                      OomCase{"forward", 2, "work", true, "mean"}),
    [](const auto& info) {
      return absl::StrCat(info.param.where, "_world", info.param.world, "_", info.param.mode,
                          info.param.owned_loader ? "_loader" : "",
                          info.param.reduction == "mean" ? "_mean" : "");
    });

// A sample that does not fit even alone stops the run on every rank, named
// with its length and rank.
TEST(OutOfMemoryTest, ASampleThatDoesNotFitAloneStopsTheRunNamingIt) {
  RunOnRanks(2, [](DistContext& ctx) {
    BalanceScenario s = OomScenario(2);
    s.oom.tokens = 10;
    const BalanceRun run = TrainBalanced(ctx, s);
    EXPECT_FALSE(run.status.ok());
    const std::string message(run.status.message());
    if (ctx.rank() == 1) {
      EXPECT_THAT(message, ContainsRegex("out of memory with sample [0-9]+ \\(length [0-9]+\\) "
                                         "alone on rank 1: it does not fit even by itself"));
    } else {
      EXPECT_THAT(message, HasSubstr("rank(s) 1 failed"));
    }
  });
}

// A caching allocator holds blocks it no longer hands out (earlier steps',
// a failed attempt's): rank 1's budget of 24 padded tokens is 4 while 20
// are cached, as at the start and after each out-of-memory error. Released
// before each retry (BalanceConfig::release_cache; CUDA's emptyCache by
// default), the recovery is the one without a cache: every gradient exact,
// the learned cap within the real budget. Not released, even one sample
// does not fit: the run stops naming it, as with a real 4-token budget.
TEST(OutOfMemoryTest, TheAllocatorsCacheIsReleasedBeforeTheRetry) {
  RunOnRanks(2, [](DistContext& ctx) {
    BalanceScenario s = OomScenario(5);
    s.oom.cached_tokens = 20;
    const BalanceRun run = TrainBalanced(ctx, s);
    ExpectAllStepsRan(run, s);
    ASSERT_EQ(run.steps.size(), 5u);
    const std::vector<int64_t>& caps = run.steps.back().state.memory_caps;
    ASSERT_EQ(caps.size(), 2u);
    EXPECT_GE(caps[1], 10) << "the cap learned the cache, not the budget";
    EXPECT_LE(caps[1], 24);
    if (ctx.rank() == 1) EXPECT_GE(run.cache_releases, 1);
  });
}

TEST(OutOfMemoryTest, ACacheNeverReleasedLeavesOneSampleWithoutRoom) {
  RunOnRanks(2, [](DistContext& ctx) {
    BalanceScenario s = OomScenario(2);
    s.oom.cached_tokens = 20;
    s.oom.release = false;
    const BalanceRun run = TrainBalanced(ctx, s);
    EXPECT_FALSE(run.status.ok());
    if (ctx.rank() == 1) {
      EXPECT_GE(run.cache_releases, 1);
      EXPECT_THAT(std::string(run.status.message()),
                  ContainsRegex("alone on rank 1: it does not fit even by itself: "));
    }
  });
}

// --evenstep_oom=fail abandons the step at once.
TEST(OutOfMemoryTest, TheFailPolicyStopsTheRunAtTheFirstOutOfMemory) {
  RunOnRanks(2, [](DistContext& ctx) {
    BalanceScenario s = OomScenario(2);
    s.flags.push_back("--evenstep_oom=fail");
    const BalanceRun run = TrainBalanced(ctx, s);
    EXPECT_FALSE(run.status.ok());
    if (ctx.rank() == 1) {
      EXPECT_THAT(std::string(run.status.message()),
                  HasSubstr("out of memory: injected: out of memory in the loss "
                            "(--evenstep_oom=fail)"));
    }
  });
}

// The learned cap is part of the checkpoint: resumed, rank 1 is never again
// given a micro-batch above its budget.
TEST(OutOfMemoryTest, TheLearnedCapSurvivesAResume) {
  SavedThenResumed([](DistContext& ctx) {
    const bool resume = RunName() == "resumed";
    const BalanceRun run = SaveOrResume(ctx, OomScenario(2), 3);
    if (!resume) {
      if (ctx.rank() == 1) EXPECT_FALSE(run.injected_oom_steps.empty());
      return;
    }
    EXPECT_EQ(run.resumed_step, 2);
    ASSERT_EQ(run.resumed_memory_caps.size(), 2u);
    EXPECT_EQ(run.resumed_memory_caps[0], 0);
    EXPECT_GE(run.resumed_memory_caps[1], 1);
    EXPECT_TRUE(run.injected_oom_steps.empty()) << "rank " << ctx.rank();
  });
}

// Caps predicted from measured peaks (BalanceConfig::memory_limit_bytes).
// Rank 1's micro-steps report 100 MiB + 2 MiB per padded token, as a device
// allocator would (scripted: the CPU has no such figure), under a limit of
// 200 MiB: 90 % of it holds 40 padded tokens.
BalanceScenario ScriptedMemoryScenario(int steps) {
  BalanceScenario s;
  s.flags = {"--evenstep_global_batch=37", "--evenstep_micro_batch_samples=4",
             "--evenstep_memory_limit_mb=200"};
  s.steps = steps;
  s.scripted_memory = {1, 100, 2};
  return s;
}

// The first step after which rank 1's cap is known (0: never).
int CapKnownAt(const BalanceRun& run) {
  for (const BalanceStepRecord& r : run.steps) {
    if (r.state.memory_caps.size() > 1 && r.state.memory_caps[1] > 0) return r.step;
  }
  return 0;
}

// Once rank 1's fit is identified (step 2: six micro-steps) it says its cap;
// every later micro-batch there holds at most that many padded tokens, every
// step's gradient stays exact (the trainer checks it), and every rank knows
// the cap. Rank 0, without figures, gets none. Static and dynamic balance.
class PredictedMemoryCapTest : public ::testing::TestWithParam<std::string> {};

TEST_P(PredictedMemoryCapTest, ARankIsCappedWhereItsMeasuredPeaksPredictItsLimit) {
  const std::string mode = GetParam();
  const int world = mode == "static" ? 2 : 3;
  const std::vector<ProcessResult> results = RunOnRanks(world, [&](DistContext& ctx) {
    BalanceScenario s = ScriptedMemoryScenario(6);
    s.flags.push_back("--evenstep_balance=" + mode);
    const BalanceRun run = TrainBalanced(ctx, s);
    ExpectAllStepsRan(run, s);
    ASSERT_EQ(run.steps.size(), 6u);
    std::vector<int64_t> want(world, 0);
    want[1] = 40;
    EXPECT_EQ(run.steps.back().state.memory_caps, want);
    const int at = CapKnownAt(run);
    EXPECT_GE(at, 1);
    EXPECT_LE(at, 3);
    if (ctx.rank() != 1) return;
    EXPECT_GT(run.steps[0].report.largest_micro_batch, 40)
        << "the cap binds: micro-batches of 4 samples exceed it";
    for (const BalanceStepRecord& r : run.steps) {
      if (r.step > at) EXPECT_LE(r.report.largest_micro_batch, 40) << "step " << r.step;
    }
  });
  ASSERT_EQ(static_cast<int>(results.size()), world);
  EXPECT_THAT(results[1].output,
              ContainsRegex("\\[evenstep\\] rank 1, step [1-3]: micro-batches capped at 40 padded "
                            "tokens, predicted from this rank's peak memory \\(100.0 MiB \\+ "
                            "2.000 MiB per padded token, within 90 % of a 200.0 MiB limit\\)"));
  EXPECT_THAT(results[0].output, Not(HasSubstr("micro-batches capped at")));
}

INSTANTIATE_TEST_SUITE_P(Modes, PredictedMemoryCapTest, ::testing::Values("static", "dynamic"));

// The predicted cap is in the checkpoint: a resumed rank 1 keeps its
// micro-batches under it from the first step.
TEST(PredictedMemoryCapTest, TheCapSurvivesAResume) {
  SavedThenResumed([](DistContext& ctx) {
    const bool resume = RunName() == "resumed";
    const BalanceRun run = SaveOrResume(ctx, ScriptedMemoryScenario(3), 4);
    ASSERT_FALSE(run.steps.empty());
    if (!resume) {
      EXPECT_EQ(run.steps.back().state.memory_caps, (std::vector<int64_t>{0, 40}));
      return;
    }
    EXPECT_EQ(run.resumed_step, 3);
    EXPECT_EQ(run.resumed_memory_caps, (std::vector<int64_t>{0, 40}));
    if (ctx.rank() != 1) return;
    for (const BalanceStepRecord& r : run.steps) {
      EXPECT_LE(r.report.largest_micro_batch, 40) << "resumed step " << r.step;
    }
  });
}

// Nothing is predicted with --evenstep_memory_limit_mb=-1, nor from the
// CPU's own figures (no per-micro-step peak) under a limit.
class NoPredictedCapTest : public ::testing::TestWithParam<bool> {};

TEST_P(NoPredictedCapTest, NothingIsPredictedWhenOffOrWithoutDeviceFigures) {
  const bool scripted = GetParam();
  const std::vector<ProcessResult> results = RunOnRanks(2, [&](DistContext& ctx) {
    BalanceScenario s;
    if (scripted) {
      s = ScriptedMemoryScenario(4);
      s.flags.back() = "--evenstep_memory_limit_mb=-1";
    } else {
      s.flags = {"--evenstep_global_batch=37", "--evenstep_micro_batch_samples=4",
                 "--evenstep_memory_limit_mb=1"};
      s.steps = 4;
    }
    const BalanceRun run = TrainBalanced(ctx, s);
    ExpectAllStepsRan(run, s);
    for (const BalanceStepRecord& r : run.steps) {
      EXPECT_TRUE(r.state.memory_caps.empty()) << "step " << r.step;
    }
  });
  for (const ProcessResult& r : results) {
    EXPECT_THAT(r.output, Not(HasSubstr("predicted from this rank's peak memory")));
  }
}

INSTANTIATE_TEST_SUITE_P(Figures, NoPredictedCapTest, ::testing::Bool(), [](const auto& info) {
  return info.param ? "ScriptedButOff" : "CpuUnderALimit";
});

}  // namespace
}  // namespace evenstep

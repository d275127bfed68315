// MetricsLogger and Evaluate over real ranks: Log/EndStep never wait for the
// other ranks, every rank writes its shard, the aggregate rotates between
// ranks and holds the cross-rank means; evaluation is split by work and its
// result does not depend on the world size.
#include "evenstep/metrics.h"

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <numeric>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/balance_trainer.h"
#include "tests/testing/on_ranks.h"
#include "tests/testing/subprocess.h"
#include "tests/testing/temp_dir.h"

namespace evenstep {
namespace {

using ::evenstep::testing::BalanceRun;
using ::evenstep::testing::BalanceScenario;
using ::evenstep::testing::Describe;
using ::evenstep::testing::ExpectAllStepsRan;
using ::evenstep::testing::ProcessResult;
using ::evenstep::testing::RanksDir;
using ::evenstep::testing::ReadRanksFile;
using ::evenstep::testing::RunOnRanks;
using ::evenstep::testing::RunOnRanksAgain;
using ::evenstep::testing::TrainBalanced;
using ::evenstep::testing::WriteRanksFile;
using ::testing::HasSubstr;

std::vector<nlohmann::json> ReadLines(const std::string& path) {
  std::vector<nlohmann::json> out;
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line)) out.push_back(nlohmann::json::parse(line));
  return out;
}

TEST(MetricsTest, LogNeverWaitsShardsAndRotatingAggregate) {
  RunOnRanks(3, [](DistContext& ctx) {
    BalanceScenario s;
    s.steps = 6;
    s.metrics_dir = RanksDir();
    const BalanceRun run = TrainBalanced(ctx, s);
    ExpectAllStepsRan(run, s);
    // Rank 1 reached step 4's boundary only after rank 0 had returned from
    // it, so the reduction was still in flight when rank 0 went on.
    if (ctx.rank() == 0) EXPECT_TRUE(run.reduction_in_flight_after_step4);
  });
  const std::string dir = RanksDir();
  for (int r = 0; r < 3; ++r) {
    const auto own = ReadLines(absl::StrFormat("%s/metrics-%05d.jsonl", dir, r));
    ASSERT_EQ(own.size(), 18u) << "rank " << r;  // 6 steps x 3 names
    EXPECT_EQ(own[1]["name"], "rank");
    EXPECT_EQ(own[1]["value"], r);
    // Interval k (steps 2, 4, 6) is aggregated by rank k % 3.
    const auto aggregate = ReadLines(absl::StrFormat("%s/metrics-aggregate-%05d.jsonl", dir, r));
    ASSERT_EQ(aggregate.size(), 1u) << "rank " << r;
    EXPECT_EQ(aggregate[0]["interval"], r);
    EXPECT_EQ(aggregate[0]["step"], 2 * (r + 1));
    EXPECT_DOUBLE_EQ(aggregate[0]["rank"].get<double>(), 1.0);         // mean of 0, 1, 2
    EXPECT_DOUBLE_EQ(aggregate[0]["rank_tensor"].get<double>(), 1.0);  // a tensor value
  }
}

// Evaluate splits the held-out set by work: the same loss sum and token
// count on 1, 2 and 3 ranks (only float summation order differs).
TEST(MetricsTest, EvaluateIsTheSameAtAnyWorldSize) {
  RunOnRanks(1, [](DistContext& ctx) {
    BalanceScenario s;
    s.steps = 2;
    s.evaluate = true;
    const BalanceRun run = TrainBalanced(ctx, s);
    ExpectAllStepsRan(run, s);
    if (ctx.rank() != 0) return;
    WriteRanksFile(absl::StrCat("eval-world", ctx.world_size()),
                   absl::StrFormat("%.9g %.0f", run.eval_loss_sum, run.eval_tokens));
  });
  RunOnRanksAgain(2, {});
  RunOnRanksAgain(3, {});
  std::vector<std::pair<double, double>> results;
  for (int world : {1, 2, 3}) {
    std::istringstream in(ReadRanksFile(absl::StrCat("eval-world", world)));
    double loss_sum = 0, tokens = 0;
    ASSERT_TRUE(in >> loss_sum >> tokens) << "world " << world;
    results.emplace_back(loss_sum, tokens);
  }
  for (size_t w = 1; w < results.size(); ++w) {
    EXPECT_NEAR(results[w].first, results[0].first, 1e-6 * results[0].first) << "world " << w + 1;
    EXPECT_EQ(results[w].second, results[0].second) << "world " << w + 1;  // same token count
  }
}

// Session::Evaluate runs with the model in eval mode and without autograd,
// restores each submodule's own mode after, and caps its micro-batches: by
// default at a rank's share of one global batch (not the rank's whole share
// of the set in one padded batch), or at --evenstep_eval_micro_batch_tokens.
TEST(MetricsTest, SessionEvaluateUsesEvalModeNoGradAndCappedMicroBatches) {
  struct Run {
    std::vector<std::string> flags;
    int64_t max_samples, max_padded;  // the cap each micro-batch must keep
  };
  // 300 samples of 2-24 tokens over 2 ranks; global batch 20 samples.
  const std::vector<Run> runs = {
      {{"--evenstep_global_batch=20"}, 10, 10 * 24},
      {{"--evenstep_global_batch=20", "--evenstep_eval_micro_batch_tokens=100"}, 100 / 2, 100}};
  for (const Run& run : runs) {
    evenstep::testing::TempDir dir("evenstep_eval");
    std::vector<std::string> args = {EVENSTEP_CKPT_HELPER, "--run_dir=" + dir.path(), "--steps=2",
                                     "--evaluate", "--optimizer=sgd"};
    args.insert(args.end(), run.flags.begin(), run.flags.end());
    auto results = evenstep::testing::RunRanks(2, args);
    for (const ProcessResult& r : results) ASSERT_EQ(r.exit_code, 0) << Describe(results);
    int micro_batches = 0;
    for (const ProcessResult& r : results) {
      for (absl::string_view line : absl::StrSplit(r.output, '\n')) {
        if (!absl::ConsumePrefix(&line, "eval micro-batch samples ")) continue;
        std::vector<std::string> f = absl::StrSplit(line, ' ');
        int64_t samples = 0, padded = 0;
        ASSERT_TRUE(absl::SimpleAtoi(f[0], &samples) && absl::SimpleAtoi(f[2], &padded)) << line;
        EXPECT_LE(samples, run.max_samples) << run.flags.back();
        EXPECT_LE(padded, run.max_padded) << run.flags.back();
        ++micro_batches;
      }
      EXPECT_THAT(r.output, HasSubstr("after eval training 1 frozen_training 0 linear_training 1"));
    }
    EXPECT_GE(micro_batches, 300 / run.max_samples) << Describe(results);
    // The sums over both ranks: every sample once, and inside fn no grad
    // mode, no training mode and no graph on any micro-batch.
    EXPECT_THAT(results[0].output, HasSubstr("eval samples 300 grad_enabled 0 training 0 "
                                             "frozen_training 0 requires_grad 0"));
  }
  // A cap below the longest training sample (13 tokens) is refused naming
  // the flag at Session::Create, before any step; one below the longest
  // evaluation sample (24 tokens) at the evaluation.
  evenstep::testing::TempDir dir("evenstep_eval");
  auto results =
      evenstep::testing::RunRanks(2, {EVENSTEP_CKPT_HELPER, "--run_dir=" + dir.path(), "--steps=1",
                                      "--evaluate", "--evenstep_eval_micro_batch_tokens=10"});
  for (const ProcessResult& r : results) {
    EXPECT_EQ(r.exit_code, 2) << Describe(results);
    EXPECT_THAT(r.output, HasSubstr("--evenstep_eval_micro_batch_tokens=10 is below the longest "
                                    "training sample (13 tokens)"));
    EXPECT_THAT(r.output, ::testing::Not(HasSubstr("step 1 loss")));
  }
  evenstep::testing::TempDir dir2("evenstep_eval");
  results =
      evenstep::testing::RunRanks(2, {EVENSTEP_CKPT_HELPER, "--run_dir=" + dir2.path(), "--steps=1",
                                      "--evaluate", "--evenstep_eval_micro_batch_tokens=20"});
  for (const ProcessResult& r : results) {
    EXPECT_EQ(r.exit_code, 2) << Describe(results);
    EXPECT_THAT(r.output, HasSubstr("--evenstep_eval_micro_batch_tokens=20 is below the longest "
                                    "evaluation sample (24 tokens)"));
  }
}

TEST(MetricsTest, EvalSharesAreWithinOneMicroBatchOfEqualWork) {
  std::mt19937 rng(4);
  std::lognormal_distribution<double> len(4.0, 1.0);
  std::vector<int64_t> lengths(777);
  for (auto& l : lengths) l = 1 + static_cast<int64_t>(len(rng));
  SamplerOptions options;
  options.micro_batch_samples = 6;
  options.shuffle = false;
  auto set = Sampler::Create(lengths, options);
  ASSERT_TRUE(set.ok());
  for (int world : {1, 2, 3, 4, 7}) {
    double largest_micro = 0;
    int64_t samples = 0;
    std::vector<double> cost;
    for (int r = 0; r < world; ++r) {
      const EvalShare share = EvalSplit(*set, r, world);
      cost = share.rank_cost;
      for (const MicroBatch& mb : share.micro_batches) {
        largest_micro = std::max(largest_micro, mb.cost);
        samples += static_cast<int64_t>(mb.samples.size());
      }
    }
    EXPECT_EQ(samples, 777) << "world " << world;
    const double total = std::accumulate(cost.begin(), cost.end(), 0.0);
    for (double c : cost) {
      EXPECT_LE(c, total / world + largest_micro) << "world " << world;
    }
  }
}

}  // namespace
}  // namespace evenstep

// A dynamic-balance run replayed from its split record, over real ranks.
//
// Under dynamic balance each step's split follows the ranks' measured
// speeds, so two runs of one program split differently and (with dropout)
// differ. The run records what split each step (RUN_DIR/splits); a run with
// --evenstep_replay (SessionOptions::replay) splits every step as recorded:
// its losses and parameters equal the recorded run's bit for bit, whatever
// its own ranks' speeds, also when the replaying run is stopped and resumed.
// The record drives the split (an edited record moves the samples), and a
// replay that cannot be exact says why: no record, a step the record lacks,
// another global batch.
#include <torch/torch.h>

#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "evenstep/session.h"
#include "evenstep/session_options.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/testing/on_ranks.h"

namespace evenstep {
namespace {

using ::evenstep::testing::RanksDir;
using ::evenstep::testing::RunOnRanks;
using ::testing::HasSubstr;

constexpr int kSamples = 48;  // 4 steps of 12 per epoch

struct Net : torch::nn::Module {
  Net() {
    a = register_module("a", torch::nn::Linear(3, 8));
    b = register_module("b", torch::nn::Linear(8, 1));
  }
  torch::Tensor forward(torch::Tensor x) {
    return b->forward(torch::dropout(torch::tanh(a->forward(x)), 0.3, is_training()));
  }
  torch::nn::Linear a{nullptr}, b{nullptr};
};

torch::Tensor LossSum(Net& net, const std::vector<int64_t>& samples) {
  const auto n = static_cast<int64_t>(samples.size());
  torch::Tensor s = torch::tensor(samples, torch::kFloat).view({n, 1});
  torch::Tensor x = torch::cat({torch::sin(s), torch::cos(s), torch::sin(0.5 * s)}, 1);
  return (net.forward(x).view({n}) - torch::cos(0.3 * s).view({n})).pow(2).sum();
}

SessionOptions Options(const std::string& name) {
  SessionOptions o;
  o.run_dir = RanksDir() + "/" + name;
  o.balance.planner.mode = BalanceMode::kDynamic;
  o.balance.sampler.global_batch = 12;
  o.balance.sampler.micro_batch_samples = 2;
  o.balance.cost_model.warmup_steps = 1;
  o.ckpt_every = 4;
  o.timeline = false;
  return o;
}

struct RunResult {
  std::vector<double> losses;    // per step run
  std::vector<int64_t> samples;  // this rank's, per step run
  std::string params;            // the final parameters' bytes
  absl::Status status;           // the first error
};

// Steps up to `last` (from the Session's first step) of the dropout model;
// `slow_rank` sleeps 2 ms per micro-batch, so that the measured speeds and
// the dynamic plan move.
RunResult Train(DistContext& dist, const SessionOptions& options, int64_t last, int slow_rank) {
  torch::manual_seed(7);
  Net net;
  torch::optim::SGD optimizer(net.parameters(), torch::optim::SGDOptions(0.05));
  RunResult run;
  auto es = Session::Create(dist, net, optimizer, std::vector<int64_t>(kSamples, 1), options);
  if (!es.ok()) {
    run.status = es.status();
    return run;
  }
  for (int64_t s = (*es)->first_step(); s <= last; ++s) {
    auto report = (*es)->Step([&](const std::vector<int64_t>& samples) {
      if (dist.rank() == slow_rank) std::this_thread::sleep_for(std::chrono::milliseconds(2));
      return LossSum(net, samples);
    });
    if (!report.ok()) {
      run.status = report.status();
      break;
    }
    run.losses.push_back(report->loss);
    run.samples.push_back(report->samples);
  }
  const absl::Status finished = (*es)->Finish();
  if (run.status.ok()) run.status = finished;
  for (const torch::Tensor& p : net.parameters()) {
    run.params.append(static_cast<const char*>(p.data_ptr()), p.numel() * sizeof(float));
  }
  return run;
}

// Losses as their exact bits.
std::string Bits(const std::vector<double>& v) {
  std::string out;
  for (double d : v) {
    uint64_t u = 0;
    std::memcpy(&u, &d, sizeof u);
    absl::StrAppend(&out, absl::Hex(u), " ");
  }
  return out;
}

TEST(SplitReplayTest, AReplayedDynamicRunIsBitIdenticalAlsoAfterAResume) {
  RunOnRanks(2, [](DistContext& dist) {
    const RunResult recorded = Train(dist, Options("recorded"), 8, /*slow_rank=*/1);
    ASSERT_TRUE(recorded.status.ok()) << recorded.status;
    ASSERT_EQ(recorded.losses.size(), 8u);

    SessionOptions replay = Options("replayed");
    replay.replay = RanksDir() + "/recorded";
    const RunResult replayed = Train(dist, replay, 8, /*slow_rank=*/0);  // other speeds
    ASSERT_TRUE(replayed.status.ok()) << replayed.status;
    EXPECT_EQ(Bits(replayed.losses), Bits(recorded.losses));
    EXPECT_EQ(replayed.samples, recorded.samples);
    EXPECT_TRUE(replayed.params == recorded.params) << "parameters differ";

    // Stopped after step 5 (checkpoints at 4 and 5) and resumed.
    SessionOptions resumed = Options("resumed");
    resumed.replay = RanksDir() + "/recorded";
    const RunResult first = Train(dist, resumed, 5, /*slow_rank=*/0);
    ASSERT_TRUE(first.status.ok()) << first.status;
    const RunResult rest = Train(dist, resumed, 8, /*slow_rank=*/-1);
    ASSERT_TRUE(rest.status.ok()) << rest.status;
    std::vector<double> both = first.losses;
    both.insert(both.end(), rest.losses.begin(), rest.losses.end());
    EXPECT_EQ(Bits(both), Bits(recorded.losses));
    EXPECT_TRUE(rest.params == recorded.params) << "parameters differ after the resume";
  });
}

// The record decides the split: step 3 rewritten to give rank 0 three
// quarters of the global batch's samples moves them there.
TEST(SplitReplayTest, TheRecordDecidesTheSplit) {
  RunOnRanks(2, [](DistContext& dist) {
    ASSERT_TRUE(Train(dist, Options("recorded"), 4, 1).status.ok());
    const std::string file =
        absl::StrFormat("%s/recorded/splits/rank-%05d.jsonl", RanksDir(), dist.rank());
    std::ifstream in(file);
    ASSERT_TRUE(in) << file;
    std::ostringstream edited;
    for (std::string line; std::getline(in, line);) {
      nlohmann::json j = nlohmann::json::parse(line);
      if (j["step"] == 3) {
        j["mode"] = "work";
        j["shares"] = {0.75, 0.25};
        j["fits"] = nlohmann::json::array();
      }
      edited << j.dump() << "\n";
    }
    in.close();
    ASSERT_TRUE(dist.Barrier().ok());  // every rank read before any writes
    std::ofstream(file) << edited.str();
    SessionOptions replay = Options("edited");
    replay.replay = RanksDir() + "/recorded";
    const RunResult run = Train(dist, replay, 4, -1);
    ASSERT_TRUE(run.status.ok()) << run.status;
    EXPECT_EQ(run.samples[2], dist.rank() == 0 ? 9 : 3);
  });
}

TEST(SplitReplayTest, AReplayThatCannotBeExactIsRefusedNamingWhy) {
  RunOnRanks(2, [](DistContext& dist) {
    ASSERT_TRUE(Train(dist, Options("recorded"), 4, 1).status.ok());
    // No record there.
    SessionOptions none = Options("none");
    none.replay = RanksDir() + "/nowhere";
    const RunResult missing = Train(dist, none, 4, -1);
    EXPECT_EQ(missing.status.code(), absl::StatusCode::kNotFound) << missing.status;
    EXPECT_THAT(
        std::string(missing.status.message()),
        HasSubstr(absl::StrFormat("nowhere/splits/rank-%05d.jsonl: no split record", dist.rank())));
    // More steps than recorded: named at the first missing one, before it runs.
    SessionOptions longer = Options("longer");
    longer.replay = RanksDir() + "/recorded";
    const RunResult beyond = Train(dist, longer, 6, -1);
    EXPECT_EQ(beyond.losses.size(), 4u);
    EXPECT_THAT(std::string(beyond.status.message()), HasSubstr("step 5: the split record"));
    EXPECT_THAT(std::string(beyond.status.message()), HasSubstr("(it holds steps 1-4)"));
    // Another sample order: the global batches differ from the recorded ones.
    SessionOptions seeded = Options("seeded");
    seeded.replay = RanksDir() + "/recorded";
    seeded.balance.sampler.seed = 99;
    const RunResult other = Train(dist, seeded, 4, -1);
    EXPECT_EQ(other.status.code(), absl::StatusCode::kFailedPrecondition) << other.status;
    EXPECT_THAT(std::string(other.status.message()),
                HasSubstr("step 1: the global batch (epoch 0, step 0, 12 samples) is not the one"));
  });
}

}  // namespace
}  // namespace evenstep

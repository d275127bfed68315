// A Session goes on after a lost rank (DistOptions::on_rank_loss kContinue,
// --evenstep_on_rank_loss=continue): a rank dies in a step, in its loss
// callback, in the loop's body, or after the step's gradients were
// synchronised (in the exchange). The survivors' Session regroups inside
// Step and the loop goes on without a line of its own for it: every step's
// parameters equal one process's run over the same global batches (SGD with
// momentum, shuffled epochs), the kept running loss too (less the step whose
// figures were lost with the rank, which the report says), the loss is said
// once, on the new rank 0, and the checkpoints written after the loss load
// at the new and at the old world size.
#include <torch/torch.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "evenstep/env.h"
#include "evenstep/flags.h"
#include "evenstep/session.h"
#include "evenstep/torch_data.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/on_ranks.h"

namespace evenstep {
namespace {

using ::evenstep::testing::OnRanksOptions;
using ::evenstep::testing::RanksDir;
using ::evenstep::testing::ReadRanksFile;
using ::evenstep::testing::RunOnRanks;
using ::evenstep::testing::RunOnRanksAgain;

constexpr int kSamples = 40, kSteps = 8;  // global batch 10: 4 steps per epoch
constexpr int kLostExit = 7;

enum class Form { kCallback, kLoop };
// Where the lost rank dies: in its loss (or the loop's body) at its first
// micro-batch; in the backward of its last micro-batch, while the gradient
// buckets are reduced; after the synchronisation, when every survivor
// applies the step and waits in the exchange; or while writing its shard of
// the checkpoint taken before the step (from the save's own thread).
enum class Where { kLoss, kBackward, kExchange, kCheckpoint };
constexpr const char* kWhere[] = {"loss", "backward", "exchange", "checkpoint"};

struct Case {
  int world;
  int lost;  // the launch rank that dies ...
  int step;  // ... in this step
  Where where;
  Form form;
  // dynamic: the splits follow measured speeds, and the Session's split
  // record (on by default) ends at the loss.
  std::string balance = "static";
};

void PrintTo(const Case& c, std::ostream* os) {
  *os << "world " << c.world << ", rank " << c.lost << " lost in step " << c.step << " ("
      << kWhere[static_cast<int>(c.where)] << "), " << c.balance
      << (c.form == Form::kLoop ? ", loop-shaped" : ", callback");
}

float X(int64_t s, int j) { return std::sin(0.7f * static_cast<float>(s) + j); }
float Y(int64_t s) { return std::cos(0.3f * static_cast<float>(s)); }

class Points : public torch::data::datasets::Dataset<Points> {
 public:
  torch::data::Example<> get(size_t index) override {
    const auto s = static_cast<int64_t>(index);
    return {torch::tensor({X(s, 0), X(s, 1), X(s, 2)}), torch::tensor(Y(s))};
  }
  torch::optional<size_t> size() const override { return kSamples; }
};

// The loss SUM of `samples` for a 3 -> 1 linear model.
torch::Tensor LossSum(torch::nn::Linear& model, const std::vector<int64_t>& samples) {
  std::vector<float> x, y;
  for (int64_t s : samples) {
    for (int j = 0; j < 3; ++j) x.push_back(X(s, j));
    y.push_back(Y(s));
  }
  const auto n = static_cast<int64_t>(samples.size());
  return (model->forward(torch::tensor(x).view({n, 3})).view({n}) - torch::tensor(y)).pow(2).sum();
}

// Dies (`die()`) when it creates a file of the checkpoint of step `step`.
class DyingEnv : public EnvWrapper {
 public:
  DyingEnv(int64_t step, std::function<bool()> dies)
      : EnvWrapper(Env::Default()),
        dir_(absl::StrFormat("step-%010d", step)),
        dies_(std::move(dies)) {}
  absl::StatusOr<std::unique_ptr<File>> Create(const std::string& path) override {
    if (absl::StrContains(path, dir_) && dies_()) std::_Exit(kLostExit);
    return EnvWrapper::Create(path);
  }

 private:
  std::string dir_;
  std::function<bool()> dies_;
};

// The run named by the env's RUN (its lines in RanksDir()/<RUN>.txt, its
// run directory RanksDir()/<DIR>); the fault is injected where the env's
// LOSE is "1".
void Train(DistContext& dist, const Case& c) {
  const std::string name = std::getenv("RUN");
  const bool inject = std::string(std::getenv("LOSE")) == "1";
  absl::SetFlag(&FLAGS_evenstep_balance, c.balance);
  absl::SetFlag(&FLAGS_evenstep_global_batch, 10);
  absl::SetFlag(&FLAGS_evenstep_micro_batch_samples, 2);
  absl::SetFlag(&FLAGS_evenstep_ckpt_every, 2);
  absl::SetFlag(&FLAGS_evenstep_loss_reduction, c.form == Form::kLoop ? "mean" : "sum");
  absl::SetFlag(&FLAGS_evenstep_resume, "newest");
  torch::manual_seed(5);
  torch::nn::Linear model(3, 1);
  torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  absl::StatusOr<SessionOptions> options = SessionOptions::FromFlags();
  ASSERT_TRUE(options.ok()) << options.status();
  options->run_dir = RanksDir() + "/" + std::getenv("DIR");
  int64_t step = 0;  // the step running now
  const bool victim = inject && dist.launch_rank() == c.lost;
  auto die_in = [&](Where where) {
    if (victim && step == c.step && where == Where::kLoss && c.where == Where::kCheckpoint) {
      // The step's loss waits here until the save's own thread, writing
      // the checkpoint of the step before, ends the process: the rank is
      // lost in this step's loss whatever the load.
      std::this_thread::sleep_for(std::chrono::seconds(60));
    }
    if (!victim || step != c.step || where != c.where) return;
    // In the exchange: every survivor has finished the synchronisation this
    // rank took part in before it goes.
    if (where == Where::kExchange) std::this_thread::sleep_for(std::chrono::seconds(1));
    std::_Exit(kLostExit);
  };
  options->balance.after_sync = [&] { die_in(Where::kExchange); };
  DyingEnv env(c.step - 1, [&] { return victim && c.where == Where::kCheckpoint; });
  options->checkpoint.env = &env;
  int backward_calls = 0;  // in this step: the last micro-batch's is the 2nd
  model->weight.register_hook([&](const torch::Tensor& grad) {
    if (step == c.step && ++backward_calls == 2) die_in(Where::kBackward);
    return grad;
  });
  auto es = Session::Create(dist, *model, optimizer, std::vector<int64_t>(kSamples, 1), *options);
  ASSERT_TRUE(es.ok()) << es.status();
  Session& session = **es;
  double running = 0;
  session.KeepSum("running", &running);
  std::string text = absl::StrCat("first ", session.first_step(), "\n");
  auto after = [&](const StepReport& r) {
    at::Tensor p = torch::cat({model->weight.flatten(), model->bias.flatten()});
    std::vector<std::string> values;
    for (int i = 0; i < p.numel(); ++i)
      values.push_back(absl::StrFormat("%.9g", p[i].item<float>()));
    absl::StrAppend(&text, "step ", r.step, " params ", absl::StrJoin(values, ","), " running ",
                    absl::StrFormat("%.17g", running), " lost [", absl::StrJoin(r.lost_ranks, ","),
                    "] figures_lost ", r.figures_lost, " world ", dist.world_size(), "\n");
  };
  // Every completed step, on every rank: also a step where dynamic balance
  // left this rank idle (its loop's body did not run in it).
  session.set_user_state([&](const StepReport& r) { after(r); }, [] { return std::string("{}"); });
  auto loader = LoaderOf(Points().map(torch::data::transforms::Stack<>()));
  for (int64_t epoch = session.first_epoch(); epoch < kSteps / 4; ++epoch) {
    if (c.form == Form::kLoop) {
      for (auto& batch : session.Batches(loader)) {
        step = session.last_report().step + 1;  // the step whose micro-batch this is
        die_in(Where::kLoss);
        torch::Tensor loss = (model->forward(batch.data).view({-1}) - batch.target).pow(2).mean();
        running += loss.item<double>() * static_cast<double>(batch.target.size(0));
        session.Backward(loss);
      }
      ASSERT_FALSE(session.stopped()) << session.Finish();
      continue;
    }
    while (session.epoch() == epoch) {
      step = session.last_report().step + 1;
      absl::StatusOr<StepReport> report = session.Step([&](const std::vector<int64_t>& samples) {
        die_in(Where::kLoss);
        torch::Tensor loss = LossSum(model, samples);
        running += loss.item<double>();
        return loss;
      });
      ASSERT_TRUE(report.ok()) << "launch rank " << dist.launch_rank() << ": " << report.status();
    }
  }
  const absl::Status finished = session.Finish();
  EXPECT_TRUE(finished.ok()) << finished;
  after(session.last_report());  // the state a resumed run must hold
  if (dist.rank() == 0) evenstep::testing::WriteRanksFile(name + ".txt", text);
}

OnRanksOptions Named(const std::string& name, const std::string& dir, bool lose) {
  OnRanksOptions o;
  o.collective_timeout = absl::Seconds(8);
  o.on_rank_loss = DistOptions::OnRankLoss::kContinue;
  o.lost_after = absl::Seconds(2);
  o.env = {{"RUN", name}, {"DIR", dir}, {"LOSE", lose ? "1" : "0"}};
  return o;
}

struct Line {
  std::vector<double> params;
  double running = 0;
  std::string rest;  // lost, figures_lost, world
};

// Step -> its line, from a run's file (the last line, the final state, as
// step -1).
std::map<int, Line> Lines(const std::string& name, int* first) {
  std::map<int, Line> lines;
  const std::vector<std::string> rows =
      absl::StrSplit(ReadRanksFile(name + ".txt"), '\n', absl::SkipEmpty());
  for (size_t i = 0; i < rows.size(); ++i) {
    const std::vector<std::string> f = absl::StrSplit(rows[i], ' ');
    if (f[0] == "first") {
      *first = std::stoi(f[1]);
      continue;
    }
    Line line;
    for (const auto& v : absl::StrSplit(f[3], ','))
      line.params.push_back(std::stod(std::string(v)));
    line.running = std::stod(f[5]);
    line.rest = absl::StrJoin(f.begin() + 6, f.end(), " ");
    lines[i + 1 == rows.size() ? -1 : std::stoi(f[1])] = line;
  }
  return lines;
}

double RelativeError(const std::vector<double>& a, const std::vector<double>& b) {
  double err = 0, scale = 1e-12;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) {
    err = std::max(err, std::abs(a[i] - b[i]));
    scale = std::max(scale, std::abs(b[i]));
  }
  return a.size() == b.size() ? err / scale : 1e9;
}

class SessionRegroupTest : public ::testing::TestWithParam<Case> {};

TEST_P(SessionRegroupTest, TheLoopGoesOnAsTheUninterruptedRun) {
  const Case c = GetParam();
  OnRanksOptions lossy = Named("lossy", "lossy", true);
  lossy.exit_codes = {{c.lost, kLostExit}};
  const auto results = RunOnRanks(
      c.world, [c](DistContext& dist) { Train(dist, c); }, lossy);
  RunOnRanksAgain(1, Named("reference", "reference", false));
  int first = 0;
  const std::map<int, Line> got = Lines("lossy", &first);
  const std::map<int, Line> want = Lines("reference", &first);
  ASSERT_EQ(want.size(), kSteps + 1u);
  ASSERT_EQ(got.size(), kSteps + 1u) << ReadRanksFile("lossy.txt");
  // The running loss of the step whose figures were lost with the rank.
  const double lost_loss =
      c.where == Where::kExchange ? want.at(c.step).running - want.at(c.step - 1).running : 0;
  for (const auto& [step, line] : want) {
    SCOPED_TRACE(absl::StrCat("step ", step));
    const Line& mine = got.at(step);
    EXPECT_LE(RelativeError(mine.params, line.params), 1e-6);
    const bool lost_here = step == c.step;
    EXPECT_EQ(absl::StrContains(mine.rest, absl::StrCat("lost [", c.lost, "]")), lost_here)
        << mine.rest;
    const bool figures_lost = lost_here && c.where == Where::kExchange;
    EXPECT_EQ(absl::StrContains(mine.rest, "figures_lost 1"), figures_lost) << mine.rest;
    const bool after_loss = step >= c.step || step == -1;
    // Sums of fp32 losses of other micro-batches: equal to fp32 precision.
    EXPECT_NEAR(mine.running, line.running - (after_loss ? lost_loss : 0),
                1e-6 * std::abs(line.running));
    if (after_loss) {
      EXPECT_THAT(mine.rest, ::testing::EndsWith(absl::StrCat("world ", c.world - 1)));
    }
  }
  // Said once, on the new rank 0.
  int said = 0;
  for (const auto& r : results) {
    for (size_t at = r.output.find("rank loss in step"); at != std::string::npos;
         at = r.output.find("rank loss in step", at + 1)) {
      ++said;
    }
  }
  EXPECT_EQ(said, 1);
  std::string line;
  for (const auto& r : results) {
    const size_t at = r.output.find("rank loss in step");
    if (at != std::string::npos) line = r.output.substr(at, r.output.find('\n', at) - at);
  }
  EXPECT_THAT(line,
              ::testing::HasSubstr(absl::StrCat("rank loss in step ", c.step, ": rank(s) ", c.lost,
                                                " lost; ", c.world - 1, " survivor(s) go on")));
  if (c.where == Where::kExchange) {
    EXPECT_THAT(line, ::testing::HasSubstr("its loss and sums are lost with the rank"));
  } else {
    EXPECT_THAT(line, ::testing::HasSubstr("is redone over"));
  }
  if (c.where == Where::kCheckpoint) {
    // The lost rank never reported on the save of the step before.
    EXPECT_THAT(line, ::testing::HasSubstr("1 checkpoint save(s) in flight abandoned"));
  }
  if (HasFailure()) {
    for (size_t r = 0; r < results.size(); ++r) {
      std::cerr << "launch rank " << r << "'s output:\n" << results[r].output << "\n";
    }
  }
  // The newest checkpoint, written after the loss, resumes at the new and
  // at the old world size with the run's final state.
  for (int world : {c.world - 1, c.world}) {
    const std::string name = absl::StrCat("resumed", world);
    RunOnRanksAgain(world, Named(name, "lossy", false));
    int resumed_first = 0;
    const std::map<int, Line> resumed = Lines(name, &resumed_first);
    EXPECT_EQ(resumed_first, kSteps + 1) << name;
    ASSERT_EQ(resumed.count(-1), 1u) << name;
    EXPECT_EQ(resumed.at(-1).params, got.at(-1).params) << name;
    EXPECT_EQ(resumed.at(-1).running, got.at(-1).running) << name;
  }
}

INSTANTIATE_TEST_SUITE_P(Losses, SessionRegroupTest,
                         ::testing::Values(Case{3, 1, 3, Where::kLoss, Form::kCallback},
                                           Case{4, 0, 4, Where::kLoss, Form::kLoop, "dynamic"},
                                           Case{3, 2, 6, Where::kBackward, Form::kCallback},
                                           Case{3, 2, 5, Where::kExchange, Form::kCallback},
                                           Case{3, 1, 5, Where::kCheckpoint, Form::kCallback}),
                         [](const ::testing::TestParamInfo<Case>& info) {
                           const Case& c = info.param;
                           return absl::StrCat("world", c.world, "_rank", c.lost, "_step", c.step,
                                               "_", kWhere[static_cast<int>(c.where)],
                                               c.form == Form::kLoop ? "_loop" : "_callback", "_",
                                               c.balance);
                         });

}  // namespace
}  // namespace evenstep

namespace evenstep {
namespace {

// Stream mode pins each rank's streams and the loop's rows of them: going
// on would move them to other ranks. Every survivor's Step refuses by name,
// before any collective of the regroup.
TEST(SessionRegroupRefusalTest, StreamModeIsRefusedByName) {
  OnRanksOptions options = Named("streams", "streams", true);
  options.exit_codes = {{1, kLostExit}};
  RunOnRanks(
      3,
      [](DistContext& dist) {
        absl::SetFlag(&FLAGS_evenstep_streams, 6);
        absl::SetFlag(&FLAGS_evenstep_global_batch, 6);
        absl::SetFlag(&FLAGS_evenstep_micro_batch_samples, 0);
        absl::SetFlag(&FLAGS_evenstep_ckpt_every, 100);
        absl::SetFlag(&FLAGS_evenstep_resume, "off");
        torch::nn::Linear model(3, 1);
        torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(0.05));
        auto es =
            Session::Create(dist, *model, optimizer, UniformLengths(24), RanksDir() + "/streams");
        ASSERT_TRUE(es.ok()) << es.status();
        for (int64_t step = 1; step <= 3; ++step) {
          absl::StatusOr<StepReport> report = (*es)->Step([&](const std::vector<int64_t>& samples) {
            if (dist.launch_rank() == 1 && step == 2) std::_Exit(kLostExit);
            return LossSum(model, samples);
          });
          if (step < 2) {
            ASSERT_TRUE(report.ok()) << report.status();
            continue;
          }
          ASSERT_FALSE(report.ok());
          EXPECT_TRUE(absl::IsFailedPrecondition(report.status())) << report.status();
          EXPECT_THAT(std::string(report.status().message()),
                      ::testing::HasSubstr("step 2: going on after a lost rank in stream mode "
                                           "(--evenstep_streams) is not supported"));
          break;
        }
      },
      options);
}

}  // namespace
}  // namespace evenstep

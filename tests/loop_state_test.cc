// The loop keeps its shape, over real ranks.
//
// The loop's own variables across a resume (Session::Keep) and the
// iteration boundary where a checkpoint reads them: a plain epoch loop (a
// local learning rate decayed at each epoch's end and copied into the
// optimizer, as pytorch-cpp's ResNet tutorial does; a running loss reset at
// each epoch's end; counters, a string, a vector and a tensor) keeps each
// variable in one line. Stopped by a preemption at an epoch's last step or
// inside an epoch, or by ending the loop early and calling Finish, and
// resumed, it prints every line of the uninterrupted run, bit for bit, in
// the callback form (Session::Step) and in the loop-shaped form
// (Session::Batches + Session::Backward). The preempted step's report
// reaches the loop. Misuse of Keep is named by the next Step.
//
// The loop-shaped form: after every step the parameters equal one
// process's plain loop on the global batch at worlds 1-3 (several
// micro-batches per rank; an idle rank); a body that skips Backward,
// throws, breaks out mid-step or calls Backward twice on one rank ends that
// step on every rank with the same named error.
//
// evenstep::Kept / KeptSum declared inside the loop over epochs (reset at
// each epoch's top) come back exactly after a preemption inside an epoch,
// at an epoch's end, and after Finish outside their scope.
#include <torch/torch.h>

#include <algorithm>
#include <csignal>
#include <cstdlib>
#include <limits>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "evenstep/checkpoint_manifest.h"
#include "evenstep/env.h"
#include "evenstep/flags.h"
#include "evenstep/kept.h"
#include "evenstep/session.h"
#include "evenstep/status_macros.h"
#include "evenstep/torch_data.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/on_ranks.h"

namespace evenstep {
namespace {

using ::evenstep::testing::OnRanksOptions;
using ::evenstep::testing::RanksDir;
using ::evenstep::testing::RunOnRanks;
using ::evenstep::testing::RunOnRanksAgain;
using ::testing::HasSubstr;

constexpr int kSamples = 24, kEpochs = 3;  // global batch 6: 4 steps per epoch

// The loss SUM of `samples` for a 3 -> 1 linear model.
torch::Tensor LossSum(torch::nn::Linear& model, const std::vector<int64_t>& samples) {
  std::vector<float> x, y;
  for (int64_t s : samples) {
    for (int j = 0; j < 3; ++j) x.push_back(std::sin(0.7f * s + j));
    y.push_back(std::cos(0.3f * s));
  }
  const auto n = static_cast<int64_t>(samples.size());
  return (model->forward(torch::tensor(x).view({n, 3})).view({n}) - torch::tensor(y)).pow(2).sum();
}

void SetFlags() {
  absl::SetFlag(&FLAGS_evenstep_balance, "static");
  absl::SetFlag(&FLAGS_evenstep_global_batch, 6);
  absl::SetFlag(&FLAGS_evenstep_micro_batch_samples, 2);
  absl::SetFlag(&FLAGS_evenstep_timeline, false);
  absl::SetFlag(&FLAGS_evenstep_shuffle, false);
  absl::SetFlag(&FLAGS_evenstep_ckpt_every, 3);
}

// The loop through Session::Step's loss callback, or loop-shaped through
// Session::Batches.
enum class Form { kCallback, kLoop };

// The samples of LossSum as a torch::data dataset (data [3], target scalar).
class Points : public torch::data::datasets::Dataset<Points> {
 public:
  torch::data::Example<> get(size_t index) override {
    const auto s = static_cast<float>(index);
    return {torch::tensor({std::sin(0.7f * s), std::sin(0.7f * s + 1), std::sin(0.7f * s + 2)}),
            torch::tensor(std::cos(0.3f * s))};
  }
  torch::optional<size_t> size() const override { return kSamples; }
};

// How a run of the loop ends early.
struct Stop {
  int preempt_before = 0;  // rank 0 raises SIGTERM before this step
  int finish_after = 0;    // the loop leaves after this step and calls Finish
};

// The plain epoch loop with its variables kept; rank 0 writes its lines to
// RanksDir()/<name>.txt: every step's and epoch's line, and how it ended.
void TrainLoop(DistContext& dist, Form form, const std::string& name, const std::string& run_dir,
               const Stop& stop) {
  SetFlags();
  // The callback form sums its losses; the loop's body takes a mean, as
  // plain loops do.
  absl::SetFlag(&FLAGS_evenstep_loss_reduction, form == Form::kLoop ? "mean" : "sum");
  torch::manual_seed(3);
  torch::nn::Linear model(3, 1);
  double current_lr = 0.05;  // the loop's own copy of the rate
  torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(current_lr));
  auto es = Session::Create(dist, *model, optimizer, std::vector<int64_t>(kSamples, 1), run_dir);
  ASSERT_TRUE(es.ok()) << es.status();
  Session& session = **es;
  double running_loss = 0;
  int64_t steps_seen = 0;
  int decays = 0;
  size_t lines_printed = 0;
  bool decayed = false;
  float last_loss = std::numeric_limits<float>::quiet_NaN();
  std::string best = "none";
  std::vector<double> epoch_losses;
  std::vector<int64_t> epoch_ends;
  at::Tensor loss_per_step = torch::zeros({kEpochs * kSamples / 6}, torch::kDouble);
  session.Keep("lr", &current_lr);
  session.Keep("running_loss", &running_loss);
  session.Keep("steps_seen", &steps_seen);
  session.Keep("decays", &decays);
  session.Keep("lines", &lines_printed);
  session.Keep("decayed", &decayed);
  session.Keep("last_loss", &last_loss);
  session.Keep("best", &best);
  session.Keep("epoch_losses", &epoch_losses);
  session.Keep("epoch_ends", &epoch_ends);
  session.Keep("loss_per_step", &loss_per_step);
  std::string text;
  auto say = [&](const std::string& line) {
    ++lines_printed;
    absl::StrAppend(&text, line, "\n");
  };
  auto write = [&] {
    if (dist.rank() == 0) evenstep::testing::WriteRanksFile(name + ".txt", text);
  };
  // After each step: false when the loop leaves (Finish called).
  auto after_step = [&](const StepReport& report) {
    // The preempted step's report reaches the loop like any other.
    EXPECT_EQ(session.preemption_pending(), report.step == stop.preempt_before);
    running_loss += report.loss;
    ++steps_seen;
    last_loss = static_cast<float>(report.loss);
    loss_per_step[report.step - 1] = report.loss;
    if (report.loss < 0.3) best = absl::StrCat("step ", report.step);
    say(absl::StrFormat("step %d loss %.17g lr %.17g running %.17g", report.step, report.loss,
                        current_lr, running_loss));
    if (report.step != stop.finish_after) return true;
    EXPECT_TRUE(session.Finish().ok());
    say("finished early");
    return false;
  };
  auto stopped = [&](const absl::Status& status) {
    EXPECT_TRUE(session.preempted()) << status;
    EXPECT_EQ(session.last_report().step, stop.preempt_before) << "no step ran after it";
    say(absl::StrCat("stopped: ", status.message()));
    write();
  };
  auto loader = LoaderOf(Points().map(torch::data::transforms::Stack<>()));
  for (int64_t epoch = session.first_epoch(); epoch < kEpochs; ++epoch) {
    if (form == Form::kLoop) {
      // The loop-shaped form: the plain loop's body, Backward for its
      // backward and step.
      for (auto& batch : session.Batches(loader)) {
        torch::Tensor loss = (model->forward(batch.data).view({-1}) - batch.target).pow(2).mean();
        session.Backward(loss);
        if (!session.step_ended()) continue;
        if (!after_step(session.last_report())) return write();
        if (session.last_report().step + 1 == stop.preempt_before && dist.rank() == 0) {
          std::raise(SIGTERM);
        }
      }
      if (session.stopped()) return stopped(session.Finish());
    }
    while (form == Form::kCallback && session.epoch() == epoch) {
      const int64_t s = session.last_report().step + 1;
      if (s == stop.preempt_before && dist.rank() == 0) std::raise(SIGTERM);
      auto report = session.Step(
          [&](const std::vector<int64_t>& samples) { return LossSum(model, samples); });
      if (!report.ok()) return stopped(report.status());
      if (!after_step(*report)) return write();
    }
    // The end of the epoch, as the plain loop has it.
    epoch_losses.push_back(running_loss / 4);
    epoch_ends.push_back(session.last_report().step);
    say(absl::StrFormat("epoch %d mean %.17g", epoch, running_loss / 4));
    running_loss = 0;
    current_lr /= 3;  // the tutorial's decay, applied to the optimizer by hand
    ++decays;
    decayed = true;
    for (auto& group : optimizer.param_groups()) group.options().set_lr(current_lr);
  }
  EXPECT_TRUE(session.Finish().ok());
  double checksum = 0;
  for (const auto& p : model->parameters()) checksum += p.sum().item<double>();
  say(absl::StrFormat(
      "final lr %.17g optimizer lr %.17g decays %d seen %d lines %d decayed %d last %.9g best %s "
      "epochs [%s] ends [%s] per-step sum %.17g params %.17g",
      current_lr, optimizer.param_groups()[0].options().get_lr(), decays, steps_seen, lines_printed,
      decayed, last_loss, best, absl::StrJoin(epoch_losses, ","), absl::StrJoin(epoch_ends, ","),
      loss_per_step.sum().item<double>(), checksum));
  write();
}

std::vector<std::string> LinesOf(const std::string& name) {
  std::vector<std::string> lines =
      absl::StrSplit(evenstep::testing::ReadRanksFile(name + ".txt"), '\n', absl::SkipEmpty());
  return lines;
}

// Runs named by LOOP_RUN: "whole", or a stopped run and its resumption
// (each pair in its own run directory, by the env's LOOP_DIR).
OnRanksOptions Named(const std::string& name, const std::string& dir) {
  OnRanksOptions o;
  o.env = {{"LOOP_RUN", name}, {"LOOP_DIR", dir}};
  return o;
}

class LoopStateTest : public ::testing::TestWithParam<Form> {};

TEST_P(LoopStateTest, AStoppedAndResumedLoopPrintsEveryLineOfTheUninterruptedRun) {
  const Form form = GetParam();
  RunOnRanks(
      2,
      [form](DistContext& dist) {
        const std::string name = std::getenv("LOOP_RUN");
        Stop stop;
        if (name == "preempted_at_epoch_end") stop.preempt_before = 8;
        if (name == "preempted_mid_epoch") stop.preempt_before = 6;
        if (name == "finished_early") stop.finish_after = 7;
        // Each stopped run and its resumption share a run directory.
        TrainLoop(dist, form, name, RanksDir() + "/" + std::getenv("LOOP_DIR"), stop);
      },
      Named("whole", "whole"));
  const std::vector<std::string> whole = LinesOf("whole");
  ASSERT_EQ(whole.size(), 12u + kEpochs + 1) << absl::StrJoin(whole, "\n");
  for (const auto& [stopped, at] : std::vector<std::pair<std::string, int>>{
           {"preempted_at_epoch_end", 8}, {"preempted_mid_epoch", 6}, {"finished_early", 7}}) {
    SCOPED_TRACE(stopped);
    RunOnRanksAgain(2, Named(stopped, stopped));
    const auto resumed = RunOnRanksAgain(2, Named(stopped + "_resumed", stopped));
    // The optimizer's rate was decayed by the loop before the save: the
    // resume says that a copy the loop keeps must be kept too.
    ASSERT_FALSE(resumed.empty());
    EXPECT_THAT(
        resumed[0].output,
        HasSubstr("), not the program's (0.05); if the loop keeps its own copy of the rate"))
        << resumed[0].output;
    std::vector<std::string> first = LinesOf(stopped), second = LinesOf(stopped + "_resumed");
    ASSERT_FALSE(first.empty());
    const std::string last = first.back();
    first.pop_back();
    if (stopped == "finished_early") {
      EXPECT_EQ(last, "finished early");
    } else {
      EXPECT_THAT(last, HasSubstr(absl::StrCat("preempted by signal 15 at step ", at,
                                               "; the checkpoint of step ", at, " is committed")));
    }
    // Together, the lines of the uninterrupted run: none lost, none twice
    // (an epoch's end runs before the boundary's save, and not again).
    first.insert(first.end(), second.begin(), second.end());
    EXPECT_EQ(absl::StrJoin(first, "\n"), absl::StrJoin(whole, "\n"));
  }
}

INSTANTIATE_TEST_SUITE_P(Forms, LoopStateTest, ::testing::Values(Form::kCallback, Form::kLoop),
                         [](const auto& info) {
                           return info.param == Form::kLoop ? "LoopShaped" : "Callback";
                         });

// The loop-shaped form's gradient is the global batch's, whatever the split:
// after every step the parameters equal one process's plain loop on the
// step's whole global batch (mean loss, SGD with momentum), at worlds 1-3,
// with several micro-batches per rank and (world 3, global batch 2) an idle
// rank in every step.
// SetFlags under dynamic balance, a global batch of `global_batch` and a
// MEAN loss.
void SetDynamicFlags(int global_batch) {
  SetFlags();
  absl::SetFlag(&FLAGS_evenstep_balance, "dynamic");
  absl::SetFlag(&FLAGS_evenstep_global_batch, global_batch);
  absl::SetFlag(&FLAGS_evenstep_loss_reduction, "mean");
}

// "world<W>_batch<B>" for a (world, global batch) parameter.
std::string WorldBatchName(const ::testing::TestParamInfo<std::tuple<int, int>>& info) {
  return absl::StrCat("world", std::get<0>(info.param), "_batch", std::get<1>(info.param));
}

class LoopShapedWorldTest : public ::testing::TestWithParam<std::tuple<int, int>> {};

TEST_P(LoopShapedWorldTest, EveryStepEqualsOneProcessOnTheGlobalBatch) {
  const auto [world, global_batch] = GetParam();
  RunOnRanks(world, [global_batch = global_batch](DistContext& dist) {
    SetDynamicFlags(global_batch);
    absl::SetFlag(&FLAGS_evenstep_ckpt_every, 0);
    torch::manual_seed(5);
    torch::nn::Linear model(3, 1), plain(3, 1);
    {
      torch::NoGradGuard copying;
      for (size_t i = 0; i < model->parameters().size(); ++i) {
        plain->parameters()[i].copy_(model->parameters()[i]);
      }
    }
    torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
    torch::optim::SGD plain_opt(plain->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
    auto es = Session::Create(dist, *model, optimizer, std::vector<int64_t>(kSamples, 1),
                              RanksDir() + "/run");
    ASSERT_TRUE(es.ok()) << es.status();
    Session& session = **es;
    // In order (no shuffle): step k's global batch is the k-th run of
    // `global_batch` samples, wrapping at the epoch's end.
    auto batch_of = [&](int64_t step) {
      std::vector<int64_t> samples;
      for (int64_t j = 0; j < global_batch; ++j)
        samples.push_back(((step - 1) * global_batch + j) % kSamples);
      return samples;
    };
    int64_t plain_steps = 0;
    // The plain loop up to `step` (an idle rank sees no step end of its own).
    auto plain_to = [&](int64_t step) {
      for (; plain_steps < step; ++plain_steps) {
        std::vector<torch::Tensor> xs, ys;
        for (int64_t i : batch_of(plain_steps + 1)) {
          auto e = Points().get(static_cast<size_t>(i));
          xs.push_back(e.data);
          ys.push_back(e.target);
        }
        plain_opt.zero_grad();
        (plain->forward(torch::stack(xs)).view({-1}) - torch::stack(ys)).pow(2).mean().backward();
        plain_opt.step();
      }
      for (size_t i = 0; i < model->parameters().size(); ++i) {
        const torch::Tensor want = plain->parameters()[i];
        EXPECT_LE(((model->parameters()[i] - want).abs().max() / want.abs().max()).item<double>(),
                  1e-5)
            << "rank " << dist.rank() << " after step " << step;
      }
    };
    auto loader = LoaderOf(Points().map(torch::data::transforms::Stack<>()));
    int64_t bodies = 0, step_ends = 0, samples_after_backward = 0;
    for (int64_t epoch = session.first_epoch(); epoch < 2; ++epoch) {
      for (auto& batch : session.Batches(loader)) {
        ++bodies;
        torch::Tensor loss = (model->forward(batch.data).view({-1}) - batch.target).pow(2).mean();
        session.Backward(loss);
        // The batch stays the loop's until its body ends (the engine has
        // loaded the next micro-batch by now).
        samples_after_backward += batch.target.size(0);
        if (!session.step_ended()) continue;
        ++step_ends;
        const int64_t step = session.last_report().step;
        EXPECT_EQ(session.balanced_step().global_batch().samples, batch_of(step));
        plain_to(step);
      }
      ASSERT_FALSE(session.stopped());
    }
    const int64_t steps = 2 * kSamples / global_batch;
    EXPECT_EQ(session.last_report().step, steps);
    ASSERT_TRUE(session.Finish().ok());
    plain_to(steps);
    EXPECT_GE(bodies, step_ends);
    // A step ends in the body of each rank that had micro-batches in it.
    evenstep::testing::WriteRanksFile(absl::StrCat("step_ends.", dist.rank()),
                                      absl::StrCat(step_ends, " ", samples_after_backward));
  });
  int64_t step_ends = 0, samples = 0;
  for (int r = 0; r < world; ++r) {
    std::vector<std::string> f =
        absl::StrSplit(evenstep::testing::ReadRanksFile(absl::StrCat("step_ends.", r)), ' ');
    ASSERT_EQ(f.size(), 2u);
    step_ends += std::stoll(f[0]);
    samples += std::stoll(f[1]);
  }
  const int64_t steps = 2 * kSamples / global_batch;
  EXPECT_EQ(samples, 2 * kSamples) << "every sample of both epochs, once, on some rank";
  EXPECT_LE(step_ends, world * steps);
  // With 2 samples on 3 ranks a rank is idle in every step: it ran those
  // steps without entering the body.
  if (global_batch < world) EXPECT_LE(step_ends, global_batch * steps);
}

INSTANTIATE_TEST_SUITE_P(Worlds, LoopShapedWorldTest,
                         ::testing::Values(std::make_tuple(1, 6), std::make_tuple(2, 6),
                                           std::make_tuple(3, 6), std::make_tuple(3, 2)),
                         WorldBatchName);

// KeepSum: the body's running sums (a loss times the batch's samples, a
// count) hold the whole global batch's after every step, on every rank, an
// idle one included, and the loop's reset at the epoch's end holds.
class KeepSumTest : public ::testing::TestWithParam<std::tuple<int, int>> {};

TEST_P(KeepSumTest, RunningSumsInTheBodyHoldEveryRanksAdditions) {
  const auto [world, global_batch] = GetParam();
  RunOnRanks(world, [global_batch = global_batch](DistContext& dist) {
    SetDynamicFlags(global_batch);
    torch::manual_seed(5);
    torch::nn::Linear model(3, 1);
    torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(0.1));
    auto es = Session::Create(dist, *model, optimizer, std::vector<int64_t>(kSamples, 1),
                              RanksDir() + "/run");
    ASSERT_TRUE(es.ok()) << es.status();
    Session& session = **es;
    double running = 0;
    int64_t seen = 0;
    session.KeepSum("running", &running);
    session.KeepSum("seen", &seen);
    auto loader = LoaderOf(Points().map(torch::data::transforms::Stack<>()));
    std::string lines;
    // The steps' global mean losses times their samples, from every step's
    // report (an idle rank's steps included: its body sees none of them).
    double from_reports = 0;
    session.set_user_state([&](const StepReport& r) { from_reports += r.loss * r.global_count; },
                           [] { return std::string("{}"); });
    for (int64_t epoch = 0; epoch < 2; ++epoch) {
      for (auto& batch : session.Batches(loader)) {
        torch::Tensor loss = (model->forward(batch.data).view({-1}) - batch.target).pow(2).mean();
        running += loss.item<double>() * static_cast<double>(batch.target.size(0));
        seen += batch.target.size(0);
        session.Backward(loss);
        if (session.step_ended()) {
          const StepReport& r = session.last_report();
          EXPECT_EQ(seen,
                    static_cast<int64_t>(r.step - epoch * (kSamples / global_batch)) * global_batch)
              << "rank " << dist.rank() << ", step " << r.step;
          EXPECT_NEAR(running, from_reports, 1e-6 * std::max(1.0, from_reports))
              << "rank " << dist.rank() << ", step " << r.step;
        }
      }
      ASSERT_FALSE(session.stopped());
      EXPECT_EQ(seen, kSamples) << "rank " << dist.rank() << ", epoch " << epoch;
      EXPECT_NEAR(running, from_reports, 1e-6 * std::max(1.0, from_reports))
          << "rank " << dist.rank() << ", epoch " << epoch;
      lines += absl::StrFormat("epoch %d running %a seen %d\n", epoch, running, seen);
      running = 0;  // the loop's own reset, on every rank
      seen = 0;
      from_reports = 0;
    }
    ASSERT_TRUE(session.Finish().ok());
    evenstep::testing::WriteRanksFile(absl::StrCat("sums-", dist.rank()), lines);
  });
  // Every rank holds the same sums, bit for bit.
  for (int r = 1; r < world; ++r) {
    EXPECT_EQ(evenstep::testing::ReadRanksFile(absl::StrCat("sums-", r)),
              evenstep::testing::ReadRanksFile("sums-0"))
        << "rank " << r;
  }
}

INSTANTIATE_TEST_SUITE_P(Worlds, KeepSumTest,
                         ::testing::Values(std::make_tuple(1, 6), std::make_tuple(2, 6),
                                           std::make_tuple(3, 2)),
                         WorldBatchName);

// Kept / KeptSum declared where pytorch-cpp's tutorials declare their
// running loss, correct count and batch index: at the top of each epoch's
// body. `name` says how the run ends: "whole" (3 epochs), "mid" (preempted
// before step 6, inside epoch 1), "boundary" (preempted before step 8, the
// last of epoch 1: the save comes after the next epoch's top reset the
// variables), "short" (2 epochs, Finish after the loop: the variables are
// out of scope), each "_resumed" going on in the same directory. Rank 0
// writes every step's and epoch's line to RanksDir()/<name>.txt.
void EpochScopedLoop(DistContext& dist, const std::string& name, const std::string& run_dir) {
  SetFlags();
  absl::SetFlag(&FLAGS_evenstep_loss_reduction, "mean");
  const int preempt_before = name == "mid" ? 6 : name == "boundary" ? 8 : 0;
  const int epochs = name == "short" ? 2 : kEpochs;
  torch::manual_seed(3);
  torch::nn::Linear model(3, 1);
  torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(0.05));
  auto es = Session::Create(dist, *model, optimizer, std::vector<int64_t>(kSamples, 1), run_dir);
  ASSERT_TRUE(es.ok()) << es.status();
  Session& session = **es;
  auto loader = LoaderOf(Points().map(torch::data::transforms::Stack<>()));
  std::string text;
  for (int64_t epoch = session.first_epoch(); epoch < epochs; ++epoch) {
    KeptSum<float> running_loss(session, "running_loss", 0.0);
    KeptSum<size_t> seen(session, "seen", 0);
    Kept<size_t> batch_index(session, "batch_index", 0);
    int64_t steps_in_epoch = session.step_in_epoch();  // also after a resume inside the epoch
    for (auto& batch : session.Batches(loader)) {
      torch::Tensor loss = (model->forward(batch.data).view({-1}) - batch.target).pow(2).mean();
      running_loss += loss.item<float>() * static_cast<float>(batch.target.size(0));
      seen += batch.target.size(0);
      session.Backward(loss);
      ++batch_index;
      if (!session.step_ended()) continue;
      const int64_t step = session.last_report().step;
      absl::StrAppend(&text, absl::StrFormat("step %d batches %d in_epoch %d running %a seen %d\n",
                                             step, batch_index.value(), ++steps_in_epoch,
                                             running_loss.value(), seen.value()));
      if (step + 1 == preempt_before && dist.rank() == 0) std::raise(SIGTERM);
    }
    if (session.stopped()) break;
    // Read through the variables' conversions, as the loop's own code does.
    const float mean = running_loss / kSamples;
    const size_t count = seen;
    absl::StrAppend(&text, absl::StrFormat("epoch %d mean %a seen %d\n", epoch, mean, count));
  }
  const absl::Status finished = session.Finish();
  EXPECT_EQ(finished.ok(), !session.preempted()) << finished;
  if (dist.rank() == 0) evenstep::testing::WriteRanksFile(name + ".txt", text);
}

TEST(EpochScopedKeptTest, VariablesDeclaredInTheEpochResumeInsideAndBetweenEpochsExactly) {
  auto run = [](DistContext& dist) {
    EpochScopedLoop(dist, std::getenv("LOOP_RUN"), RanksDir() + "/" + std::getenv("LOOP_DIR"));
  };
  RunOnRanks(2, run, Named("whole", "whole"));
  const std::string whole = evenstep::testing::ReadRanksFile("whole.txt");
  ASSERT_EQ(std::count(whole.begin(), whole.end(), '\n'), 12 + kEpochs) << whole;
  // step_in_epoch: each epoch's steps counted 1-4 from its top.
  int fourth = 0;
  for (size_t at = whole.find(" in_epoch 4 "); at != std::string::npos;
       at = whole.find(" in_epoch 4 ", at + 1)) {
    ++fourth;
  }
  EXPECT_EQ(fourth, kEpochs) << whole;
  for (const std::string stopped : {"mid", "boundary", "short"}) {
    SCOPED_TRACE(stopped);
    RunOnRanksAgain(2, Named(stopped, stopped));
    RunOnRanksAgain(2, Named(stopped + "_resumed", stopped));
    // Together, the lines of the uninterrupted run: the running sums and
    // the batch index of a resumed epoch go on from the checkpoint, a new
    // epoch's start from the declarations.
    EXPECT_EQ(evenstep::testing::ReadRanksFile(stopped + ".txt") +
                  evenstep::testing::ReadRanksFile(stopped + "_resumed.txt"),
              whole);
  }
}

// What the loop's body does wrong on one rank, at step 2.
enum class Misstep { kSkipBackward, kThrow, kBreak, kBackwardTwice };

// A loop-shaped run of 3 steps (2 micro-batches per rank and step) whose
// body on `rank` does `misstep` in step 2; Finish's status.
absl::Status LoopWith(DistContext& dist, const std::string& run_dir, Misstep misstep, int rank) {
  SetFlags();
  absl::SetFlag(&FLAGS_evenstep_loss_reduction, "mean");
  absl::SetFlag(&FLAGS_evenstep_ckpt_every, 0);
  torch::manual_seed(3);
  torch::nn::Linear model(3, 1);
  torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(0.1));
  auto es = Session::Create(dist, *model, optimizer, std::vector<int64_t>(kSamples, 1), run_dir);
  if (!es.ok()) return es.status();
  Session& session = **es;
  auto loader = LoaderOf(Points().map(torch::data::transforms::Stack<>()));
  const bool mine = dist.rank() == rank;
  try {
    for (auto& batch : session.Batches(loader)) {
      const bool now = mine && session.last_report().step + 1 == 2;
      if (now && misstep == Misstep::kSkipBackward) continue;
      if (now && misstep == Misstep::kThrow) throw std::runtime_error("the body failed");
      torch::Tensor loss = (model->forward(batch.data).view({-1}) - batch.target).pow(2).mean();
      session.Backward(loss);
      if (now && misstep == Misstep::kBackwardTwice) session.Backward(loss);
      if (now && misstep == Misstep::kBreak) break;
      if (session.step_ended() && session.last_report().step == 3) break;
    }
  } catch (const std::runtime_error& e) {
    EXPECT_STREQ(e.what(), "the body failed");  // the loop's own exception goes on
  }
  EXPECT_TRUE(session.stopped());
  EXPECT_EQ(session.last_report().step, 1) << "step 2 was abandoned on every rank";
  return session.Finish();
}

TEST(LoopShapedMisuseTest, ABodyThatLeavesOrSkipsAMicroBatchEndsTheStepOnEveryRankByName) {
  RunOnRanks(2, [](DistContext& dist) {
    const std::vector<std::pair<Misstep, std::string>> cases = {
        {Misstep::kSkipBackward, "did not call Session::Backward for micro-batch"},
        {Misstep::kThrow, "an exception left the body of the loop over Session::Batches"},
        {Misstep::kBreak, "the loop over Session::Batches was left before the epoch's end"},
        {Misstep::kBackwardTwice, "Session::Backward called twice for one micro-batch"},
    };
    int k = 0;
    for (const auto& [misstep, why] : cases) {
      const absl::Status s = LoopWith(dist, RanksDir() + "/run" + std::to_string(k++), misstep, 1);
      SCOPED_TRACE(why);
      // Every rank ends step 2 with the same named error: no peer waits.
      EXPECT_EQ(s.code(), absl::StatusCode::kAborted) << s;
      EXPECT_THAT(s.message(), HasSubstr("rank(s) 1 failed")) << s;
      if (dist.rank() == 1) EXPECT_THAT(s.message(), HasSubstr(why)) << s;
    }
    // Backward outside the loop is named by Finish.
    SetFlags();
    torch::nn::Linear model(3, 1);
    torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(0.1));
    auto es = Session::Create(dist, *model, optimizer, std::vector<int64_t>(kSamples, 1),
                              RanksDir() + "/outside");
    ASSERT_TRUE(es.ok()) << es.status();
    (*es)->Backward(model->forward(torch::ones({1, 3})).sum());
    EXPECT_THAT((*es)->Finish().message(),
                HasSubstr("Session::Backward outside a loop over Session::Batches"));
  });
}

// Session reads its flags once, at Create: a flag changed while it runs
// does not reach it, and the next Session has the new value. The second
// Session on the same DistContext commits its own checkpoints (its writer
// used to meet the first one's keys in the store, read their outcomes and
// commit nothing, while Finish returned OK).
TEST(SessionFlagsTest, FlagsAreReadOnceAtCreateAndTheNextSessionHasItsOwn) {
  RunOnRanks(2, [](DistContext& dist) {
    // The committed checkpoints of 4 steps ({} after a failure).
    auto train = [&](const std::string& dir, int ckpt_every,
                     int changed_to) -> std::vector<int64_t> {
      SetFlags();
      absl::SetFlag(&FLAGS_evenstep_ckpt_every, ckpt_every);
      absl::SetFlag(&FLAGS_evenstep_ckpt_keep, 10);
      torch::manual_seed(3);
      torch::nn::Linear model(3, 1);
      torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(0.1));
      auto es = Session::Create(dist, *model, optimizer, std::vector<int64_t>(kSamples, 1), dir);
      EXPECT_TRUE(es.ok()) << es.status();
      if (!es.ok()) return {};
      absl::SetFlag(&FLAGS_evenstep_ckpt_every, changed_to);  // too late for this Session
      for (int s = 0; s < 4; ++s) {
        auto report = (*es)->Step(
            [&](const std::vector<int64_t>& samples) { return LossSum(model, samples); });
        EXPECT_TRUE(report.ok()) << report.status();
      }
      EXPECT_TRUE((*es)->Finish().ok());
      auto listing = ListCheckpoints(*Env::Default(), dir + "/ckpt");
      EXPECT_TRUE(listing.ok()) << listing.status();
      return listing.ok() ? listing->committed : std::vector<int64_t>{};
    };
    EXPECT_EQ(train(RanksDir() + "/first", 3, 1), (std::vector<int64_t>{3, 4}));
    EXPECT_EQ(train(RanksDir() + "/second", 2, 0), (std::vector<int64_t>{2, 4}));
  });
}

// A Session over the linear model in `run_dir` whose kept variables are
// registered by `keep` (after `steps_before` steps); the next Step's status.
absl::Status FirstStep(DistContext& dist, const std::string& run_dir,
                       const std::function<void(Session&)>& keep, int steps_before = 0) {
  SetFlags();
  torch::manual_seed(3);
  torch::nn::Linear model(3, 1);
  torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(0.1));
  auto es = Session::Create(dist, *model, optimizer, std::vector<int64_t>(kSamples, 1), run_dir);
  if (!es.ok()) return es.status();
  auto step = [&] {
    return (*es)
        ->Step([&](const std::vector<int64_t>& samples) { return LossSum(model, samples); })
        .status();
  };
  for (int i = 0; i < steps_before; ++i) EVENSTEP_RETURN_IF_ERROR(step());
  keep(**es);
  absl::Status s = step();
  if (s.ok()) s = (*es)->Finish();
  return s;
}

TEST(LoopStateMisuseTest, MisuseIsNamedByTheNextStepWhichRunsNothing) {
  RunOnRanks(2, [](DistContext& dist) {
    const std::string dir = RanksDir() + "/run";
    double lr = 0.5, other = 1;
    at::Tensor undefined, sized = torch::zeros({2});
    // Twice, and after the first step.
    absl::Status s = FirstStep(dist, RanksDir() + "/twice", [&](Session& es) {
      es.Keep("lr", &lr);
      es.Keep("lr", &other);
    });
    EXPECT_THAT(s.message(), HasSubstr("Session::Keep('lr'): registered twice")) << s;
    s = FirstStep(
        dist, RanksDir() + "/late", [&](Session& es) { es.Keep("lr", &lr); }, 1);
    EXPECT_THAT(s.message(), HasSubstr("Session::Keep('lr'), rank " + std::to_string(dist.rank()) +
                                       ": called after the first step"))
        << s;
    // evenstep::Kept: two live variables of one name, another type or kind
    // for a name declared before, a first declaration after the first step.
    s = FirstStep(dist, RanksDir() + "/live",
                  [&](Session& es) { Kept<double> a(es, "x", 1), b(es, "x", 2); });
    EXPECT_THAT(s.message(), HasSubstr("evenstep::Kept('x'): declared again while the variable of "
                                       "that name is still in scope"))
        << s;
    s = FirstStep(dist, RanksDir() + "/type", [&](Session& es) {
      { Kept<double> a(es, "x", 1); }
      Kept<int> b(es, "x", 2);
    });
    EXPECT_THAT(s.message(), HasSubstr("evenstep::Kept('x'): declared again with another type"))
        << s;
    s = FirstStep(dist, RanksDir() + "/kind", [&](Session& es) {
      { KeptSum<double> a(es, "x", 1); }
      Kept<double> b(es, "x", 2);
    });
    EXPECT_THAT(s.message(), HasSubstr("declared before as a KeptSum and now as a Kept")) << s;
    s = FirstStep(
        dist, RanksDir() + "/late_kept", [&](Session& es) { KeptSum<double> a(es, "x"); }, 1);
    EXPECT_THAT(s.message(), HasSubstr("Session::Keep('x'), rank " + std::to_string(dist.rank()) +
                                       ": called after the first step"))
        << s;
    // The run that saves: lr, a tensor that is undefined, one of 2 values.
    ASSERT_TRUE(FirstStep(dist, dir, [&](Session& es) {
                  es.Keep("lr", &lr);
                  es.Keep("undefined", &undefined);
                  es.Keep("sized", &sized);
                }).ok());
    // Resumed: a name the checkpoint lacks; a value of another type; a
    // tensor of another shape; an undefined tensor to load into.
    std::string as_text;
    int64_t as_integer = 0;
    at::Tensor wrong_shape = torch::zeros({3}), was_undefined = torch::ones({1}), none;
    s = FirstStep(dist, dir, [&](Session& es) { es.Keep("missing", &lr); });
    EXPECT_THAT(s.message(), HasSubstr("Session::Keep('missing'): the resumed checkpoint holds no "
                                       "kept value of that name"))
        << s;
    EXPECT_THAT(s.message(), HasSubstr("resumed from " + dir + "/ckpt/")) << s;
    s = FirstStep(dist, dir, [&](Session& es) { es.Keep("lr", &as_text); });
    EXPECT_THAT(s.message(), HasSubstr("Session::Keep('lr'): the resumed checkpoint holds 0.5, "
                                       "which is not a string"))
        << s;
    s = FirstStep(dist, dir, [&](Session& es) { es.Keep("lr", &as_integer); });
    EXPECT_THAT(s.message(), HasSubstr("which is not a int64_t")) << s;
    s = FirstStep(dist, dir, [&](Session& es) { es.Keep("sized", &wrong_shape); });
    EXPECT_THAT(s.message(), HasSubstr("Session::Keep('sized'): ")) << s;
    EXPECT_THAT(s.message(), HasSubstr("tensor loop/sized has shape [2]")) << s;
    s = FirstStep(dist, dir, [&](Session& es) { es.Keep("sized", &none); });
    EXPECT_THAT(s.message(), HasSubstr("the tensor is undefined; make it with the saved shape"))
        << s;
    // An undefined tensor comes back undefined.
    s = FirstStep(dist, dir, [&](Session& es) { es.Keep("undefined", &was_undefined); });
    EXPECT_TRUE(s.ok()) << s;
    EXPECT_FALSE(was_undefined.defined());
  });
}

// Stream mode, loop-shaped (Session::Positions, OwnRows, KeptRows): a
// truncated-BPTT loop over 6 token streams as a plain loop writes it (its
// own zero_grad kept), on 1-3 ranks (streams 6, 3+3, 2+2+2): after every
// step the parameters equal the plain loop's on all rows, 2 epochs whose
// states start at zeros.
constexpr int64_t kStreams = 6, kSeq = 3, kChunks = 4, kVocab = 11, kHidden = 5;

struct TinyLm : torch::nn::Module {
  TinyLm() {
    torch::manual_seed(5);  // the same initial values on every rank and in the plain loop
    embed = register_module("embed", torch::nn::Embedding(kVocab, 4));
    lstm = register_module("lstm",
                           torch::nn::LSTM(torch::nn::LSTMOptions(4, kHidden).batch_first(true)));
    linear = register_module("linear", torch::nn::Linear(kHidden, kVocab));
  }
  // The mean loss of predicting `ids`' next tokens from position i, and the states after.
  torch::Tensor Loss(const torch::Tensor& ids, int64_t i, torch::Tensor& h, torch::Tensor& c) {
    auto [out, state] =
        lstm->forward(embed->forward(ids.slice(1, i, i + kSeq)), std::make_tuple(h, c));
    h = std::get<0>(state).detach();
    c = std::get<1>(state).detach();
    const torch::Tensor logits = linear->forward(out.reshape({-1, kHidden}));
    return torch::nll_loss(torch::log_softmax(logits, 1),
                           ids.slice(1, i + 1, i + 1 + kSeq).reshape(-1));
  }
  torch::nn::Embedding embed{nullptr};
  torch::nn::LSTM lstm{nullptr};
  torch::nn::Linear linear{nullptr};
};

torch::Tensor StreamCorpus() {
  torch::manual_seed(9);
  return torch::randint(0, kVocab, {kStreams, kChunks * kSeq + 1}, torch::kLong);
}

void SetStreamFlags() {
  SetFlags();
  absl::SetFlag(&FLAGS_evenstep_micro_batch_samples, 0);
  absl::SetFlag(&FLAGS_evenstep_global_batch, kStreams);
  absl::SetFlag(&FLAGS_evenstep_streams, kStreams);
  absl::SetFlag(&FLAGS_evenstep_loss_reduction, "mean");
  absl::SetFlag(&FLAGS_evenstep_balance, "dynamic");  // the streams stay pinned all the same
}

class StreamLoopWorldTest : public ::testing::TestWithParam<int> {};

TEST_P(StreamLoopWorldTest, EveryStepEqualsThePlainLoopOnAllRows) {
  RunOnRanks(GetParam(), [](DistContext& dist) {
    SetStreamFlags();
    TinyLm model, plain;
    torch::optim::SGD optimizer(model.parameters(), torch::optim::SGDOptions(0.5));
    torch::optim::SGD plain_optimizer(plain.parameters(), torch::optim::SGDOptions(0.5));
    torch::Tensor ids = StreamCorpus();
    const torch::Tensor all_rows = ids;
    auto es = Session::Create(dist, model, optimizer, UniformLengths(kStreams * kChunks),
                              RanksDir() + "/run");
    ASSERT_TRUE(es.ok()) << es.status();
    Session& session = **es;
    ASSERT_EQ(StreamsOf(ids, kSeq).positions, kChunks);
    ids = session.OwnRows(ids);
    EXPECT_EQ(ids.size(0), kStreams / dist.world_size());
    int steps = 0;
    for (int64_t epoch = session.first_epoch(); epoch < 2; ++epoch) {
      KeptRows h(session, "h", torch::zeros({1, kStreams, kHidden}));
      KeptRows c(session, "c", torch::zeros({1, kStreams, kHidden}));
      EXPECT_EQ(h.size(1), ids.size(0));
      torch::Tensor plain_h = torch::zeros({1, kStreams, kHidden}), plain_c = plain_h.clone();
      for (int64_t i : session.Positions(0, ids.size(1) - kSeq, kSeq)) {
        torch::Tensor hh = h, cc = c;
        torch::Tensor loss = model.Loss(ids, i, hh, cc);
        h = hh;
        c = cc;
        optimizer.zero_grad();
        session.Backward(loss);
        ASSERT_TRUE(session.step_ended());
        plain_optimizer.zero_grad();
        plain.Loss(all_rows, i, plain_h, plain_c).backward();
        plain_optimizer.step();
        ++steps;
        auto want = plain.named_parameters();
        for (const auto& p : model.named_parameters()) {
          const torch::Tensor w = want[p.key()];
          EXPECT_LE(((p.value() - w).abs().max() / (w.abs().max() + 1e-12)).item<double>(), 1e-5)
              << p.key() << " after step " << steps;
        }
      }
      ASSERT_FALSE(session.stopped());
    }
    EXPECT_EQ(steps, 2 * kChunks);
    EXPECT_TRUE(session.Finish().ok());
  });
}

INSTANTIATE_TEST_SUITE_P(Worlds, StreamLoopWorldTest, ::testing::Values(1, 2, 3),
                         [](const auto& info) { return absl::StrCat("world", info.param); });

// Stream mode's callback form (Session::AddStreamState): each rank writes
// only its own streams' rows of a state that has all of them; a checkpoint
// after a step gathers every rank's rows, and a Session resumed from it
// hands the whole tensor back, on every rank.
TEST(StreamStateTest, ACheckpointGathersEveryRanksRowsAndAResumeHandsThemBack) {
  RunOnRanks(2, [](DistContext& dist) {
    SetStreamFlags();
    TinyLm model;
    torch::optim::SGD optimizer(model.parameters(), torch::optim::SGDOptions(0.5));
    const torch::Tensor ids = StreamCorpus();
    auto open = [&](at::Tensor* state) {
      auto es = Session::Create(dist, model, optimizer, UniformLengths(kStreams * kChunks),
                                RanksDir() + "/run");
      EXPECT_TRUE(es.ok()) << es.status();
      EXPECT_TRUE((*es)->AddStreamState("h", state, 1).ok());
      return std::move(*es);
    };
    torch::Tensor state = torch::full({2, kStreams}, -1.0);
    std::unique_ptr<Session> first = open(&state);
    auto report = first->Step([&](const std::vector<int64_t>& samples) {
      // Sample s * kChunks + t is stream s's position t.
      torch::Tensor rows = torch::tensor(samples).div(kChunks, "floor");
      torch::Tensor h = torch::zeros({1, rows.size(0), kHidden}), c = h.clone();
      return model.Loss(ids.index_select(0, rows), 0, h, c) * rows.size(0);
    });
    ASSERT_TRUE(report.ok()) << report.status();
    const auto [begin, end] = first->stream_range();
    EXPECT_EQ(end - begin, kStreams / 2);
    for (int64_t r = begin; r < end; ++r) state.select(1, r).fill_(10.0 * r + dist.rank());
    ASSERT_TRUE(first->Checkpoint().ok());
    ASSERT_TRUE(first->Finish().ok());
    first.reset();
    torch::Tensor resumed = torch::zeros({2, kStreams});
    std::unique_ptr<Session> second = open(&resumed);
    torch::Tensor want = torch::empty({2, kStreams});
    for (int64_t r = 0; r < kStreams; ++r) want.select(1, r).fill_(10.0 * r + r / (kStreams / 2));
    EXPECT_TRUE(at::equal(resumed, want)) << resumed;
    EXPECT_TRUE(second->Finish().ok());
  });
}

// Misuse in stream mode's loop is named by the next step (Finish): a range
// of other positions than the streams', a state whose streams' dimension is
// ambiguous, and OwnRows outside stream mode.
TEST(StreamLoopMisuseTest, IsNamedByTheNextStep) {
  RunOnRanks(2, [](DistContext& dist) {
    SetStreamFlags();
    TinyLm model;
    torch::optim::SGD optimizer(model.parameters(), torch::optim::SGDOptions(0.5));
    const torch::Tensor ids = StreamCorpus();
    auto open = [&](const std::string& dir) {
      auto es = Session::Create(dist, model, optimizer, UniformLengths(kStreams * kChunks),
                                RanksDir() + "/" + dir);
      EXPECT_TRUE(es.ok()) << es.status();
      return std::move(*es);
    };
    auto body = [&](Session& session, int64_t end, const at::Tensor& initial) {
      const torch::Tensor rows = session.OwnRows(ids);
      KeptRows h(session, "h", initial);
      int bodies = 0;
      for (int64_t i : session.Positions(0, end, kSeq)) {
        ++bodies;
        torch::Tensor hh = torch::zeros({1, rows.size(0), kHidden}), cc = hh.clone();
        session.Backward(model.Loss(rows, i, hh, cc));
      }
      EXPECT_EQ(bodies, 0);
      return session.Finish();
    };
    std::unique_ptr<Session> a = open("range");
    absl::Status status = body(*a, ids.size(1) - 2 * kSeq, torch::zeros({1, kStreams, kHidden}));
    EXPECT_THAT(status.message(), HasSubstr("Session::Positions(0, 7, 3), rank "));
    EXPECT_THAT(status.message(),
                HasSubstr(": visits 3 positions, but each of the 6 streams has 4"));
    a.reset();
    std::unique_ptr<Session> b = open("ambiguous");
    status = body(*b, ids.size(1) - kSeq, torch::zeros({kStreams, kStreams}));
    EXPECT_THAT(status.message(),
                HasSubstr("evenstep::KeptRows('h'), rank " + std::to_string(dist.rank()) +
                          ": more than one dimension of [6, 6] has the 6 streams' size; give the "
                          "streams' dimension"));
    b.reset();
    absl::SetFlag(&FLAGS_evenstep_streams, 0);
    absl::SetFlag(&FLAGS_evenstep_global_batch, 6);
    std::unique_ptr<Session> c = open("not_streams");
    c->OwnRows(ids);
    auto loader = LoaderOf(Points().map(torch::data::transforms::Stack<>()));
    for (auto& batch : c->Batches(loader)) c->Backward(batch.data.sum() * 0);
    EXPECT_THAT(c->Finish().message(),
                HasSubstr("Session::OwnRows, rank " + std::to_string(dist.rank()) +
                          ": not in stream mode"));
  });
}

}  // namespace
}  // namespace evenstep

// The loop's own variables across a resume (Session::Keep), and the
// iteration boundary where a checkpoint reads them, over real ranks: a
// plain epoch loop (a local learning rate decayed at each epoch's end and
// copied into the optimizer, as pytorch-cpp's ResNet tutorial does; a
// running loss reset at each epoch's end; counters, a string, a vector and
// a tensor) keeps each variable in one line. Stopped by a preemption at an
// epoch's last step or inside an epoch, or by ending the loop early and
// calling Finish, and resumed, it prints every line of the uninterrupted
// run, bit for bit, and ends with its variables and parameters. The
// preempted step's report reaches the loop (Step returns it; the next Step
// saves and returns CANCELLED). Misuse is named by the next Step.
#include <torch/torch.h>

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
#include "evenstep/flags.h"
#include "evenstep/session.h"
#include "evenstep/status_macros.h"
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

// How a run of the loop ends early.
struct Stop {
  int preempt_before = 0;  // rank 0 raises SIGTERM before this step
  int finish_after = 0;    // the loop leaves after this step and calls Finish
};

// The plain epoch loop with its variables kept; rank 0 writes its lines to
// RanksDir()/<name>.txt: every step's and epoch's line, and how it ended.
void TrainLoop(DistContext& dist, const std::string& name, const std::string& run_dir,
               const Stop& stop) {
  SetFlags();
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
  for (int64_t epoch = session.first_epoch(); epoch < kEpochs; ++epoch) {
    while (session.epoch() == epoch) {
      const int64_t s = session.last_report().step + 1;
      if (s == stop.preempt_before && dist.rank() == 0) std::raise(SIGTERM);
      auto report = session.Step(
          [&](const std::vector<int64_t>& samples) { return LossSum(model, samples); });
      if (!report.ok()) {
        ASSERT_TRUE(session.preempted()) << report.status();
        EXPECT_EQ(session.last_report().step, stop.preempt_before) << "no step ran after it";
        say(absl::StrCat("stopped: ", report.status().message()));
        return write();
      }
      // The preempted step's report reaches the loop like any other.
      EXPECT_EQ(session.preemption_pending(), report->step == stop.preempt_before);
      running_loss += report->loss;
      ++steps_seen;
      last_loss = static_cast<float>(report->loss);
      loss_per_step[report->step - 1] = report->loss;
      if (report->loss < 0.3) best = absl::StrCat("step ", report->step);
      say(absl::StrFormat("step %d loss %.17g lr %.17g running %.17g", report->step, report->loss,
                          current_lr, running_loss));
      if (report->step == stop.finish_after) {
        EXPECT_TRUE(session.Finish().ok());
        say("finished early");
        return write();
      }
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

TEST(LoopStateTest, AStoppedAndResumedLoopPrintsEveryLineOfTheUninterruptedRun) {
  RunOnRanks(
      2,
      [](DistContext& dist) {
        const std::string name = std::getenv("LOOP_RUN");
        Stop stop;
        if (name == "preempted_at_epoch_end") stop.preempt_before = 8;
        if (name == "preempted_mid_epoch") stop.preempt_before = 6;
        if (name == "finished_early") stop.finish_after = 7;
        // Each stopped run and its resumption share a run directory.
        TrainLoop(dist, name, RanksDir() + "/" + std::getenv("LOOP_DIR"), stop);
      },
      Named("whole", "whole"));
  const std::vector<std::string> whole = LinesOf("whole");
  ASSERT_EQ(whole.size(), 12u + kEpochs + 1) << absl::StrJoin(whole, "\n");
  for (const auto& [stopped, at] : std::vector<std::pair<std::string, int>>{
           {"preempted_at_epoch_end", 8}, {"preempted_mid_epoch", 6}, {"finished_early", 7}}) {
    SCOPED_TRACE(stopped);
    RunOnRanksAgain(2, Named(stopped, stopped));
    RunOnRanksAgain(2, Named(stopped + "_resumed", stopped));
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

TEST(LoopStateTest, MisuseIsNamedByTheNextStepWhichRunsNothing) {
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

}  // namespace
}  // namespace evenstep

// The main job end to end (samples/train_fortunes.cc over real ranks):
// SIGKILL mid-run then resume from `latest` gives exactly the loss
// trajectory of an uninterrupted run (same world size), and closely on
// another world size; the same seed gives the same trajectory at world
// sizes 1, 2 and 3 (only float summation order differs: relative 1e-4).
#include <signal.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/fortunes_run.h"
#include "tests/testing/subprocess.h"
#include "tests/testing/temp_dir.h"

namespace evenstep {
namespace {

using ::evenstep::testing::Describe;
using ::evenstep::testing::ProcessResult;
using ::testing::HasSubstr;
using ::testing::Not;

class SampleTest : public ::testing::Test {
 protected:
  // Runs the trainer on `world` ranks through evenstep-run; step -> loss.
  std::map<int, double> Train(int world, const std::string& run, std::vector<std::string> extra,
                              int* exit_code = nullptr, std::string* output = nullptr) {
    return evenstep::testing::TrainFortunes(EVENSTEP_SAMPLE_TRAINER, dir_, world, run, extra,
                                            exit_code, output);
  }
  evenstep::testing::TempDir temp_{"evenstep_sample"};
  const std::string dir_ = temp_.path();
};

TEST_F(SampleTest, ResumeAfterSigkillMatchesTheUninterruptedRun) {
  const std::vector<std::string> work = {"--evenstep_balance=work"};
  const auto full = Train(2, "full", work);
  ASSERT_EQ(full.size(), 12u);
  EXPECT_LT(full.at(12), full.at(1));  // it learns
  int code = 0;
  std::vector<std::string> killed = work;
  killed.push_back("--kill_at_step=10");
  Train(2, "cut", killed, &code);
  EXPECT_EQ(code, 128 + 9) << "rank 0 must die by SIGKILL";
  std::string output;
  const auto resumed = Train(2, "cut", work, &code, &output);
  ASSERT_EQ(code, 0) << output;
  EXPECT_THAT(output, HasSubstr("resuming from"));
  ASSERT_FALSE(resumed.empty());
  EXPECT_LE(resumed.begin()->first, 11) << output;
  for (const auto& [step, loss] : resumed) {
    EXPECT_EQ(loss, full.at(step)) << "step " << step;  // exactly
  }
  // Nothing the first segment logged is lost: the resumed run writes new
  // segments beside it, and the report reads them together.
  const std::string run = dir_ + "/cut";
  for (const std::string& file :
       {"trace-00000.json", "trace-00000.1.json", "trace-00001.json", "trace-00001.1.json",
        "metrics-00000.jsonl", "metrics-00000.1.jsonl"}) {
    EXPECT_TRUE(std::filesystem::exists(run + "/" + file)) << file;
  }
  const auto report = evenstep::testing::RunAll({{{EVENSTEP_REPORT_TOOL, run}, {}}},
                                                evenstep::testing::HangBound());
  EXPECT_EQ(report[0].exit_code, 0) << report[0].output;
  // The same checkpoint resumed on 3 ranks: close, not bit-exact.
  std::filesystem::copy(dir_ + "/cut", dir_ + "/cut3", std::filesystem::copy_options::recursive);
  const auto three = Train(3, "cut3", work, &code, &output);
  ASSERT_EQ(code, 0) << output;
  for (const auto& [step, loss] : three) {
    if (step <= 12) EXPECT_NEAR(loss, full.at(step), 1e-4 * full.at(step)) << "step " << step;
  }
}

// A --device that is not one, or a CUDA device this machine lacks, stops
// the trainer before training with the flag and the reason, not a crash.
TEST_F(SampleTest, ABadDeviceStopsTheTrainerNamingTheFlag) {
  for (const std::string device : {"gpu", "cuda:99"}) {
    int code = 0;
    std::string output;
    const auto losses = Train(1, "bad_device", {"--device=" + device}, &code, &output);
    EXPECT_EQ(code, 2) << output;
    EXPECT_TRUE(losses.empty()) << output;
    EXPECT_THAT(output, HasSubstr("--device=" + device + ": ")) << output;
  }
}

// A run directory that cannot be created (here: under a regular file)
// used to abort the trainer with an uncaught std::filesystem_error.
TEST_F(SampleTest, AnUncreatableRunDirectoryStopsTheTrainerNamingTheFlagsAndTheCause) {
  { std::ofstream(dir_ + "/a_file") << "not a directory"; }
  int code = 0;
  std::string output;
  const auto losses = Train(1, "a_file/run", {}, &code, &output);
  EXPECT_EQ(code, 2) << output;
  EXPECT_TRUE(losses.empty()) << output;
  EXPECT_THAT(output, HasSubstr("--run=a_file/run: cannot create the run directory " + dir_ +
                                "/a_file/run: Not a directory"))
      << output;
}

TEST_F(SampleTest, SameTrajectoryAtWorldSizes1To3) {
  std::vector<std::map<int, double>> runs;
  for (int world : {1, 2, 3}) {
    runs.push_back(Train(world, "w" + std::to_string(world), {"--steps=6"}));
    ASSERT_EQ(runs.back().size(), 6u) << "world " << world;
  }
  for (size_t w = 1; w < runs.size(); ++w) {
    for (const auto& [step, loss] : runs[0]) {
      EXPECT_NEAR(runs[w].at(step), loss, 1e-4 * loss) << "world " << w + 1 << " step " << step;
    }
  }
}

// The torch::data port (samples/dist_mnist.cc, the README's example): both
// it and the loop it was ported from train over 2 ranks; the ported loop
// runs whole epochs by the session's epoch, and a second run with more
// epochs resumes where the first stopped and ends after exactly those
// epochs (512 samples, global batch 64: 8 steps an epoch).
TEST(TorchDataSampleTest, PortedDistMnistTrainsWholeEpochsAndResumesByEpoch) {
  evenstep::testing::TempDir dir("evenstep_mnist");
  auto run = [&](const std::string& program, std::vector<std::string> extra) {
    std::vector<std::string> argv = {
        EVENSTEP_RUN, "-n", "2", "--", program, "--samples=512", "--evenstep_timeout=60s"};
    argv.insert(argv.end(), extra.begin(), extra.end());
    return evenstep::testing::RunAll({{argv, {}}}, evenstep::testing::HangBound(4))[0];
  };
  const ProcessResult plain = run(EVENSTEP_MNIST_PLAIN, {"--epochs=1"});
  ASSERT_EQ(plain.exit_code, 0) << plain.output;
  const std::string run_dir = dir.path() + "/run";
  const ProcessResult first =
      run(EVENSTEP_MNIST, {"--epochs=1", "--run_dir=" + run_dir, "--evenstep_data_workers=2"});
  ASSERT_EQ(first.exit_code, 0) << first.output;
  EXPECT_TRUE(std::filesystem::exists(run_dir + "/ckpt/step-0000000008/manifest.json"))
      << first.output;
  const ProcessResult second = run(EVENSTEP_MNIST, {"--epochs=3", "--run_dir=" + run_dir});
  ASSERT_EQ(second.exit_code, 0) << second.output;
  EXPECT_THAT(second.output, HasSubstr("(step 8)"));  // "[evenstep] resuming from ... (step 8)"
  EXPECT_TRUE(std::filesystem::exists(run_dir + "/ckpt/step-0000000024/manifest.json"))
      << second.output;
  EXPECT_FALSE(std::filesystem::exists(run_dir + "/ckpt/step-0000000025")) << second.output;
}

// A ported sample beside its plain loop, both run with the same flags
// (`common`); the port through evenstep-run with static balance in a run
// directory of its own per name.
struct PortedPair {
  std::string port, plain;
  std::vector<std::string> common;
  evenstep::testing::TempDir dir{"evenstep_port"};

  // `extra` flags come last (a later flag overrides an earlier one).
  evenstep::testing::ProcessSpec Port(int world, const std::string& run,
                                      const std::vector<std::string>& extra = {}) const {
    std::vector<std::string> argv = {EVENSTEP_RUN,
                                     "-n",
                                     std::to_string(world),
                                     "--",
                                     port,
                                     "--evenstep_run_dir=" + dir.path() + "/" + run,
                                     "--evenstep_timeout=60s",
                                     "--evenstep_balance=static"};
    argv.insert(argv.end(), common.begin(), common.end());
    argv.insert(argv.end(), extra.begin(), extra.end());
    return {argv, {}};
  }
  ProcessResult Run(const evenstep::testing::ProcessSpec& spec) const {
    return evenstep::testing::RunAll({spec}, evenstep::testing::HangBound(4))[0];
  }
  ProcessResult RunPlain() const {
    std::vector<std::string> argv = {plain};
    argv.insert(argv.end(), common.begin(), common.end());
    return Run({argv, {}});
  }
  // The port on `world` ranks as run `run`, SIGTERM to the launcher once
  // `line` is printed; the stopped run's result (none, after a failure
  // naming what went wrong, when the line never came or the signal failed).
  std::optional<ProcessResult> Preempted(int world, const std::string& run, const std::string& line,
                                         const std::vector<std::string>& extra = {}) const {
    evenstep::testing::Subprocess cut(Port(world, run, extra));
    if (!cut.WaitForOutput(line, evenstep::testing::HangBound(4))) {
      ADD_FAILURE() << "no '" << line << "' in\n" << cut.OutputSoFar();
      return std::nullopt;
    }
    if (kill(cut.pid(), SIGTERM) != 0) {
      ADD_FAILURE() << "kill(SIGTERM) failed";
      return std::nullopt;
    }
    return cut.Wait(evenstep::testing::HangBound(2));
  }
};

// "[e/E][b/B] D_loss: X | G_loss: Y" lines of rank `prefix` ("" for a
// plain run), without the carriage return the original prints first.
std::vector<std::string> GanLines(const std::string& output, const std::string& prefix) {
  std::vector<std::string> lines;
  for (absl::string_view line : absl::StrSplit(output, '\n')) {
    if (!absl::ConsumePrefix(&line, prefix)) continue;
    absl::ConsumePrefix(&line, "\r");
    if (absl::StartsWith(line, "[") && absl::StrContains(line, "] D_loss: ")) {
      lines.emplace_back(line);
    }
  }
  return lines;
}

// {D_loss, G_loss} of a GanLines line; the "[e/E][b/B]" before them.
std::pair<double, double> GanFigures(const std::string& line, std::string* position) {
  const size_t d = line.find(" D_loss: "), g = line.find(" | G_loss: ");
  double d_loss = -1, g_loss = -1;
  if (d == std::string::npos || g == std::string::npos ||
      !absl::SimpleAtod(line.substr(d + 9, g - d - 9), &d_loss) ||
      !absl::SimpleAtod(line.substr(g + 11), &g_loss)) {
    ADD_FAILURE() << "not a progress line: " << line;
  }
  *position = line.substr(0, d);
  return {d_loss, g_loss};
}

// The DCGAN port (samples/dcgan.cc: two model parts, the loop's body as
// pytorch/examples writes it) against its plain loop (samples/dcgan_plain.cc),
// 1280 images, batches of 64, 3 epochs, a line every 4 batches: one and two
// ranks print the plain loop's lines (epoch, batch) and follow its curve
// (each epoch's mean losses within 25 %: another sample order and other
// draws, as a plain rerun with another seed); SIGTERM mid-epoch, and the
// rerun prints the uninterrupted run's remaining lines exactly (the batch
// counter from step_in_epoch, the draws reseeded per step). That each step
// equals the plain loop on the whole batch is PartsWorldTest's proof.
TEST(DcganSampleTest, OneAndTwoRanksFollowThePlainLoopAndPreemptionResumesEveryLine) {
  const PortedPair pair{EVENSTEP_DCGAN,
                        EVENSTEP_DCGAN_PLAIN,
                        {"--samples=1280", "--epochs=3", "--channels=8", "--log_interval=4"}};
  const ProcessResult plain_run = pair.RunPlain();
  ASSERT_EQ(plain_run.exit_code, 0) << plain_run.output;
  const std::vector<std::string> plain = GanLines(plain_run.output, "");
  ASSERT_EQ(plain.size(), 15u) << plain_run.output;
  EXPECT_THAT(plain_run.output, HasSubstr("Training complete!"));
  auto epoch_means = [](const std::vector<std::string>& lines, std::vector<std::string>* where) {
    std::vector<std::pair<double, double>> means(3);
    for (size_t i = 0; i < lines.size(); ++i) {
      std::string position;
      const auto [d, g] = GanFigures(lines[i], &position);
      where->push_back(position);
      means[i / 5].first += d / 5;
      means[i / 5].second += g / 5;
    }
    return means;
  };
  std::vector<std::string> plain_positions;
  const auto plain_means = epoch_means(plain, &plain_positions);
  EXPECT_EQ(plain_positions[5], "[ 2/ 3][  4/ 20]");
  for (int world : {1, 2}) {
    SCOPED_TRACE(absl::StrCat(world, " rank(s)"));
    const ProcessResult run = pair.Run(pair.Port(world, absl::StrCat("world", world)));
    ASSERT_EQ(run.exit_code, 0) << run.output;
    const std::vector<std::string> lines = GanLines(run.output, "[0] ");
    ASSERT_EQ(lines.size(), plain.size()) << run.output;
    std::vector<std::string> positions;
    const auto means = epoch_means(lines, &positions);
    EXPECT_EQ(positions, plain_positions);
    for (size_t e = 0; e < means.size(); ++e) {
      EXPECT_NEAR(means[e].first, plain_means[e].first, 0.25 * plain_means[e].first) << e;
      EXPECT_NEAR(means[e].second, plain_means[e].second, 0.25 * plain_means[e].second) << e;
    }
  }

  const ProcessResult two = pair.Run(pair.Port(2, "two"));
  ASSERT_EQ(two.exit_code, 0) << two.output;
  const std::optional<ProcessResult> cut = pair.Preempted(2, "cut", "[ 2/ 3][  8/ 20]");
  ASSERT_TRUE(cut.has_value());
  EXPECT_EQ(cut->exit_code, 83) << cut->output;
  EXPECT_THAT(cut->output, HasSubstr("then stopping"));
  const ProcessResult resumed = pair.Run(pair.Port(2, "cut"));
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  EXPECT_THAT(resumed.output, HasSubstr("resuming from"));
  std::vector<std::string> both = GanLines(cut->output, "[0] ");
  ASSERT_LT(both.size(), 15u) << cut->output;
  for (std::string& line : GanLines(resumed.output, "[0] ")) both.push_back(line);
  EXPECT_EQ(both, GanLines(two.output, "[0] ")) << cut->output << resumed.output;
}

// Rank `prefix`'s lines that start with `start`, without the prefix.
std::string RankLinesStarting(const std::string& output, const std::string& prefix,
                              const std::string& start) {
  std::string lines;
  for (absl::string_view line : absl::StrSplit(output, '\n')) {
    if (absl::ConsumePrefix(&line, prefix) && absl::StartsWith(line, start)) {
      absl::StrAppend(&lines, line, "\n");
    }
  }
  return lines;
}

// The two numbers after `first` and `second` in each of `lines` (e.g.
// "Loss: X, Accuracy: Y"), in order.
std::vector<std::pair<double, double>> Figures(const std::string& lines, const std::string& first,
                                               const std::string& second) {
  std::vector<std::pair<double, double>> figures;
  for (absl::string_view line : absl::StrSplit(lines, '\n', absl::SkipEmpty())) {
    const size_t a = line.find(first), b = line.find(second);
    if (a == absl::string_view::npos || b == absl::string_view::npos) continue;
    double x = 0, y = 0;
    absl::string_view xs = line.substr(a + first.size()), ys = line.substr(b + second.size());
    xs = xs.substr(0, xs.find(',')), ys = ys.substr(0, ys.find(','));
    if (absl::SimpleAtod(xs, &x) && absl::SimpleAtod(ys, &y)) figures.emplace_back(x, y);
  }
  return figures;
}

// {loss, accuracy} of each "Epoch [" and then "Testset" line of rank
// `prefix` ("" for a plain run): "... Loss: X, Accuracy: Y".
std::vector<std::pair<double, double>> EpochAndTestFigures(const std::string& output,
                                                           const std::string& prefix) {
  return Figures(
      RankLinesStarting(output, prefix, "E") + RankLinesStarting(output, prefix, "Testset"),
      "Loss: ", "Accuracy: ");
}

// The port on 2 ranks as run `run` (with `extra` flags), stopped by SIGTERM
// to the launcher once `line` is printed (the step is saved, exit 83), then
// run again in its directory (it resumes, exit 0): for each of `starts`,
// rank 0's lines of both runs together are `whole`'s (an uninterrupted
// run), exactly.
void ExpectStoppedAndResumedLines(const PortedPair& pair, const ProcessResult& whole,
                                  const std::string& line, const std::vector<std::string>& starts,
                                  const std::vector<std::string>& extra = {},
                                  const std::string& run = "cut") {
  const std::optional<ProcessResult> cut = pair.Preempted(2, run, line, extra);
  ASSERT_TRUE(cut.has_value());
  EXPECT_EQ(cut->exit_code, 83) << cut->output;
  EXPECT_THAT(cut->output, HasSubstr("then stopping"));
  const ProcessResult resumed = pair.Run(pair.Port(2, run, extra));
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  EXPECT_THAT(resumed.output, HasSubstr("resuming from"));
  for (const std::string& start : starts) {
    EXPECT_EQ(RankLinesStarting(cut->output, "[0] ", start) +
                  RankLinesStarting(resumed.output, "[0] ", start),
              RankLinesStarting(whole.output, "[0] ", start))
        << cut->output << resumed.output;
  }
}

// A dynamic-balance run of the port on 2 ranks, then its replay from the
// run's split record (--evenstep_replay) stopped by SIGTERM once `line` is
// printed and resumed: rank 0's lines starting with each of `starts` in
// the replay's two runs together are the original's, bit for bit.
void ExpectDynamicRunReplaysAcrossAResume(const PortedPair& pair, const std::string& line,
                                          const std::vector<std::string>& starts) {
  const ProcessResult original = pair.Run(pair.Port(2, "dynamic", {"--evenstep_balance=dynamic"}));
  ASSERT_EQ(original.exit_code, 0) << original.output;
  ExpectStoppedAndResumedLines(
      pair, original, line, starts,
      {"--evenstep_balance=dynamic", "--evenstep_replay=" + pair.dir.path() + "/dynamic"},
      "replayed");
}

// "Test set: Average loss: X | Accuracy: Y" lines -> {X, Y}.
std::vector<std::pair<double, double>> TestFigures(const std::string& lines) {
  std::vector<std::pair<double, double>> figures;
  for (absl::string_view line : absl::StrSplit(lines, '\n', absl::SkipEmpty())) {
    std::vector<std::string> f = absl::StrSplit(line, ' ', absl::SkipEmpty());
    double loss = 0, accuracy = 0;
    if (f.size() == 8 && absl::SimpleAtod(f[4], &loss) && absl::SimpleAtod(f[7], &accuracy)) {
      figures.emplace_back(loss, accuracy);
    }
  }
  return figures;
}

TEST(LoopMnistSampleTest, OneRankPrintsThePlainLinesTwoFollowPreemptionResumesADynamicRunReplays) {
  // The loop-shaped port (samples/mnist.cc) of a plain torch::data trainer
  // (samples/mnist_plain.cc): 1280 images, batches of 64, 3 epochs.
  const PortedPair pair{
      EVENSTEP_LOOP_MNIST, EVENSTEP_LOOP_MNIST_PLAIN, {"--samples=1280", "--epochs=3"}};
  const ProcessResult plain_run = pair.RunPlain();
  ASSERT_EQ(plain_run.exit_code, 0) << plain_run.output;
  const std::string plain_lines = RankLinesStarting(plain_run.output, "", "T");
  ASSERT_EQ(TestFigures(plain_lines).size(), 3u) << plain_run.output;

  // One rank, one micro-batch per step, torch's own random stream (no
  // reseeding, so dropout draws as the plain loop does): every line.
  evenstep::testing::ProcessSpec one = pair.Port(1, "one");
  one.argv.push_back("--evenstep_reseed=false");
  const ProcessResult on_one = pair.Run(one);
  ASSERT_EQ(on_one.exit_code, 0) << on_one.output;
  EXPECT_EQ(RankLinesStarting(on_one.output, "[0] ", "T"), plain_lines);

  // Two ranks: half the batch each, the same curve (each epoch's test loss
  // within 2 %).
  const ProcessResult two = pair.Run(pair.Port(2, "two"));
  ASSERT_EQ(two.exit_code, 0) << two.output;
  const auto want = TestFigures(plain_lines);
  const auto got = TestFigures(RankLinesStarting(two.output, "[0] ", "Test set"));
  ASSERT_EQ(got.size(), want.size()) << two.output;
  for (size_t e = 0; e < want.size(); ++e) {
    EXPECT_NEAR(got[e].first, want[e].first, 0.02 * want[e].first) << "epoch " << e + 1;
  }

  // SIGTERM to the launcher after epoch 1's test: the loop's current step
  // completes, the next one saves it and the run exits 83; the rerun goes on
  // inside that epoch, and the test lines of both are the uninterrupted
  // run's, exactly. A dynamic-balance run, replayed from its split record
  // and stopped and resumed on the way, prints its test lines bit for bit.
  ExpectStoppedAndResumedLines(pair, two, "[0] Test set", {"Test set"});
  ExpectDynamicRunReplaysAcrossAResume(pair, "[0] Test set", {"Test set"});
}

// The loop-shaped port of pytorch-cpp's convolutional network tutorial
// (samples/cnn.cc) beside its plain loop (samples/cnn_plain.cc): 1000
// images, batches of 100, 3 epochs. The plain loop draws its order from a
// RandomSampler, the port from evenstep's shuffle, so the runs follow one
// curve rather than print the same lines; SIGTERM inside epoch 2 and a
// rerun print the uninterrupted run's epoch and test lines exactly (the
// epoch's running loss and correct count, declared at its top, resume
// with the sums the stopped run had reached); a dynamic-balance run replayed
// from its split record, stopped and resumed on the way, prints its lines
// bit for bit.
TEST(CnnSampleTest, RanksFollowThePlainLoopAResumedEpochKeepsItsSumsADynamicRunReplays) {
  const PortedPair pair{EVENSTEP_CNN, EVENSTEP_CNN_PLAIN, {"--samples=1000", "--epochs=3"}};
  const ProcessResult plain_run = pair.RunPlain();
  ASSERT_EQ(plain_run.exit_code, 0) << plain_run.output;
  const auto plain = EpochAndTestFigures(plain_run.output, "");
  ASSERT_EQ(plain.size(), 4u) << plain_run.output;
  for (int world : {1, 2}) {
    SCOPED_TRACE(absl::StrCat(world, " rank(s)"));
    const ProcessResult run = pair.Run(pair.Port(world, absl::StrCat("world", world)));
    ASSERT_EQ(run.exit_code, 0) << run.output;
    // The epoch lines on every rank (the same sums), the test set on rank 0.
    EXPECT_EQ(RankLinesStarting(run.output, absl::StrCat("[", world - 1, "] "), "Epoch ["),
              RankLinesStarting(run.output, "[0] ", "Epoch ["));
    EXPECT_EQ(RankLinesStarting(run.output, absl::StrCat("[", world - 1, "] "), "Testset"),
              world == 1 ? RankLinesStarting(run.output, "[0] ", "Testset") : "");
    const auto port = EpochAndTestFigures(run.output, "[0] ");
    ASSERT_EQ(port.size(), plain.size()) << run.output;
    // The last epoch and the test set (the first epochs' figures move with
    // the order the samples come in).
    for (size_t i = plain.size() - 2; i < plain.size(); ++i) {
      EXPECT_NEAR(port[i].first, plain[i].first, 0.25 * plain[i].first + 0.01) << "line " << i;
      EXPECT_NEAR(port[i].second, plain[i].second, 0.05) << "line " << i;
    }
  }
  const ProcessResult two = pair.Run(pair.Port(2, "two"));
  ASSERT_EQ(two.exit_code, 0) << two.output;
  ExpectStoppedAndResumedLines(pair, two, "[0] Epoch [1/3]", {"Epoch [", "Testset"});
  ExpectDynamicRunReplaysAcrossAResume(pair, "[0] Epoch [1/3]", {"Epoch [", "Testset"});
}

// The loop-shaped port of pytorch-cpp's variational autoencoder tutorial
// (samples/vae.cc, a batch-SUM objective, a random draw in the model)
// beside its plain loop (samples/vae_plain.cc): 1000 images, batches of
// 100, 3 epochs, a progress line every 2 batches. Two ranks follow the
// plain curve (each epoch's mean reconstruction loss within 10 %) and
// write the epoch's images; SIGTERM inside epoch 2 and a rerun print the uninterrupted run's
// lines exactly; a dynamic-balance run replayed from its split record, and
// stopped and resumed on the way, prints the original's lines, bit for bit.
TEST(VaeSampleTest, TwoRanksFollowThePlainLoopPreemptionResumesAndADynamicRunReplays) {
  const evenstep::testing::TempDir image_dir{"evenstep_vae_images"};
  const std::string images = image_dir.path();
  const PortedPair pair{
      EVENSTEP_VAE,
      EVENSTEP_VAE_PLAIN,
      {"--samples=1000", "--epochs=3", "--log_every=2", "--output_dir=" + images + "/"}};
  const ProcessResult plain_run = pair.RunPlain();
  ASSERT_EQ(plain_run.exit_code, 0) << plain_run.output;
  EXPECT_TRUE(std::filesystem::exists(images + "/sampled-3.pgm")) << plain_run.output;
  std::filesystem::remove_all(images);
  std::filesystem::create_directories(images);
  // Each epoch's mean reconstruction loss over its 5 progress lines.
  auto epoch_means = [](const std::string& lines) {
    std::vector<double> means;
    const auto figures = Figures(lines, "Reconstruction loss: ", "KL-divergence: ");
    for (size_t i = 0; i + 5 <= figures.size(); i += 5) {
      double sum = 0;
      for (size_t j = i; j < i + 5; ++j) sum += figures[j].first;
      means.push_back(sum / 5);
    }
    return means;
  };
  const std::vector<double> plain = epoch_means(RankLinesStarting(plain_run.output, "", "Epoch ["));
  ASSERT_EQ(plain.size(), 3u) << plain_run.output;

  const ProcessResult two = pair.Run(pair.Port(2, "two"));
  ASSERT_EQ(two.exit_code, 0) << two.output;
  const std::string lines = RankLinesStarting(two.output, "[0] ", "Epoch [");
  const std::vector<double> port = epoch_means(lines);
  ASSERT_EQ(port.size(), plain.size()) << two.output;
  for (size_t e = 0; e < plain.size(); ++e) {
    EXPECT_NEAR(port[e], plain[e], 0.1 * plain[e]) << "epoch " << e + 1;
  }
  EXPECT_TRUE(std::filesystem::exists(images + "/sampled-3.pgm")) << two.output;

  ExpectStoppedAndResumedLines(pair, two, "[0] Epoch [2/3], Step [2/", {"Epoch ["});

  ExpectDynamicRunReplaysAcrossAResume(pair, "[0] Epoch [2/3], Step [2/", {"Epoch ["});
}

// The LSTM language model port (samples/lm.cc: pytorch-cpp's loop as
// written, in stream mode: every row a stream whose hidden state stays on
// its rank) against its plain loop (samples/lm_plain.cc), 20 rows of 40
// chunks, 3 epochs: one rank prints the plain loop's epoch lines (to float
// rounding); two ranks the same losses (the applied gradient is the global
// batch's, whatever the split) and perplexities within 2 % (each rank's exp
// of its own rows' loss); SIGTERM during the second epoch, and the rerun
// prints the uninterrupted run's remaining lines exactly (the hidden states,
// KeptRows, and the running sums come back from the checkpoint).
TEST(LmSampleTest, OneAndTwoRanksPrintThePlainLoopsLinesAndPreemptionResumesExactly) {
  PortedPair pair{
      EVENSTEP_LM, EVENSTEP_LM_PLAIN, {"--chunks=40", "--epochs=3", "--hidden=64", "--vocab=200"}};
  pair.common.push_back("--sample_output=" + pair.dir.path() + "/sample.txt");
  const ProcessResult plain_run = pair.RunPlain();
  ASSERT_EQ(plain_run.exit_code, 0) << plain_run.output;
  EXPECT_THAT(plain_run.output, HasSubstr("Finished generating samples!"));
  const auto plain =
      Figures(RankLinesStarting(plain_run.output, "", "Epoch ["), "Loss: ", "Perplexity: ");
  ASSERT_EQ(plain.size(), 3u) << plain_run.output;
  EXPECT_LT(plain[2].first, plain[0].first);  // it learns
  for (int world : {1, 2}) {
    SCOPED_TRACE(absl::StrCat(world, " rank(s)"));
    const ProcessResult run = pair.Run(pair.Port(world, absl::StrCat("world", world)));
    ASSERT_EQ(run.exit_code, 0) << run.output;
    const auto port =
        Figures(RankLinesStarting(run.output, "[0] ", "Epoch ["), "Loss: ", "Perplexity: ");
    ASSERT_EQ(port.size(), plain.size()) << run.output;
    for (size_t e = 0; e < plain.size(); ++e) {
      EXPECT_NEAR(port[e].first, plain[e].first, 1e-5 * plain[e].first) << "epoch " << e + 1;
      EXPECT_NEAR(port[e].second, plain[e].second, (world == 1 ? 1e-5 : 0.02) * plain[e].second)
          << "epoch " << e + 1;
    }
    // Samples are drawn on rank 0 only, after Finish.
    EXPECT_THAT(run.output, HasSubstr("[0] Finished generating samples!"));
    EXPECT_THAT(run.output, Not(HasSubstr("[1] Generating samples")));
  }
  const ProcessResult two = pair.Run(pair.Port(2, "two"));
  ASSERT_EQ(two.exit_code, 0) << two.output;
  ExpectStoppedAndResumedLines(pair, two, "[0] Epoch [1/3]", {"Epoch ["});
}

// The loop-shaped port of pytorch-cpp's deep residual network tutorial
// (samples/resnet.cc) beside its plain loop (samples/resnet_plain.cc): 2000
// images, batches of 100, 5 epochs, the loop's own learning rate divided by
// 3 after epochs 2 and 4, augmentation by tensor transforms drawing from
// torch's default generator (the port loads on the training thread:
// data_workers=0). The plain loop's RandomSampler and evenstep's shuffle
// order the samples differently, so one and two ranks follow the plain
// curve (the last epoch's and the test set's loss within 10 %); SIGTERM
// inside epoch 3 and a rerun print the uninterrupted run's epoch and test
// lines exactly (running sums, the decayed rate and the draws all resume);
// a run of 2 epochs extended to 5 in the same run directory prints epochs
// 3-5 as the uninterrupted run does.
TEST(ResNetSampleTest, OneAndTwoRanksFollowThePlainLoopAndPreemptionResumesExactly) {
  const PortedPair pair{
      EVENSTEP_RESNET,
      EVENSTEP_RESNET_PLAIN,
      {"--samples=2000", "--epochs=5", "--decay_every=2", "--image=16", "--width=8"}};
  const ProcessResult plain_run = pair.RunPlain();
  ASSERT_EQ(plain_run.exit_code, 0) << plain_run.output;
  const auto plain = EpochAndTestFigures(plain_run.output, "");
  ASSERT_EQ(plain.size(), 6u) << plain_run.output;
  EXPECT_LT(plain[4].first, plain[0].first);  // it learns
  for (int world : {1, 2}) {
    SCOPED_TRACE(absl::StrCat(world, " rank(s)"));
    const ProcessResult run = pair.Run(pair.Port(world, absl::StrCat("world", world)));
    ASSERT_EQ(run.exit_code, 0) << run.output;
    const auto port = EpochAndTestFigures(run.output, "[0] ");
    ASSERT_EQ(port.size(), plain.size()) << run.output;
    for (size_t i = plain.size() - 2; i < plain.size(); ++i) {
      EXPECT_NEAR(port[i].first, plain[i].first, 0.1 * plain[i].first) << "line " << i;
    }
  }
  const ProcessResult two = pair.Run(pair.Port(2, "two"));
  ASSERT_EQ(two.exit_code, 0) << two.output;
  const std::string epochs = RankLinesStarting(two.output, "[0] ", "Epoch [");

  ExpectStoppedAndResumedLines(pair, two, "[0] Epoch [2/5]", {"Epoch [", "Testset"});

  // A finished run extended: --epochs=2 to its end (Finish saves the last
  // step after the epoch loop: the running sums are out of scope, the rate
  // decayed), then --epochs=5 in the same run directory: epochs 3-5 and the
  // test set as the uninterrupted run prints them.
  evenstep::testing::ProcessSpec short_run = pair.Port(2, "grow");
  short_run.argv.push_back("--epochs=2");
  const ProcessResult first = pair.Run(short_run);
  ASSERT_EQ(first.exit_code, 0) << first.output;
  const ProcessResult grown = pair.Run(pair.Port(2, "grow"));
  ASSERT_EQ(grown.exit_code, 0) << grown.output;
  EXPECT_EQ(RankLinesStarting(grown.output, "[0] ", "Epoch ["),
            epochs.substr(epochs.find("Epoch [3/5]")))
      << grown.output;
  EXPECT_EQ(RankLinesStarting(grown.output, "[0] ", "Testset"),
            RankLinesStarting(two.output, "[0] ", "Testset"));
}

}  // namespace
}  // namespace evenstep

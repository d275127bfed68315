// Several models in one Session (tests/parts_helper.cc, a small GAN over real
// ranks): both parts' parameters after 5 steps equal the plain single-process
// GAN loop on the whole global batch, the generator's gradient flowing
// through the discriminator included; a preempted run resumes both parts,
// their optimizers, the learning-rate schedules, the reseeded dropout and the
// loop's own state exactly; misuse is refused by name.
#include <regex>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/subprocess.h"
#include "tests/testing/temp_dir.h"

namespace evenstep {
namespace {

using ::evenstep::testing::Describe;
using ::evenstep::testing::ProcessResult;
using ::evenstep::testing::TempDir;
using ::testing::HasSubstr;
using ::testing::Not;

std::vector<ProcessResult> RunParts(int world, const std::string& run_dir,
                                    std::vector<std::string> args) {
  args.push_back("--run_dir=" + run_dir);
  // Three ranks get 6, 6 and 5 samples of each global batch of 17, in
  // micro-batches of at most 2: uneven shares, several micro-batches.
  for (const char* flag : {"--evenstep_balance=static", "--evenstep_global_batch=17",
                           "--evenstep_micro_batch_samples=2", "--evenstep_timeline=false"}) {
    args.push_back(flag);
  }
  return evenstep::testing::RunProgramOnRanks(world, EVENSTEP_PARTS_HELPER, args);
}

// Rank 0's "final ..." line (parameter checksums, running state, rates).
std::string FinalLine(const std::string& output) {
  std::smatch m;
  if (std::regex_search(output, m, std::regex("final [^\n]*"))) return m.str();
  return "";
}

TEST(PartsTest, BothPartsEqualThePlainLoopOnTheWholeBatch) {
  for (int world : {1, 2, 3}) {
    TempDir dir("parts");
    auto results = RunParts(world, dir.path(), {"--steps=5"});
    for (int r = 0; r < world; ++r) {
      EXPECT_EQ(results[r].exit_code, 0) << "world " << world << "\n" << Describe(results);
      EXPECT_THAT(results[r].output, HasSubstr(absl::StrCat("parts ok rank ", r)))
          << Describe(results);
    }
    EXPECT_THAT(results[0].output, HasSubstr("step 5 d_loss")) << Describe(results);
  }
}

TEST(PartsTest, APreemptedRunResumesBothPartsSchedulesRandomStreamsAndLoopState) {
  // Dropout in the discriminator: its masks come from the per-micro-batch
  // reseeding, so the resumed steps repeat them.
  TempDir whole("parts-whole"), split("parts-split");
  const std::vector<std::string> args = {"--steps=7", "--dropout", "--evenstep_ckpt_every=0"};
  auto uninterrupted = RunParts(2, whole.path(), args);
  for (const auto& r : uninterrupted) ASSERT_EQ(r.exit_code, 0) << Describe(uninterrupted);
  const std::string want = FinalLine(uninterrupted[0].output);
  ASSERT_FALSE(want.empty()) << Describe(uninterrupted);

  std::vector<std::string> preempt = args;
  preempt.push_back("--preempt_at=4");
  auto first = RunParts(2, split.path(), preempt);
  for (const auto& r : first) ASSERT_EQ(r.exit_code, 83) << Describe(first);
  // The preempted step's losses are the uninterrupted run's step 4.
  std::smatch m;
  const std::string out0 = first[0].output;
  ASSERT_TRUE(std::regex_search(out0, m, std::regex("preempted at step 4 (d_loss [^\n]*)")))
      << Describe(first);
  EXPECT_THAT(uninterrupted[0].output, HasSubstr("step 4 " + m.str(1))) << Describe(first);

  auto second = RunParts(2, split.path(), args);
  for (const auto& r : second) ASSERT_EQ(r.exit_code, 0) << Describe(second);
  EXPECT_THAT(second[0].output, HasSubstr("resuming from")) << Describe(second);
  for (int step = 5; step <= 7; ++step) {
    std::smatch line;
    const std::string out = uninterrupted[0].output;
    ASSERT_TRUE(
        std::regex_search(out, line, std::regex(absl::StrCat("step ", step, " d_loss [^\n]*"))));
    EXPECT_THAT(second[0].output, HasSubstr(line.str())) << Describe(second);
  }
  EXPECT_EQ(FinalLine(second[0].output), want) << Describe(second);
}

TEST(PartsTest, AThrowInTheSecondPartAbandonsItOnEveryRankAndTheRanksGoOnAlike) {
  // Rank 1's generator loss throws in step 3: every rank's Step returns
  // ABORTED naming rank 1, the part and the micro-batch; the discriminator
  // has stepped (as in the plain loop), the generator has not, on every rank
  // alike; steps 4 and 5 run, and both ranks end with the same parameters.
  TempDir dir("parts-throw");
  auto results = RunParts(2, dir.path(), {"--steps=5", "--throw_at=3"});
  std::vector<std::string> finals;
  for (const auto& r : results) {
    EXPECT_EQ(r.exit_code, 0) << Describe(results);
    EXPECT_THAT(r.output, HasSubstr("step 3 failed: ABORTED"));
    EXPECT_THAT(r.output, HasSubstr("step 3, part 'generator', micro-batch ")) << Describe(results);
    EXPECT_THAT(r.output, HasSubstr("abandoned on every rank: rank(s) 1 failed"))
        << Describe(results);
    finals.push_back(FinalLine(r.output));
    EXPECT_FALSE(finals.back().empty()) << Describe(results);
  }
  EXPECT_THAT(results[1].output, HasSubstr("rank 1, step 3, part 'generator', micro-batch 1 of 4: "
                                           "the generator's loss failed"))
      << Describe(results);
  EXPECT_THAT(results[0].output, HasSubstr("step 5 d_loss")) << Describe(results);
  EXPECT_EQ(finals[0], finals[1]) << Describe(results);
}

TEST(PartsTest, MisuseIsRefusedByName) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"dup_name", "model part name 'discriminator': given twice"},
      {"shared_param",
       "a parameter is in two model parts, part 'discriminator' (0.weight) and "
       "part 'generator' (0.weight)"},
      {"no_part", "no model part"},
      {"one_loss", "this step has 2 model parts: Step takes one loss function per part"},
      {"undeclared_sum", "AddToSum('typo'): not declared (DeclareSum before the first step)"},
      {"sum_twice", "DeclareSum('samples'), rank"},
      {"schedule_unknown_part", "Session::ScheduleLearningRate"},
  };
  for (const auto& [bad, message] : cases) {
    TempDir dir("parts-bad");
    auto results = RunParts(2, dir.path(), {"--bad=" + bad});
    for (const auto& r : results) {
      EXPECT_EQ(r.exit_code, 3) << bad << "\n" << Describe(results);
      EXPECT_THAT(r.output, HasSubstr(message)) << bad << "\n" << Describe(results);
      EXPECT_THAT(r.output, Not(HasSubstr("A STEP RAN"))) << bad << "\n" << Describe(results);
    }
  }
}

}  // namespace
}  // namespace evenstep

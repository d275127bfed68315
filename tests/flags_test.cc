// ParseEvenstepFlags for programs with their own argument parsing, and the
// flag -> config conversion.
#include "evenstep/flags.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "evenstep/balanced_step.h"
#include "evenstep/checkpointer.h"

namespace evenstep {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

class FlagsTest : public ::testing::Test {
 protected:
  void TearDown() override {
    absl::SetFlag(&FLAGS_evenstep_balance, "dynamic");
    absl::SetFlag(&FLAGS_evenstep_global_batch, 64);
    absl::SetFlag(&FLAGS_evenstep_drop_last, false);
    absl::SetFlag(&FLAGS_evenstep_cost_quadratic, 0.0);
    absl::SetFlag(&FLAGS_evenstep_ckpt_keep, 3);
    absl::SetFlag(&FLAGS_evenstep_ckpt_in_flight, 1);
  }
  // Runs ParseEvenstepFlags over `args` (argv[0] added) and returns what is left.
  absl::Status Parse(std::vector<std::string> args, std::vector<std::string>* rest) {
    storage_ = std::move(args);
    storage_.insert(storage_.begin(), "trainer");
    std::vector<char*> argv;
    for (auto& a : storage_) argv.push_back(a.data());
    argv.push_back(nullptr);
    int argc = static_cast<int>(storage_.size());
    absl::Status s = ParseEvenstepFlags(&argc, argv.data());
    rest->assign(argv.begin() + 1, argv.begin() + argc);
    return s;
  }
  std::vector<std::string> storage_;
};

TEST_F(FlagsTest, TakesEvenstepFlagsAndLeavesTheRest) {
  std::vector<std::string> rest;
  ASSERT_TRUE(Parse({"--lr", "0.1", "--evenstep_balance=work", "data.txt",
                     "--evenstep_global_batch", "128", "--evenstep_drop_last", "-v"},
                    &rest)
                  .ok());
  EXPECT_THAT(rest, ElementsAre("--lr", "0.1", "data.txt", "-v"));
  EXPECT_EQ(absl::GetFlag(FLAGS_evenstep_balance), "work");
  EXPECT_EQ(absl::GetFlag(FLAGS_evenstep_global_batch), 128);
  EXPECT_TRUE(absl::GetFlag(FLAGS_evenstep_drop_last));
  ASSERT_TRUE(Parse({"--noevenstep_drop_last", "--", "--evenstep_balance=static"}, &rest).ok());
  EXPECT_FALSE(absl::GetFlag(FLAGS_evenstep_drop_last));
  EXPECT_THAT(rest, ElementsAre("--", "--evenstep_balance=static"));
  EXPECT_EQ(absl::GetFlag(FLAGS_evenstep_balance), "work");
}

TEST_F(FlagsTest, BadValuesNameTheFlag) {
  std::vector<std::string> rest;
  EXPECT_THAT(Parse({"--evenstep_global_batch=many"}, &rest).message(),
              HasSubstr("--evenstep_global_batch=many"));
  EXPECT_THAT(Parse({"--evenstep_balanse=work"}, &rest).message(),
              HasSubstr("--evenstep_balanse: no such evenstep flag"));
  EXPECT_THAT(Parse({"--evenstep_seed"}, &rest).message(), HasSubstr("--evenstep_seed: missing"));
  absl::SetFlag(&FLAGS_evenstep_balance, "fast");
  EXPECT_THAT(BalanceConfig::FromFlags().status().message(),
              HasSubstr("--evenstep_balance=fast: expected static, work or dynamic"));
}

TEST_F(FlagsTest, CheckpointFlagsOutOfRangeNameTheFlag) {
  absl::SetFlag(&FLAGS_evenstep_ckpt_keep, 0);
  EXPECT_THAT(CheckpointOptionsFromFlags().status().message(),
              HasSubstr("--evenstep_ckpt_keep=0: must be >= 1"));
  absl::SetFlag(&FLAGS_evenstep_ckpt_keep, 3);
  absl::SetFlag(&FLAGS_evenstep_ckpt_in_flight, -2);
  EXPECT_THAT(CheckpointOptionsFromFlags().status().message(),
              HasSubstr("--evenstep_ckpt_in_flight=-2: must be >= 1"));
}

TEST_F(FlagsTest, ProgramDefaultsAreOverriddenByTheCommandLine) {
  SetFlagDefaults("global_batch=32 evenstep_balance=work  drop_last=true");
  EXPECT_EQ(absl::GetFlag(FLAGS_evenstep_global_batch), 32);
  EXPECT_EQ(absl::GetFlag(FLAGS_evenstep_balance), "work");
  EXPECT_TRUE(absl::GetFlag(FLAGS_evenstep_drop_last));
  std::vector<std::string> rest;
  ASSERT_TRUE(Parse({"--evenstep_global_batch=48"}, &rest).ok());
  EXPECT_EQ(absl::GetFlag(FLAGS_evenstep_global_batch), 48);
  EXPECT_EQ(absl::GetFlag(FLAGS_evenstep_balance), "work");
}

TEST_F(FlagsTest, BadProgramDefaultsStopTheProgramNamingTheFlag) {
  EXPECT_EXIT(SetFlagDefaults("global_batch=many"), ::testing::ExitedWithCode(2),
              "--evenstep_global_batch=many");
  EXPECT_EXIT(SetFlagDefaults("globl_batch=8"), ::testing::ExitedWithCode(2),
              "--evenstep_globl_batch: no such evenstep flag");
  EXPECT_EXIT(SetFlagDefaults("drop_last"), ::testing::ExitedWithCode(2),
              "--evenstep_drop_last: wants NAME=VALUE");
}

TEST_F(FlagsTest, ConfigFromFlags) {
  absl::SetFlag(&FLAGS_evenstep_balance, "static");
  absl::SetFlag(&FLAGS_evenstep_cost_quadratic, 0.5);
  auto config = BalanceConfig::FromFlags();
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->planner.mode, BalanceMode::kStatic);
  ASSERT_TRUE(config->cost);
  EXPECT_EQ(config->cost(10), 60);
  EXPECT_EQ(config->sampler.global_batch, 64);
}

}  // namespace
}  // namespace evenstep

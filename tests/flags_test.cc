// ParseEvenstepFlags for programs with their own argument parsing, and the
// flag -> config conversion.
#include "evenstep/flags.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <map>
#include <string>
#include <vector>

#include "absl/flags/commandlineflag.h"
#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/reflection.h"
#include "absl/strings/match.h"
#include "evenstep/balanced_step.h"
#include "evenstep/train_checkpointer.h"
#include "tests/testing/flag_args.h"

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
    absl::SetFlag(&FLAGS_evenstep_min_micro_batches, 1);
    absl::SetFlag(&FLAGS_evenstep_max_micro_batches, 0);
  }
  // Runs ParseEvenstepFlags over `args` (argv[0] added) and returns what is left.
  absl::Status Parse(std::vector<std::string> args, std::vector<std::string>* rest) {
    return testing::ParseEvenstepArgs(std::move(args), rest);
  }
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
  EXPECT_THAT(BalanceConfigFromFlags().status().message(),
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
  auto config = BalanceConfigFromFlags();
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->planner.mode, BalanceMode::kStatic);
  ASSERT_TRUE(config->cost);
  EXPECT_EQ(config->cost(10), 60);
  EXPECT_EQ(config->sampler.global_batch, 64);
}

// Every value of every --evenstep_* flag that is not valid, and what the
// program says: a flag missing from this table fails the test, so a new flag
// cannot ship without its invalid values tried.
struct BadValues {
  const char* flag;
  std::vector<const char*> values;  // each: a parse error or a validation error naming the flag
  const char* why_none = "";        // for flags without an invalid value: why
};

const std::vector<BadValues>& FlagTable() {
  static const std::vector<BadValues> table = {
      {"evenstep_backend", {"foo", ""}},
      {"evenstep_timeout", {"0s", "-1s", "inf", "ten", "1ns", "999ms"}},
      {"evenstep_rendezvous_timeout", {"0s", "-5m", "inf", "10ms"}},
      {"evenstep_on_rank_loss", {"maybe", "", "Continue"}},
      {"evenstep_lost_after", {"0s", "-1s", "inf", "500ms"}},
      {"evenstep_comm_hook", {"foo", ""}},
      {"evenstep_sync_topology", {"tree", "", "Flat"}},
      {"evenstep_oom", {"skip", "", "Split"}},
      {"evenstep_memory_limit_mb", {"-2", "-0.5", "nan", "lots"}},
      {"evenstep_memory_headroom", {"0", "1.5", "-0.1", "nan"}},
      {"evenstep_preempt_signals", {"KILL", "TERM,FOO", "15"}},
      {"evenstep_bucket_cap_mb", {"0", "-1", "nan", "inf", "1e30"}},
      {"evenstep_first_bucket_cap_mb", {"0", "-1", "nan", "1e30"}},
      {"evenstep_balance", {"foo", ""}},
      {"evenstep_global_batch", {"0", "-5", "many"}},
      {"evenstep_batch_unit", {"bytes"}},
      {"evenstep_micro_batch_samples", {"-1"}},
      {"evenstep_micro_batch_tokens", {"-1"}},
      {"evenstep_min_micro_batches", {"-1"}},
      {"evenstep_max_micro_batches", {"-1"}},
      {"evenstep_plan_interval", {"0", "-2"}},
      {"evenstep_plan_damping", {"0", "1.5", "-0.1", "nan"}},
      {"evenstep_warmup_steps", {"-1"}},
      {"evenstep_seed", {"-1", "x"}},
      {"evenstep_sort_window", {"-1"}},
      {"evenstep_drop_last", {"maybe"}},
      {"evenstep_shuffle", {"maybe"}},
      {"evenstep_streams", {"-1", "x"}},
      {"evenstep_reseed", {"sometimes"}},
      {"evenstep_split_record", {"maybe"}},
      {"evenstep_replay",
       {},
       "any directory is a valid value; one without a split record fails Session::Create "
       "naming the file (split_replay_test: AReplayThatCannotBeExactIsRefusedNamingWhy)"},
      {"evenstep_run_dir", {""}},
      {"evenstep_prefetch_next_step", {"maybe"}},
      {"evenstep_pin_memory", {"sometimes"}},
      {"evenstep_health_warn", {"-0.1", "1", "nan", "x"}},
      {"evenstep_preflight", {"sometimes", ""}},
      {"evenstep_preflight_quick", {"maybe"}},
      {"evenstep_preflight_data_dir",
       {},
       "any path is a valid value; an unusable one is a note in the preflight's report "
       "(preflight_test: BadInputIsRefusedByName)"},
      {"evenstep_preflight_inject",
       {"one:x", "matmul_fp32_gflops:0", "matmul_fp32_gflops:a=1", ":0=1", "m:0=x"}},
      {"evenstep_device", {"tpu:9", "cuda:x"}},
      {"evenstep_normalize", {"bytes"}},
      {"evenstep_cost_quadratic", {"-1", "nan", "inf", "1e308"}},
      {"evenstep_clip_grad_norm", {"-1", "nan", "inf"}},
      {"evenstep_loss_reduction", {"avg", ""}},
      {"evenstep_objective", {"average", ""}},
      {"evenstep_data_workers", {"-2", "two", "100000"}},
      {"evenstep_prefetch", {"0", "-2", "100000"}},
      {"evenstep_ckpt_dir",
       {},
       "any path is a valid value; an unusable one fails TrainCheckpointer::Create naming it "
       "(resume_test: BadFlagsAndPathsStopWithAMessage)"},
      {"evenstep_ckpt_keep", {"0", "-1"}},
      {"evenstep_ckpt_in_flight", {"0"}},
      {"evenstep_ckpt_when_busy", {"later"}},
      {"evenstep_ckpt_slice_mb", {"0", "-1", "nan", "1e30", "1e-300", "0.0009"}},
      {"evenstep_ckpt_every", {"-1"}},
      {"evenstep_resume", {"maybe", ""}},
      {"evenstep_ckpt_on_error", {"ignore"}},
      {"evenstep_ckpt_max_failures", {"-1"}},
      {"evenstep_timeline", {"maybe"}},
      {"evenstep_log_every", {"0", "-3"}},
      {"evenstep_eval_micro_batch_tokens", {"-1", "1e3"}},
  };
  return table;
}

// Values each valid alone but not together: the error names both flags.
// SetFlagDefaults after absl::ParseCommandLine used to override a value
// given on the command line without a word.
TEST_F(FlagsTest, ProgramDefaultsAfterTheCommandLineWasParsedAreRefusedByName) {
  auto parse_then_default = [] {
    char arg0[] = "prog";
    char arg1[] = "--evenstep_ckpt_every=13";
    char* argv[] = {arg0, arg1};
    absl::ParseCommandLine(2, argv);
    SetFlagDefaults("ckpt_every=50");
  };
  EXPECT_EXIT(
      parse_then_default(), ::testing::ExitedWithCode(2),
      "\"ckpt_every=50\" would override --evenstep_ckpt_every=13 set before it \\(on the "
      "command line, or by the program\\): call SetFlagDefaults before absl::ParseCommandLine");
}

// Stream mode used to ignore --evenstep_global_batch without a word.
TEST_F(FlagsTest, AGlobalBatchBesideStreamModeIsRefusedNamingBothFlags) {
  absl::SetFlag(&FLAGS_evenstep_streams, 8);
  EXPECT_TRUE(BalanceConfigFromFlags().ok());  // the default global batch: stream mode's own
  absl::SetFlag(&FLAGS_evenstep_global_batch, 8);
  EXPECT_TRUE(BalanceConfigFromFlags().ok());  // the same number
  absl::SetFlag(&FLAGS_evenstep_global_batch, 32);
  const absl::Status s = BalanceConfigFromFlags().status();
  absl::SetFlag(&FLAGS_evenstep_streams, 0);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(s.message(), HasSubstr("--evenstep_global_batch=32 with --evenstep_streams=8: in "
                                     "stream mode a step is one position of every stream"));
}

TEST_F(FlagsTest, InvalidCombinationsAreErrorsNamingBothFlags) {
  absl::SetFlag(&FLAGS_evenstep_min_micro_batches, 5);
  absl::SetFlag(&FLAGS_evenstep_max_micro_batches, 2);
  const absl::Status s = ValidateEvenstepFlags();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(s.message(), HasSubstr("--evenstep_min_micro_batches=5 is more than "
                                     "--evenstep_max_micro_batches=2"));
  absl::SetFlag(&FLAGS_evenstep_max_micro_batches, 0);  // no bound: any minimum
  EXPECT_TRUE(ValidateEvenstepFlags().ok());
  absl::SetFlag(&FLAGS_evenstep_max_micro_batches, 5);
  EXPECT_TRUE(ValidateEvenstepFlags().ok());
}

TEST_F(FlagsTest, EveryInvalidValueOfEveryFlagIsAnErrorNamingTheFlag) {
  ASSERT_TRUE(ValidateEvenstepFlags().ok()) << "the defaults must be valid";
  std::map<std::string, const BadValues*> by_name;
  for (const BadValues& b : FlagTable()) by_name[b.flag] = &b;
  int tried = 0;
  for (const auto& [name, flag] : absl::GetAllFlags()) {
    if (!absl::StartsWith(name, "evenstep_")) continue;
    auto it = by_name.find(std::string(name));
    ASSERT_NE(it, by_name.end()) << "--" << name << " is not in the table of invalid values";
    const BadValues& bad = *it->second;
    EXPECT_TRUE(!bad.values.empty() || *bad.why_none) << name;
    const std::string original = flag->CurrentValue();
    for (const char* value : bad.values) {
      ++tried;
      const std::string arg = absl::StrCat("--", name, "=", value);
      std::string error;
      if (!flag->ParseFrom(value, &error)) {
        // Not even of the flag's type: the parser names the flag.
        std::vector<std::string> rest;
        const absl::Status s = Parse({arg}, &rest);
        EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << arg;
        EXPECT_THAT(s.message(), HasSubstr("--" + std::string(name))) << arg;
        continue;
      }
      const absl::Status s = ValidateEvenstepFlags();
      EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << arg << ": " << s;
      EXPECT_THAT(s.message(), HasSubstr("--" + std::string(name))) << arg;
      ASSERT_TRUE(flag->ParseFrom(original, &error)) << error;
    }
    ASSERT_TRUE(ValidateEvenstepFlags().ok()) << "after --" << name;
  }
  EXPECT_GT(tried, 60);
}

}  // namespace
}  // namespace evenstep

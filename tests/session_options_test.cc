// SessionOptions: the Session's configuration without flags.
//
// A default SessionOptions is what the flags' defaults give (a program that
// fills options in code starts where a flag user does); two Sessions one
// after the other on one DistContext, each with its own options, each run
// as its options say and leave the flags as they were; options filled in
// code are checked as the flags are, each error naming the field and its
// flag.
#include "evenstep/session_options.h"

#include <signal.h>
#include <torch/torch.h>

#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "evenstep/checkpoint_manifest.h"
#include "evenstep/env.h"
#include "evenstep/flags.h"
#include "evenstep/log.h"
#include "evenstep/session.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/on_ranks.h"

namespace evenstep {
namespace {

using ::evenstep::testing::RanksDir;
using ::evenstep::testing::RunOnRanks;
using ::testing::HasSubstr;

// Every setting a flag fills, as text: two options that print alike
// configure a Session alike.
std::string Describe(const SessionOptions& o) {
  const BalanceConfig& b = o.balance;
  const SamplerOptions& s = b.sampler;
  const CheckpointOptions& c = o.checkpoint;
  const PreflightOptions& p = o.preflight_options;
  std::string signals;
  for (int sig : o.preempt_signals) absl::StrAppend(&signals, sig, ",");
  return absl::StrCat(
      "run_dir=", o.run_dir, " backend=", static_cast<int>(o.dist.backend),
      " timeout=", absl::FormatDuration(o.dist.collective_timeout),
      " rendezvous=", absl::FormatDuration(o.dist.rendezvous_timeout),
      " reduction=", static_cast<int>(b.loss_reduction),
      " objective=", static_cast<int>(b.objective), " seed=", s.seed,
      " unit=", static_cast<int>(s.budget_unit), " global_batch=", s.global_batch,
      " mb_samples=", s.micro_batch_samples, " mb_tokens=", s.micro_batch_tokens,
      " min_mb=", s.min_micro_batches, " sort_window=", s.sort_window, " shuffle=", s.shuffle,
      " drop_last=", s.drop_last, " normalize=", static_cast<int>(s.normalization),
      " streams=", s.streams, " balance=", static_cast<int>(b.planner.mode),
      " max_mb=", b.planner.max_micro_batches, " damping=", b.planner.damping,
      " warmup=", b.cost_model.warmup_steps, " bucket=", b.grad_sync.bucket_cap_bytes,
      " first_bucket=", b.grad_sync.first_bucket_cap_bytes,
      " sync_timeout=", absl::FormatDuration(b.grad_sync.timeout),
      " topology=", static_cast<int>(b.sync_topology), " cost=", static_cast<bool>(b.cost),
      " plan_interval=", b.plan_interval, " clip=", b.clip_grad_norm,
      " oom=", static_cast<int>(b.oom), " memory_limit=", b.memory_limit_bytes,
      " headroom=", b.memory_headroom, " workers=", b.data_workers, " prefetch=", b.prefetch,
      " prefetch_next=", b.prefetch_next_step, " pin=", b.pin_memory,
      " health_warn=", b.health_warn, " reseed=", b.reseed, " ckpt_dir=", c.dir, " keep=", c.keep,
      " in_flight=", c.max_in_flight, " when_busy=", static_cast<int>(c.when_busy),
      " slice=", c.slice_bytes, " ckpt_every=", o.ckpt_every,
      " resume=", static_cast<int>(o.resume), " on_error=", static_cast<int>(o.ckpt_on_error),
      " max_failures=", o.ckpt_max_failures, " signals=", signals, " timeline=", o.timeline,
      " log_every=", o.log_every, " eval_tokens=", o.eval_micro_batch_tokens,
      " preflight=", static_cast<int>(o.preflight), " quick=", p.quick, " data_dir=", p.data_dir,
      " device=", p.device, " split_record=", o.split_record, " replay=", o.replay,
      " record_dir=", b.split_record, " replay_dir=", b.split_replay);
}

TEST(SessionOptionsTest, TheDefaultsAreTheFlagsDefaults) {
  absl::StatusOr<SessionOptions> from_flags = SessionOptions::FromFlags();
  ASSERT_TRUE(from_flags.ok()) << from_flags.status();
  EXPECT_EQ(Describe(SessionOptions()), Describe(*from_flags));
  EXPECT_TRUE(SessionOptions().Validate().ok()) << SessionOptions().Validate();
}

TEST(SessionOptionsTest, FromFlagsReadsEveryKindOfFlag) {
  absl::SetFlag(&FLAGS_evenstep_global_batch, 12);
  absl::SetFlag(&FLAGS_evenstep_resume, "off");
  absl::SetFlag(&FLAGS_evenstep_ckpt_on_error, "fail");
  absl::SetFlag(&FLAGS_evenstep_preempt_signals, "SIGUSR2,INT");
  absl::SetFlag(&FLAGS_evenstep_preflight, "warn");
  absl::SetFlag(&FLAGS_evenstep_ckpt_slice_mb, 2.0);
  absl::StatusOr<SessionOptions> o = SessionOptions::FromFlags();
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->balance.sampler.global_batch, 12);
  EXPECT_EQ(o->resume, ResumeMode::kOff);
  EXPECT_EQ(o->ckpt_on_error, OnSaveError::kFail);
  EXPECT_EQ(o->preempt_signals, (std::vector<int>{SIGUSR2, SIGINT}));
  EXPECT_EQ(o->preflight, PreflightMode::kWarn);
  EXPECT_EQ(o->checkpoint.slice_bytes, 2 << 20);
}

// Options filled in code are refused as the flags are, naming the field
// and its flag, before anything starts.
TEST(SessionOptionsTest, BadOptionsFromCodeAreRefusedNamingTheFieldAndItsFlag) {
  struct Case {
    std::function<void(SessionOptions&)> set;
    std::string error;
  };
  const std::vector<Case> cases = {
      {[](SessionOptions& o) { o.ckpt_every = -1; },
       "SessionOptions: --evenstep_ckpt_every=-1: must be >= 0"},
      {[](SessionOptions& o) { o.run_dir = ""; }, "SessionOptions: --evenstep_run_dir=: empty"},
      {[](SessionOptions& o) { o.log_every = 0; }, "--evenstep_log_every=0: must be >= 1"},
      {[](SessionOptions& o) { o.preempt_signals = {SIGKILL}; },
       "preempt_signals: signal 9 is not one a preemption is sent with"},
      {[](SessionOptions& o) { o.balance.sampler.global_batch = 0; },
       "SessionOptions.balance: --evenstep_global_batch=0: must be >= 1"},
      {[](SessionOptions& o) { o.balance.planner.damping = 0; },
       "--evenstep_plan_damping=0: must be in (0, 1]"},
      {[](SessionOptions& o) { o.balance.grad_sync.bucket_cap_bytes = 0; },
       "--evenstep_bucket_cap_mb=0"},
      {[](SessionOptions& o) { o.checkpoint.keep = 0; },
       "SessionOptions.checkpoint: --evenstep_ckpt_keep=0: must be >= 1"},
      {[](SessionOptions& o) { o.dist.collective_timeout = absl::Milliseconds(10); },
       "SessionOptions.dist: --evenstep_timeout=10ms: must be finite and at least 1s"},
  };
  RunOnRanks(1, [&](DistContext& dist) {
    for (const Case& c : cases) {
      SessionOptions options;
      options.run_dir = RanksDir() + "/bad";
      c.set(options);
      torch::nn::Linear model(3, 1);
      torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(0.1));
      auto es = Session::Create(dist, *model, optimizer, std::vector<int64_t>(8, 1), options);
      ASSERT_FALSE(es.ok()) << "accepted: " << c.error;
      EXPECT_EQ(es.status().code(), absl::StatusCode::kInvalidArgument) << es.status();
      EXPECT_THAT(std::string(es.status().message()), HasSubstr(c.error));
    }
  });
}

// The loss SUM of `samples` for a 3 -> 1 linear model.
torch::Tensor LossSum(torch::nn::Linear& model, const std::vector<int64_t>& samples) {
  const auto n = static_cast<int64_t>(samples.size());
  torch::Tensor s = torch::tensor(samples, torch::kFloat).view({n, 1});
  torch::Tensor x = torch::cat({torch::sin(s), torch::cos(s), torch::sin(0.5 * s)}, 1);
  return (model->forward(x).view({n}) - torch::cos(0.3 * s).view({n})).pow(2).sum();
}

struct RunResult {
  std::vector<int64_t> committed;  // checkpoints
  std::vector<double> batch_counts;
  bool has_timeline = false;
};

// `steps` steps of a Session made from `options` alone.
RunResult Train(DistContext& dist, const SessionOptions& options, int steps) {
  torch::manual_seed(3);
  torch::nn::Linear model(3, 1);
  torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(0.1));
  RunResult result;
  auto es = Session::Create(dist, *model, optimizer, std::vector<int64_t>(24, 1), options);
  EXPECT_TRUE(es.ok()) << es.status();
  if (!es.ok()) return result;
  for (int s = 0; s < steps; ++s) {
    auto report =
        (*es)->Step([&](const std::vector<int64_t>& samples) { return LossSum(model, samples); });
    EXPECT_TRUE(report.ok()) << report.status();
    if (report.ok()) result.batch_counts.push_back(report->global_count);
  }
  EXPECT_TRUE((*es)->Finish().ok());
  es->reset();
  auto listing = ListCheckpoints(*Env::Default(), options.run_dir + "/ckpt");
  EXPECT_TRUE(listing.ok()) << listing.status();
  if (listing.ok()) result.committed = listing->committed;
  auto names = Env::Default()->List(options.run_dir);
  for (const std::string& n : names.ok() ? *names : std::vector<std::string>{}) {
    result.has_timeline = result.has_timeline || n.rfind("trace-", 0) == 0;
  }
  return result;
}

TEST(SessionOptionsTest, TwoSessionsOneAfterTheOtherRunAsTheirOwnOptionsSay) {
  RunOnRanks(2, [](DistContext& dist) {
    SessionOptions first;
    first.run_dir = RanksDir() + "/first";
    first.balance.planner.mode = BalanceMode::kStatic;
    first.balance.sampler.global_batch = 6;
    first.ckpt_every = 2;
    first.checkpoint.keep = 10;
    SessionOptions second = first;
    second.run_dir = RanksDir() + "/second";
    second.balance.sampler.global_batch = 4;
    second.ckpt_every = 3;
    second.timeline = false;

    const RunResult a = Train(dist, first, 4);
    const RunResult b = Train(dist, second, 4);
    EXPECT_EQ(a.committed, (std::vector<int64_t>{2, 4}));
    EXPECT_EQ(b.committed, (std::vector<int64_t>{3, 4}));  // and the last step's
    EXPECT_EQ(a.batch_counts, (std::vector<double>(4, 6)));
    EXPECT_EQ(b.batch_counts, (std::vector<double>(4, 4)));
    EXPECT_TRUE(a.has_timeline);
    EXPECT_FALSE(b.has_timeline);
    // Options are not flags: the flags are as they were.
    EXPECT_EQ(absl::GetFlag(FLAGS_evenstep_global_batch), 64);
    EXPECT_EQ(absl::GetFlag(FLAGS_evenstep_ckpt_every), 0);
  });
}

// A rank whose own set-up fails in Session::Create (here: its run directory
// lies under a regular file) stops every rank at once with its reason: the
// others used to go on into Create's first collective and wait for it until
// the collective timeout (60 s here), then name only a rank that never
// arrived. Then the same ranks create a good Session and train: the failed
// Create left nothing behind.
TEST(SessionOptionsTest, ARankWhoseSetUpFailsStopsEveryRankNamingItsReason) {
  RunOnRanks(3, [](DistContext& dist) {
    const std::string blocker = RanksDir() + "/a-file";
    if (dist.rank() == 1) evenstep::testing::WriteRanksFile("a-file", "not a directory");
    SessionOptions options;
    options.balance.planner.mode = BalanceMode::kStatic;
    options.balance.sampler.global_batch = 6;
    options.run_dir = dist.rank() == 1 ? blocker + "/run" : RanksDir() + "/run";
    torch::nn::Linear model(3, 1);
    torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(0.1));
    auto es = Session::Create(dist, *model, optimizer, std::vector<int64_t>(24, 1), options);
    ASSERT_FALSE(es.ok());
    EXPECT_THAT(es.status().message(), HasSubstr("rank 1")) << es.status();
    EXPECT_THAT(es.status().message(), HasSubstr(blocker + "/run")) << es.status();
    if (dist.rank() != 1) {
      EXPECT_EQ(es.status().code(), absl::StatusCode::kFailedPrecondition) << es.status();
      EXPECT_THAT(es.status().message(),
                  HasSubstr(absl::StrCat("rank ", dist.rank(),
                                         ": Session::Create stopped on every rank because one "
                                         "failed: ")))
          << es.status();
    }
    options.run_dir = RanksDir() + "/good";
    const RunResult good = Train(dist, options, 2);
    EXPECT_EQ(good.batch_counts, (std::vector<double>(2, 6)));
  });
}

// Every line the library prints goes through the one sink: an application
// that replaces it gets the Session's lines (a fresh start, then a resume),
// without the prefix, which is the default sink's.
TEST(LogSinkTest, TheSessionsLinesReachAReplacedSink) {
  RunOnRanks(1, [](DistContext& dist) {
    std::vector<std::string> lines;
    SetLogSink([&](LogLevel, absl::string_view line) { lines.emplace_back(line); });
    SessionOptions options;
    options.run_dir = RanksDir() + "/logged";
    options.balance.sampler.global_batch = 6;
    options.timeline = false;
    for (int run = 0; run < 2; ++run) {
      torch::nn::Linear model(3, 1);
      torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(0.1));
      auto es = Session::Create(dist, *model, optimizer, std::vector<int64_t>(12, 1), options);
      ASSERT_TRUE(es.ok()) << es.status();
      if (run == 0) {
        ASSERT_TRUE(
            (*es)
                ->Step([&](const std::vector<int64_t>& samples) { return LossSum(model, samples); })
                .ok());
      }
      ASSERT_TRUE((*es)->Finish().ok());
    }
    SetLogSink(nullptr);
    EXPECT_THAT(lines, ::testing::Contains(::testing::StartsWith("no committed checkpoint in ")));
    EXPECT_THAT(lines, ::testing::Contains(::testing::HasSubstr("resuming from ")));
    for (const std::string& line : lines) {
      EXPECT_FALSE(absl::StartsWith(line, "[evenstep]")) << "the prefix is the sink's: " << line;
    }
  });
}

}  // namespace
}  // namespace evenstep

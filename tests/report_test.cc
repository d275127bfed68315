// The timeline and evenstep-report. The report's judgements (who straggles,
// in which phase, a periodic stall, nobody) are checked on scripted
// timelines: per-rank trace files written through Timeline from StepReports
// whose times are fixed here, so no test depends on how the machine
// schedules ranks. One run over real ranks checks the plumbing: every rank
// writes its trace, the merged trace is valid Chrome Trace JSON with one
// process per rank and the expected phases, and the pictures are written.

#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "evenstep/balanced_step.h"
#include "evenstep/timeline.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/balance_trainer.h"
#include "tests/testing/on_ranks.h"
#include "tests/testing/subprocess.h"
#include "tests/testing/temp_dir.h"

namespace evenstep {
namespace {

using ::evenstep::testing::BalanceScenario;
using ::evenstep::testing::ExpectAllStepsRan;
using ::evenstep::testing::RanksDir;
using ::evenstep::testing::RunOnRanks;
using ::evenstep::testing::TempDir;
using ::evenstep::testing::TrainBalanced;
using ::testing::HasSubstr;

std::string RunReport(const std::string& dir) {
  return evenstep::testing::RunAll({{{EVENSTEP_REPORT_TOOL, dir}, {}}},
                                   evenstep::testing::HangBound(2))[0]
      .output;
}

// Writes trace-RRRRR.json of 3 ranks for 12 synchronous steps with fixed
// times: every rank computes 4 micro-steps of 5 ms data + 20 ms compute;
// the gradient sync ends 2 ms after the last arrival, then 5 ms optimizer
// and 3 ms exchange, which every rank leaves together. `duty(rank, step)`
// is a "checkpoint" span of that many ms after the step on that rank: a
// blocking one delays the rank's next step; a background one
// (`background`) overlaps the next step and delays nothing.
// `health(rank, step)`, when given, is each rank's online health score;
// `memory(rank, step)` the step's peak memory in MB and largest micro-batch
// (padded tokens), 500 MB and 64 when not given.
struct MemoryFigure {
  double peak_mb = 500;
  int64_t largest_micro_batch = 64;
};
template <typename Duty>
void ScriptedRun(const std::string& dir, Duty duty, bool background = false,
                 std::function<double(int, int)> health = nullptr,
                 std::function<MemoryFigure(int, int)> memory = nullptr,
                 const std::string& duty_span = "checkpoint") {
  constexpr int kRanks = 3, kSteps = 12;
  std::vector<std::unique_ptr<Timeline>> timelines;
  for (int r = 0; r < kRanks; ++r) {
    auto t = Timeline::Open(dir, r);
    EXPECT_TRUE(t.ok()) << t.status();
    timelines.push_back(std::move(*t));
  }
  const absl::Time t0 = absl::FromUnixSeconds(1'800'000'000);
  std::vector<absl::Time> begin(kRanks, t0);
  for (int step = 1; step <= kSteps; ++step) {
    std::vector<StepReport> reports(kRanks);
    absl::Time last_arrival = absl::InfinitePast();
    for (int r = 0; r < kRanks; ++r) {
      StepReport& rep = reports[r];
      rep.step = step;
      rep.begin = begin[r];
      absl::Time t = begin[r];
      for (int m = 0; m < 4; ++m) {
        MicroTiming micro;
        micro.begin = t;
        micro.data_end = t + absl::Milliseconds(5);
        micro.end = micro.data_end + absl::Milliseconds(20);
        t = micro.end;
        rep.micro.push_back(micro);
      }
      rep.arrived = t;
      last_arrival = std::max(last_arrival, t);
    }
    const absl::Time synced = last_arrival + absl::Milliseconds(2);
    const absl::Time end = synced + absl::Milliseconds(8);
    for (int r = 0; r < kRanks; ++r) {
      StepReport& rep = reports[r];
      rep.micro.back().end = synced;  // the last backward returns after the sync
      rep.synced = synced;
      rep.optimizer_begin = synced;
      rep.optimizer = absl::Milliseconds(5);
      rep.end = end;
      if (health) {
        for (int h = 0; h < kRanks; ++h) rep.rank_health.push_back(health(h, step));
      }
      const MemoryFigure m = memory ? memory(r, step) : MemoryFigure{};
      rep.memory.peak_bytes = static_cast<int64_t>(m.peak_mb * (1 << 20));
      rep.largest_micro_batch = m.largest_micro_batch;
      timelines[r]->AddStep(rep);
      begin[r] = end;
      if (const int ms = duty(r, step); ms > 0) {
        timelines[r]->Span(duty_span, end, end + absl::Milliseconds(ms), step);
        if (!background) begin[r] = end + absl::Milliseconds(ms);
      }
    }
  }
  for (auto& t : timelines) EXPECT_TRUE(t->Close().ok());
}

// Three real ranks write their traces into RanksDir(): rank 0 blocks 20 ms
// after every step (a synchronous save on rank 0).
void TraceRun() {
  RunOnRanks(3, [](DistContext& ctx) {
    BalanceScenario s;
    s.flags = {"--evenstep_balance=static", "--evenstep_global_batch=24",
               "--evenstep_micro_batch_samples=4"};
    s.steps = 6;
    s.sleep_ms_per_micro = 5;
    s.duty = BalanceScenario::Duty::kRank0;
    s.duty_ms = 20;
    s.trace_dir = RanksDir();
    ExpectAllStepsRan(TrainBalanced(ctx, s), s);
  });
}

TEST(ReportTest, RealRanksWriteTracesThatMergeIntoOneChromeTraceWithPictures) {
  TraceRun();
  const std::string dir = RanksDir();
  const std::string out = RunReport(dir);
  EXPECT_THAT(out, HasSubstr("peak MB"));
  {
    std::ifstream report(dir + "/report.json");
    const nlohmann::json j = nlohmann::json::parse(report, nullptr, false);
    ASSERT_TRUE(j.is_object()) << out;
    for (const nlohmann::json& rank : j["ranks"]) {
      EXPECT_GT(rank["peak_memory_mb"].get<double>(), 10.0) << out;  // a libtorch process
      EXPECT_EQ(rank["memory_source"], "resident set") << out;
      EXPECT_GT(rank["largest_micro_batch"].get<int64_t>(), 0) << out;
    }
  }
  // Pictures (python3-matplotlib is installed by scripts/install_deps.sh).
  for (const char* file :
       {"phases.png", "arrival_skew.png", "memory.png", "report.html", "report.json"}) {
    EXPECT_TRUE(std::filesystem::exists(dir + "/" + file)) << file << "\n" << out;
  }
  // The merged trace: Chrome Trace JSON, one process per rank, the phases.
  std::ifstream in(dir + "/trace.json");
  const nlohmann::json trace = nlohmann::json::parse(in, nullptr, false);
  ASSERT_TRUE(trace.is_array());
  std::set<int> pids;
  std::set<std::string> names;
  for (const auto& e : trace) {
    ASSERT_TRUE(e.contains("ph") && e.contains("pid") && e.contains("name")) << e.dump();
    pids.insert(e["pid"].get<int>());
    names.insert(e["name"].get<std::string>());
    if (e["ph"] == "X") ASSERT_TRUE(e.contains("ts") && e.contains("dur")) << e.dump();
  }
  EXPECT_EQ(pids, (std::set<int>{0, 1, 2}));
  for (const char* phase :
       {"data", "compute", "sync_wait", "optimizer", "arrive", "checkpoint", "process_name"}) {
    EXPECT_TRUE(names.count(phase)) << phase;
  }
}

// An evaluation is its own phase, not io: rank 1 evaluates for 80 ms after
// every step and loses its time in "eval"; nobody's io has any.
TEST(ReportTest, AnEvaluationIsItsOwnPhaseNotIo) {
  const TempDir temp("evenstep_report");
  const std::string& dir = temp.path();
  ScriptedRun(
      dir, [](int rank, int) { return rank == 1 ? 80 : 0; }, false, nullptr, nullptr, "eval");
  const std::string out = RunReport(dir);
  EXPECT_THAT(out, HasSubstr("straggler: rank 1 arrives last")) << out;
  EXPECT_THAT(out, HasSubstr("loses the time in eval")) << out;
  std::ifstream in(dir + "/report.json");
  const nlohmann::json j = nlohmann::json::parse(in);
  for (const nlohmann::json& rank : j["ranks"]) {
    EXPECT_EQ(rank["io_ms"].get<double>(), 0.0) << j.dump();
    EXPECT_EQ(rank["eval_ms"].get<double>() > 0, rank["rank"] == 1) << j.dump();
  }
}

TEST(ReportTest, NamesRank0WithTheUsualDuties) {
  // Rank 0 blocks 80 ms for a checkpoint after every step (100 ms of work).
  const TempDir temp("evenstep_report");
  const std::string& dir = temp.path();
  ScriptedRun(dir, [](int rank, int) { return rank == 0 ? 80 : 0; });
  const std::string out = RunReport(dir);
  EXPECT_THAT(out, HasSubstr("straggler: rank 0 arrives last")) << out;
  EXPECT_THAT(out, HasSubstr("loses the time in io")) << out;
  EXPECT_THAT(out, ::testing::Not(HasSubstr("degrading"))) << out;
}

TEST(ReportTest, ARunDirectoryWithASpaceOrQuoteGetsItsPicturesAndAFailedPlotIsAnError) {
  // The plot used to be started through the shell unquoted: a space in the
  // path split it, no picture was written, and the tool still exited 0.
  const TempDir temp("evenstep_report");
  const std::string dir = temp.path() + "/my run's dir";
  std::filesystem::create_directories(dir);
  ScriptedRun(dir, [](int rank, int) { return rank == 0 ? 80 : 0; });
  auto results = evenstep::testing::RunAll({{{EVENSTEP_REPORT_TOOL, dir}, {}}},
                                           evenstep::testing::HangBound(2));
  EXPECT_EQ(results[0].exit_code, 0) << results[0].output;
  EXPECT_TRUE(std::filesystem::exists(dir + "/phases.png")) << results[0].output;
  EXPECT_TRUE(std::filesystem::exists(dir + "/report.html")) << results[0].output;
  // A plot that fails (its output file is a directory): exit 1, named.
  std::filesystem::remove(dir + "/phases.png");
  std::filesystem::create_directories(dir + "/phases.png");
  results = evenstep::testing::RunAll({{{EVENSTEP_REPORT_TOOL, dir}, {}}},
                                      evenstep::testing::HangBound(2));
  EXPECT_EQ(results[0].exit_code, 1) << results[0].output;
  EXPECT_THAT(results[0].output, HasSubstr("evenstep-report: the plot of " + dir + " failed"));
}

TEST(ReportTest, NamesARankThatSlowedAgainstItsOwnBest) {
  // Rank 1's health falls from step 6 to 0.6 at step 12; rank 2 dips to
  // 0.85 (above the 0.8 line) and recovers.
  const TempDir temp("evenstep_report");
  const std::string& dir = temp.path();
  ScriptedRun(
      dir, [](int, int) { return 0; }, false,
      [](int rank, int step) {
        if (rank == 1) return step < 6 ? 1.0 : 1.0 - 0.4 * (step - 5) / 7.0;
        if (rank == 2) return step == 4 ? 0.85 : 1.0;
        return 1.0;
      });
  const std::string out = RunReport(dir);
  EXPECT_THAT(out, HasSubstr("degrading: rank 1 slowed to 0.60x its own best speed (step 12)"))
      << out;
  EXPECT_THAT(out, ::testing::Not(HasSubstr("degrading: rank 2"))) << out;
  EXPECT_THAT(out, ::testing::Not(HasSubstr("degrading: rank 0"))) << out;
  std::ifstream in(dir + "/report.json");
  const nlohmann::json j = nlohmann::json::parse(in);
  ASSERT_EQ(j["health"].size(), 1u) << j.dump();
  EXPECT_EQ(j["health"][0]["rank"], 1);
}

// Memory is judged apart from compute: rank 1 peaks at 1.4x the others'
// memory at the same work and is named for memory, never as a straggler
// (its times equal the others').
TEST(ReportTest, NamesAMemoryImbalanceApartFromCompute) {
  const TempDir temp("evenstep_report");
  const std::string& dir = temp.path();
  ScriptedRun(
      dir, [](int, int) { return 0; }, false, nullptr,
      [](int rank, int step) {
        if (rank == 1) return MemoryFigure{step == 3 ? 700.0 : 690.0, 64};
        return MemoryFigure{500, 64};
      });
  const std::string out = RunReport(dir);
  EXPECT_THAT(out, HasSubstr("memory: rank 1 peaks at 1.40x the median rank's memory (700 MB "
                             "against 500 MB, resident set), at the same work"))
      << out;
  EXPECT_THAT(out, HasSubstr("no straggler")) << out;
  std::ifstream in(dir + "/report.json");
  const nlohmann::json j = nlohmann::json::parse(in);
  ASSERT_EQ(j["memory"].size(), 1u) << j.dump();
  EXPECT_EQ(j["memory"][0]["rank"], 1);
  EXPECT_TRUE(j["straggler"].is_null()) << j.dump();
  std::ifstream html(dir + "/report.html");
  const std::string page((std::istreambuf_iterator<char>(html)), std::istreambuf_iterator<char>());
  EXPECT_THAT(page, HasSubstr("rank 1 peaks at 1.40x the median rank&#x27;s memory")) << page;
  EXPECT_THAT(page, HasSubstr("memory.png"));
}

// A rank whose larger peak its larger micro-batches explain (1.5x the
// median's, peaking at 1.4x) is not named; even memory is said so.
TEST(ReportTest, NamesNoMemoryImbalanceWhereTheWorkExplainsItOrMemoryIsEven) {
  for (const bool larger_work : {true, false}) {
    const TempDir temp("evenstep_report");
    const std::string& dir = temp.path();
    ScriptedRun(
        dir, [](int, int) { return 0; }, false, nullptr,
        [larger_work](int rank, int) {
          if (larger_work) return rank == 2 ? MemoryFigure{700, 96} : MemoryFigure{500, 64};
          return MemoryFigure{500.0 + 20 * rank, 64};
        });
    const std::string out = RunReport(dir);
    EXPECT_THAT(out, HasSubstr(absl::StrCat("memory: even (the highest rank peaks at ",
                                            larger_work ? "1.40" : "1.04", "x the median rank's")))
        << out;
    std::ifstream in(dir + "/report.json");
    EXPECT_TRUE(nlohmann::json::parse(in)["memory"].empty());
  }
}

// A real run with a planted memory asymmetry (rank 1 holds a touched 768 MiB
// buffer the others do not): the report names rank 1's memory from the
// ranks' own measurements (plumbing: the resident set per step reaches the
// verdict).
TEST(ReportTest, NamesARealRankHoldingAnExtraBuffer) {
  RunOnRanks(3, [](DistContext& ctx) {
    BalanceScenario s;
    s.flags = {"--evenstep_balance=static", "--evenstep_global_batch=24",
               "--evenstep_micro_batch_samples=4"};
    s.steps = 4;
    s.trace_dir = RanksDir();
    s.extra_buffer_rank = 1;
    s.extra_buffer_mb = 768;
    ExpectAllStepsRan(TrainBalanced(ctx, s), s);
  });
  const std::string dir = RanksDir();
  const std::string out = RunReport(dir);
  EXPECT_THAT(
      out, ::testing::ContainsRegex("memory: rank 1 peaks at [0-9.]+x the median rank's "
                                    "memory \\([0-9]+ MB against [0-9]+ MB, resident "
                                    "set\\), (at the same work|with [0-9.]+x the median's largest "
                                    "micro-batch)"))
      << out;
  std::ifstream in(dir + "/report.json");
  const nlohmann::json j = nlohmann::json::parse(in);
  ASSERT_EQ(j["memory"].size(), 1u) << out;
  EXPECT_EQ(j["memory"][0]["rank"], 1) << out;
  EXPECT_GT(j["memory"][0]["ratio_to_median"].get<double>(), 1.2) << out;
}

TEST(ReportTest, NamesRank2WhenItCarriesTheDuty) {
  // The judgement follows the data, not rank 0's usual role.
  const TempDir temp("evenstep_report");
  const std::string& dir = temp.path();
  ScriptedRun(dir, [](int rank, int) { return rank == 2 ? 80 : 0; });
  const std::string out = RunReport(dir);
  EXPECT_THAT(out, HasSubstr("straggler: rank 2 arrives last")) << out;
}

TEST(ReportTest, FindsAPeriodicStall) {
  // Rank 0 blocks after every third step: late in steps 4, 7, 10 (the step
  // after each duty), not in most steps: a periodic stall, not a straggler.
  const TempDir temp("evenstep_report");
  const std::string& dir = temp.path();
  ScriptedRun(dir, [](int rank, int step) { return rank == 0 && step % 3 == 0 ? 80 : 0; });
  const std::string out = RunReport(dir);
  EXPECT_THAT(out, HasSubstr("periodic stall: rank 0 is late every 3 steps")) << out;
  EXPECT_THAT(out, HasSubstr("no straggler")) << out;
}

TEST(ReportTest, NamesNobodyWithEvenstepBackgroundCheckpoints) {
  // Every rank writes its shard in the background after every step: the
  // spans overlap the next step and nobody arrives late.
  const TempDir temp("evenstep_report");
  const std::string& dir = temp.path();
  ScriptedRun(
      dir, [](int, int) { return 60; }, /*background=*/true);
  const std::string out = RunReport(dir);
  EXPECT_THAT(out, HasSubstr("no straggler")) << out;
  EXPECT_THAT(out, ::testing::Not(HasSubstr("periodic stall"))) << out;
}

}  // namespace
}  // namespace evenstep

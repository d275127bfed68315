// The timeline and evenstep-report over real ranks: rank 0 given the usual
// extra duty (a synchronous checkpoint/log/eval after every step) is named as
// the straggler with the phase it loses the time in; with evenstep's
// sharded background checkpoints nobody is named. The merged trace is valid
// Chrome Trace JSON with one process per rank and the expected phases.

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/subprocess.h"

namespace evenstep {
namespace {

using ::evenstep::testing::Describe;
using ::evenstep::testing::ProcessResult;
using ::testing::HasSubstr;

std::string RunReport(const std::string& dir) {
  return evenstep::testing::RunAll({{{EVENSTEP_REPORT_TOOL, dir}, {}}}, absl::Seconds(120))[0]
      .output;
}

std::string TraceRun(const std::string& duty, int every = 1) {
  char tmpl[] = "/tmp/evenstep_report_XXXXXX";
  const std::string dir = mkdtemp(tmpl);
  auto results = evenstep::testing::RunRanks(
      3, {EVENSTEP_BALANCE_HELPER, "--evenstep_timeout=60s", "--evenstep_balance=static",
          "--evenstep_global_batch=24", "--evenstep_micro_batch_samples=4", "--steps=12",
          "--sleep_ms_per_micro=25", "--duty=" + duty, "--duty_ms=80",
          "--duty_every=" + std::to_string(every), "--trace_dir=" + dir,
          "--evenstep_ckpt_dir=" + dir + "/ckpt"});
  for (const ProcessResult& r : results) EXPECT_EQ(r.exit_code, 0) << Describe(results);
  return dir;
}

TEST(ReportTest, NamesRank0WithTheUsualDuties) {
  const std::string dir = TraceRun("rank0");
  const std::string out = RunReport(dir);
  EXPECT_THAT(out, HasSubstr("straggler: rank 0 arrives last"));
  EXPECT_THAT(out, HasSubstr("loses the time in io"));
  EXPECT_THAT(out, HasSubstr("peak MB"));
  {
    std::ifstream report(dir + "/report.json");
    const nlohmann::json j = nlohmann::json::parse(report, nullptr, false);
    ASSERT_TRUE(j.is_object());
    EXPECT_GT(j["ranks"][0]["peak_rss_mb"].get<double>(), 10.0);  // a libtorch process
  }
  // Pictures (python3-matplotlib is installed by scripts/install_deps.sh).
  for (const char* file : {"phases.png", "arrival_skew.png", "report.html", "report.json"}) {
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
  std::filesystem::remove_all(dir);
}

TEST(ReportTest, FindsAPeriodicStall) {
  // Rank 0 blocks after every third step: late in steps 4, 7, 10 (the step
  // after each duty), not in most steps: a periodic stall, not a straggler.
  const std::string dir = TraceRun("rank0", 3);
  const std::string out = RunReport(dir);
  EXPECT_THAT(out, HasSubstr("periodic stall: rank 0 is late every 3 steps")) << out;
  EXPECT_THAT(out, HasSubstr("no straggler")) << out;
  std::filesystem::remove_all(dir);
}

TEST(ReportTest, NamesNobodyWithEvenstepBackgroundCheckpoints) {
  const std::string dir = TraceRun("evenstep");
  const std::string out = RunReport(dir);
  EXPECT_THAT(out, HasSubstr("no straggler"));
  EXPECT_TRUE(std::filesystem::exists(dir + "/ckpt/latest"));
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace evenstep

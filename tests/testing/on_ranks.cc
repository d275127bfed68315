#include "tests/testing/on_ranks.h"

#include <unistd.h>

#include <climits>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <memory>
#include <numeric>
#include <sstream>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "evenstep/internal/error_text.h"
#include "evenstep/internal/store_server.h"
#include "gtest/gtest.h"
#include "tests/testing/temp_dir.h"

namespace evenstep::testing {

namespace {
// Set in a rank's environment (its rank is the launcher's RANK).
constexpr char kRankVar[] = "EVENSTEP_TEST_AS_RANK";
constexpr char kDirVar[] = "EVENSTEP_TEST_RANKS_DIR";

// The running test's full name, for the ranks' gtest filter.
std::string CurrentTest() {
  const ::testing::TestInfo* info = ::testing::UnitTest::GetInstance()->current_test_info();
  return absl::StrCat(info->test_suite_name(), ".", info->name());
}

// The running test's ranks: whether it started them, and the directory
// they share (both reset as each test starts).
class TestRanks : public ::testing::EmptyTestEventListener {
 public:
  static TestRanks& Get() {
    static TestRanks* const listener = [] {
      auto* l = new TestRanks;
      ::testing::UnitTest::GetInstance()->listeners().Append(l);  // gtest owns it
      return l;
    }();
    return *listener;
  }
  bool started = false;
  std::unique_ptr<TempDir> dir;
  void OnTestStart(const ::testing::TestInfo&) override { started = false; }
  void OnTestEnd(const ::testing::TestInfo&) override { dir.reset(); }
};

std::string SelfPath() {
  char path[PATH_MAX];
  const ssize_t n = readlink("/proc/self/exe", path, sizeof(path) - 1);
  return n > 0 ? std::string(path, n) : std::string("/proc/self/exe");
}
}  // namespace

int RankOfThisProcess() {
  const char* marked = std::getenv(kRankVar);
  const char* v = std::getenv("RANK");
  int rank = -1;
  return marked != nullptr && v != nullptr && absl::SimpleAtoi(v, &rank) ? rank : -1;
}

void RunHereIfRank(const RankBody& body, const OnRanksOptions& options) {
  if (RankOfThisProcess() < 0) return;
  DistOptions dist;
  dist.backend = options.backend;
  dist.collective_timeout = options.collective_timeout;
  dist.on_rank_loss = options.on_rank_loss;
  dist.lost_after = options.lost_after;
  dist.rendezvous_timeout = absl::Seconds(60);
  bool ok = true;
  {
    absl::StatusOr<std::unique_ptr<DistContext>> ctx = DistContext::Create(dist);
    if (!ctx.ok()) {
      ADD_FAILURE() << "rank " << RankOfThisProcess() << ": " << ctx.status();
    } else {
      try {
        body(**ctx);
      } catch (const std::exception& e) {
        ADD_FAILURE() << "rank " << RankOfThisProcess() << " threw: " << internal::ErrorText(e);
      }
    }
    ok = !::testing::Test::HasFailure();
  }
  std::cout.flush();
  std::cerr.flush();
  std::_Exit(ok ? 0 : 1);
}

ProcessSpec ThisTestAsRank() {
  return ProcessSpec{{SelfPath(), "--gtest_filter=" + CurrentTest()}, {{kRankVar, "1"}}};
}

ProcessSpec ReplacementOf(int launch_rank) {
  ProcessSpec spec = ThisTestAsRank();
  for (const char* name : {"WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                           "TORCHELASTIC_USE_AGENT_STORE", "OMP_NUM_THREADS", kDirVar,
                           "EVENSTEP_TEST_TIMEOUT_SCALE"}) {
    if (const char* value = std::getenv(name); value != nullptr) spec.env.emplace_back(name, value);
  }
  spec.env.emplace_back("RANK", std::to_string(launch_rank));
  spec.env.emplace_back("LOCAL_RANK", std::to_string(launch_rank));
  spec.env.emplace_back("EVENSTEP_JOIN", "1");
  return spec;
}

void ExpectRanksPassed(const std::vector<ProcessResult>& results,
                       const std::map<int, int>& exit_codes) {
  const int world = static_cast<int>(results.size());
  for (int r = 0; r < world; ++r) {
    const ProcessResult& p = results[r];
    const auto expected = exit_codes.find(r);
    if (p.exit_code == (expected == exit_codes.end() ? 0 : expected->second) && !p.timed_out) {
      continue;
    }
    ADD_FAILURE() << "rank " << r << " of " << world << " failed ("
                  << (p.timed_out     ? std::string("timed out")
                      : p.signal != 0 ? absl::StrCat("signal ", p.signal)
                                      : absl::StrCat("exit ", p.exit_code))
                  << "); its output:\n"
                  << p.output;
  }
}

std::string RanksDir() {
  if (RankOfThisProcess() >= 0) {
    const char* dir = std::getenv(kDirVar);
    return dir != nullptr ? dir : "";
  }
  TestRanks& ranks = TestRanks::Get();
  if (ranks.dir == nullptr) ranks.dir = std::make_unique<TempDir>("evenstep_ranks");
  return ranks.dir->path();
}

void WriteRanksFile(const std::string& name, const std::string& text) {
  std::ofstream(RanksDir() + "/" + name) << text;
}

std::string ReadRanksFile(const std::string& name) {
  std::ifstream in(RanksDir() + "/" + name);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

std::vector<ProcessResult> RunOnRanksAgain(int world, const OnRanksOptions& options) {
  if (!TestRanks::Get().started) {
    ADD_FAILURE() << "RunOnRanksAgain in " << CurrentTest() << " before its RunOnRanks";
    return {};
  }
  if (!options.nodes.empty() &&
      std::accumulate(options.nodes.begin(), options.nodes.end(), 0) != world) {
    ADD_FAILURE() << "RunOnRanks(" << world << "): the nodes hold a different number of ranks";
    return {};
  }
  ProcessSpec self = ThisTestAsRank();
  self.env.emplace_back(kDirVar, RanksDir());
  self.env.insert(self.env.end(), options.env.begin(), options.env.end());
  std::vector<ProcessResult> results =
      RunRanks(world, self.argv, options.timeout, options.nodes, self.env);
  ExpectRanksPassed(results, options.exit_codes);
  return results;
}

std::vector<ProcessResult> RunOnRanks(int world, const RankBody& body,
                                      const OnRanksOptions& options) {
  RunHereIfRank(body, options);
  if (std::exchange(TestRanks::Get().started, true)) {
    ADD_FAILURE() << "RunOnRanks called twice in " << CurrentTest()
                  << ": a rank re-runs its TEST only up to the first call; make the second "
                     "scenario its own TEST (or a TEST_P), or run the same body again with "
                     "RunOnRanksAgain";
    return {};
  }
  return RunOnRanksAgain(world, options);
}

}  // namespace evenstep::testing

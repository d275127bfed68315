#include "tests/testing/on_ranks.h"

#include <unistd.h>

#include <cstdlib>
#include <iostream>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "evenstep/internal/error_text.h"
#include "evenstep/internal/store_server.h"
#include "gtest/gtest.h"

namespace evenstep::testing {

namespace {
constexpr char kRankVar[] = "EVENSTEP_TEST_RANK";

// The running test's full name, for the ranks' gtest filter.
std::string CurrentTest() {
  const ::testing::TestInfo* info = ::testing::UnitTest::GetInstance()->current_test_info();
  return absl::StrCat(info->test_suite_name(), ".", info->name());
}

[[noreturn]] void RunAsRank(const std::function<void(DistContext&)>& body) {
  DistOptions options;
  options.backend = CommBackend::kGloo;
  options.collective_timeout = absl::Seconds(60);
  options.rendezvous_timeout = absl::Seconds(60);
  bool ok = true;
  {
    absl::StatusOr<std::unique_ptr<DistContext>> ctx = DistContext::Create(options);
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
}  // namespace

int RankOfThisProcess() {
  const char* v = std::getenv(kRankVar);
  int rank = -1;
  return v != nullptr && absl::SimpleAtoi(v, &rank) ? rank : -1;
}

std::vector<ProcessResult> RunOnRanks(int world, const std::function<void(DistContext&)>& body,
                                      const OnRanksOptions& options) {
  if (RankOfThisProcess() >= 0) RunAsRank(body);
  auto server = internal::StoreServer::Start(0);
  if (!server.ok()) {
    ADD_FAILURE() << "could not host the store: " << server.status();
    return {};
  }
  std::vector<ProcessSpec> specs = TorchrunRanks(
      world, (*server)->port(), {"/proc/self/exe", "--gtest_filter=" + CurrentTest()});
  for (int r = 0; r < world; ++r) {
    specs[r].env.emplace_back(kRankVar, std::to_string(r));
    specs[r].env.insert(specs[r].env.end(), options.env.begin(), options.env.end());
  }
  std::vector<ProcessResult> results = RunAll(specs, options.timeout);
  for (int r = 0; r < static_cast<int>(results.size()); ++r) {
    const ProcessResult& p = results[r];
    if (p.exit_code == 0 && !p.timed_out) continue;
    ADD_FAILURE() << "rank " << r << " of " << world << " failed ("
                  << (p.timed_out     ? std::string("timed out")
                      : p.signal != 0 ? absl::StrCat("signal ", p.signal)
                                      : absl::StrCat("exit ", p.exit_code))
                  << "); its output:\n"
                  << p.output;
  }
  return results;
}

}  // namespace evenstep::testing

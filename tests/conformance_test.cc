// GradSync conformance: every case of tests/conformance_helper.cc on worlds 2
// and 3 against a single-process run on the whole global batch (max relative
// error <= 1e-5 per parameter; bf16 parameters 1e-2), the failure scenarios'
// errors on every rank, and the same cases against PyTorch's
// DistributedDataParallel itself (tests/ddp_peer.py under the Python whose
// torch matches this build: EVENSTEP_PEER_PYTHON; skipped with a message when
// it has no torch).
#include <fstream>
#include <memory>
#include <regex>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/testing/subprocess.h"
#include "torch/version.h"

namespace evenstep {
namespace {

using ::evenstep::testing::Describe;
using ::evenstep::testing::ProcessResult;
using ::testing::HasSubstr;

std::vector<ProcessResult> RunCase(int world, const std::vector<std::string>& args) {
  return evenstep::testing::RunProgramOnRanks(world, EVENSTEP_CONFORMANCE_HELPER, args);
}

struct Conf {
  std::string name;
  int world;
  int micro;                       // micro-steps per rank per step, sync on the last
  std::vector<std::string> extra;  // scenario flags
  std::string label;               // the test name's suffix for the flags
  friend void PrintTo(const Conf& c, std::ostream* os) {
    *os << c.name << " world " << c.world << " micro " << c.micro;
    for (const std::string& f : c.extra) *os << " " << f;
  }
};

class ConformanceTest : public ::testing::TestWithParam<Conf> {};

TEST_P(ConformanceTest, ParametersEqualSingleProcessAfterFiveSteps) {
  const Conf c = GetParam();
  std::vector<std::string> args = {"--case_name=" + c.name, absl::StrCat("--micro=", c.micro)};
  args.insert(args.end(), c.extra.begin(), c.extra.end());
  auto results = RunCase(c.world, args);
  for (const ProcessResult& r : results) {
    EXPECT_EQ(r.exit_code, 0) << Describe(results);
    EXPECT_THAT(r.output, HasSubstr("conformance ok " + c.name)) << Describe(results);
  }
}

std::vector<Conf> AllCases() {
  std::vector<Conf> cases;
  for (int world : {2, 3}) {
    for (const char* name :
         {"tied_adam", "tied_sgd", "sparse", "batchnorm", "mixed", "layout", "reverse"}) {
      cases.push_back({name, world, 3, {}, ""});
    }
    // One synced backward per step, and two: the used-parameter bitmap must
    // wait for the sparse gradient (it once rode in the last dense bucket,
    // launched before the embedding's hook ran: a silently local gradient).
    for (int micro : {1, 2}) {
      for (const char* name : {"sparse", "tied_adam", "control_flow"}) {
        cases.push_back({name, world, micro, {}, ""});
      }
    }
    // DDP's scenarios: a layer used by one rank on odd steps and one never
    // used (no false error), one trainable parameter, gradients kept over
    // steps (no zero_grad), create_graph, two synced backwards in a step.
    cases.push_back({"control_flow", world, 3, {}, ""});
    cases.push_back({"zero_features", world, 3, {}, ""});
    cases.push_back({"zero_features", world, 1, {"--keep_grad"}, "_keep_grad"});
    cases.push_back({"reverse", world, 2, {"--inference"}, "_inference"});
    for (int micro : {1, 3}) {
      for (const char* name : {"one_param", "tied_adam", "sparse", "control_flow"}) {
        cases.push_back({name, world, micro, {"--keep_grad"}, "_keep_grad"});
      }
      cases.push_back({"one_param",
                       world,
                       micro,
                       {"--keep_grad", "--create_graph"},
                       "_keep_grad_create_graph"});
    }
    for (const char* name : {"reverse", "tied_adam", "one_param"}) {
      cases.push_back({name, world, 3, {"--scenario=two_backward"}, "_two_backward"});
    }
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Cases, ConformanceTest, ::testing::ValuesIn(AllCases()),
                         [](const auto& info) {
                           return absl::StrCat(info.param.name, "_world", info.param.world,
                                               "_micro", info.param.micro, info.param.label);
                         });

TEST(ConformanceTest, RandomModelsEqualOneProcess) {
  // Seeded random models (sparse or dense embedding, tied head or not, a
  // frozen layer, a layer no rank uses on odd seeds), random subsets of
  // layers per rank and step, 1-3 micro-steps per rank and step, gradients
  // kept over steps on every third seed: after 5 steps every parameter
  // equals a single process's. 16 seeds x 2 worlds, about 25 s.
  for (int world : {2, 3}) {
    for (int seed = 1; seed <= 16; ++seed) {
      std::vector<std::string> args = {"--case_name=random", absl::StrCat("--seed=", seed)};
      if (seed % 3 == 0) args.push_back("--keep_grad");
      if (seed % 4 == 1) args.push_back("--inference");
      auto results = RunCase(world, args);
      for (const ProcessResult& r : results) {
        EXPECT_EQ(r.exit_code, 0) << "seed " << seed << " world " << world << Describe(results);
        EXPECT_THAT(r.output, HasSubstr("conformance ok random"));
      }
    }
  }
}

// The hierarchical sync under the same cases, on 2 nodes x 2 ranks
// simulated on this host (GROUP_RANK): every parameter equals one process's
// after five steps, as with the flat sync.
TEST(ConformanceTest, TheHierarchicalSyncPassesTheSameCases) {
  struct Run {
    std::string name;
    int micro;
    std::vector<std::string> extra;
  };
  std::vector<Run> runs;
  for (const char* name : {"tied_adam", "tied_sgd", "sparse", "mixed", "layout", "reverse",
                           "control_flow", "zero_features"}) {
    runs.push_back({name, 3, {}});
  }
  runs.push_back({"batchnorm", 1, {}});  // 3 micro-batches of 4 ranks' share: some of 1 sample
  runs.push_back({"sparse", 1, {}});
  runs.push_back({"one_param", 1, {"--keep_grad", "--create_graph"}});
  runs.push_back({"tied_adam", 3, {"--scenario=two_backward"}});
  for (int seed = 1; seed <= 6; ++seed) {
    runs.push_back({"random", 1 + seed % 3, {absl::StrCat("--seed=", seed)}});
    if (seed % 3 == 0) runs.back().extra.push_back("--keep_grad");
  }
  for (const Run& run : runs) {
    std::vector<std::string> args = {"--evenstep_sync_topology=hierarchical",
                                     "--case_name=" + run.name,
                                     absl::StrCat("--micro=", run.micro)};
    args.insert(args.end(), run.extra.begin(), run.extra.end());
    auto results = evenstep::testing::RunProgramOnNodes({2, 2}, EVENSTEP_CONFORMANCE_HELPER, args);
    for (const ProcessResult& r : results) {
      EXPECT_EQ(r.exit_code, 0) << absl::StrJoin(args, " ") << Describe(results);
      EXPECT_THAT(r.output, HasSubstr("gradient sync: hierarchical (2 nodes x 2 ranks"));
      EXPECT_THAT(r.output, HasSubstr("conformance ok " + run.name)) << Describe(results);
    }
  }
}

TEST(ConformanceTest, AnIdleRankJoinsWithZeros) {
  for (int world : {2, 3}) {
    auto results = RunCase(world, {"--case_name=tied_adam", "--idle_rank=1"});
    for (const ProcessResult& r : results) {
      EXPECT_EQ(r.exit_code, 0) << Describe(results);
      EXPECT_THAT(r.output, HasSubstr("conformance ok")) << Describe(results);
    }
  }
}

TEST(ConformanceTest, ReverseOrderOverlapsAfterTheRebuild) {
  auto results = RunCase(2, {"--case_name=reverse"});
  ASSERT_EQ(results[0].exit_code, 0) << Describe(results);
  // Step 1: registration order, the first bucket's gradients come last.
  // Later steps: rank 0's ready order, buckets start during backward.
  std::smatch m;
  const std::regex pattern("launched during backward: step 1 ([0-9]+), last ([0-9]+) of ([0-9]+)");
  ASSERT_TRUE(std::regex_search(results[0].output, m, pattern)) << Describe(results);
  const int first = std::stoi(m[1]), last = std::stoi(m[2]), buckets = std::stoi(m[3]);
  EXPECT_GE(buckets, 4);
  EXPECT_LE(first, 1) << "only the first layer's bucket can start before the end";
  EXPECT_GE(last, buckets - 1) << "every bucket but the last starts during backward";
}

TEST(ConformanceTest, AnExceptionInsideBackwardAbandonsTheStepOnEveryRank) {
  // Rank 1's synced backward throws in step 3 after some buckets started:
  // every rank abandons step 3 (no gradient left, no timeout) and the run
  // goes on, matching a reference that skips step 3, whether the caller calls
  // AbandonStep never (GradSync sees the engine drop the backward), only
  // when its sync did not complete, or always in its catch (it then starts
  // nothing more). Thrown in the first, unsynced backward of the step, the
  // caller's AbandonStep joins the sync for it.
  struct Way {
    const char* abandon;
    const char* throw_in;
  };
  for (const Way way : {Way{"never", "synced"}, Way{"if_needed", "synced"}, Way{"always", "synced"},
                        Way{"if_needed", "first"}, Way{"always", "first"}}) {
    for (int world : {2, 3}) {
      for (int micro : {1, 3}) {
        if (std::string(way.throw_in) == "first" && micro == 1) continue;  // the same backward
        auto results = RunCase(
            world,
            {"--case_name=reverse", "--scenario=exception", absl::StrCat("--abandon=", way.abandon),
             absl::StrCat("--throw_in=", way.throw_in), absl::StrCat("--micro=", micro)});
        SCOPED_TRACE(absl::StrCat("--abandon=", way.abandon, " --throw_in=", way.throw_in,
                                  " world ", world, " micro ", micro));
        for (const ProcessResult& r : results) {
          EXPECT_EQ(r.exit_code, 0) << Describe(results);
          EXPECT_THAT(r.output, HasSubstr("step 3 abandoned")) << Describe(results);
          EXPECT_THAT(r.output, HasSubstr("abandoned on every rank: rank(s) 1 failed"))
              << Describe(results);
          EXPECT_THAT(r.output, HasSubstr("conformance ok")) << Describe(results);
        }
        EXPECT_THAT(results[1].output, HasSubstr("injected failure inside backward"));
      }
    }
  }
}

TEST(ConformanceTest, RequiresGradChangedAfterAttachIsRefusedByName) {
  auto results = RunCase(2, {"--case_name=reverse", "--scenario=unfreeze"});
  for (const ProcessResult& r : results) {
    EXPECT_EQ(r.exit_code, 4) << Describe(results);
    EXPECT_THAT(r.output, HasSubstr("parameter 'l2.weight' no longer requires grad"))
        << Describe(results);
  }
  results = RunCase(2, {"--case_name=tied_sgd", "--scenario=thaw"});
  for (const ProcessResult& r : results) {
    EXPECT_EQ(r.exit_code, 4) << Describe(results);
    EXPECT_THAT(r.output, HasSubstr("parameter 'proj.weight' was frozen at GradSync::Attach and "
                                    "requires grad now"))
        << Describe(results);
  }
}

// ---- against PyTorch DDP ----

bool PythonHasTorch() {
  return evenstep::testing::RunShell(
             absl::StrCat(EVENSTEP_PEER_PYTHON, " -c 'import torch.distributed'"))
             .first == 0;
}

nlohmann::json ReadJson(const std::string& path) {
  std::ifstream in(path);
  nlohmann::json j;
  if (in) in >> j;
  return j;
}

struct DdpCase {
  std::string name;
  int micro;
  std::vector<std::string> flags;  // given to both sides
  std::string label;
  friend void PrintTo(const DdpCase& c, std::ostream* os) {
    *os << c.name << " micro " << c.micro;
    for (const std::string& f : c.flags) *os << " " << f;
  }
};

class DdpTest : public ::testing::TestWithParam<DdpCase> {};

TEST_P(DdpTest, ParametersEqualPyTorchDdpAfterFiveSteps) {
  if (!PythonHasTorch()) {
    GTEST_SKIP() << "no torch in " << EVENSTEP_PEER_PYTHON
                 << " (apt install python3-torch): the comparison with PyTorch DDP did not run";
  }
  const DdpCase c = GetParam();
  const std::string& name = c.name;
  char dir_template[] = "/tmp/evenstep-ddp-XXXXXX";
  ASSERT_NE(mkdtemp(dir_template), nullptr);
  const std::string dir = dir_template;
  std::vector<std::string> args = {"--case_name=" + name, "--out=" + dir + "/evenstep.json",
                                   absl::StrCat("--micro=", c.micro)};
  args.insert(args.end(), c.flags.begin(), c.flags.end());
  auto results = RunCase(2, args);
  for (const ProcessResult& r : results) ASSERT_EQ(r.exit_code, 0) << Describe(results);
  std::string peer_flags;
  for (const std::string& f : c.flags) absl::StrAppend(&peer_flags, " ", f);
  auto [code, output] = evenstep::testing::RunShell(
      absl::StrCat(EVENSTEP_PEER_PYTHON, " ", EVENSTEP_SOURCE_DIR, "/tests/ddp_peer.py --case ",
                   name, " --micro ", c.micro, peer_flags, " --out ", dir, "/ddp.json",
                   // The peer zeroes gradients the way this build's libtorch
                   // does (2.x: zero_grad() resets them to undefined).
                   TORCH_VERSION_MAJOR >= 2 ? " --zero_grad_to_none" : "", " 2>&1"),
      evenstep::testing::HangBound(4));
  ASSERT_EQ(code, 0) << output;
  const nlohmann::json ours = ReadJson(dir + "/evenstep.json");
  const nlohmann::json ddp = ReadJson(dir + "/ddp.json");
  ASSERT_FALSE(ours.is_null());
  ASSERT_FALSE(ddp.is_null()) << output;
  for (const char* kind : {"params", "buffers"}) {
    if (!ours.contains(kind)) continue;
    ASSERT_TRUE(ddp.contains(kind)) << kind;
    ASSERT_EQ(ours[kind].size(), ddp[kind].size())
        << kind << ": " << ddp[kind].dump().substr(0, 200);
    for (const auto& [key, values] : ours[kind].items()) {
      ASSERT_TRUE(ddp[kind].contains(key)) << "DDP has no " << key;
      const auto a = values.get<std::vector<double>>();
      const auto b = ddp[kind][key].get<std::vector<double>>();
      ASSERT_EQ(a.size(), b.size()) << key;
      double scale = 1e-12, diff = 0;
      for (size_t i = 0; i < a.size(); ++i) {
        scale = std::max(scale, std::abs(b[i]));
        diff = std::max(diff, std::abs(a[i] - b[i]));
      }
      EXPECT_LE(diff / scale, 1e-5) << name << " " << key;
    }
  }
  if (HasFailure()) {
    std::cout << "kept " << dir << " (evenstep.json, ddp.json) for a look" << std::endl;
  } else {
    evenstep::testing::RunShell("rm -rf " + dir);
  }
}

// mixed is not here: Gloo in torch 1.13 reduces no bf16 (DDP fails on it).
// tied_sgd only against 1.13: with torch 2.8, libtorch's C++ SGD and
// Python's SGD disagree on it even in one process without any sync (Python
// single process = DDP to 8e-8; libtorch single process = evenstep; the two
// 0.05 apart), so the comparison would test the optimizers, not the sync;
// the single-process conformance case still covers it there.
// sparse with one micro-step: one synced backward (the bitmap case);
// one_param and control_flow: DDP's own scenarios; --keep_grad: no zero_grad
// (DDP averages kept gradients back to themselves).
std::vector<DdpCase> DdpCases() {
  std::vector<DdpCase> cases;
  for (const char* name :
       {"tied_adam", "sparse", "batchnorm", "layout", "reverse", "control_flow"}) {
    cases.push_back({name, 3, {}, ""});
  }
  if (TORCH_VERSION_MAJOR < 2) cases.push_back({"tied_sgd", 3, {}, ""});
  cases.push_back({"sparse", 1, {}, "_micro1"});
  cases.push_back({"control_flow", 1, {}, "_micro1"});
  // Not zero_features: DDP 1.13 over Gloo fails in its first broadcast ("The
  // size of tensor a (6) must match the size of tensor b (0)"); GradSync
  // matches one process there (ConformanceTest zero_features_*).
  cases.push_back({"one_param", 1, {"--keep_grad"}, "_micro1_keep_grad"});
  cases.push_back({"one_param", 3, {"--keep_grad", "--create_graph"}, "_keep_grad_create_graph"});
  cases.push_back({"sparse", 3, {"--keep_grad"}, "_keep_grad"});
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Cases, DdpTest, ::testing::ValuesIn(DdpCases()),
                         [](const auto& info) { return info.param.name + info.param.label; });

}  // namespace
}  // namespace evenstep

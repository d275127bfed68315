// GradSync conformance: every model case (tests/testing/conformance_models.h)
// on worlds 2 and 3 trained through GradSync beside a single-process
// reference on the whole global batch in the same rank, every parameter and
// buffer compared after five steps (max relative error <= 1e-5; bf16
// parameters 1e-2); PyTorch DDP's own test scenarios (unused and
// rank-dependent parameters, kept gradients, create_graph, two synced
// backwards, inference forwards, an exception inside backward, requires_grad
// changed after Attach); the hierarchical sync under the same cases; and the
// same cases against PyTorch's DistributedDataParallel itself
// (tests/ddp_peer.py under the Python whose torch matches this build:
// EVENSTEP_PEER_PYTHON; skipped with a message when it has no torch). Each
// scenario runs on real ranks inside its TEST (RunOnRanks).
#include <torch/torch.h>

#include <fstream>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "evenstep/grad_sync.h"
#include "evenstep/sync_topology.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/testing/conformance_models.h"
#include "tests/testing/on_ranks.h"
#include "torch/version.h"

namespace evenstep {
namespace {

using ::evenstep::testing::OnRanksOptions;
using ::evenstep::testing::RanksDir;
using ::evenstep::testing::RunOnRanks;
using ::testing::HasSubstr;
namespace conformance = ::evenstep::testing::conformance;
using conformance::Tensor;

// One conformance run: a model case trained for `steps` optimizer steps of
// `micro` micro-steps per rank (sync on the last) through GradSync.
struct Scenario {
  std::string case_name = "tied_adam";
  int micro = 3;
  int steps = 5;
  uint64_t seed = 0;          // random's
  int idle_rank = -1;         // no micro-batch in any step: joins through SyncNow
  bool keep_grad = false;     // no zero_grad between steps (model and reference)
  bool create_graph = false;  // every backward of the model with create_graph
  bool inference = false;     // forwards under NoGradGuard and without backward before each
                              // step (DDP's test_ddp_inference): they change nothing
  bool two_backward = false;  // the sync on two backwards of every step: the second adds to
                              // the reduced gradient, as in one process
  // Rank 1's backward of step 3 throws: in the synced backward, or in the
  // first (unsynced) one; the caller then calls AbandonStep never, if_needed
  // (syncs_completed() did not advance) or always.
  bool throw_at_3 = false;
  bool throw_in_first = false;
  std::string abandon = "if_needed";
  // After step 2: reverse's l2.weight frozen ("unfreeze") or tied's frozen
  // proj.weight made trainable ("thaw").
  std::string change_requires_grad;
  bool hierarchical = false;
  std::string out;  // rank 0 writes its parameters and buffers there (JSON)
};

// What a rank saw: buckets launched during backward in step 1 and the last
// step; each abandoned step's status.
struct Outcome {
  int launched_first = -1, launched_last = -1;
  int64_t num_buckets = 0;
  std::vector<std::string> abandoned;  // "step N: <status>"
  std::vector<std::string> thrown;     // this rank's exceptions
};

// Every buffer equal to rank 0's.
void ExpectBuffersEqualRankZeros(DistContext& dist, conformance::Case& model, int step) {
  for (const auto& item : model.named_buffers()) {
    Tensor root = item.value().detach().clone();
    ASSERT_TRUE(dist.Broadcast(root, 0).ok());
    EXPECT_TRUE(torch::equal(root, item.value()))
        << "step " << step << ": buffer " << item.key() << " differs from rank 0's";
  }
}

// Every parameter and buffer of `model` within its tolerance of `ref`'s.
void ExpectEqualToReference(conformance::Case& model, conformance::Case& ref) {
  auto mine = conformance::UniqueParams(model), want = conformance::UniqueParams(ref);
  ASSERT_EQ(mine.size(), want.size());
  for (size_t i = 0; i < mine.size(); ++i) {
    EXPECT_LE(conformance::MaxRelError(mine[i].second, want[i].second),
              model.Tolerance(mine[i].first))
        << mine[i].first << "'s max relative error against one process";
  }
  auto ref_buffers = ref.named_buffers();
  for (const auto& item : model.named_buffers()) {
    EXPECT_LE(conformance::MaxRelError(item.value(), ref_buffers[item.key()]), 1e-5)
        << "buffer " << item.key() << "'s max relative error against one process";
  }
}

// Rank 0's parameters and buffers as JSON, for the comparison with DDP.
void WriteParameters(conformance::Case& model, const std::string& path) {
  nlohmann::json out;
  auto flat = [](const Tensor& t) {
    Tensor f = t.detach().to(torch::kDouble).contiguous().view({-1});
    return std::vector<double>(f.data_ptr<double>(), f.data_ptr<double>() + f.numel());
  };
  for (const auto& [n, p] : conformance::UniqueParams(model)) out["params"][n] = flat(p);
  for (const auto& item : model.named_buffers()) out["buffers"][item.key()] = flat(item.value());
  std::ofstream(path) << out.dump();
}

// Rank `rank`'s micro-steps of one step; an exception is recorded in
// `outcome` and, as the scenario's caller decides, AbandonStep called.
// Returns whether the step was abandoned.
bool MicroSteps(GradSync& sync, conformance::Case& model, const Scenario& s, int step, int rank,
                const std::vector<std::vector<int64_t>>& mine, Outcome* outcome) {
  const int64_t syncs_before = sync.syncs_completed();
  const int n = static_cast<int>(mine.size());
  sync.SetStep(step);  // at the step's start: an AbandonStep before the sync carries it too
  try {
    for (int m = 0; m < n; ++m) {
      const bool last = m + 1 == n;
      sync.set_sync_enabled(last || (s.two_backward && m == n - 2));
      if (sync.sync_enabled()) sync.SetStep(step);  // again before each synchronisation
      if (s.throw_at_3) {
        static_cast<conformance::Reverse&>(model).fire_step =
            (s.throw_in_first ? m == 0 : last) ? 3 : -1;
      }
      Tensor loss = model.Loss(mine[m], step, rank) / conformance::kN;
      if (last) {
        if (absl::Status st = sync.PrepareForBackward(loss); !st.ok()) {
          throw std::runtime_error(st.ToString());
        }
      }
      loss.backward({}, /*retain_graph=*/c10::nullopt, s.create_graph);
    }
    return false;
  } catch (const std::exception& e) {
    outcome->thrown.push_back(absl::StrCat("step ", step, ": ", e.what()));
    if (s.abandon == "always" ||
        (s.abandon == "if_needed" && sync.syncs_completed() == syncs_before)) {
      sync.AbandonStep(absl::InternalError(e.what())).IgnoreError();  // its status is sync's
    }
    return true;
  }
}

// The scenario on this rank, beside the reference on the whole global batch:
// EXPECTs after each step that the buffers equal rank 0's and after the
// last that every parameter and buffer equals the reference's; an abandoned
// step leaves no gradient (the reference skips it).
Outcome Train(DistContext& dist, const Scenario& s) {
  const int world = dist.world_size(), rank = dist.rank();
  auto model = conformance::MakeCase(s.case_name, s.seed);
  auto ref = conformance::MakeCase(s.case_name, s.seed);
  Outcome outcome;
  if (model == nullptr) {
    ADD_FAILURE() << "no case " << s.case_name;
    return outcome;
  }
  if (s.throw_at_3) static_cast<conformance::Reverse&>(*model).fire_rank = 1;
  GradSyncOptions options;
  options.timeout = absl::Seconds(60);
  options.bucket_cap_bytes = 256;  // several buckets even for these small models
  options.first_bucket_cap_bytes = 64;
  if (s.hierarchical) {
    auto choice = ApplySyncTopology(dist, SyncTopology::kHierarchical, &options);
    EXPECT_TRUE(choice.ok()) << choice.status();
    if (choice.ok()) EXPECT_THAT(choice->line, HasSubstr("gradient sync: hierarchical ("));
  }
  auto sync = GradSync::Attach(*model, dist.data_group(), options);
  EXPECT_TRUE(sync.ok()) << sync.status();
  if (!sync.ok()) return outcome;
  outcome.num_buckets = (*sync)->num_buckets();
  auto opt = model->Optimizer();
  auto ref_opt = ref->Optimizer();
  auto split = conformance::Split(world, s.idle_rank, s.micro);
  auto* random = dynamic_cast<conformance::Random*>(model.get());
  for (int step = 1; step <= s.steps; ++step) {
    if (random != nullptr) {  // this step's micro-steps per rank: 1-3, from the seed
      for (int r = 0; r < world; ++r)
        split[r] = conformance::Split(world, s.idle_rank, random->Micro(step, r))[r];
    }
    if (s.inference && rank != s.idle_rank) {
      {
        torch::NoGradGuard no_grad;
        model->Loss(split[rank][0], step, rank);
      }
      model->Loss(split[rank][0], step, rank);  // a graph nobody runs backward on
    }
    if (step == 3 && s.change_requires_grad == "unfreeze") {
      static_cast<conformance::Reverse&>(*model).l[1]->weight.set_requires_grad(false);
    }
    if (step == 3 && s.change_requires_grad == "thaw") {
      static_cast<conformance::Tied&>(*model).proj->weight.set_requires_grad(true);
    }
    bool abandoned = false;
    if (rank == s.idle_rank) {
      (*sync)->SetStep(step);
      const absl::Status joined = (*sync)->SyncNow();
      abandoned = !joined.ok();
      if (abandoned) outcome.thrown.push_back(absl::StrCat("step ", step, ": ", joined.ToString()));
    } else {
      abandoned = MicroSteps(**sync, *model, s, step, rank, split[rank], &outcome);
    }
    if (abandoned) {
      outcome.abandoned.push_back(absl::StrCat("step ", step, ": ", (*sync)->status().ToString()));
      for (auto& p : model->parameters()) {
        EXPECT_FALSE(p.grad().defined()) << "a gradient left after abandoned step " << step;
      }
      if (!s.change_requires_grad.empty()) return outcome;
      opt->zero_grad();
      continue;  // the reference skips the step too
    }
    const SyncStats stats = (*sync)->last_stats();
    if (step == 1) outcome.launched_first = stats.buckets_launched_during_backward;
    outcome.launched_last = stats.buckets_launched_during_backward;
    opt->step();
    if (!s.keep_grad) opt->zero_grad();
    conformance::ReferenceStep(*ref, *ref_opt, step, world, split, s.keep_grad);
    ExpectBuffersEqualRankZeros(dist, *model, step);
  }
  EXPECT_TRUE(s.change_requires_grad.empty()) << "no step failed after requires_grad changed";
  ExpectEqualToReference(*model, *ref);
  if (rank == 0 && !s.out.empty()) WriteParameters(*model, s.out);
  return outcome;
}

// Every abandoned step's and exception's text, for matching.
std::string Errors(const Outcome& o) {
  return absl::StrCat(absl::StrJoin(o.thrown, "\n"), "\n", absl::StrJoin(o.abandoned, "\n"));
}

struct Conf {
  Scenario s;
  int world;
  std::string label;  // the test name's suffix for the scenario's switches
  friend void PrintTo(const Conf& c, std::ostream* os) {
    *os << c.s.case_name << " world " << c.world << " micro " << c.s.micro << c.label;
  }
};

// Trains `c` on its world; every rank ends equal to one process, with no
// step abandoned.
void ExpectConforms(const Conf& c, const OnRanksOptions& options = {}) {
  RunOnRanks(
      c.world,
      [c](DistContext& dist) {
        const Outcome o = Train(dist, c.s);
        EXPECT_TRUE(o.abandoned.empty()) << Errors(o);
      },
      options);
}

Conf Make(const char* name, int world, int micro, std::string label = "",
          void (*set)(Scenario*) = nullptr) {
  Conf c{Scenario{}, world, std::move(label)};
  c.s.case_name = name;
  c.s.micro = micro;
  if (set != nullptr) set(&c.s);
  return c;
}

void KeepGrad(Scenario* s) { s->keep_grad = true; }
void KeepGradCreateGraph(Scenario* s) {
  s->keep_grad = true;
  s->create_graph = true;
}
void Inference(Scenario* s) { s->inference = true; }
void TwoBackward(Scenario* s) { s->two_backward = true; }

std::vector<Conf> AllCases() {
  std::vector<Conf> cases;
  for (int world : {2, 3}) {
    for (const char* name :
         {"tied_adam", "tied_sgd", "sparse", "batchnorm", "mixed", "layout", "reverse"}) {
      cases.push_back(Make(name, world, 3));
    }
    // One synced backward per step, and two: the used-parameter bitmap must
    // wait for the sparse gradient (it once rode in the last dense bucket,
    // launched before the embedding's hook ran: a silently local gradient).
    for (int micro : {1, 2}) {
      for (const char* name : {"sparse", "tied_adam", "control_flow"}) {
        cases.push_back(Make(name, world, micro));
      }
    }
    // DDP's scenarios: a layer used by one rank on odd steps and one never
    // used (no false error), one trainable parameter, gradients kept over
    // steps (no zero_grad), create_graph, two synced backwards in a step.
    cases.push_back(Make("control_flow", world, 3));
    cases.push_back(Make("zero_features", world, 3));
    cases.push_back(Make("zero_features", world, 1, "_keep_grad", KeepGrad));
    cases.push_back(Make("reverse", world, 2, "_inference", Inference));
    for (int micro : {1, 3}) {
      for (const char* name : {"one_param", "tied_adam", "sparse", "control_flow"}) {
        cases.push_back(Make(name, world, micro, "_keep_grad", KeepGrad));
      }
      cases.push_back(
          Make("one_param", world, micro, "_keep_grad_create_graph", KeepGradCreateGraph));
    }
    for (const char* name : {"reverse", "tied_adam", "one_param"}) {
      cases.push_back(Make(name, world, 3, "_two_backward", TwoBackward));
    }
  }
  return cases;
}

class ConformanceTest : public ::testing::TestWithParam<Conf> {};

TEST_P(ConformanceTest, ParametersEqualSingleProcessAfterFiveSteps) { ExpectConforms(GetParam()); }

INSTANTIATE_TEST_SUITE_P(Cases, ConformanceTest, ::testing::ValuesIn(AllCases()),
                         [](const auto& info) {
                           return absl::StrCat(info.param.s.case_name, "_world", info.param.world,
                                               "_micro", info.param.s.micro, info.param.label);
                         });

// Seeded random models (sparse or dense embedding, tied head or not, a
// frozen layer, a layer no rank uses on odd seeds), random subsets of layers
// per rank and step, 1-3 micro-steps per rank and step, gradients kept over
// steps on every third seed, inference forwards on every fourth: after 5
// steps every parameter equals a single process's. 16 seeds x 2 worlds.
std::vector<Conf> RandomCases() {
  std::vector<Conf> cases;
  for (int world : {2, 3}) {
    for (int seed = 1; seed <= 16; ++seed) {
      Conf c = Make("random", world, 3, absl::StrCat("_seed", seed));
      c.s.seed = seed;
      c.s.keep_grad = seed % 3 == 0;
      c.s.inference = seed % 4 == 1;
      cases.push_back(c);
    }
  }
  return cases;
}

class RandomConformanceTest : public ::testing::TestWithParam<Conf> {};

TEST_P(RandomConformanceTest, RandomModelsEqualOneProcess) { ExpectConforms(GetParam()); }

INSTANTIATE_TEST_SUITE_P(Seeds, RandomConformanceTest, ::testing::ValuesIn(RandomCases()),
                         [](const auto& info) {
                           return absl::StrCat("world", info.param.world, info.param.label);
                         });

// The hierarchical sync under the same cases, on 2 nodes x 2 ranks
// simulated on this host (GROUP_RANK): every parameter equals one process's
// after five steps, as with the flat sync.
std::vector<Conf> HierarchicalCases() {
  std::vector<Conf> cases;
  for (const char* name : {"tied_adam", "tied_sgd", "sparse", "mixed", "layout", "reverse",
                           "control_flow", "zero_features"}) {
    cases.push_back(Make(name, 4, 3));
  }
  cases.push_back(Make("batchnorm", 4, 1));  // 3 micro-batches of 4 ranks' share: some of 1 sample
  cases.push_back(Make("sparse", 4, 1));
  cases.push_back(Make("one_param", 4, 1, "_keep_grad_create_graph", KeepGradCreateGraph));
  cases.push_back(Make("tied_adam", 4, 3, "_two_backward", TwoBackward));
  for (int seed = 1; seed <= 6; ++seed) {
    Conf c = Make("random", 4, 1 + seed % 3, absl::StrCat("_seed", seed));
    c.s.seed = seed;
    c.s.keep_grad = seed % 3 == 0;
    cases.push_back(c);
  }
  for (Conf& c : cases) c.s.hierarchical = true;
  return cases;
}

class HierarchicalConformanceTest : public ::testing::TestWithParam<Conf> {};

TEST_P(HierarchicalConformanceTest, TheHierarchicalSyncPassesTheSameCases) {
  OnRanksOptions two_nodes;
  two_nodes.nodes = {2, 2};
  ExpectConforms(GetParam(), two_nodes);
}

INSTANTIATE_TEST_SUITE_P(Cases, HierarchicalConformanceTest,
                         ::testing::ValuesIn(HierarchicalCases()), [](const auto& info) {
                           return absl::StrCat(info.param.s.case_name, "_micro", info.param.s.micro,
                                               info.param.label);
                         });

class IdleRankTest : public ::testing::TestWithParam<int> {};

TEST_P(IdleRankTest, AnIdleRankJoinsWithZeros) {
  Conf c = Make("tied_adam", GetParam(), 3);
  c.s.idle_rank = 1;
  ExpectConforms(c);
}

INSTANTIATE_TEST_SUITE_P(Worlds, IdleRankTest, ::testing::Values(2, 3),
                         [](const auto& info) { return absl::StrCat("world", info.param); });

TEST(ConformanceOrderTest, ReverseOrderOverlapsAfterTheRebuild) {
  RunOnRanks(2, [](DistContext& dist) {
    const Outcome o = Train(dist, Make("reverse", 2, 3).s);
    if (dist.rank() != 0) return;
    // Step 1: registration order, the first bucket's gradients come last.
    // Later steps: rank 0's ready order, buckets start during backward.
    EXPECT_GE(o.num_buckets, 4);
    EXPECT_LE(o.launched_first, 1) << "only the first layer's bucket can start before the end";
    EXPECT_GE(o.launched_last, o.num_buckets - 1)
        << "every bucket but the last starts during backward";
  });
}

// Rank 1's backward throws in step 3 after some buckets started: every rank
// abandons step 3 (no gradient left, no timeout) and the run goes on,
// matching a reference that skips step 3, whether the caller calls
// AbandonStep never (GradSync sees the engine drop the backward), only when
// its sync did not complete, or always in its catch (it then starts nothing
// more). Thrown in the first, unsynced backward of the step, the caller's
// AbandonStep joins the sync for it.
struct Thrown {
  const char* abandon;
  bool in_first;
  int world, micro;
  friend void PrintTo(const Thrown& t, std::ostream* os) {
    *os << "abandon " << t.abandon << (t.in_first ? " in the first backward" : "") << " world "
        << t.world << " micro " << t.micro;
  }
};

std::vector<Thrown> ThrownCases() {
  std::vector<Thrown> cases;
  for (const auto& [abandon, in_first] :
       std::vector<std::pair<const char*, bool>>{{"never", false},
                                                 {"if_needed", false},
                                                 {"always", false},
                                                 {"if_needed", true},
                                                 {"always", true}}) {
    for (int world : {2, 3}) {
      for (int micro : {1, 3}) {
        if (in_first && micro == 1) continue;  // the same backward
        cases.push_back({abandon, in_first, world, micro});
      }
    }
  }
  return cases;
}

class ExceptionInBackwardTest : public ::testing::TestWithParam<Thrown> {};

TEST_P(ExceptionInBackwardTest, AbandonsTheStepOnEveryRank) {
  const Thrown t = GetParam();
  RunOnRanks(t.world, [t](DistContext& dist) {
    Scenario s = Make("reverse", t.world, t.micro).s;
    s.throw_at_3 = true;
    s.throw_in_first = t.in_first;
    s.abandon = t.abandon;
    const Outcome o = Train(dist, s);
    ASSERT_EQ(o.abandoned.size(), 1u) << Errors(o);
    EXPECT_THAT(o.abandoned[0], HasSubstr("step 3: ABORTED"));
    EXPECT_THAT(o.abandoned[0], HasSubstr("abandoned on every rank: rank(s) 1 failed"));
    if (dist.rank() == 1) EXPECT_THAT(Errors(o), HasSubstr("injected failure inside backward"));
  });
}

INSTANTIATE_TEST_SUITE_P(Ways, ExceptionInBackwardTest, ::testing::ValuesIn(ThrownCases()),
                         [](const auto& info) {
                           return absl::StrCat(info.param.abandon,
                                               info.param.in_first ? "_first" : "_synced", "_world",
                                               info.param.world, "_micro", info.param.micro);
                         });

TEST(ConformanceTest, FreezingAfterAttachIsRefusedByName) {
  RunOnRanks(2, [](DistContext& dist) {
    Scenario s = Make("reverse", 2, 3).s;
    s.change_requires_grad = "unfreeze";
    EXPECT_THAT(Errors(Train(dist, s)), HasSubstr("parameter 'l2.weight' no longer requires grad"));
  });
}

TEST(ConformanceTest, ThawingAfterAttachIsRefusedByName) {
  RunOnRanks(2, [](DistContext& dist) {
    Scenario s = Make("tied_sgd", 2, 3).s;
    s.change_requires_grad = "thaw";
    EXPECT_THAT(Errors(Train(dist, s)),
                HasSubstr("parameter 'proj.weight' was frozen at GradSync::Attach and requires "
                          "grad now"));
  });
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

class DdpTest : public ::testing::TestWithParam<Conf> {};

// Rank 0's parameters and buffers after five steps on two ranks against
// ddp_peer.py's, which trains the same case with the same split under
// DistributedDataParallel.
TEST_P(DdpTest, ParametersEqualPyTorchDdpAfterFiveSteps) {
  if (evenstep::testing::RankOfThisProcess() < 0 && !PythonHasTorch()) {
    GTEST_SKIP() << "no torch in " << EVENSTEP_PEER_PYTHON
                 << " (apt install python3-torch): the comparison with PyTorch DDP did not run";
  }
  const Conf c = GetParam();
  RunOnRanks(2, [c](DistContext& dist) {
    Scenario s = c.s;
    s.out = RanksDir() + "/evenstep.json";
    const Outcome o = Train(dist, s);
    EXPECT_TRUE(o.abandoned.empty()) << Errors(o);
  });
  auto [code, output] = evenstep::testing::RunShell(
      absl::StrCat(EVENSTEP_PEER_PYTHON, " ", EVENSTEP_SOURCE_DIR, "/tests/ddp_peer.py --case ",
                   c.s.case_name, " --micro ", c.s.micro, c.s.keep_grad ? " --keep_grad" : "",
                   c.s.create_graph ? " --create_graph" : "", " --out ", RanksDir(), "/ddp.json",
                   // The peer zeroes gradients the way this build's libtorch
                   // does (2.x: zero_grad() resets them to undefined).
                   TORCH_VERSION_MAJOR >= 2 ? " --zero_grad_to_none" : "", " 2>&1"),
      evenstep::testing::HangBound(4));
  ASSERT_EQ(code, 0) << output;
  const nlohmann::json ours = ReadJson(RanksDir() + "/evenstep.json");
  const nlohmann::json ddp = ReadJson(RanksDir() + "/ddp.json");
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
      EXPECT_LE(diff / scale, 1e-5) << c.s.case_name << " " << key;
    }
  }
}

// mixed is not here: Gloo in torch 1.13 reduces no bf16 (DDP fails on it).
// tied_sgd only against 1.13: with torch 2.8, libtorch's C++ SGD and
// Python's SGD disagree on it even in one process without any sync (Python
// single process = DDP to 8e-8; libtorch single process = evenstep; the two
// 0.05 apart), so the comparison would test the optimizers, not the sync;
// the single-process conformance case still covers it there.
// sparse with one micro-step: one synced backward (the bitmap case);
// one_param and control_flow: DDP's own scenarios; keep_grad: no zero_grad
// (DDP averages kept gradients back to themselves).
std::vector<Conf> DdpCases() {
  std::vector<Conf> cases;
  for (const char* name :
       {"tied_adam", "sparse", "batchnorm", "layout", "reverse", "control_flow"}) {
    cases.push_back(Make(name, 2, 3));
  }
  if (TORCH_VERSION_MAJOR < 2) cases.push_back(Make("tied_sgd", 2, 3));
  cases.push_back(Make("sparse", 2, 1, "_micro1"));
  cases.push_back(Make("control_flow", 2, 1, "_micro1"));
  // Not zero_features: DDP 1.13 over Gloo fails in its first broadcast ("The
  // size of tensor a (6) must match the size of tensor b (0)"); GradSync
  // matches one process there (ConformanceTest zero_features_*).
  cases.push_back(Make("one_param", 2, 1, "_micro1_keep_grad", KeepGrad));
  cases.push_back(Make("one_param", 2, 3, "_keep_grad_create_graph", KeepGradCreateGraph));
  cases.push_back(Make("sparse", 2, 3, "_keep_grad", KeepGrad));
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Cases, DdpTest, ::testing::ValuesIn(DdpCases()), [](const auto& info) {
  return info.param.s.case_name + info.param.label;
});

}  // namespace
}  // namespace evenstep

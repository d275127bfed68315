// A seeded fuzz over programs that DDP users write, on real ranks (Gloo on
// 127.0.0.1), each rank beside a single-process reference. A program, from
// its seed: two models (tests/testing/conformance_models.h's Random: a
// sparse or dense embedding, layers used by random subsets of ranks and
// steps, a frozen layer), each with its own GradSync on its own group
// (DistContext::NewDataGroup), driven in the same order on every rank, with
// GradSync::SetStep; 1-3 micro-steps per rank, model and step; an idle rank
// (every fourth seed); after each step one of four zero_grad modes (the
// optimizer's, in place, to none, none at all: gradients kept into the next
// step); the probe pattern (a backward with sync off after the optimizer
// step, before zero_grad); and, in some steps, an exception on one rank at
// one of four points (before the model's first forward, at the very start
// of the synchronised backward before any gradient, in an unsynchronised
// micro-step, inside the synchronised backward after most gradients), the
// program catching it with AbandonStep (half the seeds) or leaving the rest
// of the step without it (the other half).
//
// The rule, per model and step: every rank applied it and its parameters
// equal the reference's (max relative error <= 1e-5), or every rank ended
// it with ABORTED naming the thrower (abandoned alike), or every rank ends
// its run with the named pairing error (FailedPrecondition "reduced together
// with another step's", or "out of order" where the ranks began different
// models' synchronisations) and nothing of that synchronisation was applied.
// No rank aborts, and nobody waits for a collective timeout (60 s, far
// above the hang bound's share of a test).
//
// EVENSTEP_PROGRAM_FUZZ_SEEDS=N runs N seeds per world instead of the CI's
// bounded 12 (docs/development.md has a longer run's figures).
#include <torch/torch.h>

#include <cstdlib>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "evenstep/grad_sync.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/testing/conformance_models.h"
#include "tests/testing/on_ranks.h"

namespace evenstep {
namespace {

namespace conformance = ::evenstep::testing::conformance;
using conformance::Mix;
using conformance::Tensor;
using ::evenstep::testing::RanksDir;
using ::evenstep::testing::RunOnRanks;

constexpr int kSteps = 6;
constexpr int kModels = 2;
enum Point { kBefore, kStart, kUnsynced, kInside };
const char* const kPointNames[] = {"before", "start", "unsynced", "inside"};
enum ZeroMode { kOptimizer, kInPlace, kToNone, kKeep };

// What the program does, from its seed (the same on every rank).
struct Program {
  uint64_t seed = 0;
  int world = 2;
  bool abandon = true;  // catches with AbandonStep
  int idle = -1;
  // The exception of step s, if any: rank, model and point.
  bool Throws(int step) const { return step < kSteps && Mix(seed, step, 77) % 3 == 0; }
  int Thrower(int step) const {
    const int working = idle >= 0 ? world - 1 : world;
    return static_cast<int>(Mix(seed, step, 78) % working);
  }
  int ThrowModel(int step) const { return static_cast<int>(Mix(seed, step, 79) % 2); }
  Point ThrowPoint(int step) const { return static_cast<Point>(Mix(seed, step, 80) % 4); }
  ZeroMode Zero(int step) const { return static_cast<ZeroMode>(Mix(seed, step, 81) % 4); }
  bool Probe(int step) const { return Zero(step) != kKeep && Mix(seed, step, 82) % 2 == 0; }
};

Program MakeProgram(uint64_t seed, int world) {
  Program p;
  p.seed = seed;
  p.world = world;
  p.abandon = seed % 2 == 0;
  p.idle = seed % 4 == 3 ? world - 1 : -1;
  return p;
}

void ZeroGrads(conformance::Case& m, torch::optim::Optimizer& opt, ZeroMode mode) {
  if (mode == kKeep) return;
  if (mode == kOptimizer) {
    opt.zero_grad();
    return;
  }
  torch::NoGradGuard no_grad;
  for (auto& p : m.parameters()) {
    if (!p.grad().defined()) continue;
    if (mode == kToNone) {
      p.mutable_grad() = Tensor();
    } else {
      p.mutable_grad().zero_();
    }
  }
}

struct Injected : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// One model of one rank: its case, optimizer, sync and reference.
struct Model {
  std::shared_ptr<conformance::Case> net, ref;
  std::unique_ptr<torch::optim::Optimizer> opt, ref_opt;
  std::unique_ptr<Subgroup> group;  // its own (DistContext::NewDataGroup)
  std::unique_ptr<GradSync> sync;
};

// This rank's micro-steps of `model` in `step`, throwing where the program
// says; an injected exception is an Injected.
void MicroSteps(Model& m, const Program& p, int step, int rank,
                const std::vector<std::vector<int64_t>>& mine, int index) {
  const bool throws = p.Throws(step) && p.Thrower(step) == rank && p.ThrowModel(step) == index;
  const Point point = p.ThrowPoint(step);
  const int n = static_cast<int>(mine.size());
  if (throws && point == kBefore) throw Injected("injected before the first forward");
  for (int k = 0; k < n; ++k) {
    const bool last = k + 1 == n;
    m.sync->set_sync_enabled(last);
    Tensor loss = m.net->Loss(mine[k], step, rank) / conformance::kN;
    const bool here = throws && (point == kUnsynced ? k == 0 : last);
    if (here && (point == kStart || point == kUnsynced)) {
      loss.register_hook(
          [](Tensor g) -> Tensor { throw Injected("injected at backward's start"); });
    }
    Tensor embed = static_cast<conformance::Random&>(*m.net).embed->weight;
    int handle = -1;
    if (here && point == kInside) {
      handle = embed.register_hook(
          [](Tensor g) -> Tensor { throw Injected("injected inside the synced backward"); });
    }
    if (last) {
      if (absl::Status s = m.sync->PrepareForBackward(loss); !s.ok()) {
        throw std::runtime_error(s.ToString());
      }
    }
    try {
      loss.backward();
    } catch (...) {
      if (handle >= 0) embed.remove_hook(handle);
      throw;
    }
    if (handle >= 0) embed.remove_hook(handle);
  }
}

// The program on this rank: per model and step, "ok", "aborted", "pairing",
// "threw" (this rank's own exception, step left without AbandonStep),
// "skipped" (the rest of a step left) or "stopped"; EXPECTs the reference.
std::vector<std::vector<std::string>> RunProgram(DistContext& dist, const Program& p) {
  const int world = dist.world_size(), rank = dist.rank();
  std::vector<Model> models(kModels);
  std::vector<std::vector<std::string>> record(kModels);
  for (int i = 0; i < kModels; ++i) {
    Model& m = models[i];
    m.net = conformance::MakeCase("random", p.seed * 10 + i);
    m.ref = conformance::MakeCase("random", p.seed * 10 + i);
    m.opt = m.net->Optimizer();
    m.ref_opt = m.ref->Optimizer();
    GradSyncOptions options;
    options.timeout = absl::Seconds(60);
    options.bucket_cap_bytes = 256;
    options.first_bucket_cap_bytes = 64;
    auto group = dist.NewDataGroup();
    EXPECT_TRUE(group.ok()) << group.status();
    if (!group.ok()) return record;
    m.group = std::move(*group);
    auto sync = GradSync::Attach(*m.net, m.group->process_group(), options);
    EXPECT_TRUE(sync.ok()) << sync.status();
    if (!sync.ok()) return record;
    m.sync = std::move(*sync);
  }
  bool stopped = false;  // a pairing error (fatal) ends the program, as it would a real one
  for (int step = 1; step <= kSteps; ++step) {
    bool leave_step = false;
    for (int i = 0; i < kModels; ++i) {
      Model& m = models[i];
      if (stopped || leave_step) {
        record[i].push_back(stopped ? "stopped" : "skipped");
        continue;
      }
      auto* random = static_cast<conformance::Random*>(m.net.get());
      std::vector<std::vector<std::vector<int64_t>>> split(world);
      for (int r = 0; r < world; ++r) {
        split[r] = conformance::Split(world, p.idle, random->Micro(step, r))[r];
      }
      m.sync->SetStep(step);
      const int64_t syncs_before = m.sync->syncs_completed();
      std::string outcome = "ok";
      try {
        if (rank == p.idle) {
          if (absl::Status s = m.sync->SyncNow(); !s.ok()) throw std::runtime_error(s.ToString());
        } else {
          MicroSteps(m, p, step, rank, split[rank], i);
        }
        if (!m.sync->status().ok()) throw std::runtime_error(m.sync->status().ToString());
      } catch (const std::exception& e) {
        // The engine may rethrow the hook's exception as its own type.
        const bool mine = absl::StrContains(e.what(), "injected");
        if (p.abandon) m.sync->AbandonStep(absl::InternalError(e.what())).IgnoreError();
        const absl::Status s = m.sync->status();
        if (!m.sync->fatal_status().ok()) {
          outcome = "pairing";
          EXPECT_THAT(std::string(m.sync->fatal_status().message()),
                      ::testing::AnyOf(::testing::HasSubstr("reduced together with another"),
                                       ::testing::HasSubstr("gradient syncs are out of order")))
              << "model " << i << " step " << step;
        } else if (mine && !p.abandon && m.sync->syncs_completed() == syncs_before) {
          outcome = "threw";  // its synchronisation never began
        } else {
          outcome = s.code() == absl::StatusCode::kAborted ? "aborted" : s.ToString();
        }
        if (!p.abandon) leave_step = true;
      }
      record[i].push_back(outcome);
      if (outcome == "ok") {
        m.opt->step();
        if (p.Probe(step) && rank != p.idle) {  // a backward with sync off, then zero_grad
          m.sync->set_sync_enabled(false);
          (m.net->Loss(split[rank][0], step, rank) / conformance::kN).backward();
          m.sync->set_sync_enabled(true);
        }
        ZeroGrads(*m.net, *m.opt, p.Zero(step));
        conformance::ReferenceStep(*m.ref, *m.ref_opt, step, world, split, true);
        ZeroGrads(*m.ref, *m.ref_opt, p.Zero(step));
      } else {
        m.sync->set_sync_enabled(true);
        stopped = outcome == "pairing";
        ZeroGrads(*m.net, *m.opt, kToNone);  // a kept gradient went with the abandoned step
        ZeroGrads(*m.ref, *m.ref_opt, kToNone);
      }
      auto mine = conformance::UniqueParams(*m.net), want = conformance::UniqueParams(*m.ref);
      for (size_t j = 0; j < mine.size(); ++j) {
        EXPECT_LE(conformance::MaxRelError(mine[j].second, want[j].second), 1e-5)
            << "model " << i << " step " << step << " (" << outcome << "): " << mine[j].first;
      }
    }
  }
  return record;
}

class ProgramFuzzTest : public ::testing::TestWithParam<int> {};

// The outcome rule across ranks for one program (see the top of the file).
void ExpectOutcomeRule(const Program& p, const std::vector<nlohmann::json>& ranks,
                       std::map<std::string, int>* tally) {
  // Model-steps in the order a rank runs them: step by step, model by model.
  auto order = [](int model, int s) { return s * kModels + model; };
  const int none = order(kModels, kSteps);
  int first_pairing = none;  // the program's first model-step with a pairing error
  for (const nlohmann::json& r : ranks) {
    for (int i = 0; i < kModels; ++i) {
      for (int s = 0; s < kSteps; ++s) {
        if (r[i][s] == "pairing") first_pairing = std::min(first_pairing, order(i, s));
      }
    }
  }
  const std::string program = absl::StrCat("seed ", p.seed, " world ", p.world, " (",
                                           p.abandon ? "" : "no ", "AbandonStep)");
  if (p.abandon) EXPECT_EQ(first_pairing, none) << program << ": a pairing error";
  for (int i = 0; i < kModels; ++i) {
    for (int s = 0; s < kSteps; ++s) {
      std::map<std::string, int> seen;
      for (const nlohmann::json& r : ranks) ++seen[r[i][s].get<std::string>()];
      const std::string where = absl::StrCat(program, " model ", i, " step ", s + 1);
      if (seen.count("ok")) {
        EXPECT_EQ(seen["ok"], p.world) << where << ": applied on some ranks only";
        EXPECT_LT(order(i, s), first_pairing) << where << ": applied at or after a pairing error";
      }
      if (seen.count("aborted")) EXPECT_EQ(seen["aborted"], p.world) << where;
      for (const auto& [what, count] : seen) {
        EXPECT_TRUE(what == "ok" || what == "aborted" || what == "pairing" || what == "threw" ||
                    what == "skipped" || what == "stopped")
            << where << ": " << what;
        // A rank that left a step before its synchronisation began may be
        // named later, in another model (the synchronisation it began next).
        if (what == "pairing" || what == "stopped") EXPECT_LE(first_pairing, order(i, s)) << where;
        if (what == "threw") EXPECT_LT(first_pairing, none) << where << ": a throw not named";
      }
      ++(*tally)[seen.size() == 1 ? seen.begin()->first : "mixed"];
    }
  }
  if (first_pairing == none) return;
  // Every rank ends its run with the named error (in some model).
  for (size_t r = 0; r < ranks.size(); ++r) {
    bool named = false;
    for (int i = 0; i < kModels; ++i) {
      for (int s = 0; s < kSteps; ++s) named |= ranks[r][i][s] == "pairing";
    }
    EXPECT_TRUE(named) << program << ": rank " << r << " never saw the pairing error";
  }
}

int Seeds() {
  const char* env = std::getenv("EVENSTEP_PROGRAM_FUZZ_SEEDS");
  return env != nullptr ? std::max(1, std::atoi(env)) : 12;
}

TEST_P(ProgramFuzzTest, EveryStepIsExactOrEndsAlikeOnEveryRankNeverAnAbort) {
  const int world = GetParam();
  const int seeds = Seeds();
  RunOnRanks(world, [seeds](DistContext& dist) {
    // Every seed's program on this context (each model on its own group).
    nlohmann::json all = nlohmann::json::array();
    for (int seed = 1; seed <= seeds; ++seed) {
      const Program p = MakeProgram(seed, dist.world_size());
      SCOPED_TRACE(absl::StrCat("seed ", seed));
      all.push_back(RunProgram(dist, p));
      if (::testing::Test::HasFailure()) break;
    }
    std::ofstream(RanksDir() + "/rank-" + std::to_string(dist.rank()) + ".json") << all.dump();
  });
  std::vector<nlohmann::json> ranks;
  for (int r = 0; r < world; ++r) {
    std::ifstream in(RanksDir() + "/rank-" + std::to_string(r) + ".json");
    ranks.push_back(nlohmann::json::parse(in, nullptr, false));
    ASSERT_TRUE(ranks.back().is_array()) << "rank " << r << " left no record";
  }
  std::map<std::string, int> tally;
  for (size_t k = 0; k < ranks[0].size(); ++k) {
    std::vector<nlohmann::json> of_seed;
    for (const nlohmann::json& r : ranks) of_seed.push_back(r.at(k));
    ExpectOutcomeRule(MakeProgram(k + 1, world), of_seed, &tally);
  }
  std::string line;
  for (const auto& [what, count] : tally) absl::StrAppend(&line, " ", what, "=", count);
  std::cout << "program fuzz: world " << world << ", " << ranks[0].size()
            << " programs, model-steps:" << line << std::endl;
}

INSTANTIATE_TEST_SUITE_P(Worlds, ProgramFuzzTest, ::testing::Values(2, 3),
                         [](const auto& info) { return absl::StrCat("world", info.param); });

}  // namespace
}  // namespace evenstep

// What DDP users' programs do that the gradient sync must survive without a
// wrong number or an abort, over real ranks (Gloo on 127.0.0.1), each
// compared with one process's gradient or expected to end with the same
// named error on every rank:
// - a sparse embedding whose gradient was zeroed in place (libtorch 1.13's
//   zero_grad leaves every dimension sparse) beside a rank that adds rows:
//   the ranks' sparse payloads differed in layout and Gloo aborted;
// - an input-gradient probe (a backward with sync off) after a step, then
//   zero_grad (in place, or set to none): its kept copy and use marks were
//   subtracted at the next synchronisation;
// - a kept gradient scaled in place, with or without a probe's addition:
//   refused;
// - two GradSyncs on one process group: refused at Attach; on groups of
//   their own (DistContext::NewDataGroup), driven by one backward whose
//   launch order differs per rank: exact;
// - a rank that left a step between two GradSyncs' backward passes without
//   AbandonStep: named on every rank at once, not after the timeout;
// - a collective of the program's own on the sync's group that shifts the
//   pairing: every rank names the mispaired synchronisation, applies
//   nothing, and the DistContext refuses its next collective at once;
// - a rank that left a step before any gradient without AbandonStep: named
//   by the caller's step number (GradSync::SetStep) on every rank;
// - model parts whose optimizers do not hold exactly their own parameters;
// - an earlier part's BatchNorm statistics changed by a later part's
//   forward: rank 0's on every rank after the step.
#include <torch/torch.h>

#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "evenstep/balanced_step.h"
#include "evenstep/grad_sync.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/on_ranks.h"
#include "tests/testing/sync_net.h"

namespace evenstep {
namespace {

using ::evenstep::testing::ExpectGradsNear;
using ::evenstep::testing::GlobalSyncBatch;
using ::evenstep::testing::kSyncBatch;
using ::evenstep::testing::MakeSyncNet;
using ::evenstep::testing::MaxRelError;
using ::evenstep::testing::RunOnRanks;
using ::evenstep::testing::ScaledLoss;
using ::evenstep::testing::SyncBatch;
using ::evenstep::testing::TinyBuckets;
using ::testing::HasSubstr;

// Rank r's samples of a step: {r + step, r + step + world, ...}.
torch::Tensor Samples(int rank, int world, int step) {
  return torch::arange(rank + step, kSyncBatch, world);
}

// The program's zero_grad: in place (libtorch 1.13's Optimizer::zero_grad)
// or set to none (2.x's default).
void ZeroGrads(torch::nn::Module& net, bool to_none) {
  torch::NoGradGuard no_grad;
  for (auto& p : net.parameters()) {
    if (!p.grad().defined()) continue;
    if (to_none) {
      p.mutable_grad() = torch::Tensor();
    } else {
      p.mutable_grad().zero_();
    }
  }
}

struct SafetyCase {
  int world;
  bool to_none;
};

class SyncSafetyTest : public ::testing::TestWithParam<SafetyCase> {};
// The program classes at worlds 2 and 3.
class WorldTest : public ::testing::TestWithParam<int> {};

struct Bag : torch::nn::Module {
  Bag() {
    torch::manual_seed(3);
    emb = register_module("emb",
                          torch::nn::Embedding(torch::nn::EmbeddingOptions(10, 4).sparse(true)));
    head = register_module("head", torch::nn::Linear(4, 1));
  }
  // Sum over `ids` of head(emb(id)), or of head(ones) without the embedding.
  torch::Tensor Loss(const torch::Tensor& ids, bool use_emb) {
    torch::Tensor h = use_emb ? emb->forward(ids) : torch::ones({ids.size(0), 4});
    return head->forward(h).pow(2).sum();
  }
  torch::nn::Embedding emb{nullptr};
  torch::nn::Linear head{nullptr};
};

TEST_P(SyncSafetyTest, SparseGradientInAnyLayoutBesideAnIdleRank) {
  const SafetyCase c = GetParam();
  RunOnRanks(c.world, [c](DistContext& dist) {
    const int rank = dist.rank(), world = dist.world_size();
    auto ids = [world](int r, int step) { return torch::arange(r + step, 10, world); };
    Bag net;
    auto sync = GradSync::Attach(net, dist.data_group(), TinyBuckets());
    ASSERT_TRUE(sync.ok()) << sync.status();
    // Step 1: every rank adds rows.
    (*sync)->SetStep(0);
    net.Loss(ids(rank, 0), true).backward();
    ASSERT_TRUE((*sync)->status().ok()) << (*sync)->status();
    ZeroGrads(net, c.to_none);
    // Step 2: only rank 0 touches the embedding.
    (*sync)->SetStep(1);
    net.Loss(ids(rank, 1), rank == 0).backward();
    ASSERT_TRUE((*sync)->status().ok()) << (*sync)->status();
    Bag ref;
    for (int r = 0; r < world; ++r) ref.Loss(ids(r, 1), r == 0).backward();
    ASSERT_TRUE(net.emb->weight.grad().defined()) << "rank " << rank;
    EXPECT_LE(MaxRelError(net.emb->weight.grad().to_dense(), ref.emb->weight.grad().to_dense()),
              1e-5)
        << "rank " << rank << ": the embedding's gradient";
    EXPECT_LE(MaxRelError(net.head->weight.grad(), ref.head->weight.grad()), 1e-5)
        << "rank " << rank << ": the head's gradient";
  });
}

TEST_P(SyncSafetyTest, AProbeBackwardBetweenStepsIsForgottenOnceZeroed) {
  const SafetyCase c = GetParam();
  RunOnRanks(c.world, [c](DistContext& dist) {
    const int rank = dist.rank(), world = dist.world_size();
    const SyncBatch batch = GlobalSyncBatch();
    auto net = MakeSyncNet(5, torch::kCPU, testing::kSyncHidden, /*with_extra=*/true);
    auto sync = GradSync::Attach(*net, dist.data_group(), TinyBuckets());
    ASSERT_TRUE(sync.ok()) << sync.status();
    (*sync)->SetStep(0);
    ScaledLoss(*net, batch, Samples(rank, world, 0)).backward();
    // The probe: a gradient of the inputs, computed with sync off; it also
    // accumulates into the parameters (the extra layer on rank 1 only).
    (*sync)->set_sync_enabled(false);
    ScaledLoss(*net, batch, Samples(rank, world, 1), /*use_extra=*/rank == 1).backward();
    (*sync)->set_sync_enabled(true);
    ZeroGrads(*net, c.to_none);
    (*sync)->SetStep(1);
    ScaledLoss(*net, batch, Samples(rank, world, 2)).backward();
    ASSERT_TRUE((*sync)->status().ok()) << (*sync)->status();
    auto ref = MakeSyncNet(5, torch::kCPU, testing::kSyncHidden, true);
    for (int r = 0; r < world; ++r) ScaledLoss(*ref, batch, Samples(r, world, 2)).backward();
    for (const auto& name : {"l1.weight", "l2.weight", "l3.bias", "l4.weight"}) {
      EXPECT_LE(
          MaxRelError(net->named_parameters()[name].grad(), ref->named_parameters()[name].grad()),
          1e-5)
          << "rank " << rank << ": " << name << " after the probe";
    }
    // The extra layer, used by the probe only and zeroed since, is unused
    // everywhere: as in one process, what zero_grad left stays.
    const torch::Tensor extra = net->extra->weight.grad();
    if (c.to_none) {
      EXPECT_FALSE(extra.defined()) << "rank " << rank;
    } else if (extra.defined()) {
      EXPECT_EQ(extra.abs().sum().item<double>(), 0) << "rank " << rank;
    }
  });
}

INSTANTIATE_TEST_SUITE_P(Worlds, SyncSafetyTest,
                         ::testing::Values(SafetyCase{2, false}, SafetyCase{2, true},
                                           SafetyCase{3, false}, SafetyCase{3, true}),
                         [](const auto& info) {
                           return absl::StrCat("world", info.param.world,
                                               info.param.to_none ? "_to_none" : "_in_place");
                         });

// A kept gradient scaled in place, after a probe's backward added to it or
// right after the synchronisation wrote it (it used to count once per rank:
// world times too much): refused by name on every rank, nothing survives.
class KeptScaledTest : public ::testing::TestWithParam<std::tuple<int, bool>> {};

TEST_P(KeptScaledTest, AKeptGradientScaledInPlaceIsRefusedByName) {
  const auto [world_size, probe] = GetParam();
  RunOnRanks(world_size, [probe = probe](DistContext& dist) {
    const int rank = dist.rank(), world = dist.world_size();
    const SyncBatch batch = GlobalSyncBatch();
    auto net = MakeSyncNet(5);
    auto sync = GradSync::Attach(*net, dist.data_group(), TinyBuckets());
    ASSERT_TRUE(sync.ok()) << sync.status();
    (*sync)->SetStep(0);
    ScaledLoss(*net, batch, Samples(rank, world, 0)).backward();
    if (probe) {
      (*sync)->set_sync_enabled(false);
      ScaledLoss(*net, batch, Samples(rank, world, 1)).backward();  // adds to the kept gradient
      (*sync)->set_sync_enabled(true);
    }
    {
      torch::NoGradGuard no_grad;
      for (auto& p : net->parameters()) p.mutable_grad().mul_(0.5);
    }
    std::string error;
    (*sync)->SetStep(1);
    try {
      ScaledLoss(*net, batch, Samples(rank, world, 2)).backward();
    } catch (const std::exception& e) {
      error = e.what();
    }
    EXPECT_THAT(error, HasSubstr(probe ? "changed it in place"
                                       : "was kept from the last synchronisation (no zero_grad) "
                                         "and changed in place"))
        << "rank " << rank;
    EXPECT_THAT(error, HasSubstr("abandoned on every rank")) << "rank " << rank;
    for (const auto& p : net->parameters()) {
      EXPECT_FALSE(p.grad().defined()) << "rank " << rank << ": a gradient survived the refusal";
    }
    if (!probe) return;
    // The next synchronisation starts clean and is exact.
    (*sync)->SetStep(2);
    ScaledLoss(*net, batch, Samples(rank, world, 3)).backward();
    ASSERT_TRUE((*sync)->status().ok()) << (*sync)->status();
    auto ref = MakeSyncNet(5);
    {
      // The reference starts from the same (unstepped) weights.
      for (int r = 0; r < world; ++r) ScaledLoss(*ref, batch, Samples(r, world, 3)).backward();
    }
    ExpectGradsNear(*net, *ref, 1e-5, absl::StrCat("rank ", rank, " after the refusal"));
  });
}

INSTANTIATE_TEST_SUITE_P(WorldsAndProbe, KeptScaledTest,
                         ::testing::Combine(::testing::Values(2, 3), ::testing::Bool()),
                         [](const auto& info) {
                           return absl::StrCat(
                               "world", std::get<0>(info.param),
                               std::get<1>(info.param) ? "_after_a_probe" : "_alone");
                         });

TEST_P(WorldTest, ASharedGroupIsRefusedAndOwnGroupsAreExact) {
  RunOnRanks(GetParam(), [](DistContext& dist) {
    const int rank = dist.rank(), world = dist.world_size();
    const SyncBatch batch = GlobalSyncBatch();
    auto d = MakeSyncNet(5, torch::kCPU, testing::kSyncHidden, /*with_extra=*/true);
    auto g = MakeSyncNet(6, torch::kCPU, testing::kSyncHidden, /*with_extra=*/true);
    auto sync_d = GradSync::Attach(*d, dist.data_group(), TinyBuckets());
    ASSERT_TRUE(sync_d.ok()) << sync_d.status();
    auto shared = GradSync::Attach(*g, dist.data_group(), TinyBuckets());
    ASSERT_FALSE(shared.ok()) << "rank " << rank << ": a second GradSync on one group";
    EXPECT_THAT(std::string(shared.status().message()), HasSubstr("NewDataGroup"));
    auto own = dist.NewDataGroup();
    ASSERT_TRUE(own.ok()) << own.status();
    auto sync_g = GradSync::Attach(*g, (*own)->process_group(), TinyBuckets());
    ASSERT_TRUE(sync_g.ok()) << sync_g.status();
    // One backward drives both syncs; D's extra branch only on rank 0, so
    // the buckets become ready in another order on each rank.
    for (int step = 0; step < 2; ++step) {
      (*sync_d)->SetStep(step);
      (*sync_g)->SetStep(step);
      ZeroGrads(*d, true);
      ZeroGrads(*g, true);
      const torch::Tensor idx = Samples(rank, world, step);
      (ScaledLoss(*d, batch, idx, /*use_extra=*/rank == 0) + ScaledLoss(*g, batch, idx, true))
          .backward();
      ASSERT_TRUE((*sync_d)->status().ok()) << (*sync_d)->status();
      ASSERT_TRUE((*sync_g)->status().ok()) << (*sync_g)->status();
      auto ref_d = MakeSyncNet(5, torch::kCPU, testing::kSyncHidden, true);
      auto ref_g = MakeSyncNet(6, torch::kCPU, testing::kSyncHidden, true);
      for (int r = 0; r < world; ++r) {
        const torch::Tensor ridx = Samples(r, world, step);
        (ScaledLoss(*ref_d, batch, ridx, r == 0) + ScaledLoss(*ref_g, batch, ridx, true))
            .backward();
      }
      ExpectGradsNear(*d, *ref_d, 1e-5, absl::StrCat("rank ", rank, " step ", step, " D"));
      ExpectGradsNear(*g, *ref_g, 1e-5, absl::StrCat("rank ", rank, " step ", step, " G"));
    }
  });
}

// Two raw GradSyncs (G's, then D's, each on a data group of its own, SetStep
// on both), and rank 1 leaves step 1 after G's synchronised backward (an
// exception caught without AbandonStep): its G synchronisation of step 2
// used to wait for peers that wait in D's of step 1, until the collective
// timeout. Every rank names it at once (GradSync's timeout here is far
// longer than the test's), nothing of it is applied, and every later
// synchronisation of either GradSync fails at once.
TEST_P(WorldTest, ARankThatLeftAStepBetweenTwoGradSyncsIsNamedAtOnce) {
  RunOnRanks(GetParam(), [](DistContext& dist) {
    const int rank = dist.rank();
    torch::manual_seed(1);
    torch::nn::Linear g(3, 3), d(3, 1);
    GradSyncOptions options;
    options.timeout = absl::Minutes(30);
    auto own = dist.NewDataGroup();
    ASSERT_TRUE(own.ok()) << own.status();
    auto sync_g = GradSync::Attach(*g, dist.data_group(), options);
    auto sync_d = GradSync::Attach(*d, (*own)->process_group(), options);
    ASSERT_TRUE(sync_g.ok() && sync_d.ok());
    std::string error;
    int failed_at = -1;
    for (int step = 0; step < 3 && error.empty(); ++step) {
      (*sync_g)->SetStep(step);
      (*sync_d)->SetStep(step);
      ZeroGrads(*g, true);
      ZeroGrads(*d, true);
      const torch::Tensor x = torch::ones({4, 3}) * (step + 1);
      try {
        g->forward(x).sum().backward();
        if (rank == 1 && step == 1) continue;  // "threw" before D's backward, went on
        d->forward(x).sum().backward();
      } catch (const std::exception& e) {
        error = e.what();
        failed_at = step;
      }
    }
    EXPECT_EQ(failed_at, rank == 1 ? 2 : 1) << error;
    EXPECT_THAT(error, HasSubstr("gradient syncs are out of order")) << "rank " << rank;
    EXPECT_THAT(error, HasSubstr(absl::StrCat("rank 1", rank == 1 ? " (here)" : "",
                                              " at data group 1 step 2")))
        << "rank " << rank;
    EXPECT_THAT(error, HasSubstr(absl::StrCat("rank 0", rank == 0 ? " (here)" : "",
                                              " at data group 2 step 1")))
        << "rank " << rank;
    torch::nn::Linear& failed = rank == 1 ? g : d;
    EXPECT_FALSE(failed->weight.grad().defined()) << "rank " << rank << ": something was applied";
    // Whatever the program does next, no synchronisation pairs any more.
    (*sync_d)->SetStep(3);
    std::string next;
    try {
      d->forward(torch::ones({4, 3})).sum().backward();
    } catch (const std::exception& e) {
      next = e.what();
    }
    EXPECT_THAT(next, HasSubstr("out of order")) << "rank " << rank;
  });
}

TEST_P(WorldTest, AMispairedSynchronisationIsNamedOnEveryRankAndNothingApplied) {
  RunOnRanks(GetParam(), [](DistContext& dist) {
    const int rank = dist.rank();
    torch::manual_seed(1);
    torch::nn::Linear lin(3, 2);  // 8 gradients in one bucket with the control values
    GradSyncOptions options;
    options.rebuild_buckets = false;
    options.timeout = absl::Seconds(30);
    auto sync = GradSync::Attach(*lin, dist.data_group(), options);
    ASSERT_TRUE(sync.ok()) << sync.status();
    ASSERT_EQ((*sync)->num_buckets(), 1);
    // The bucket: 8 gradients, then failure flags, synchronisation numbers
    // and step numbers (one per rank each) and 2 used flags.
    const int64_t bucket = 8 + 3 * dist.world_size() + 2;
    auto raw = [&dist, bucket] {
      std::vector<at::Tensor> v{torch::zeros({bucket})};
      dist.data_group().allreduce(v)->wait();
    };
    // Rank 1's own collective on the sync's group comes first: the others'
    // bucket pairs with it, and rank 1's bucket with their next one.
    if (rank == 1) raw();
    std::string error;
    (*sync)->SetStep(0);
    try {
      lin->forward(torch::ones({4, 3})).sum().backward();
    } catch (const std::exception& e) {
      error = e.what();
    }
    if (rank != 1) raw();
    // Named by the step numbers (the program's collective carried none).
    EXPECT_THAT(error, HasSubstr("was reduced together with another step's")) << "rank " << rank;
    EXPECT_THAT(error, HasSubstr("rank 1")) << "rank " << rank;
    EXPECT_FALSE(lin->weight.grad().defined()) << "rank " << rank << ": a mixed sum was applied";
    // The context knows: its next collective fails at once, naming the sync.
    torch::Tensor t = torch::ones({1});
    const absl::Status next = dist.AllReduce(t);
    EXPECT_FALSE(next.ok()) << "rank " << rank;
    EXPECT_THAT(std::string(next.message()), HasSubstr("reduced together with another"));
  });
}

// A loop over a raw GradSync whose rank 1 leaves step 1 before any gradient
// (an exception at the very start of backward) without AbandonStep: its
// next synchronisation has the number of its peers' current one, so only
// the caller's step number (SetStep) tells them apart; every rank names
// both steps and applies nothing, instead of reducing step 1 with step 2.
TEST_P(WorldTest, ARankThatSkippedAStepBeforeAnyGradientIsNamedByItsStep) {
  RunOnRanks(GetParam(), [](DistContext& dist) {
    const int rank = dist.rank();
    torch::manual_seed(1);
    torch::nn::Linear lin(3, 2);
    GradSyncOptions options;
    options.timeout = absl::Seconds(30);
    auto sync = GradSync::Attach(*lin, dist.data_group(), options);
    ASSERT_TRUE(sync.ok()) << sync.status();
    std::string error;
    int failed_at = -1;
    for (int step = 0; step < 3 && error.empty(); ++step) {
      (*sync)->SetStep(step);
      if (rank == 1 && step == 1) continue;  // "threw" before any gradient, skipped the step
      try {
        lin->forward(torch::ones({4, 3}) * (step + 1)).sum().backward();
      } catch (const std::exception& e) {
        error = e.what();
        failed_at = step;
      }
      if (error.empty()) ZeroGrads(*lin, false);
    }
    EXPECT_EQ(failed_at, rank == 1 ? 2 : 1) << error;
    EXPECT_THAT(error, HasSubstr(absl::StrCat("of step ", failed_at, " (GradSync::SetStep)")));
    EXPECT_THAT(error, HasSubstr(absl::StrCat("rank ", rank, " (here) at #", failed_at)));
    const int other = rank == 1 ? 0 : 1;
    EXPECT_THAT(error, HasSubstr(absl::StrCat("rank ", other, " at another (#", rank == 1 ? 1 : 2,
                                              " modulo 251)")));
    EXPECT_FALSE(lin->weight.grad().defined()) << "rank " << rank << ": a mixed sum was applied";
  });
}

// Model parts whose optimizers do not hold exactly their module's
// trainable parameters are refused before anything is synchronised.
TEST(SyncSafetyTest, APartsOptimizerMustHoldExactlyItsParameters) {
  RunOnRanks(1, [](DistContext& dist) {
    torch::nn::Linear encoder(3, 4), decoder(4, 2);
    std::vector<at::Tensor> both = encoder->parameters();
    for (const auto& p : decoder->parameters()) both.push_back(p);
    torch::optim::Adam over_both(both, torch::optim::AdamOptions(1e-3));
    torch::optim::Adam enc_only(encoder->parameters(), torch::optim::AdamOptions(1e-3));
    torch::optim::Adam dec_only(decoder->parameters(), torch::optim::AdamOptions(1e-3));
    torch::optim::SGD weight_only(std::vector<at::Tensor>{encoder->weight},
                                  torch::optim::SGDOptions(0.1));
    const std::vector<int64_t> lengths(64, 1);  // the default global batch
    auto status = [&](std::vector<ModelPart> parts) {
      return BalancedStep::Create(dist, std::move(parts), lengths, BalanceConfig()).status();
    };
    // One optimizer over two modules, given with one of them.
    absl::Status s = status({ModelPart("encoder", *encoder, over_both)});
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_THAT(std::string(s.message()), HasSubstr("2 tensor(s) that are not parameters"));
    EXPECT_THAT(std::string(s.message()), HasSubstr("container module"));
    // One optimizer in two parts.
    s = status(
        {ModelPart("encoder", *encoder, over_both), ModelPart("decoder", *decoder, over_both)});
    EXPECT_THAT(std::string(s.message()), HasSubstr("the same optimizer")) << s;
    // An optimizer that lacks a trainable parameter.
    s = status({ModelPart("encoder", *encoder, weight_only)});
    EXPECT_THAT(std::string(s.message()),
                HasSubstr("lacks 1 trainable parameter(s) of its module: 'bias'"))
        << s;
    // Frozen, the bias may stay out; and separate parts are accepted.
    encoder->bias.set_requires_grad(false);
    EXPECT_TRUE(status({ModelPart("encoder", *encoder, weight_only)}).ok());
    encoder->bias.set_requires_grad(true);
    s = status(
        {ModelPart("encoder", *encoder, enc_only), ModelPart("decoder", *decoder, dec_only)});
    EXPECT_TRUE(s.ok()) << s;
  });
}

// BalancedStep, one rank's backward throws after every gradient of its last
// micro-batch was synchronised (a hook on a branch the engine runs last):
// the gradient is whole, so every rank applies the step, nobody waits in
// the exchange for the rank that threw, and every rank's Step names it.
TEST_P(WorldTest, AThrowAfterEveryGradientWasSynchronisedIsNamedOnEveryRank) {
  RunOnRanks(GetParam(), [](DistContext& dist) {
    const int rank = dist.rank();
    torch::manual_seed(4);
    torch::nn::Linear net(3, 1);
    torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.1));
    auto step = BalancedStep::Create(dist, *net, opt, std::vector<int64_t>(64, 1), BalanceConfig());
    ASSERT_TRUE(step.ok()) << step.status();
    for (int s = 1; s <= 3; ++s) {
      auto report = (*step)->Step({[&](const MicroBatch& mb) {
        // Created before the model's nodes, so the engine runs its node last.
        torch::Tensor a = torch::ones({1}).requires_grad_();
        torch::Tensor late = a * 1;
        const bool last = mb.index + 1 == static_cast<int>((*step)->micro_batches().size());
        if (s == 2 && rank == 1 && last) {
          late.register_hook([](torch::Tensor g) -> torch::Tensor {
            throw std::runtime_error("planted: after every gradient");
          });
        }
        torch::Tensor idx = torch::tensor(mb.samples, torch::kLong).to(torch::kFloat);
        torch::Tensor x = torch::stack({idx / 64, torch::cos(idx), torch::sin(idx)}, 1);
        return net->forward(x).pow(2).sum() + late.sum() * 0;
      }});
      if (s == 2) {
        ASSERT_FALSE(report.ok()) << "rank " << rank << " step 2";
        EXPECT_THAT(std::string(report.status().message()),
                    HasSubstr("rank(s) 1 threw after every gradient of the step was synchronised"))
            << "rank " << rank;
      } else {
        ASSERT_TRUE(report.ok()) << "rank " << rank << " step " << s << ": " << report.status();
      }
      // The replicas never differ.
      torch::Tensor flat = torch::cat({net->weight.detach().reshape({-1}), net->bias.detach()});
      std::vector<at::Tensor> all;
      ASSERT_TRUE(dist.AllGather(flat, &all).ok());
      for (size_t r = 1; r < all.size(); ++r) {
        EXPECT_TRUE(torch::equal(all[0], all[r])) << "rank " << rank << " step " << s;
      }
    }
  });
}

// Two model parts, G's loss run through D in train mode (a GAN): D's
// BatchNorm statistics change per rank after D's synchronisation; at the
// end of every step they are rank 0's on every rank (what a checkpoint or an
// evaluation then sees), and the parameters stay equal.
TEST_P(WorldTest, AnEarlierPartsBuffersChangedByALaterPartsForwardAreOneValueAfterTheStep) {
  RunOnRanks(GetParam(), [](DistContext& dist) {
    const int rank = dist.rank();
    torch::manual_seed(5);
    torch::nn::Sequential d(torch::nn::Linear(3, 4), torch::nn::BatchNorm1d(4),
                            torch::nn::Linear(4, 1));
    torch::nn::Linear g(3, 3);
    torch::optim::SGD d_opt(d->parameters(), torch::optim::SGDOptions(0.1));
    torch::optim::SGD g_opt(g->parameters(), torch::optim::SGDOptions(0.1));
    auto step = BalancedStep::Create(dist, {{"D", *d, d_opt}, {"G", *g, g_opt}},
                                     std::vector<int64_t>(64, 1), BalanceConfig());
    ASSERT_TRUE(step.ok()) << step.status();
    auto input = [](const MicroBatch& mb) {
      torch::Tensor idx = torch::tensor(mb.samples, torch::kLong).to(torch::kFloat);
      return torch::stack({idx / 64, torch::cos(idx), torch::sin(idx)}, 1);
    };
    for (int s = 1; s <= 3; ++s) {
      auto report = (*step)->Step(
          {[&](const MicroBatch& mb) { return d->forward(input(mb)).pow(2).sum(); },
           [&](const MicroBatch& mb) {
             return d->forward(g->forward(input(mb)) * (rank + 1)).sum();  // differs per rank
           }});
      ASSERT_TRUE(report.ok()) << "rank " << rank << " step " << s << ": " << report.status();
      std::vector<torch::Tensor> state;
      for (const auto& b : d->buffers())
        state.push_back(b.detach().to(torch::kFloat).reshape({-1}));
      for (const auto& p : d->parameters()) state.push_back(p.detach().reshape({-1}));
      std::vector<at::Tensor> all;
      ASSERT_TRUE(dist.AllGather(torch::cat(state), &all).ok());
      for (size_t r = 1; r < all.size(); ++r) {
        EXPECT_TRUE(torch::equal(all[0], all[r])) << "rank " << rank << " step " << s;
      }
    }
  });
}

// The commonest porting mistake: the plain loop's loss.backward() and
// optimizer.step() left inside the loss function. It used to surface as
// libtorch's "backward through the graph a second time" (whose hint leads
// elsewhere) after each rank's replica had moved by its own gradient. Now
// named on every rank before evenstep's backward, the step abandoned, and no
// further step runs (the replicas may differ).
TEST_P(WorldTest, ALossFunctionThatRunsBackwardOrStepsItselfIsNamedOnEveryRank) {
  RunOnRanks(GetParam(), [](DistContext& dist) {
    const int rank = dist.rank();
    torch::manual_seed(4);
    torch::nn::Linear net(3, 1);
    torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.1));
    BalanceConfig config;
    config.sampler.global_batch = 8;
    config.sampler.micro_batch_samples = 2;  // two micro-batches per rank
    auto step = BalancedStep::Create(dist, *net, opt, std::vector<int64_t>(64, 1), config);
    ASSERT_TRUE(step.ok()) << step.status();
    for (const std::string program : {"right", "backward_and_step", "next"}) {
      auto report = (*step)->Step({[&](const MicroBatch& mb) {
        torch::Tensor idx = torch::tensor(mb.samples, torch::kLong).to(torch::kFloat);
        torch::Tensor x = torch::stack({idx / 64, torch::cos(idx), torch::sin(idx)}, 1);
        torch::Tensor loss = net->forward(x).pow(2).sum();
        if (program == "backward_and_step") {
          loss.backward({}, /*retain_graph=*/true);
          opt.step();
        }
        return loss;
      }});
      if (program == "right") {
        EXPECT_TRUE(report.ok()) << "rank " << rank << ": " << report.status();
        continue;
      }
      ASSERT_FALSE(report.ok()) << "rank " << rank << " " << program;
      const std::string message(report.status().message());
      if (program == "next") {
        EXPECT_THAT(message, HasSubstr("no further step runs after step")) << "rank " << rank;
      } else {
        EXPECT_THAT(message, HasSubstr("while the loss function ran,")) << "rank " << rank;
        EXPECT_THAT(message, HasSubstr("must not call loss.backward(), optimizer.step()"))
            << "rank " << rank;
      }
    }
  });
}

INSTANTIATE_TEST_SUITE_P(Worlds, WorldTest, ::testing::Values(2, 3),
                         [](const auto& info) { return absl::StrCat("world", info.param); });

}  // namespace
}  // namespace evenstep

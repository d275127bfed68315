// GradSync over real ranks (Gloo on 127.0.0.1): exactness for world sizes 1-4
// and random uneven splits, overlap ordering, no-sync accumulation, unused
// and frozen parameters, zero-work ranks, replica mismatch, comm hooks, the
// hierarchical sync, and what a timed-out sync leaves behind. Each scenario's
// per-rank code and checks sit inside its TEST (RunOnRanks: this binary again
// as each rank); the model and batch are tests/testing/sync_net.h's.
#include "evenstep/grad_sync.h"

#include <torch/torch.h>

#include <chrono>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "evenstep/internal/collective.h"
#include "evenstep/sync_topology.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/on_ranks.h"
#include "tests/testing/sync_net.h"

namespace evenstep {
namespace {

using ::evenstep::testing::ExpectGradsNear;
using ::evenstep::testing::GlobalSyncBatch;
using ::evenstep::testing::kSyncBatch;
using ::evenstep::testing::kSyncHidden;
using ::evenstep::testing::kSyncIn;
using ::evenstep::testing::MakeSyncNet;
using ::evenstep::testing::MaxRelError;
using ::evenstep::testing::OnRanksOptions;
using ::evenstep::testing::RunOnRanks;
using ::evenstep::testing::ScaledLoss;
using ::evenstep::testing::SyncBatch;
using ::evenstep::testing::SyncExactSplit;
using ::evenstep::testing::TinyBuckets;
using ::testing::ContainsRegex;
using ::testing::HasSubstr;

struct ExactCase {
  int world;
  int seed;
  friend void PrintTo(const ExactCase& c, std::ostream* os) {
    *os << "world " << c.world << " seed " << c.seed;
  }
};

class GradSyncExactTest : public ::testing::TestWithParam<ExactCase> {};

TEST_P(GradSyncExactTest, SyncedGradientEqualsSingleProcessGradient) {
  const ExactCase c = GetParam();
  RunOnRanks(c.world, [c](DistContext& dist) {
    const auto run = SyncExactSplit(dist, c.seed, TinyBuckets());
    if (c.world > 1 && dist.rank() == c.seed % c.world) {
      // The split leaves this rank without work; it joined through SyncNow.
      EXPECT_EQ(run.samples, 0);
      EXPECT_EQ(run.micro_batches, 0);
    } else {
      EXPECT_GT(run.micro_batches, 0) << "rank " << dist.rank();
    }
  });
}

INSTANTIATE_TEST_SUITE_P(Splits, GradSyncExactTest,
                         ::testing::Values(ExactCase{1, 11}, ExactCase{2, 12}, ExactCase{2, 21},
                                           ExactCase{3, 13}, ExactCase{3, 31}, ExactCase{4, 14},
                                           ExactCase{4, 41}),
                         [](const auto& info) {
                           return absl::StrCat("world", info.param.world, "_seed", info.param.seed);
                         });

TEST(GradSyncTest, BucketsStartBeforeBackwardEnds) {
  RunOnRanks(2, [](DistContext& dist) {
    const auto run = SyncExactSplit(dist, 3, TinyBuckets());  // seed 3: rank 1 idle, rank 0 works
    if (dist.rank() != 0) return;
    // Ordering, not timing: with >= 8 buckets at least one collective started
    // from a gradient hook before the last gradient existed.
    EXPECT_GT(run.micro_batches, 0);
    EXPECT_GE(run.buckets_launched_during_backward, 1) << "of " << run.num_buckets;
  });
}

// Worlds of 2 and 3 ranks.
class GradSyncWorldTest : public ::testing::TestWithParam<int> {};

TEST_P(GradSyncWorldTest, NoSyncAccumulatesLocally) {
  RunOnRanks(GetParam(), [](DistContext& dist) {
    const int world = dist.world_size(), rank = dist.rank();
    const SyncBatch batch = GlobalSyncBatch();
    auto net = MakeSyncNet(3);
    auto ref = MakeSyncNet(3);
    auto sync = GradSync::Attach(*net, dist.data_group(), TinyBuckets());
    ASSERT_TRUE(sync.ok()) << sync.status();
    // Rank r's micro-batches are samples {r, r + world, ...} in 3 chunks.
    auto micro = [world](int r, int m) {
      return torch::arange(r + m * world, kSyncBatch, 3 * world);
    };
    (*sync)->set_sync_enabled(false);
    for (int m = 0; m < 2; ++m) {
      ScaledLoss(*net, batch, micro(rank, m)).backward();
      ScaledLoss(*ref, batch, micro(rank, m)).backward();
    }
    EXPECT_EQ((*sync)->collectives_started(), 0) << "collectives during no-sync micro-steps";
    ExpectGradsNear(*net, *ref, 0, "local accumulation");
    (*sync)->set_sync_enabled(true);
    (*sync)->SetStep(0);
    ScaledLoss(*net, batch, micro(rank, 2)).backward();
    // One per bucket, and once the broadcast of rank 0's ready order.
    EXPECT_EQ((*sync)->collectives_started(), (*sync)->num_buckets() + 1);
    // Expected: the gradient over every rank's micro-batches.
    auto all = MakeSyncNet(3);
    for (int r = 0; r < world; ++r) {
      for (int m = 0; m < 3; ++m) ScaledLoss(*all, batch, micro(r, m)).backward();
    }
    ExpectGradsNear(*net, *all, 1e-5, "synced");
  });
}

// With rank 0 alone adding the `extra` layer to its logits, every rank's
// gradients (extra's too) equal one process's of all ranks' losses: extra's
// is reduced as zeros from the other ranks. Twice, after an optimizer's
// zero_grad() (which detach_()es the gradients GradSync wrote back).
void ExpectUnusedParameterReducedAsZeros(DistContext& dist, const GradSyncOptions& options) {
  const int world = dist.world_size(), rank = dist.rank();
  const SyncBatch batch = GlobalSyncBatch();
  auto net = MakeSyncNet(5, torch::kCPU, kSyncHidden, /*with_extra=*/true);
  auto sync = GradSync::Attach(*net, dist.data_group(), options);
  ASSERT_TRUE(sync.ok()) << sync.status();
  const auto idx = torch::arange(kSyncBatch);
  torch::optim::SGD optimizer(net->parameters(), torch::optim::SGDOptions(0.0));
  for (int step = 0; step < 2; ++step) {
    optimizer.zero_grad();
    (*sync)->SetStep(step);
    ScaledLoss(*net, batch, idx, /*use_extra=*/rank == 0).backward();
    auto ref_main = MakeSyncNet(5, torch::kCPU, kSyncHidden, true);
    ScaledLoss(*ref_main, batch, idx, false).backward();
    auto ref_extra = MakeSyncNet(5, torch::kCPU, kSyncHidden, true);
    ScaledLoss(*ref_extra, batch, idx, true).backward();
    for (const auto& item : net->named_parameters()) {
      const bool is_extra = item.key().rfind("extra", 0) == 0;
      const torch::Tensor want_extra = ref_extra->named_parameters()[item.key()].grad();
      const torch::Tensor want =
          is_extra ? want_extra
                   : want_extra + (world - 1) * ref_main->named_parameters()[item.key()].grad();
      EXPECT_LE(MaxRelError(item.value().grad(), want), 1e-5)
          << "step " << step << ", " << item.key() << " on rank " << rank;
    }
    optimizer.step();  // lr 0: nothing moves, but the parameters were stepped
  }
}

TEST(GradSyncTest, UnusedParameterIsReducedAsZeros) {
  RunOnRanks(3,
             [](DistContext& dist) { ExpectUnusedParameterReducedAsZeros(dist, TinyBuckets()); });
}

TEST(GradSyncTest, FrozenParametersStartEqualOnEveryRank) {
  RunOnRanks(3, [](DistContext& dist) {
    auto net = MakeSyncNet(100 + dist.rank());  // every rank its own weights
    for (auto& p : net->l1->parameters()) p.set_requires_grad(false);
    auto sync = GradSync::Attach(*net, dist.data_group(), TinyBuckets());
    ASSERT_TRUE(sync.ok()) << sync.status();
    for (const auto& item : net->named_parameters()) {
      const torch::Tensor mine = item.value().detach().clone();
      torch::Tensor root = mine.clone();
      ASSERT_TRUE(dist.Broadcast(root, 0).ok());
      EXPECT_TRUE(torch::equal(mine, root))
          << item.key() << (item.value().requires_grad() ? "" : " (frozen)") << " on rank "
          << dist.rank() << " differs from rank 0's after Attach";
    }
  });
}

TEST(GradSyncTest, ReplicaMismatchNamesParameterAndRanks) {
  RunOnRanks(3, [](DistContext& dist) {
    // Rank 1's first layer has 17 rows instead of 16.
    auto net = MakeSyncNet(1, torch::kCPU, dist.rank() == 1 ? kSyncHidden + 1 : kSyncHidden);
    auto sync = GradSync::Attach(*net, dist.data_group(), TinyBuckets());
    ASSERT_FALSE(sync.ok());
    EXPECT_EQ(sync.status().code(), absl::StatusCode::kFailedPrecondition);
    // Named on every rank, with both shapes and which ranks hold each.
    EXPECT_THAT(std::string(sync.status().message()),
                HasSubstr("model replicas differ at parameter #0: rank(s) 0,2 have 'l1.weight' "
                          "Float[16, 12] cpu; rank(s) 1 have 'l1.weight' Float[17, 12] cpu"));
  });
}

// A comm hook by name, and how the ranks' result relates to one process's
// gradient of the whole batch (sum: equal; avg: 1/world of it; user: SUM
// doubled by a continuation), within what its arithmetic allows.
struct HookUnderTest {
  CommHook hook;
  double factor = 1, tolerance = 1e-2;  // fp16, bf16: compressed
};

HookUnderTest HookNamed(const std::string& name, int world) {
  HookUnderTest h;
  if (name == "user") {
    CommHook base = SumHook();
    h.hook = [base](const CommHookContext& ctx, at::Tensor& bucket) {
      return BucketFuture::Then(base(ctx, bucket),
                                [](at::Tensor reduced) { return reduced.mul(2); });
    };
    h.factor = 2;
    h.tolerance = 1e-5;
    return h;
  }
  auto named = CommHookByName(name);
  EXPECT_TRUE(named.ok()) << named.status();
  if (named.ok()) h.hook = *named;
  if (name == "avg") h.factor = 1.0 / world;
  if (name == "avg" || name == "sum") h.tolerance = 1e-5;  // the same sums in another order
  return h;
}

// Rank r's samples r, r + world, ...: the ranks' hooked sync against one
// process's gradient of the whole batch.
void ExpectHookedSyncMatches(DistContext& dist, const HookUnderTest& h,
                             const GradSyncOptions& options, const std::string& name) {
  const SyncBatch batch = GlobalSyncBatch();
  auto net = MakeSyncNet(9);
  auto sync = GradSync::Attach(*net, dist.data_group(), options);
  ASSERT_TRUE(sync.ok()) << sync.status();
  auto whole = MakeSyncNet(9);
  ScaledLoss(*whole, batch, torch::arange(0, kSyncBatch)).backward();
  (*sync)->SetStep(0);
  ScaledLoss(*net, batch, torch::arange(dist.rank(), kSyncBatch, dist.world_size())).backward();
  ExpectGradsNear(*net, *whole, h.tolerance, "hook " + name, h.factor);
}

class CommHookTest : public ::testing::TestWithParam<std::string> {};

TEST_P(CommHookTest, MatchesSum) {
  const std::string name = GetParam();
  RunOnRanks(3, [name](DistContext& dist) {
    const HookUnderTest h = HookNamed(name, dist.world_size());
    GradSyncOptions options = TinyBuckets();
    options.comm_hook = h.hook;
    ExpectHookedSyncMatches(dist, h, options, name);
  });
}

INSTANTIATE_TEST_SUITE_P(Hooks, CommHookTest,
                         ::testing::Values("sum", "avg", "fp16", "bf16", "user"));

TEST(GradSyncTest, AUserHookSeesEveryGradientWithItsPlace) {
  RunOnRanks(2, [](DistContext& dist) {
    const SyncBatch batch = GlobalSyncBatch();
    auto net = MakeSyncNet(9);
    auto sync = GradSync::Attach(*net, dist.data_group(), TinyBuckets());
    ASSERT_TRUE(sync.ok()) << sync.status();
    std::map<std::string, int> seen;
    int lasts = 0;
    CommHook base = SumHook();
    (*sync)->set_comm_hook([&](const CommHookContext& ctx, at::Tensor& bucket) {
      int64_t offset = 0;
      for (const BucketParam& p : *ctx.params) {
        ++seen[p.name];
        int64_t numel = 1;
        for (int64_t d : p.sizes) numel *= d;
        EXPECT_EQ(p.offset, offset) << p.name;
        EXPECT_EQ(p.numel, numel) << p.name;
        offset += p.numel;
      }
      EXPECT_EQ(offset, bucket.numel()) << "a user hook sees only gradients";
      if (ctx.is_last) {
        ++lasts;
        EXPECT_EQ(ctx.bucket_index, ctx.num_buckets - 1) << "is_last on another bucket";
      }
      return base(ctx, bucket);
    });
    (*sync)->SetStep(0);
    ScaledLoss(*net, batch, torch::arange(dist.rank(), kSyncBatch, dist.world_size())).backward();
    for (const auto& item : net->named_parameters()) {
      EXPECT_EQ(seen[item.key()], 1) << item.key() << " seen";
    }
    EXPECT_EQ(lasts, 1);
    EXPECT_TRUE((*sync)->status().ok()) << (*sync)->status();
  });
}

TEST_P(GradSyncWorldTest, PowerSgdIsExactOnRankOneAndErrorFeedbackConverges) {
  RunOnRanks(GetParam(), [](DistContext& dist) {
    const int world = dist.world_size();
    torch::manual_seed(3);
    auto lin = torch::nn::Linear(torch::nn::LinearOptions(8, 6).bias(false));
    GradSyncOptions options = TinyBuckets();
    options.comm_hook = PowerSgdHook({});
    auto sync = GradSync::Attach(*lin, dist.data_group(), options);
    ASSERT_TRUE(sync.ok()) << sync.status();
    int64_t step = 0;
    auto grad_of = [&](const torch::Tensor& x) {
      lin->zero_grad();
      (*sync)->SetStep(step++);
      lin(x).pow(2).sum().backward();
      return lin->weight.grad().clone();
    };
    // 1. The same single sample on every rank: a rank-1 gradient; its SUM is
    // rank 1 and PowerSGD reproduces it (d/dW sum((Wx)^2) = 2 (Wx) x^T a rank).
    torch::manual_seed(4);
    const torch::Tensor x1 = torch::randn({1, 8});
    const torch::Tensor got = grad_of(x1);
    const torch::Tensor exact = (2 * world) * lin->weight.detach().matmul(x1.t()).matmul(x1);
    EXPECT_LE(MaxRelError(got, exact), 1e-4) << "the rank-1 gradient";
    // 2. A rank-3 gradient (three samples, different per rank), the same
    // every step: one approximation misses by about its 2nd singular value;
    // with error feedback, the mean of T approximations misses by O(1/T).
    torch::manual_seed(10 + dist.rank());
    const torch::Tensor x3 = torch::randn({3, 8});
    (*sync)->set_sync_enabled(false);
    torch::Tensor sum = grad_of(x3);
    (*sync)->set_sync_enabled(true);
    ASSERT_TRUE(dist.AllReduce(sum).ok());
    torch::Tensor total = torch::zeros_like(sum);
    double first = 0;
    constexpr int kSteps = 40;
    for (int t = 1; t <= kSteps; ++t) {
      torch::Tensor g = grad_of(x3);
      total += g;
      if (t == 1) first = MaxRelError(g, sum);
    }
    EXPECT_GT(first, 1e-3) << "one step of a rank-1 approximation of a rank-3 gradient";
    EXPECT_LT(MaxRelError(total / kSteps, sum), first / 5)
        << "the mean of " << kSteps << " steps with error feedback";
  });
}

INSTANTIATE_TEST_SUITE_P(Worlds, GradSyncWorldTest, ::testing::Values(2, 3),
                         [](const auto& info) { return absl::StrCat("world", info.param); });

// SetStep is required before every synchronisation: without it a rank that
// left a step before its first gradient would pair its next step's buckets
// with its peers' current ones. A synchronised backward or a SyncNow that
// begins without SetStep since the last one is refused on every rank by
// name, before any collective; with it the same program is exact.
TEST(GradSyncTest, ASynchronisationWithoutSetStepIsRefusedByName) {
  RunOnRanks(2, [](DistContext& dist) {
    const int rank = dist.rank(), world = dist.world_size();
    const SyncBatch batch = GlobalSyncBatch();
    auto net = MakeSyncNet(9);
    auto sync = GradSync::Attach(*net, dist.data_group(), TinyBuckets());
    ASSERT_TRUE(sync.ok()) << sync.status();
    const torch::Tensor mine = torch::arange(rank, kSyncBatch, world);
    std::string error;
    try {
      ScaledLoss(*net, batch, mine).backward();
    } catch (const std::exception& e) {
      error = e.what();
    }
    EXPECT_THAT(error, HasSubstr(absl::StrCat("GradSync (rank ", rank,
                                              "): synchronisation #1 began without "
                                              "GradSync::SetStep since the last one")));
    EXPECT_EQ((*sync)->collectives_started(), 0) << "a collective before the refusal";
    const absl::Status idle = (*sync)->SyncNow();
    EXPECT_EQ(idle.code(), absl::StatusCode::kFailedPrecondition) << idle;
    // With SetStep: exact.
    net->zero_grad();
    (*sync)->SetStep(0);
    ScaledLoss(*net, batch, mine).backward();
    ASSERT_TRUE((*sync)->status().ok()) << (*sync)->status();
    auto whole = MakeSyncNet(9);
    ScaledLoss(*whole, batch, torch::arange(0, kSyncBatch)).backward();
    ExpectGradsNear(*net, *whole, 1e-5, absl::StrCat("rank ", rank, " with SetStep"));
    // A second synchronisation without a new SetStep: refused again.
    net->zero_grad();
    error.clear();
    try {
      ScaledLoss(*net, batch, mine).backward();
    } catch (const std::exception& e) {
      error = e.what();
    }
    EXPECT_THAT(error, HasSubstr("synchronisation #2 began without GradSync::SetStep"));
  });
}

TEST(GradSyncTest, AnUndeclaredSparseGradientFailsOnEveryRankNamingIt) {
  RunOnRanks(2, [](DistContext& dist) {
    auto embed = torch::nn::Embedding(torch::nn::EmbeddingOptions(10, 4).sparse(true));
    std::vector<NamedTensor> params = {{"embed.weight", embed->weight}};
    auto sync = GradSync::Attach(params, {}, dist.data_group(), TinyBuckets());
    ASSERT_TRUE(sync.ok()) << sync.status();
    (*sync)->SetStep(0);
    try {
      embed(torch::tensor({1, 2, 3}, torch::kLong)).sum().backward();
      ADD_FAILURE() << "backward with an undeclared sparse gradient succeeded";
    } catch (const std::exception& e) {
      EXPECT_THAT(e.what(), HasSubstr("ABORTED"));
      EXPECT_THAT(e.what(), HasSubstr("parameter 'embed.weight' received a sparse gradient"));
    }
  });
}

// Rank 1 never joins the sync (it forgets SyncNow): rank 0's times out
// (naming it, with the DistContext's diagnosis hook); rank 0's next sync,
// all_reduce and barrier return that failure without starting (a started
// one would block on, or pair with, the timed-out all_reduce). Without the
// hook (grad_sync.md's plain GradSync example) the DistContext learns it too.
class TimeoutTest : public ::testing::TestWithParam<bool> {};

TEST_P(TimeoutTest, AfterACollectiveTimesOutEveryLaterCollectiveFailsAtOnce) {
  const bool hook = GetParam();
  OnRanksOptions options;
  options.collective_timeout = absl::Seconds(3);
  RunOnRanks(
      2,
      [hook](DistContext& dist) {
        torch::manual_seed(1);
        testing::SyncNet net(kSyncHidden, false);
        GradSyncOptions sync_options = TinyBuckets();
        sync_options.timeout = dist.options().collective_timeout;
        if (hook) {
          sync_options.diagnosis.arrive = [&dist] { return dist.MarkArrival(); };
          sync_options.diagnosis.diagnose = [&dist](int64_t seq, const std::string& what,
                                                    absl::Duration elapsed,
                                                    const std::string& error) {
            return dist.Diagnose(seq, what, elapsed, error);
          };
        }
        auto sync = GradSync::Attach(net, dist.data_group(), sync_options);
        ASSERT_TRUE(sync.ok()) << sync.status();
        if (dist.rank() == 1) {
          // Stays alive (the store answers) without joining, past rank 0's checks.
          std::this_thread::sleep_for(std::chrono::seconds(8));
          return;
        }
        (*sync)->SetStep(0);
        try {
          net.forward(torch::randn({4, kSyncIn})).sum().backward();
          ADD_FAILURE() << "the sync succeeded without rank 1";
        } catch (const std::exception& e) {
          // Without the hook the words are whichever deadline fired first:
          // the sync's own ("timed out") or Gloo's ("Timed out waiting",
          // "Application timeout caused pair closure").
          EXPECT_THAT(
              e.what(),
              ContainsRegex(hook ? "DEADLINE_EXCEEDED.*rank\\(s\\) 1"
                                 : "DEADLINE_EXCEEDED.*failed after .*([Tt]imed out|timeout)"));
        }
        const absl::Status again = (*sync)->SyncNow();
        EXPECT_EQ(again.code(), absl::StatusCode::kDeadlineExceeded) << "next sync: " << again;
        torch::Tensor t = torch::ones({2});
        const absl::Status next = dist.AllReduce(t);
        EXPECT_EQ(next.code(), absl::StatusCode::kDeadlineExceeded) << next;
        EXPECT_THAT(
            std::string(next.message()),
            ContainsRegex("rank 0: all_reduce .* not started: an earlier collective failed"));
        const absl::Status barrier = dist.Barrier();
        EXPECT_EQ(barrier.code(), absl::StatusCode::kDeadlineExceeded) << barrier;
        EXPECT_THAT(std::string(barrier.message()), HasSubstr("rank 0: barrier not started"));
      },
      options);
}

INSTANTIATE_TEST_SUITE_P(Diagnosis, TimeoutTest, ::testing::Bool(),
                         [](const auto& info) { return info.param ? "hook" : "plain"; });

// Gloo's own deadline can fire a moment before the collective's, in any of
// its wordings: each is DEADLINE_EXCEEDED (the caller stops rather than
// retries); a lost peer is UNAVAILABLE.
TEST(CollectiveFailedTest, EveryWordingOfATimeoutIsDeadlineExceeded) {
  const absl::Duration timeout = absl::Seconds(3), early = absl::Milliseconds(2997);
  for (const char* error :
       {"[./gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 3000ms for recv",
        "Application timeout caused pair closure", "the collective timed out"}) {
    const absl::Status s =
        internal::CollectiveFailed(0, "all_reduce", {true, error, early}, timeout);
    EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << error;
  }
  const absl::Status lost = internal::CollectiveFailed(
      0, "all_reduce", {true, "Connection reset by peer", absl::Seconds(1)}, timeout);
  EXPECT_EQ(lost.code(), absl::StatusCode::kUnavailable) << lost;
}

// A c10d work that completes when told to (finish is c10d's own).
class TestWork : public c10d::Work {
 public:
  void Complete() { finish(); }
};

// A wait with `abandon` (a rank that may go on after a lost peer) polls the
// work: it ends as UNAVAILABLE once abandon() says so, as DEADLINE_EXCEEDED
// at its own deadline, and returns what the work did once it completes.
TEST(CollectiveWaitTest, AWaitThatMayBeAbandonedEndsByNameOrWithTheWork) {
  auto never = c10::make_intrusive<TestWork>();
  const internal::CollectiveWait abandoned =
      internal::WaitCollective(never.get(), absl::Seconds(60), absl::Now(), [] { return true; });
  ASSERT_TRUE(abandoned.failed);
  EXPECT_EQ(abandoned.error, internal::kAbandonedWait);
  EXPECT_EQ(internal::CollectiveFailed(0, "all_reduce", abandoned, absl::Seconds(60)).code(),
            absl::StatusCode::kUnavailable);

  const internal::CollectiveWait late = internal::WaitCollective(
      never.get(), absl::Milliseconds(30), absl::Now(), [] { return false; });
  ASSERT_TRUE(late.failed);
  EXPECT_EQ(internal::CollectiveFailed(0, "all_reduce", late, absl::Milliseconds(30)).code(),
            absl::StatusCode::kDeadlineExceeded)
      << late.error;

  auto done = c10::make_intrusive<TestWork>();
  std::thread completer([&] { done->Complete(); });
  int asked = 0;
  const internal::CollectiveWait finished = internal::WaitCollective(
      done.get(), absl::Seconds(60), absl::Now(), [&] { return ++asked > 1000000; });
  completer.join();
  EXPECT_FALSE(finished.failed) << finished.error;
}

// The hierarchical sync (reduce-scatter within each node, all-reduce across,
// all-gather within) against one process's gradient, on nodes simulated on
// this host (GROUP_RANK): the same scenarios as the flat sync, every
// parameter its own bucket (so buckets smaller than the node's ranks and
// uneven chunks are covered), a rank without work joining through SyncNow.
struct TopologyCase {
  std::vector<int> nodes;
  std::string scenario;  // "exact", "unused", or a hook's name
  int seed = 0;          // exact's split
  friend void PrintTo(const TopologyCase& c, std::ostream* os) {
    *os << absl::StrJoin(c.nodes, "+") << " " << c.scenario << " " << c.seed;
  }
};

class HierarchicalSyncTest : public ::testing::TestWithParam<TopologyCase> {};

TEST_P(HierarchicalSyncTest, EqualsTheSingleProcessGradient) {
  const TopologyCase c = GetParam();
  OnRanksOptions on_nodes;
  on_nodes.nodes = c.nodes;
  int world = 0;
  for (int n : c.nodes) world += n;
  RunOnRanks(
      world,
      [c](DistContext& dist) {
        const bool hook = c.scenario != "exact" && c.scenario != "unused";
        const HookUnderTest h = hook ? HookNamed(c.scenario, dist.world_size()) : HookUnderTest{};
        GradSyncOptions options = TinyBuckets();
        if (hook) options.comm_hook = h.hook;
        auto choice = ApplySyncTopology(dist, SyncTopology::kHierarchical, &options);
        ASSERT_TRUE(choice.ok()) << choice.status();
        EXPECT_THAT(choice->line,
                    HasSubstr(absl::StrCat("gradient sync: hierarchical (", c.nodes.size(),
                                           c.nodes.size() == 1 ? " node x " : " nodes x ",
                                           c.nodes[0], " rank")));
        if (c.scenario == "exact") {
          SyncExactSplit(dist, c.seed, options);
        } else if (c.scenario == "unused") {
          ExpectUnusedParameterReducedAsZeros(dist, options);
        } else {
          ExpectHookedSyncMatches(dist, h, options, c.scenario);
        }
      },
      on_nodes);
}

INSTANTIATE_TEST_SUITE_P(
    Layouts, HierarchicalSyncTest,
    ::testing::Values(TopologyCase{{2, 2}, "exact", 14}, TopologyCase{{2, 2}, "exact", 41},
                      TopologyCase{{1, 1}, "exact", 12}, TopologyCase{{3}, "exact", 13},
                      TopologyCase{{2, 2}, "unused"}, TopologyCase{{2, 2}, "avg"},
                      TopologyCase{{2, 2}, "fp16"}, TopologyCase{{1, 1, 1}, "bf16"}),
    [](const auto& info) {
      return absl::StrCat(absl::StrJoin(info.param.nodes, "x"), "_", info.param.scenario,
                          info.param.seed > 0 ? absl::StrCat("_", info.param.seed) : std::string());
    });

// What hierarchical cannot do is refused on every rank, naming the flag and
// the reason; auto stays flat there and says why.
TEST(HierarchicalSyncTest, UnevenNodesAreRefusedAndAutoStaysFlat) {
  OnRanksOptions uneven;
  uneven.nodes = {3, 1};
  RunOnRanks(
      4,
      [](DistContext& dist) {
        GradSyncOptions options = TinyBuckets();
        auto refused = ApplySyncTopology(dist, SyncTopology::kHierarchical, &options);
        ASSERT_FALSE(refused.ok());
        EXPECT_THAT(std::string(refused.status().message()),
                    HasSubstr("--evenstep_sync_topology=hierarchical: the nodes hold different "
                              "numbers of ranks (node0: 3 ranks (0,1,2); node1: 1 rank (3))"));
        auto flat = ApplySyncTopology(dist, SyncTopology::kAuto, &options);
        ASSERT_TRUE(flat.ok()) << flat.status();
        EXPECT_FALSE(flat->hierarchical);
        EXPECT_THAT(flat->line, HasSubstr("gradient sync: flat (hierarchical cannot run: the "
                                          "nodes hold different numbers of ranks"));
        SyncExactSplit(dist, 14, options);
      },
      uneven);
}

TEST(HierarchicalSyncTest, AWholeGradientHookIsRefused) {
  OnRanksOptions two_nodes;
  two_nodes.nodes = {1, 1};
  RunOnRanks(
      2,
      [](DistContext& dist) {
        GradSyncOptions options = TinyBuckets();
        options.comm_hook = HookNamed("user", dist.world_size()).hook;
        auto refused = ApplySyncTopology(dist, SyncTopology::kHierarchical, &options);
        ASSERT_FALSE(refused.ok());
        EXPECT_THAT(std::string(refused.status().message()), HasSubstr("powersgd or a user hook"));
      },
      two_nodes);
}

}  // namespace
}  // namespace evenstep

// DistContext over real processes over Gloo on 127.0.0.1, with a c10d store
// hosted by the test (port from the OS) or by rank 0, every wait bounded so a
// hang fails. The collectives' results are checked inside their TEST on each
// rank (RunOnRanks: this binary again as each rank); the launch conventions
// and failures start rank_helper, whose process image is the point there.

#include <ATen/ATen.h>

#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "evenstep/internal/store_server.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/on_ranks.h"
#include "tests/testing/subprocess.h"

namespace evenstep {
namespace {

using ::evenstep::testing::Describe;
using ::evenstep::testing::ProcessResult;
using ::evenstep::testing::ProcessSpec;
using ::evenstep::testing::RunAll;
using ::evenstep::testing::TorchrunRanks;
using ::testing::HasSubstr;

const absl::Duration kHangBound = evenstep::testing::HangBound();
// Short timeouts keep failure scenarios quick; generous enough for a loaded CI box.
const std::vector<std::string> kShortTimeouts = {"--evenstep_rendezvous_timeout=4s",
                                                 "--evenstep_timeout=4s"};

std::vector<std::string> HelperArgs(std::vector<std::string> scenario,
                                    const std::vector<std::string>& flags = {}) {
  std::vector<std::string> argv = {EVENSTEP_RANK_HELPER};
  argv.insert(argv.end(), flags.begin(), flags.end());
  argv.insert(argv.end(), scenario.begin(), scenario.end());
  return argv;
}

std::unique_ptr<internal::StoreServer> HostStore() {
  auto server = internal::StoreServer::Start(0);
  EXPECT_TRUE(server.ok()) << server.status();
  return server.ok() ? std::move(*server) : nullptr;
}

class CollectivesTest : public ::testing::TestWithParam<int> {};

// Every collective's exact result on every rank, at world sizes 1 to 4 (the
// ranks: this binary again, evenstep::testing::RunOnRanks).
TEST_P(CollectivesTest, ExactResults) {
  const int world = GetParam();
  evenstep::testing::RunOnRanks(world, [world](DistContext& dist) {
    const int r = dist.rank();
    ASSERT_EQ(dist.world_size(), world);
    // Integer sum: arange(5) + 100 * rank summed over ranks.
    at::Tensor t = at::arange(5, at::kLong) + 100 * r;
    ASSERT_TRUE(dist.AllReduce(t).ok());
    at::Tensor want = at::arange(5, at::kLong) * world + 100 * (world * (world - 1) / 2);
    EXPECT_TRUE(at::equal(t, want)) << "all_reduce sum int64 on rank " << r << ": " << t;
    // A float sum of binary fractions is exact.
    at::Tensor f = at::full({7}, 0.5 * (r + 1), at::kFloat);
    ASSERT_TRUE(dist.AllReduce(f).ok());
    EXPECT_TRUE(at::equal(f, at::full({7}, 0.25 * world * (world + 1), at::kFloat)))
        << "all_reduce sum float on rank " << r << ": " << f;
    double factorial = 1;
    for (int i = 2; i <= world; ++i) factorial *= i;
    const struct {
      ReduceOp op;
      double mine, expected;
      const char* name;
    } ops[] = {{ReduceOp::kMax, 1.0 * r, world - 1.0, "max"},
               {ReduceOp::kMin, 1.0 * r, 0.0, "min"},
               {ReduceOp::kProduct, r + 1.0, factorial, "product"}};
    for (const auto& c : ops) {
      at::Tensor x = at::full({3}, c.mine, at::kDouble);
      ASSERT_TRUE(dist.AllReduce(x, c.op).ok()) << c.name;
      EXPECT_TRUE(at::equal(x, at::full({3}, c.expected, at::kDouble)))
          << "all_reduce " << c.name << " on rank " << r << ": " << x;
    }
    // All-gather: rank q contributes 10 * q + 1.
    std::vector<at::Tensor> gathered;
    ASSERT_TRUE(dist.AllGather(at::full({2, 3}, 10 * r + 1, at::kInt), &gathered).ok());
    ASSERT_EQ(static_cast<int>(gathered.size()), world);
    for (int q = 0; q < world; ++q) {
      EXPECT_TRUE(at::equal(gathered[q], at::full({2, 3}, 10 * q + 1, at::kInt)))
          << "all_gather[" << q << "] on rank " << r << ": " << gathered[q];
    }
    // Broadcast from the last rank.
    const int root = world - 1;
    at::Tensor b = r == root ? at::full({4}, 42.0 + root, at::kFloat) : at::zeros({4}, at::kFloat);
    ASSERT_TRUE(dist.Broadcast(b, root).ok());
    EXPECT_TRUE(at::equal(b, at::full({4}, 42.0 + root, at::kFloat)))
        << "broadcast on rank " << r << ": " << b;
    EXPECT_TRUE(dist.Barrier().ok());
  });
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, CollectivesTest, ::testing::Values(1, 2, 3, 4),
                         [](const auto& info) { return absl::StrCat("world", info.param); });

// Agree: a stage each rank runs alone, agreed before the next collective.
// All succeed: OK everywhere. One fails: every other rank stops at once
// quoting it (and the failed rank gets its own error). The context stays
// usable: the next agreement and collective are exact.
TEST(DistContextTest, AgreeStopsEveryRankQuotingTheRankThatFailed) {
  evenstep::testing::RunOnRanks(3, [](DistContext& dist) {
    const int r = dist.rank();
    EXPECT_TRUE(dist.Agree("opening the files", absl::OkStatus()).ok());
    const absl::Status mine =
        r == 2 ? absl::NotFoundError("rank 2: shard-2.bin: no such file") : absl::OkStatus();
    const absl::Status agreed = dist.Agree("opening the shards", mine);
    if (r == 2) {
      EXPECT_EQ(agreed, mine);
    } else {
      EXPECT_EQ(agreed.code(), absl::StatusCode::kFailedPrecondition) << agreed;
      EXPECT_EQ(agreed.message(),
                absl::StrCat("rank ", r,
                             ": opening the shards stopped on every rank because one failed: "
                             "rank 2: shard-2.bin: no such file"));
    }
    EXPECT_TRUE(dist.Agree("opening them again", absl::OkStatus()).ok());
    at::Tensor t = at::full({2}, r + 1.0);
    ASSERT_TRUE(dist.AllReduce(t).ok());
    EXPECT_TRUE(at::equal(t, at::full({2}, 6.0)));
  });
}

TEST(DistContextTest, SingleProcessNeedsNoLauncher) {
  auto results = RunAll({ProcessSpec{HelperArgs({"collectives"}), {}}}, kHangBound);
  EXPECT_EQ(results[0].exit_code, 0) << Describe(results);
  EXPECT_THAT(results[0].output, HasSubstr("via single process"));
}

// Prefixes and claims belong to their context, not to the process: a
// context made after another (a second run in one process) hands out the
// first prefixes again, as its peers do, and holds no claim of the first.
TEST(DistContextTest, PrefixesAndClaimsBelongToTheirContext) {
  {
    auto a = DistContext::Create(LaunchEnv{}, DistOptions{});
    ASSERT_TRUE(a.ok()) << a.status();
    EXPECT_EQ((*a)->NextPrefix("topology"), "topology/0/");
    EXPECT_EQ((*a)->NextPrefix("topology"), "topology/1/");
    EXPECT_EQ((*a)->NextPrefix("other"), "other/0/");
    EXPECT_TRUE((*a)->Claim("session"));
    EXPECT_FALSE((*a)->Claim("session"));
    (*a)->Release("session");
    EXPECT_TRUE((*a)->Claim("session"));
  }
  auto b = DistContext::Create(LaunchEnv{}, DistOptions{});
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ((*b)->NextPrefix("topology"), "topology/0/");
  EXPECT_TRUE((*b)->Claim("session"));
}

// Ranks whose rank 0 hosts the store on MASTER_PORT, in a network namespace
// of their own (see NetNamespace); skipped where none can be made.
class Rank0HostsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ns_ = evenstep::testing::NetNamespace::Create();
    if (ns_ == nullptr) {
      GTEST_SKIP() << "cannot make a network namespace here (ip netns add needs root): rank 0 "
                      "hosting the store on a fixed port is not run";
    }
  }
  // `world` torchrun-style ranks running `argv` in the namespace, without
  // TORCHELASTIC_USE_AGENT_STORE: rank 0 hosts the store.
  std::vector<ProcessSpec> Rank0HostedRanks(int world, const std::vector<std::string>& argv) {
    auto specs = TorchrunRanks(world, ns_->kPort, argv);
    for (auto& spec : specs) {
      spec.argv = ns_->Wrap(spec.argv);
      auto& env = spec.env;
      env.erase(
          std::remove_if(env.begin(), env.end(),
                         [](const auto& kv) { return kv.first == "TORCHELASTIC_USE_AGENT_STORE"; }),
          env.end());
    }
    return specs;
  }
  std::unique_ptr<evenstep::testing::NetNamespace> ns_;
};

// The rank that hosts the store (rank 0, no launcher agent) stopping in
// start-up: it keeps the store up until the others have read why, and they
// name it (the store's end used to reach them as "Broken pipe").
TEST_F(Rank0HostsTest, Rank0StoppingInStartUpIsNamedByTheOthersWithItsReason) {
  auto specs = Rank0HostedRanks(2, HelperArgs({"init"}, {"--evenstep_timeout=60s"}));
  specs[0].env.push_back({"GLOO_SOCKET_IFNAME", "no-such-if0"});
  auto results = RunAll(specs, kHangBound);
  for (const ProcessResult& r : results) {
    EXPECT_FALSE(r.timed_out) << Describe(results);
    EXPECT_EQ(r.exit_code, 3) << Describe(results);
  }
  EXPECT_THAT(results[1].output,
              HasSubstr("rank 1: start-up stopped on every rank because one failed: rank 0 (host "))
      << Describe(results);
  EXPECT_THAT(results[1].output, HasSubstr("GLOO_SOCKET_IFNAME=no-such-if0 is not an interface"))
      << Describe(results);
}

// Rank 0, the store's host, lost after start-up: the others' failed
// collective says that the store went with it, naming rank 0.
TEST_F(Rank0HostsTest, Rank0LostAfterStartUpIsNamedAsTheStoresHost) {
  auto results =
      RunAll(Rank0HostedRanks(2, HelperArgs({"die_after_init", "0"}, kShortTimeouts)), kHangBound);
  EXPECT_EQ(results[0].exit_code, 0) << Describe(results);
  EXPECT_FALSE(results[1].timed_out) << Describe(results);
  EXPECT_EQ(results[1].exit_code, 4) << Describe(results);
  EXPECT_THAT(results[1].output,
              HasSubstr("the store is unreachable too (rank 0 hosts it, so rank 0 has stopped or "
                        "cannot be reached)"))
      << Describe(results);
}

TEST_F(Rank0HostsTest, Rank0HostsTheStoreWhenNoAgent) {
  auto specs = Rank0HostedRanks(2, HelperArgs({"collectives"}));
  auto results = RunAll(specs, kHangBound);
  for (const ProcessResult& r : results) EXPECT_EQ(r.exit_code, 0) << Describe(results);
  EXPECT_THAT(results[0].output, HasSubstr("hosted by rank 0"));
}

TEST_F(Rank0HostsTest, SlurmConvention) {
  const auto& ns = ns_;
  const int port = ns->kPort;
  std::vector<ProcessSpec> specs;
  for (int r = 0; r < 3; ++r) {
    specs.push_back(ProcessSpec{ns->Wrap(HelperArgs({"collectives"})),
                                {{"SLURM_PROCID", std::to_string(r)},
                                 {"SLURM_NTASKS", "3"},
                                 {"SLURM_LOCALID", std::to_string(r)},
                                 {"SLURM_NODEID", "0"},
                                 {"SLURM_STEP_TASKS_PER_NODE", "3"},
                                 {"SLURM_JOB_NODELIST", "localhost"},
                                 {"MASTER_PORT", std::to_string(port)}}});
  }
  auto results = RunAll(specs, kHangBound);
  for (int r = 0; r < 3; ++r) {
    EXPECT_EQ(results[r].exit_code, 0) << Describe(results);
    EXPECT_THAT(results[r].output, HasSubstr(absl::StrCat("rank ", r, "/3 (local ", r,
                                                          "/3) via Slurm, store localhost:")));
  }
}

TEST_F(Rank0HostsTest, OpenMpiConvention) {
  const auto& ns = ns_;
  const int port = ns->kPort;
  std::vector<ProcessSpec> specs;
  for (int r = 0; r < 2; ++r) {
    specs.push_back(ProcessSpec{ns->Wrap(HelperArgs({"collectives"})),
                                {{"OMPI_COMM_WORLD_RANK", std::to_string(r)},
                                 {"OMPI_COMM_WORLD_SIZE", "2"},
                                 {"OMPI_COMM_WORLD_LOCAL_RANK", std::to_string(r)},
                                 {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"},
                                 {"MASTER_ADDR", "127.0.0.1"},
                                 {"MASTER_PORT", std::to_string(port)}}});
  }
  auto results = RunAll(specs, kHangBound);
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(results[r].exit_code, 0) << Describe(results);
    EXPECT_THAT(results[r].output, HasSubstr("via Open MPI"));
  }
}

TEST(DistContextTest, MissingPeerAtRendezvousIsNamed) {
  auto store = HostStore();
  ASSERT_NE(store, nullptr);
  // A world of 3 in which rank 2 never starts.
  auto specs = TorchrunRanks(3, store->port(), HelperArgs({"init"}, kShortTimeouts));
  specs.pop_back();
  auto results = RunAll(specs, kHangBound);
  for (const ProcessResult& r : results) {
    EXPECT_FALSE(r.timed_out) << Describe(results);
    EXPECT_EQ(r.exit_code, 3) << Describe(results);
    EXPECT_THAT(r.output, HasSubstr("DEADLINE_EXCEEDED"));
    EXPECT_THAT(r.output, HasSubstr("with 2 of 3 ranks joined; missing rank(s) 2"));
  }
}

// A rank that stops in start-up (here: GLOO_SOCKET_IFNAME names an interface
// its host does not have) is named by every other rank, with its reason, as
// soon as it stops: the others used to wait in Gloo's connect until its
// timeout and then report only a broken connection.
TEST(DistContextTest, ARankThatStopsInStartUpIsNamedByEveryOtherRankWithItsReason) {
  auto store = HostStore();
  ASSERT_NE(store, nullptr);
  const std::vector<std::string> long_timeouts = {"--evenstep_rendezvous_timeout=60s",
                                                  "--evenstep_timeout=60s"};
  auto specs = TorchrunRanks(3, store->port(), HelperArgs({"init"}, long_timeouts));
  specs[1].env.push_back({"GLOO_SOCKET_IFNAME", "no-such-if0"});
  auto results = RunAll(specs, kHangBound);
  for (int r = 0; r < 3; ++r) {
    EXPECT_FALSE(results[r].timed_out) << Describe(results);
    EXPECT_EQ(results[r].exit_code, 3) << Describe(results);
    EXPECT_THAT(results[r].output, HasSubstr("rank 1 (host ")) << Describe(results);
    EXPECT_THAT(results[r].output,
                HasSubstr("): GLOO_SOCKET_IFNAME=no-such-if0 is not an interface that is up"))
        << Describe(results);
    if (r != 1) {
      EXPECT_THAT(results[r].output,
                  HasSubstr(absl::StrCat("rank ", r,
                                         ": start-up stopped on every rank because one failed: "
                                         "rank 1 (host ")))
          << Describe(results);
    }
  }
}

TEST(DistContextTest, MismatchedWorldSizesFailOnEveryRank) {
  auto store = HostStore();
  ASSERT_NE(store, nullptr);
  auto specs = TorchrunRanks(2, store->port(), HelperArgs({"init"}, kShortTimeouts));
  specs[1].env[1].second = "3";  // rank 1 believes WORLD_SIZE=3
  specs[1].env[3].second = "3";
  auto results = RunAll(specs, kHangBound);
  for (const ProcessResult& r : results) {
    EXPECT_FALSE(r.timed_out) << Describe(results);
    EXPECT_EQ(r.exit_code, 3) << Describe(results);
    EXPECT_THAT(r.output, HasSubstr("world size mismatch"));
  }
}

TEST(DistContextTest, DuplicateRankIsReported) {
  auto store = HostStore();
  ASSERT_NE(store, nullptr);
  auto specs = TorchrunRanks(2, store->port(), HelperArgs({"init"}, kShortTimeouts));
  specs[1] = specs[0];  // two processes with RANK=0
  auto results = RunAll(specs, kHangBound);
  int reported = 0;
  for (const ProcessResult& r : results) {
    EXPECT_FALSE(r.timed_out) << Describe(results);
    EXPECT_EQ(r.exit_code, 3) << Describe(results);
    reported += r.output.find("two processes claim rank 0") != std::string::npos;
  }
  EXPECT_EQ(reported, 2) << Describe(results);
}

// torchrun's agent keeps its store across restarts, and each agent counts
// only its own workers' failures: after a restart the group's
// TORCHELASTIC_RESTART_COUNT is 1 on one host and 0 on the other
// (pytorch#108158). Every launch, whatever its ranks' counts, meets in fresh
// keys of the same store; a launch with rank 0 twice (and no rank 2) stops
// on every process with a named error.
TEST(DistContextTest, TorchrunLaunchesMeetInFreshKeysWhateverTheirRestartCounts) {
  auto store = HostStore();
  ASSERT_NE(store, nullptr);
  auto launch = [&](std::vector<std::string> restart_counts) {
    auto specs = TorchrunRanks(static_cast<int>(restart_counts.size()), store->port(),
                               HelperArgs({"init"}, kShortTimeouts));
    for (size_t r = 0; r < specs.size(); ++r) {
      specs[r].env.push_back({"TORCHELASTIC_RUN_ID", "job-7"});
      specs[r].env.push_back({"TORCHELASTIC_RESTART_COUNT", restart_counts[r]});
    }
    return RunAll(specs, kHangBound);
  };
  for (const auto& counts : std::vector<std::vector<std::string>>{
           {"0", "0"}, {"1", "0"}, {"1", "1"}, {"1", "1"}, {"2", "1"}}) {
    auto results = launch(counts);
    for (const ProcessResult& r : results) {
      EXPECT_EQ(r.exit_code, 0) << "restart counts " << counts[0] << "," << counts[1] << "\n"
                                << Describe(results);
    }
  }
  // Rank 0 twice in one launch (a world of 3 whose RANKs are 0, 1, 0).
  auto specs = TorchrunRanks(3, store->port(), HelperArgs({"init"}, kShortTimeouts));
  for (ProcessSpec& spec : specs) {
    spec.env.push_back({"TORCHELASTIC_RUN_ID", "job-8"});
    for (auto& [name, value] : spec.env) {
      if (name == "RANK" && value == "2") value = "0";
    }
  }
  auto results = RunAll(specs, kHangBound);
  for (const ProcessResult& r : results) {
    EXPECT_FALSE(r.timed_out) << Describe(results);
    EXPECT_NE(r.exit_code, 0) << Describe(results);
    EXPECT_TRUE(r.output.find("two processes claim rank 0") != std::string::npos ||
                r.output.find("missing rank(s) 2") != std::string::npos)
        << Describe(results);
  }
}

TEST(DistContextTest, UnresolvableMasterHostIsNamedAtOnce) {
  // Both ranks, the would-be host of the store included, name the host and
  // the variable it came from. The rendezvous timeout (10 min) is far beyond
  // the hang bound: waiting for it would time the test out.
  evenstep::testing::RefusingPort port;  // a port the OS picked; never reached
  auto specs =
      TorchrunRanks(2, port.port(), HelperArgs({"init"}, {"--evenstep_rendezvous_timeout=10m"}));
  for (ProcessSpec& spec : specs) {
    for (auto& [name, value] : spec.env) {
      if (name == "MASTER_ADDR") value = "no-such-host.invalid";
      if (name == "TORCHELASTIC_USE_AGENT_STORE") value = "False";
    }
  }
  auto results = RunAll(specs, kHangBound);
  for (const ProcessResult& r : results) {
    EXPECT_FALSE(r.timed_out) << Describe(results);
    EXPECT_EQ(r.exit_code, 3) << Describe(results);
    EXPECT_THAT(r.output, HasSubstr("the store host 'no-such-host.invalid' (MASTER_ADDR) does "
                                    "not resolve"))
        << Describe(results);
  }
}

TEST(DistContextTest, UnresolvableSlurmNodeIsNamedAtOnce) {
  // srun's environment by hand: the store host is the allocation's first
  // node, which does not resolve; every rank names it and the variable.
  std::vector<ProcessSpec> specs;
  for (int r = 0; r < 2; ++r) {
    specs.push_back(ProcessSpec{HelperArgs({"init"}, {"--evenstep_rendezvous_timeout=10m"}),
                                {{"SLURM_PROCID", std::to_string(r)},
                                 {"SLURM_NTASKS", "2"},
                                 {"SLURM_LOCALID", std::to_string(r)},
                                 {"SLURM_NODEID", "0"},
                                 {"SLURM_STEP_TASKS_PER_NODE", "2"},
                                 {"SLURM_JOB_ID", "4242"},
                                 {"SLURM_JOB_NODELIST", "no-such-node[1-2].invalid"}}});
  }
  auto results = RunAll(specs, kHangBound);
  for (const ProcessResult& r : results) {
    EXPECT_FALSE(r.timed_out) << Describe(results);
    EXPECT_EQ(r.exit_code, 3) << Describe(results);
    EXPECT_THAT(r.output, HasSubstr("'no-such-node1.invalid' (")) << Describe(results);
    EXPECT_THAT(r.output, HasSubstr("NODELIST) does not resolve")) << Describe(results);
  }
}

TEST(DistContextTest, UnreachableMasterFailsWithinTheTimeout) {
  evenstep::testing::RefusingPort refusing;
  auto specs =
      TorchrunRanks(2, refusing.port(), HelperArgs({"init"}, {"--evenstep_rendezvous_timeout=2s"}));
  specs.erase(specs.begin());  // only rank 1, a client
  auto results = RunAll(specs, kHangBound);
  EXPECT_FALSE(results[0].timed_out) << Describe(results);
  EXPECT_EQ(results[0].exit_code, 3) << Describe(results);
  EXPECT_THAT(results[0].output,
              HasSubstr(absl::StrCat("rank 1: cannot reach the c10d TCPStore at 127.0.0.1:",
                                     refusing.port(), " (MASTER_ADDR:MASTER_PORT)")));
}

TEST(DistContextTest, BadFlagIsNamed) {
  auto results =
      RunAll({ProcessSpec{HelperArgs({"init"}, {"--evenstep_backend=mpi"}), {}}}, kHangBound);
  EXPECT_EQ(results[0].exit_code, 3) << Describe(results);
  EXPECT_THAT(results[0].output, HasSubstr("--evenstep_backend=mpi: expected auto, gloo or nccl"));
}

TEST(DistContextTest, PeerThatLeftIsNamed) {
  auto store = HostStore();
  ASSERT_NE(store, nullptr);
  auto results =
      RunAll(TorchrunRanks(3, store->port(), HelperArgs({"die_after_init", "2"}, kShortTimeouts)),
             kHangBound);
  EXPECT_EQ(results[2].exit_code, 0) << Describe(results);
  for (int r = 0; r < 2; ++r) {
    EXPECT_FALSE(results[r].timed_out) << Describe(results);
    EXPECT_EQ(results[r].exit_code, 4) << Describe(results);
    EXPECT_THAT(results[r].output, HasSubstr(absl::StrCat("rank ", r, ": all_reduce of Float[8]")));
    // #1 is DistContext::Create's barrier, #2 the helper's, #3 the all_reduce.
    EXPECT_THAT(results[r].output, HasSubstr("rank(s) 2 (last at #2) never arrived"));
  }
}

TEST(DistContextTest, AWriteToADeadPeerFailsInsteadOfEndingTheRankBySigpipe) {
  // Gloo writes to a dead peer's socket raise SIGPIPE: by default that ends
  // the surviving rank without a word, before it can name the peer that never
  // arrived (seen in BalancedStepTest.APeerThatDiesIsNamedAsNeverArrived under
  // load). After Create the write fails with EPIPE; a handler the program
  // installed itself is left in place.
  for (bool own : {false, true}) {
    std::vector<std::string> scenario = {"write_to_closed_pipe"};
    if (own) scenario.push_back("own");
    auto store = HostStore();
    ASSERT_NE(store, nullptr);
    auto results = RunAll(TorchrunRanks(2, store->port(), HelperArgs(scenario)), kHangBound);
    for (const auto& r : results) {
      EXPECT_EQ(r.signal, 0) << Describe(results);
      EXPECT_EQ(r.exit_code, 0) << Describe(results);
      EXPECT_THAT(r.output, HasSubstr(absl::StrCat("write returned -1 EPIPE, own handler ran ",
                                                   own ? 1 : 0, " time(s)")))
          << Describe(results);
    }
  }
}

TEST(DistContextTest, StalledPeerIsNamedAfterTheTimeout) {
  auto store = HostStore();
  ASSERT_NE(store, nullptr);
  auto specs = TorchrunRanks(3, store->port(), HelperArgs({"stall_rank", "1"}, kShortTimeouts));
  std::vector<std::unique_ptr<evenstep::testing::Subprocess>> procs;
  for (const auto& spec : specs)
    procs.push_back(std::make_unique<evenstep::testing::Subprocess>(spec));
  for (int r : {0, 2}) {
    ProcessResult result = procs[r]->Wait(kHangBound);
    EXPECT_FALSE(result.timed_out) << result.output;
    EXPECT_EQ(result.exit_code, 4) << result.output;
    EXPECT_THAT(result.output, HasSubstr("DEADLINE_EXCEEDED"));
    // Rank 1 passed DistContext::Create's barrier (#1) and stalled.
    EXPECT_THAT(result.output, HasSubstr("rank(s) 1 (last at #1) never arrived"));
  }
  // Rank 1 sleeps; the Subprocess destructor kills it.
}

}  // namespace
}  // namespace evenstep

// Ranks on separate hosts, simulated with network namespaces
// (tests/testing/netns.h): each host's own name on 127.0.1.1, as a Debian or
// Ubuntu /etc/hosts has it, one rank per host, and MASTER_ADDR set to the
// first host's NAME (what people type) without GLOO_SOCKET_IFNAME. Gloo must
// bind to the address that reaches the master, not to loopback: the group
// forms and its collectives are exact. Skipped with the reason where
// namespaces cannot be made (no root, no `ip`).
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "evenstep/grad_sync.h"
#include "evenstep/internal/store_server.h"
#include "evenstep/sync_topology.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/netns.h"
#include "tests/testing/on_ranks.h"
#include "tests/testing/subprocess.h"
#include "tests/testing/sync_net.h"
#include "tests/testing/temp_dir.h"

namespace evenstep {
namespace {

using ::evenstep::testing::ProcessSpec;
using ::evenstep::testing::SimulatedCluster;
using ::testing::HasSubstr;
using ::testing::Not;

using Env = std::vector<std::pair<std::string, std::string>>;

// The torchrun variables of rank `rank`, one rank per host, the store hosted
// by the test inside host 0 (port from the OS there).
Env RankEnv(const SimulatedCluster& cluster, int rank, int port) {
  return {{"RANK", std::to_string(rank)},
          {"WORLD_SIZE", std::to_string(cluster.hosts())},
          {"LOCAL_RANK", "0"},
          {"LOCAL_WORLD_SIZE", "1"},
          {"MASTER_ADDR", cluster.name(0)},
          {"MASTER_PORT", std::to_string(port)},
          {"TORCHELASTIC_USE_AGENT_STORE", "True"},
          {"OMP_NUM_THREADS", "1"}};
}

// What srun gives rank `rank` (one task per node): the master is the first
// host of the node list and rank 0 hosts the store on the port derived from
// the job id. A fixed port is safe here: nothing else lives in these
// namespaces.
Env SlurmEnv(const SimulatedCluster& cluster, int rank) {
  const int n = cluster.hosts();
  return {{"SLURM_PROCID", std::to_string(rank)},
          {"SLURM_NTASKS", std::to_string(n)},
          {"SLURM_LOCALID", "0"},
          {"SLURM_NODEID", std::to_string(rank)},
          {"SLURM_TASKS_PER_NODE", absl::StrCat("1(x", n, ")")},
          {"SLURM_JOB_NODELIST", absl::StrCat("node-[0-", n - 1, "]")},
          {"SLURM_JOB_ID", "4242"},
          {"OMP_NUM_THREADS", "1"}};
}

// What `mpirun -x MASTER_ADDR=node-0 -x MASTER_PORT=...` gives rank `rank`.
Env MpirunEnv(const SimulatedCluster& cluster, int rank) {
  return {{"OMPI_COMM_WORLD_RANK", std::to_string(rank)},
          {"OMPI_COMM_WORLD_SIZE", std::to_string(cluster.hosts())},
          {"OMPI_COMM_WORLD_LOCAL_RANK", "0"},
          {"OMPI_COMM_WORLD_LOCAL_SIZE", "1"},
          {"MASTER_ADDR", cluster.name(0)},
          {"MASTER_PORT", "29611"},
          {"OMP_NUM_THREADS", "1"}};
}

// The c10d store, served from inside host `k` (its socket made there, port
// from the OS), or null.
std::unique_ptr<internal::StoreServer> HostStoreIn(const SimulatedCluster& cluster, int k) {
  std::unique_ptr<internal::StoreServer> store;
  absl::Status entered = cluster.InHost(k, [&] {
    auto started = internal::StoreServer::Start(0);
    if (started.ok()) store = std::move(*started);
  });
  return entered.ok() ? std::move(store) : nullptr;
}

TEST(MultiHostTest, HostNamesOnLoopbackStillFormAGroupWithExactCollectives) {
  for (int hosts : {2, 3}) {
    auto cluster = SimulatedCluster::Create(hosts);
    if (!cluster.ok()) GTEST_SKIP() << "no simulated hosts here: " << cluster.status();
    std::unique_ptr<internal::StoreServer> store = HostStoreIn(**cluster, 0);
    ASSERT_NE(store, nullptr);
    std::vector<ProcessSpec> specs;
    for (int r = 0; r < hosts; ++r) {
      specs.push_back((*cluster)->On(r,
                                     {EVENSTEP_RANK_HELPER, "--evenstep_rendezvous_timeout=30s",
                                      "--evenstep_timeout=30s", "collectives"},
                                     RankEnv(**cluster, r, store->port())));
    }
    const auto results = evenstep::testing::RunAll(specs, evenstep::testing::HangBound(2));
    for (int r = 0; r < hosts; ++r) {
      EXPECT_FALSE(results[r].timed_out) << hosts << " hosts\n" << results[r].output;
      EXPECT_EQ(results[r].exit_code, 0) << hosts << " hosts\n" << results[r].output;
      EXPECT_THAT(results[r].output,
                  HasSubstr(absl::StrCat("collectives ok: rank ", r, " of ", hosts)));
      // Each host says where its ranks listen, and why.
      EXPECT_THAT(results[r].output,
                  HasSubstr(absl::StrCat(
                      "[evenstep] host ", (*cluster)->name(r), " (rank ", r, "): Gloo on ",
                      (*cluster)->address(r),
                      r == 0 ? " (the address the ranks on other hosts reach MASTER_ADDR node-0 "
                               "at; it is loopback here)"
                             : " (the address that reaches MASTER_ADDR node-0)")));
    }
  }
}

// The same under srun's and mpirun's conventions, where rank 0 hosts the
// store itself (bound on every address of host 0, reached over loopback by
// rank 0 and over the link by the others).
TEST(MultiHostTest, SrunAndMpirunConventionsAcrossHosts) {
  auto cluster = SimulatedCluster::Create(2);
  if (!cluster.ok()) GTEST_SKIP() << "no simulated hosts here: " << cluster.status();
  for (const char* launcher : {"srun", "mpirun"}) {
    std::vector<ProcessSpec> specs;
    for (int r = 0; r < 2; ++r) {
      specs.push_back((*cluster)->On(
          r,
          {EVENSTEP_RANK_HELPER, "--evenstep_rendezvous_timeout=30s", "--evenstep_timeout=30s",
           "collectives"},
          std::string(launcher) == "srun" ? SlurmEnv(**cluster, r) : MpirunEnv(**cluster, r)));
    }
    const auto results = evenstep::testing::RunAll(specs, evenstep::testing::HangBound(2));
    for (int r = 0; r < 2; ++r) {
      EXPECT_EQ(results[r].exit_code, 0) << launcher << "\n" << results[r].output;
      EXPECT_THAT(results[r].output, HasSubstr(absl::StrCat("collectives ok: rank ", r, " of 2")))
          << launcher;
    }
  }
}

// The preflight across hosts (plumbing; its verdicts on timings are tested
// with injected figures in preflight_test): 2 ranks on each of 2 hosts, the
// nodes are the hosts' own names, and the within-node and cross-node
// all-reduce groups both measure.
TEST(MultiHostTest, PreflightSeesTheHostsAsNodesAndMeasuresAcrossThem) {
  auto cluster = SimulatedCluster::Create(2);
  if (!cluster.ok()) GTEST_SKIP() << "no simulated hosts here: " << cluster.status();
  std::unique_ptr<internal::StoreServer> store = HostStoreIn(**cluster, 0);
  ASSERT_NE(store, nullptr);
  evenstep::testing::TempDir dir("evenstep_multihost");
  const std::string json = dir.path() + "/preflight.json";
  std::vector<ProcessSpec> specs;
  for (int r = 0; r < 4; ++r) {
    Env env = RankEnv(**cluster, r, store->port());
    for (auto& [name, value] : env) {
      if (name == "WORLD_SIZE") value = "4";
      if (name == "LOCAL_RANK") value = std::to_string(r % 2);
      if (name == "LOCAL_WORLD_SIZE") value = "2";
    }
    specs.push_back((*cluster)->On(r / 2,
                                   {EVENSTEP_PREFLIGHT, "--quick", "--json=" + json,
                                    "--evenstep_rendezvous_timeout=60s", "--evenstep_timeout=60s"},
                                   env));
  }
  const auto results = evenstep::testing::RunAll(specs, evenstep::testing::HangBound(4));
  for (int r = 0; r < 4; ++r) {
    EXPECT_FALSE(results[r].timed_out) << results[r].output;
    // 3: an outlier named on this shared machine's timings; still a full run.
    EXPECT_TRUE(results[r].exit_code == 0 || results[r].exit_code == 3) << results[r].output;
  }
  EXPECT_THAT(results[0].output, HasSubstr("4 ranks on 2 nodes")) << results[0].output;
  std::ifstream in(json);
  const nlohmann::json report = nlohmann::json::parse(in, nullptr, false);
  ASSERT_TRUE(report.is_object()) << results[0].output;
  EXPECT_EQ(report["nodes"], nlohmann::json::array({"node-0", "node-0", "node-1", "node-1"}));
  EXPECT_GT(report["group"]["local_busbw_gbps"].get<double>(), 0);
  EXPECT_GT(report["group"]["cross_node_busbw_gbps"].get<double>(), 0);
}

// The ranks of a `hosts` x `per_host` job on `cluster` (torchrun's
// variables, the store hosted by the test in host 0), running `argv`.
std::vector<ProcessSpec> JobOnHosts(const SimulatedCluster& cluster, int per_host, int port,
                                    const std::vector<std::string>& argv) {
  std::vector<ProcessSpec> specs;
  const int world = cluster.hosts() * per_host;
  for (int r = 0; r < world; ++r) {
    Env env = RankEnv(cluster, r, port);
    for (auto& [name, value] : env) {
      if (name == "WORLD_SIZE") value = std::to_string(world);
      if (name == "LOCAL_RANK") value = std::to_string(r % per_host);
      if (name == "LOCAL_WORLD_SIZE") value = std::to_string(per_host);
    }
    specs.push_back(cluster.On(r / per_host, argv, env));
  }
  return specs;
}

// The hierarchical sync across real (simulated) hosts whose link is slow:
// the nodes are the host names, auto measures the link and picks
// hierarchical, and the gradient equals one process's (2 x 2 and 2 x 1).
// The ranks are this test again (RunHereIfRank), started inside the hosts.
class MultiHostSyncTest : public ::testing::TestWithParam<int> {};

TEST_P(MultiHostSyncTest, AutoPicksTheHierarchicalSyncOverASlowLinkAndItIsExact) {
  const int per_host = GetParam();
  evenstep::testing::RunHereIfRank([per_host](DistContext& dist) {
    GradSyncOptions options = evenstep::testing::TinyBuckets();
    auto choice = ApplySyncTopology(
        dist, per_host == 1 ? SyncTopology::kHierarchical : SyncTopology::kAuto, &options);
    ASSERT_TRUE(choice.ok()) << choice.status();
    EXPECT_THAT(choice->line,
                HasSubstr(absl::StrCat("gradient sync: hierarchical (2 nodes x ", per_host)));
    evenstep::testing::SyncExactSplit(dist, 14, options);
  });
  SimulatedCluster::Options options;
  options.mbit = {100, 100};
  auto cluster = SimulatedCluster::Create(2, options);
  if (!cluster.ok()) GTEST_SKIP() << "no simulated hosts here: " << cluster.status();
  std::unique_ptr<internal::StoreServer> store = HostStoreIn(**cluster, 0);
  ASSERT_NE(store, nullptr);
  const ProcessSpec self = evenstep::testing::ThisTestAsRank();
  std::vector<ProcessSpec> specs = JobOnHosts(**cluster, per_host, store->port(), self.argv);
  for (ProcessSpec& spec : specs) spec.env.insert(spec.env.end(), self.env.begin(), self.env.end());
  evenstep::testing::ExpectRanksPassed(
      evenstep::testing::RunAll(specs, evenstep::testing::HangBound(2)));
}

INSTANTIATE_TEST_SUITE_P(PerHost, MultiHostSyncTest, ::testing::Values(2, 1),
                         [](const auto& info) { return absl::StrCat(info.param, "_per_host"); });

// A rank on the other host that leaves mid-job (after the start-up
// barrier, before the all_reduce the others enter): every other rank, on
// both hosts, fails within the collective timeout naming it.
TEST(MultiHostTest, ARankLostOnTheOtherHostIsNamedWithinTheTimeout) {
  auto cluster = SimulatedCluster::Create(2);
  if (!cluster.ok()) GTEST_SKIP() << "no simulated hosts here: " << cluster.status();
  std::unique_ptr<internal::StoreServer> store = HostStoreIn(**cluster, 0);
  ASSERT_NE(store, nullptr);
  const auto results = evenstep::testing::RunAll(
      JobOnHosts(**cluster, 2, store->port(),
                 {EVENSTEP_RANK_HELPER, "--evenstep_rendezvous_timeout=30s",
                  "--evenstep_timeout=10s", "die_after_init", "3"}),
      evenstep::testing::HangBound(2));
  EXPECT_EQ(results[3].exit_code, 0) << evenstep::testing::Describe(results);
  for (int r = 0; r < 3; ++r) {
    EXPECT_FALSE(results[r].timed_out) << evenstep::testing::Describe(results);
    EXPECT_EQ(results[r].exit_code, 4) << evenstep::testing::Describe(results);
    EXPECT_THAT(results[r].output, HasSubstr("rank(s) 3 (last at #2) never arrived"))
        << evenstep::testing::Describe(results);
  }
}

// A whole host lost (both its ranks gone) under
// --evenstep_on_rank_loss=continue: the other host's ranks regroup through
// the store on their host and all_reduce exactly among themselves; a
// killed rank on the other host is known lost through its liveness socket,
// across the link between the hosts.
TEST(MultiHostTest, AHostLostWholeLeavesTheOtherHostsRanksGoingOn) {
  auto cluster = SimulatedCluster::Create(2);
  if (!cluster.ok()) GTEST_SKIP() << "no simulated hosts here: " << cluster.status();
  std::unique_ptr<internal::StoreServer> store = HostStoreIn(**cluster, 0);
  ASSERT_NE(store, nullptr);
  const auto results = evenstep::testing::RunAll(
      JobOnHosts(
          **cluster, 2, store->port(),
          {EVENSTEP_RANK_HELPER, "--evenstep_rendezvous_timeout=30s", "--evenstep_timeout=20s",
           "--evenstep_on_rank_loss=continue", "--evenstep_lost_after=3s", "lose_from", "2"}),
      evenstep::testing::HangBound(2));
  for (int r = 0; r < 4; ++r) {
    EXPECT_FALSE(results[r].timed_out) << evenstep::testing::Describe(results);
    EXPECT_EQ(results[r].exit_code, 0) << evenstep::testing::Describe(results);
  }
  for (int r = 0; r < 2; ++r) {
    // Launch ranks 1 and 2 contribute 1 + 2.
    EXPECT_THAT(results[r].output,
                HasSubstr(absl::StrCat("regrouped: rank(s) 2, 3 lost; 2 survivor(s) go on (regroup "
                                       "1); rank ",
                                       r, " of 2, sum 3")))
        << evenstep::testing::Describe(results);
  }
}

// The preflight on shaped links (the shaper sets the rates: 40 Mbit/s
// against an unshaped path tens of times faster on any load). One host's
// link slow among three hosts of one rank: the link is named, with its
// hosts. Every link between two hosts of two ranks slow: the cross-node
// ratio is reported with the hierarchical sync recommended.
TEST(MultiHostTest, PreflightNamesTheSlowLinkAndTheSlowPathBetweenNodes) {
  evenstep::testing::TempDir dir("evenstep_multihost");
  const std::string json = dir.path() + "/preflight.json";
  auto run = [&](const SimulatedCluster& cluster, int per_host) {
    std::unique_ptr<internal::StoreServer> store = HostStoreIn(cluster, 0);
    EXPECT_NE(store, nullptr);
    if (store == nullptr) return std::string();
    const auto results = evenstep::testing::RunAll(
        JobOnHosts(cluster, per_host, store->port(),
                   {EVENSTEP_PREFLIGHT, "--quick", "--json=" + json,
                    "--evenstep_rendezvous_timeout=60s", "--evenstep_timeout=60s"}),
        evenstep::testing::HangBound(4));
    for (const auto& r : results) {
      EXPECT_FALSE(r.timed_out) << r.output;
      EXPECT_EQ(r.exit_code, 3) << r.output;  // 3: an outlier named
    }
    return results[0].output;
  };
  {
    SimulatedCluster::Options options;
    options.mbit = {0, 0, 40};
    auto cluster = SimulatedCluster::Create(3, options);
    if (!cluster.ok()) GTEST_SKIP() << "no simulated hosts here: " << cluster.status();
    const std::string out = run(**cluster, 1);
    EXPECT_THAT(out, HasSubstr("link 0-2 (node-0 to node-2): all-reduce")) << out;
    EXPECT_THAT(out, Not(HasSubstr("rank 2: every link measured is slow"))) << out;
  }
  {
    SimulatedCluster::Options options;
    options.mbit = {40, 40};
    auto cluster = SimulatedCluster::Create(2, options);
    ASSERT_TRUE(cluster.ok()) << cluster.status();
    const std::string out = run(**cluster, 2);
    EXPECT_THAT(out, HasSubstr("cross-node all-reduce")) << out;
    EXPECT_THAT(out, HasSubstr("--evenstep_sync_topology=hierarchical")) << out;
  }
}

// The `collectives` scenario on each host with 5 s timeouts, GLOO_SOCKET_IFNAME
// set to ifnames[r] on rank r's host ("" = unset).
std::vector<ProcessSpec> CollectivesWithIfnames(const SimulatedCluster& cluster, int port,
                                                const std::vector<std::string>& ifnames) {
  std::vector<ProcessSpec> specs;
  for (int r = 0; r < cluster.hosts(); ++r) {
    auto env = RankEnv(cluster, r, port);
    if (!ifnames[r].empty()) env.emplace_back("GLOO_SOCKET_IFNAME", ifnames[r]);
    specs.push_back(cluster.On(r,
                               {EVENSTEP_RANK_HELPER, "--evenstep_rendezvous_timeout=5s",
                                "--evenstep_timeout=5s", "collectives"},
                               env));
  }
  return specs;
}

// Loopback asked for (GLOO_SOCKET_IFNAME=lo) in a job across hosts: what
// the old default did silently (one rank refused, the other waiting for
// Gloo's connect timeout). Every rank stops at once, naming the variable,
// the host and what to set.
TEST(MultiHostTest, GlooOnLoopbackAcrossHostsIsRefusedNamingTheFix) {
  auto cluster = SimulatedCluster::Create(2);
  if (!cluster.ok()) GTEST_SKIP() << "no simulated hosts here: " << cluster.status();
  std::unique_ptr<internal::StoreServer> store = HostStoreIn(**cluster, 0);
  ASSERT_NE(store, nullptr);
  const auto results =
      evenstep::testing::RunAll(CollectivesWithIfnames(**cluster, store->port(), {"lo", "lo"}),
                                evenstep::testing::HangBound(2));
  for (int r = 0; r < 2; ++r) {
    EXPECT_FALSE(results[r].timed_out) << results[r].output;
    EXPECT_NE(results[r].exit_code, 0) << results[r].output;
    EXPECT_THAT(results[r].output,
                HasSubstr(absl::StrCat("rank ", r, ": host ", (*cluster)->name(r),
                                       ": GLOO_SOCKET_IFNAME=lo is a loopback interface but the "
                                       "job spans hosts (2 ranks, 1 on this host)")))
        << results[r].output;
    EXPECT_THAT(results[r].output, HasSubstr("set MASTER_ADDR to an address the other hosts reach"))
        << results[r].output;
  }
}

// What torchrun hands its workers: MASTER_ADDR = the first agent's host
// name, which that host maps to 127.0.1.1, on a master host with a second
// interface (a docker0 or a second NIC: no single address to pick). The
// ranks on the other hosts reached the master at its address on the shared
// network; the master host learns it from them and binds Gloo there: the
// group forms on the first try with exact collectives (it used to stop every
// rank naming GLOO_SOCKET_IFNAME, which a torchrun user cannot set per host).
TEST(MultiHostTest, TorchrunsMasterNameOnLoopbackWithTwoInterfacesTrainsOnTheFirstTry) {
  auto cluster = SimulatedCluster::Create(3);
  if (!cluster.ok()) GTEST_SKIP() << "no simulated hosts here: " << cluster.status();
  ASSERT_TRUE((*cluster)->AddIsolatedInterface(0, "docker0", "10.76.0.1").ok());
  std::unique_ptr<internal::StoreServer> store = HostStoreIn(**cluster, 0);
  ASSERT_NE(store, nullptr);
  std::vector<ProcessSpec> specs;
  for (int r = 0; r < 3; ++r) {
    specs.push_back((*cluster)->On(r,
                                   {EVENSTEP_RANK_HELPER, "--evenstep_rendezvous_timeout=30s",
                                    "--evenstep_timeout=30s", "collectives"},
                                   RankEnv(**cluster, r, store->port())));
  }
  const auto results = evenstep::testing::RunAll(specs, evenstep::testing::HangBound(2));
  for (int r = 0; r < 3; ++r) {
    EXPECT_FALSE(results[r].timed_out) << evenstep::testing::Describe(results);
    EXPECT_EQ(results[r].exit_code, 0) << evenstep::testing::Describe(results);
    EXPECT_THAT(results[r].output, HasSubstr(absl::StrCat("collectives ok: rank ", r, " of 3")));
  }
  EXPECT_THAT(
      results[0].output,
      HasSubstr(absl::StrCat("[evenstep] host node-0 (rank 0): Gloo on ", (*cluster)->address(0),
                             " (the address the ranks on other hosts reach MASTER_ADDR "
                             "node-0 at; it is loopback here)")))
      << results[0].output;
}

// One host's Gloo on an address the other host cannot reach (its
// GLOO_SOCKET_IFNAME points at a second interface on a private network,
// like docker0): the rendezvous through MASTER_ADDR works, the Gloo pairs
// cannot connect. What users saw before: one rank refused at once, the
// other waiting 304 s past its 5 s flags with an address and no cause.
// Every rank ends within the timeout flag with a named error: its own
// address, the peer's, and what to check.
TEST(MultiHostTest, AGlooAddressTheOtherHostCannotReachEndsEveryRankWithinTheTimeout) {
  auto cluster = SimulatedCluster::Create(2);
  if (!cluster.ok()) GTEST_SKIP() << "no simulated hosts here: " << cluster.status();
  ASSERT_TRUE((*cluster)->AddIsolatedInterface(0, "private0", "10.76.0.1").ok());
  std::unique_ptr<internal::StoreServer> store = HostStoreIn(**cluster, 0);
  ASSERT_NE(store, nullptr);
  const auto results =
      evenstep::testing::RunAll(CollectivesWithIfnames(**cluster, store->port(), {"private0", ""}),
                                evenstep::testing::HangBound(2));
  for (int r = 0; r < 2; ++r) {
    EXPECT_FALSE(results[r].timed_out) << evenstep::testing::Describe(results);
    EXPECT_EQ(results[r].exit_code, 3) << evenstep::testing::Describe(results);  // init failed
    const std::string& out = results[r].output;
    EXPECT_THAT(out, HasSubstr(absl::StrCat(
                         "rank ", r,
                         ": the Gloo connections between hosts cannot form: rank 1 (host node-1) "
                         "cannot reach rank 0 (host node-0, Gloo on 10.76.0.1, interface private0 "
                         "from GLOO_SOCKET_IFNAME): Network is unreachable (no route from here")))
        << out;
    // The fix names the host and what is up there, the shared network first.
    EXPECT_THAT(out, HasSubstr("set GLOO_SOCKET_IFNAME to the interface on the network the hosts "
                               "share, on node-0 (up there: "))
        << out;
    EXPECT_THAT(out, HasSubstr(absl::StrCat((*cluster)->interface(0), "=", (*cluster)->address(0))))
        << out;
  }
}

}  // namespace
}  // namespace evenstep

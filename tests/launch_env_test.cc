// Launcher environment conventions: torchrun, Slurm, Open MPI, none.
#include "evenstep/launch_env.h"

#include <map>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace evenstep {
namespace {

using ::testing::HasSubstr;

absl::StatusOr<LaunchEnv> Detect(const std::map<std::string, std::string>& vars) {
  return DetectLaunchEnv([&](absl::string_view name) -> std::optional<std::string> {
    auto it = vars.find(std::string(name));
    if (it == vars.end()) return std::nullopt;
    return it->second;
  });
}

TEST(LaunchEnvTest, NoLauncherIsAWorldOfOne) {
  auto env = Detect({});
  ASSERT_TRUE(env.ok()) << env.status();
  EXPECT_EQ(env->launcher, Launcher::kNone);
  EXPECT_EQ(env->rank, 0);
  EXPECT_EQ(env->world_size, 1);
  EXPECT_EQ(env->local_world_size, 1);
  EXPECT_TRUE(env->master_addr.empty());
}

TEST(LaunchEnvTest, Torchrun) {
  auto env = Detect({{"RANK", "5"},
                     {"WORLD_SIZE", "8"},
                     {"LOCAL_RANK", "1"},
                     {"LOCAL_WORLD_SIZE", "4"},
                     {"MASTER_ADDR", "10.1.2.3"},
                     {"MASTER_PORT", "29400"}});
  ASSERT_TRUE(env.ok()) << env.status();
  EXPECT_EQ(env->launcher, Launcher::kTorchrun);
  EXPECT_EQ(env->rank, 5);
  EXPECT_EQ(env->world_size, 8);
  EXPECT_EQ(env->local_rank, 1);
  EXPECT_EQ(env->local_world_size, 4);
  EXPECT_EQ(env->master_addr, "10.1.2.3");
  EXPECT_EQ(env->master_port, 29400);
  EXPECT_FALSE(env->agent_store);
  EXPECT_THAT(env->Describe(), HasSubstr("rank 5/8 (local 1/4) via torchrun"));
}

TEST(LaunchEnvTest, TorchrunAgentStoreAndDefaults) {
  auto env = Detect({{"RANK", "0"},
                     {"WORLD_SIZE", "2"},
                     {"MASTER_ADDR", "127.0.0.1"},
                     {"TORCHELASTIC_USE_AGENT_STORE", "True"}});
  ASSERT_TRUE(env.ok()) << env.status();
  EXPECT_TRUE(env->agent_store);
  EXPECT_EQ(env->master_port, 29500);
  EXPECT_EQ(env->local_rank, 0);
  EXPECT_EQ(env->local_world_size, 2);
}

TEST(LaunchEnvTest, TorchrunRankOutOfRangeNamesTheVariables) {
  auto env = Detect({{"RANK", "2"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "h"}});
  ASSERT_EQ(env.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(env.status().message(), HasSubstr("RANK=2 is not in [0, WORLD_SIZE=2)"));
}

TEST(LaunchEnvTest, TorchrunMissingWorldSize) {
  auto env = Detect({{"RANK", "0"}});
  ASSERT_EQ(env.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(env.status().message(), HasSubstr("WORLD_SIZE is not set"));
}

TEST(LaunchEnvTest, NonIntegerValueNamesTheVariable) {
  auto env = Detect({{"RANK", "one"}, {"WORLD_SIZE", "2"}});
  ASSERT_EQ(env.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(env.status().message(), HasSubstr("RANK=\"one\" is not an integer"));
}

TEST(LaunchEnvTest, MissingMasterAddrForSeveralRanks) {
  auto env = Detect({{"RANK", "0"}, {"WORLD_SIZE", "2"}});
  ASSERT_EQ(env.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(env.status().message(), HasSubstr("MASTER_ADDR is not set"));
}

TEST(LaunchEnvTest, MasterPortZeroForSeveralRanksIsRefusedNamingIt) {
  // What torchrun 1.13 gives workers under static rendezvous with
  // --master_port 0: without this check every rank waits out the timeout.
  auto env =
      Detect({{"RANK", "1"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "h"}, {"MASTER_PORT", "0"}});
  ASSERT_EQ(env.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(env.status().message(), HasSubstr("MASTER_PORT=0 under torchrun: the 2 ranks"));
  EXPECT_TRUE(Detect({{"RANK", "0"}, {"WORLD_SIZE", "1"}, {"MASTER_PORT", "0"}}).ok());
}

TEST(LaunchEnvTest, LocalRankBeyondLocalWorld) {
  auto env = Detect({{"RANK", "3"},
                     {"WORLD_SIZE", "4"},
                     {"LOCAL_RANK", "2"},
                     {"LOCAL_WORLD_SIZE", "2"},
                     {"MASTER_ADDR", "h"}});
  ASSERT_EQ(env.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(env.status().message(), HasSubstr("LOCAL_RANK=2"));
}

TEST(LaunchEnvTest, Slurm) {
  auto env = Detect({{"SLURM_PROCID", "5"},
                     {"SLURM_NTASKS", "6"},
                     {"SLURM_LOCALID", "1"},
                     {"SLURM_NODEID", "2"},
                     {"SLURM_STEP_TASKS_PER_NODE", "2(x3)"},
                     {"SLURM_JOB_NODELIST", "gpu[07-09],cpu1"},
                     {"SLURM_JOB_ID", "123456"}});
  ASSERT_TRUE(env.ok()) << env.status();
  EXPECT_EQ(env->launcher, Launcher::kSlurm);
  EXPECT_EQ(env->rank, 5);
  EXPECT_EQ(env->world_size, 6);
  EXPECT_EQ(env->local_rank, 1);
  EXPECT_EQ(env->local_world_size, 2);
  EXPECT_EQ(env->master_addr, "gpu07");
  EXPECT_EQ(env->master_port, 15000 + 123456 % 20000);
}

TEST(LaunchEnvTest, SlurmStepTasksAndMasterOverride) {
  auto env = Detect({{"SLURM_PROCID", "0"},
                     {"SLURM_NTASKS", "16"},
                     {"SLURM_STEP_NUM_TASKS", "3"},
                     {"SLURM_TASKS_PER_NODE", "3"},
                     {"SLURM_JOB_NODELIST", "n1"},
                     {"MASTER_ADDR", "head"},
                     {"MASTER_PORT", "4000"}});
  ASSERT_TRUE(env.ok()) << env.status();
  EXPECT_EQ(env->world_size, 3);
  EXPECT_EQ(env->local_world_size, 3);
  EXPECT_EQ(env->master_addr, "head");
  EXPECT_EQ(env->master_port, 4000);
}

TEST(LaunchEnvTest, SlurmRankOutOfRange) {
  auto env = Detect({{"SLURM_PROCID", "4"}, {"SLURM_NTASKS", "4"}, {"SLURM_JOB_NODELIST", "a"}});
  ASSERT_EQ(env.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(env.status().message(), HasSubstr("SLURM_PROCID=4 is not in [0, SLURM_NTASKS=4)"));
}

TEST(LaunchEnvTest, OpenMpi) {
  auto env = Detect({{"OMPI_COMM_WORLD_RANK", "3"},
                     {"OMPI_COMM_WORLD_SIZE", "4"},
                     {"OMPI_COMM_WORLD_LOCAL_RANK", "1"},
                     {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"},
                     {"MASTER_ADDR", "node0"},
                     {"MASTER_PORT", "1234"}});
  ASSERT_TRUE(env.ok()) << env.status();
  EXPECT_EQ(env->launcher, Launcher::kOpenMpi);
  EXPECT_EQ(env->rank, 3);
  EXPECT_EQ(env->world_size, 4);
  EXPECT_EQ(env->local_rank, 1);
  EXPECT_EQ(env->local_world_size, 2);
  EXPECT_EQ(env->master_addr, "node0");
  EXPECT_EQ(env->master_port, 1234);
}

TEST(LaunchEnvTest, OpenMpiWithoutMasterAddrSaysHowToPassIt) {
  auto env = Detect({{"OMPI_COMM_WORLD_RANK", "0"}, {"OMPI_COMM_WORLD_SIZE", "2"}});
  ASSERT_EQ(env.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(env.status().message(), HasSubstr("-x MASTER_ADDR"));
}

TEST(LaunchEnvTest, TorchrunTakesPrecedenceOverSlurm) {
  auto env = Detect({{"RANK", "1"},
                     {"WORLD_SIZE", "2"},
                     {"MASTER_ADDR", "h"},
                     {"SLURM_PROCID", "0"},
                     {"SLURM_NTASKS", "1"}});
  ASSERT_TRUE(env.ok()) << env.status();
  EXPECT_EQ(env->launcher, Launcher::kTorchrun);
  EXPECT_EQ(env->rank, 1);
}

TEST(LaunchEnvTest, MpirunInsideASlurmAllocationIsOneOpenMpiWorld) {
  // sbatch -n 1 ... mpirun -np 4: Slurm describes the allocation (one task,
  // SLURM_PROCID 0 in every process), Open MPI the processes it started.
  for (const char* rank : {"0", "3"}) {
    auto env = Detect({{"OMPI_COMM_WORLD_RANK", rank},
                       {"OMPI_COMM_WORLD_SIZE", "4"},
                       {"OMPI_COMM_WORLD_LOCAL_RANK", rank},
                       {"OMPI_COMM_WORLD_LOCAL_SIZE", "4"},
                       {"SLURM_PROCID", "0"},
                       {"SLURM_NTASKS", "1"},
                       {"SLURM_JOB_ID", "4242"},
                       {"SLURM_JOB_NODELIST", "gpu[07-08]"}});
    ASSERT_TRUE(env.ok()) << env.status();
    EXPECT_EQ(env->launcher, Launcher::kOpenMpi);
    EXPECT_EQ(env->world_size, 4);
    EXPECT_EQ(env->rank, std::stoi(rank));
    EXPECT_EQ(env->master_addr, "gpu07");
    EXPECT_EQ(env->master_addr_source, "the first host of SLURM_JOB_NODELIST");
    EXPECT_EQ(env->master_port, 15000 + 4242);
  }
}

TEST(LaunchEnvTest, TorchrunRunIdNamespacesTheStore) {
  auto env = Detect({{"RANK", "0"},
                     {"WORLD_SIZE", "2"},
                     {"MASTER_ADDR", "h"},
                     {"TORCHELASTIC_RUN_ID", "abc"},
                     {"TORCHELASTIC_RESTART_COUNT", "2"}});
  ASSERT_TRUE(env.ok()) << env.status();
  // The restart count differs between hosts: not part of the namespace.
  EXPECT_EQ(env->run_namespace, "abc");
  auto plain = Detect({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "h"}});
  ASSERT_TRUE(plain.ok());
  EXPECT_EQ(plain->run_namespace, "");
}

TEST(SlurmNodelistTest, FirstHost) {
  EXPECT_EQ(*FirstHostOfSlurmNodelist("node1"), "node1");
  EXPECT_EQ(*FirstHostOfSlurmNodelist("node[03-05,9],gpu1"), "node03");
  EXPECT_EQ(*FirstHostOfSlurmNodelist("gpu1,node[03-05]"), "gpu1");
  EXPECT_EQ(*FirstHostOfSlurmNodelist("rack[1-2]-n[7-8]"), "rack1-n7");
  EXPECT_EQ(*FirstHostOfSlurmNodelist("a[9]"), "a9");
  EXPECT_EQ(FirstHostOfSlurmNodelist("n[1-2").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(FirstHostOfSlurmNodelist("").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(FirstHostOfSlurmNodelist("n[]").status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(SlurmNodelistTest, TasksOnNode) {
  EXPECT_EQ(*SlurmTasksOnNode("4", 0), 4);
  EXPECT_EQ(*SlurmTasksOnNode("2(x3),1", 0), 2);
  EXPECT_EQ(*SlurmTasksOnNode("2(x3),1", 2), 2);
  EXPECT_EQ(*SlurmTasksOnNode("2(x3),1", 3), 1);
  EXPECT_EQ(SlurmTasksOnNode("2(x3),1", 4).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(SlurmTasksOnNode("2(3)", 0).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace evenstep

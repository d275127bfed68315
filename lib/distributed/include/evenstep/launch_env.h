// Where this process sits in the job: rank, world size, local rank and the
// rendezvous address, read from the environment variables of the launcher that
// started it (torchrun, Slurm's srun, Open MPI's mpirun, or evenstep-run which
// speaks the torchrun convention). Pure functions of the environment; no I/O,
// thread-compatible.
//
//   absl::StatusOr<LaunchEnv> env = evenstep::DetectLaunchEnv();
//   if (!env.ok()) { std::cerr << env.status() << "\n"; return 1; }
//   std::cout << env->Describe() << "\n";
#pragma once

#include <functional>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace evenstep {

// The exit status of a rank stopped by a preemption signal after its step was
// saved and committed (Session; the sample exits with it). Distinct from
// failures, so evenstep-run and job scripts can tell it apart and requeue:
// evenstep-run does not treat it as a failure and exits with it when every
// rank did.
inline constexpr int kPreemptedExitCode = 83;

// The exit status for a loop that stops on `status`: 0 for OK,
// kPreemptedExitCode for CANCELLED (what Session::Step or Finish returns
// once it has saved a preempted step), 1 otherwise:
//   if (!report.ok()) { std::cerr << report.status() << "\n"; return ExitCode(report.status()); }
//   return ExitCode(es->Finish());
inline int ExitCode(const absl::Status& status) {
  if (status.ok()) return 0;
  return absl::IsCancelled(status) ? kPreemptedExitCode : 1;
}

// For a rank started by a launcher (RANK set; nothing otherwise): stdout
// line-buffered when it is a pipe or a file (a loop's progress appears as it
// is printed; EVENSTEP_STDOUT_BUFFERED=1 keeps stdio's block buffering), and
// SIGTERM and SIGUSR1, where the program left their default action, exit at
// once with kPreemptedExitCode and a line saying that no step was in
// progress, until a Session installs its own handlers (it saves the step,
// then stops). DistContext::Create calls it; call it first in main to cover
// what comes before (loading data, building the model). Nothing of it runs
// before main. Idempotent; true when RANK is set.
bool PrepareLaunchedRank();

enum class Launcher {
  kNone,      // no launcher variables: a world of size 1, no network
  kTorchrun,  // RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT
  kSlurm,     // SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, nodelist
  kOpenMpi,   // OMPI_COMM_WORLD_RANK / _SIZE / _LOCAL_RANK / _LOCAL_SIZE
};

absl::string_view LauncherName(Launcher launcher);

struct LaunchEnv {
  Launcher launcher = Launcher::kNone;
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  int local_world_size = 1;
  // Host and port of the c10d TCPStore. Empty / 0 for a world of size 1.
  std::string master_addr;
  int master_port = 0;
  // True when the launcher hosts the store itself (torchrun's and evenstep-run's
  // TORCHELASTIC_USE_AGENT_STORE=True): every rank, rank 0 included, is a client.
  bool agent_store = false;
  // Where master_addr came from, for errors ("MASTER_ADDR", "the first host
  // of SLURM_JOB_NODELIST").
  std::string master_addr_source = "MASTER_ADDR";
  // The job's namespace in the store under torchrun: TORCHELASTIC_RUN_ID
  // ("none" when only TORCHELASTIC_RESTART_COUNT is set), empty otherwise.
  // Each launch of the group (the first, each restart) meets in fresh keys
  // of the agent's long-lived store under it, in the launch generation the
  // ranks agree on (internal/launch_generation.h): the restart count is not
  // the same on every host.
  std::string run_namespace;

  // One line for logs: "rank 1/4 (local 1/2) via torchrun, store 10.0.0.1:29500".
  std::string Describe() const;
};

// Reads a variable; std::nullopt when it is not set.
using EnvLookup = std::function<std::optional<std::string>(absl::string_view name)>;

// Detects the launcher convention from `lookup` (the process environment by
// default). Precedence: torchrun (RANK set), Slurm (SLURM_PROCID set), Open MPI
// (OMPI_COMM_WORLD_RANK set), else a world of size 1. Open MPI goes before
// Slurm: mpirun inside a Slurm allocation sets both, and its OMPI_COMM_WORLD_*
// describe the processes it started (the Slurm ones describe the
// allocation); MASTER_ADDR then defaults to the allocation's first host. Fails with
// InvalidArgument naming the variable when a value is malformed or
// inconsistent (rank >= world size, local rank >= local world size, missing
// WORLD_SIZE or MASTER_ADDR where the convention needs it).
absl::StatusOr<LaunchEnv> DetectLaunchEnv(const EnvLookup& lookup);
absl::StatusOr<LaunchEnv> DetectLaunchEnv();

// The first host of a Slurm hostlist expression ("node[03-05,9],gpu1" ->
// "node03"; "rack[1-2]-n[7-8]" -> "rack1-n7"). InvalidArgument when malformed.
absl::StatusOr<std::string> FirstHostOfSlurmNodelist(absl::string_view nodelist);

// The number of tasks on node `node_index` from a Slurm tasks-per-node
// expression ("2(x3),1" means nodes 0-2 run 2 tasks, node 3 runs 1).
absl::StatusOr<int> SlurmTasksOnNode(absl::string_view tasks_per_node, int node_index);

}  // namespace evenstep

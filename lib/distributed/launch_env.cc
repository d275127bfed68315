// Launcher environment conventions; see launch_env.h.
#include "evenstep/launch_env.h"

#include <signal.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "evenstep/status_macros.h"

namespace evenstep {
namespace {

// A rank started by a launcher that gets SIGTERM or SIGUSR1 (the default
// --evenstep_preempt_signals) before its Session installs its own handlers
// has run no step of this run: it says so and exits kPreemptedExitCode
// (PrepareLaunchedRank).
extern "C" void ExitPreemptedBeforeSession(int sig) {
  char line[] =
      "[evenstep] signal 00 outside a Session: no step of this run in progress, nothing to save; "
      "exiting 83 (preempted)\n";
  line[18] = static_cast<char>('0' + sig / 10 % 10);
  line[19] = static_cast<char>('0' + sig % 10);
  ssize_t ignored = write(STDERR_FILENO, line, sizeof(line) - 1);
  (void)ignored;
  _exit(kPreemptedExitCode);
}

// Line-buffered stdout for a rank whose stdout is a pipe or a file
// (EVENSTEP_STDOUT_BUFFERED=1 keeps stdio's default).
void LineBufferStdout() {
  const char* keep = std::getenv("EVENSTEP_STDOUT_BUFFERED");
  if (isatty(STDOUT_FILENO) || (keep != nullptr && std::string(keep) == "1")) return;
  std::fflush(stdout);  // what was printed before keeps its order
  setvbuf(stdout, nullptr, _IOLBF, BUFSIZ);
}

// The default action of SIGTERM and SIGUSR1 (a program's own handler is
// kept) replaced by ExitPreemptedBeforeSession.
void ExitOnEarlyPreemption() {
  for (int sig : {SIGTERM, SIGUSR1}) {
    struct sigaction old {};
    if (sigaction(sig, nullptr, &old) != 0 || old.sa_handler != SIG_DFL) continue;
    struct sigaction action {};
    action.sa_handler = ExitPreemptedBeforeSession;
    sigemptyset(&action.sa_mask);
    sigaction(sig, &action, nullptr);
  }
}

constexpr int kDefaultMasterPort = 29500;

// Reads an integer variable. `required` variables that are missing fail;
// optional ones return `fallback`.
absl::StatusOr<int> ReadInt(const EnvLookup& lookup, absl::string_view name, bool required,
                            int fallback, absl::string_view convention) {
  std::optional<std::string> value = lookup(name);
  if (!value.has_value() || value->empty()) {
    if (!required) return fallback;
    return absl::InvalidArgumentError(
        absl::StrCat(name, " is not set but the ", convention, " launch convention needs it"));
  }
  int parsed = 0;
  if (!absl::SimpleAtoi(*value, &parsed)) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, "=\"", *value, "\" is not an integer (", convention, " convention)"));
  }
  return parsed;
}

std::string ReadString(const EnvLookup& lookup, absl::string_view name) {
  std::optional<std::string> value = lookup(name);
  return value.has_value() ? *value : std::string();
}

absl::Status Validate(const LaunchEnv& env, absl::string_view rank_var, absl::string_view world_var,
                      absl::string_view local_rank_var, absl::string_view local_world_var) {
  const std::string convention(LauncherName(env.launcher));
  if (env.world_size < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat(world_var, "=", env.world_size, " must be at least 1 (", convention, ")"));
  }
  if (env.rank < 0 || env.rank >= env.world_size) {
    return absl::InvalidArgumentError(absl::StrCat(rank_var, "=", env.rank, " is not in [0, ",
                                                   world_var, "=", env.world_size, ") (",
                                                   convention, ")"));
  }
  if (env.local_world_size < 1 || env.local_world_size > env.world_size) {
    return absl::InvalidArgumentError(absl::StrCat(local_world_var, "=", env.local_world_size,
                                                   " is not in [1, ", world_var, "=",
                                                   env.world_size, "] (", convention, ")"));
  }
  if (env.local_rank < 0 || env.local_rank >= env.local_world_size) {
    return absl::InvalidArgumentError(absl::StrCat(local_rank_var, "=", env.local_rank,
                                                   " is not in [0, ", local_world_var, "=",
                                                   env.local_world_size, ") (", convention, ")"));
  }
  if (env.world_size > 1 && env.master_addr.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "MASTER_ADDR is not set; a world of ", env.world_size, " ranks under ", convention,
        " needs the host of rank 0 (export MASTER_ADDR=<host> MASTER_PORT=<port>)"));
  }
  if (env.master_port < 0 || env.master_port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("MASTER_PORT=", env.master_port, " is not a TCP port"));
  }
  if (env.world_size > 1 && env.master_port == 0) {
    // torchrun 1.13's static rendezvous passes its --master_port 0 on to the
    // workers: rank 0 would host the store on a port only it knows, and the
    // others would wait for the rendezvous timeout.
    return absl::InvalidArgumentError(absl::StrCat(
        "MASTER_PORT=0 under ", convention, ": the ", env.world_size,
        " ranks cannot meet on a port the OS picks for one of them; give the store's real port "
        "(torchrun: --master_port P with static rendezvous, or --standalone / "
        "--rdzv_backend c10d)"));
  }
  return absl::OkStatus();
}

absl::StatusOr<LaunchEnv> FromTorchrun(const EnvLookup& lookup) {
  LaunchEnv env;
  env.launcher = Launcher::kTorchrun;
  constexpr absl::string_view kConv = "torchrun";
  EVENSTEP_ASSIGN_OR_RETURN(env.rank, ReadInt(lookup, "RANK", true, 0, kConv));
  EVENSTEP_ASSIGN_OR_RETURN(env.world_size, ReadInt(lookup, "WORLD_SIZE", true, 0, kConv));
  EVENSTEP_ASSIGN_OR_RETURN(env.local_rank, ReadInt(lookup, "LOCAL_RANK", false, env.rank, kConv));
  EVENSTEP_ASSIGN_OR_RETURN(env.local_world_size,
                            ReadInt(lookup, "LOCAL_WORLD_SIZE", false, env.world_size, kConv));
  env.master_addr = ReadString(lookup, "MASTER_ADDR");
  EVENSTEP_ASSIGN_OR_RETURN(env.master_port,
                            ReadInt(lookup, "MASTER_PORT", false, kDefaultMasterPort, kConv));
  std::string agent = ReadString(lookup, "TORCHELASTIC_USE_AGENT_STORE");
  env.agent_store = agent == "True" || agent == "true" || agent == "1";
  const std::string run_id = ReadString(lookup, "TORCHELASTIC_RUN_ID");
  const std::string restart = ReadString(lookup, "TORCHELASTIC_RESTART_COUNT");
  if (!run_id.empty() || !restart.empty()) {
    env.run_namespace = run_id.empty() ? "none" : run_id;
  }
  EVENSTEP_RETURN_IF_ERROR(Validate(env, "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"));
  return env;
}

// MASTER_ADDR, else the first host of the Slurm allocation's node list.
absl::Status MasterFromSlurmNodelist(const EnvLookup& lookup, LaunchEnv& env) {
  env.master_addr = ReadString(lookup, "MASTER_ADDR");
  if (!env.master_addr.empty()) return absl::OkStatus();
  for (const char* var : {"SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"}) {
    std::string nodelist = ReadString(lookup, var);
    if (nodelist.empty()) continue;
    absl::StatusOr<std::string> first = FirstHostOfSlurmNodelist(nodelist);
    if (!first.ok()) {
      return absl::InvalidArgumentError(absl::StrCat(var, ": ", first.status().message()));
    }
    env.master_addr = *first;
    env.master_addr_source = absl::StrCat("the first host of ", var);
    break;
  }
  return absl::OkStatus();
}

absl::StatusOr<LaunchEnv> FromSlurm(const EnvLookup& lookup) {
  LaunchEnv env;
  env.launcher = Launcher::kSlurm;
  constexpr absl::string_view kConv = "Slurm";
  EVENSTEP_ASSIGN_OR_RETURN(env.rank, ReadInt(lookup, "SLURM_PROCID", true, 0, kConv));
  // srun sets SLURM_STEP_NUM_TASKS for the step; SLURM_NTASKS is the job's.
  const char* world_var = lookup("SLURM_STEP_NUM_TASKS") ? "SLURM_STEP_NUM_TASKS" : "SLURM_NTASKS";
  EVENSTEP_ASSIGN_OR_RETURN(env.world_size, ReadInt(lookup, world_var, true, 0, kConv));
  EVENSTEP_ASSIGN_OR_RETURN(env.local_rank, ReadInt(lookup, "SLURM_LOCALID", false, 0, kConv));

  const char* local_world_var = "SLURM_STEP_TASKS_PER_NODE";
  std::string tasks_per_node = ReadString(lookup, local_world_var);
  if (tasks_per_node.empty()) {
    local_world_var = "SLURM_TASKS_PER_NODE";
    tasks_per_node = ReadString(lookup, local_world_var);
  }
  if (!tasks_per_node.empty()) {
    EVENSTEP_ASSIGN_OR_RETURN(const int node, ReadInt(lookup, "SLURM_NODEID", false, 0, kConv));
    absl::StatusOr<int> local = SlurmTasksOnNode(tasks_per_node, node);
    if (!local.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat(local_world_var, ": ", local.status().message()));
    }
    env.local_world_size = *local;
  } else {
    local_world_var = "SLURM_NTASKS_PER_NODE";
    EVENSTEP_ASSIGN_OR_RETURN(env.local_world_size,
                              ReadInt(lookup, local_world_var, false, env.world_size, kConv));
  }

  EVENSTEP_RETURN_IF_ERROR(MasterFromSlurmNodelist(lookup, env));
  // Every rank of a job derives the same port from the job id, so two jobs
  // sharing a node do not collide; MASTER_PORT overrides it.
  EVENSTEP_ASSIGN_OR_RETURN(const int job_id, ReadInt(lookup, "SLURM_JOB_ID", false, -1, kConv));
  const int fallback_port = job_id >= 0 ? 15000 + job_id % 20000 : kDefaultMasterPort;
  EVENSTEP_ASSIGN_OR_RETURN(env.master_port,
                            ReadInt(lookup, "MASTER_PORT", false, fallback_port, kConv));
  EVENSTEP_RETURN_IF_ERROR(
      Validate(env, "SLURM_PROCID", world_var, "SLURM_LOCALID", local_world_var));
  return env;
}

absl::StatusOr<LaunchEnv> FromOpenMpi(const EnvLookup& lookup) {
  LaunchEnv env;
  env.launcher = Launcher::kOpenMpi;
  constexpr absl::string_view kConv = "Open MPI";
  EVENSTEP_ASSIGN_OR_RETURN(env.rank, ReadInt(lookup, "OMPI_COMM_WORLD_RANK", true, 0, kConv));
  EVENSTEP_ASSIGN_OR_RETURN(env.world_size,
                            ReadInt(lookup, "OMPI_COMM_WORLD_SIZE", true, 0, kConv));
  EVENSTEP_ASSIGN_OR_RETURN(env.local_rank,
                            ReadInt(lookup, "OMPI_COMM_WORLD_LOCAL_RANK", false, 0, kConv));
  EVENSTEP_ASSIGN_OR_RETURN(env.local_world_size, ReadInt(lookup, "OMPI_COMM_WORLD_LOCAL_SIZE",
                                                          false, env.world_size, kConv));
  // Inside a Slurm allocation (mpirun under sbatch/salloc) rank 0 runs on
  // the allocation's first host, and the job id gives the port.
  EVENSTEP_RETURN_IF_ERROR(MasterFromSlurmNodelist(lookup, env));
  EVENSTEP_ASSIGN_OR_RETURN(const int job_id, ReadInt(lookup, "SLURM_JOB_ID", false, -1, kConv));
  EVENSTEP_ASSIGN_OR_RETURN(
      env.master_port, ReadInt(lookup, "MASTER_PORT", false,
                               job_id >= 0 ? 15000 + job_id % 20000 : kDefaultMasterPort, kConv));
  absl::Status s = Validate(env, "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
                            "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE");
  if (!s.ok() && env.master_addr.empty() && env.world_size > 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        s.message(), "; with mpirun pass -x MASTER_ADDR=<host of rank 0> -x MASTER_PORT=<port>"));
  }
  EVENSTEP_RETURN_IF_ERROR(s);
  return env;
}

bool IsSet(const EnvLookup& lookup, absl::string_view name) {
  std::optional<std::string> value = lookup(name);
  return value.has_value() && !value->empty();
}

}  // namespace

absl::string_view LauncherName(Launcher launcher) {
  switch (launcher) {
    case Launcher::kNone:
      return "single process";
    case Launcher::kTorchrun:
      return "torchrun";
    case Launcher::kSlurm:
      return "Slurm";
    case Launcher::kOpenMpi:
      return "Open MPI";
  }
  return "unknown";
}

std::string LaunchEnv::Describe() const {
  std::string out = absl::StrFormat("rank %d/%d (local %d/%d) via %s", rank, world_size, local_rank,
                                    local_world_size, LauncherName(launcher));
  if (world_size > 1) {
    absl::StrAppend(&out, ", store ", master_addr, ":", master_port,
                    agent_store ? " (hosted by the launcher)" : " (hosted by rank 0)");
  }
  return out;
}

absl::StatusOr<LaunchEnv> DetectLaunchEnv(const EnvLookup& lookup) {
  if (IsSet(lookup, "RANK") || IsSet(lookup, "WORLD_SIZE")) return FromTorchrun(lookup);
  if (IsSet(lookup, "OMPI_COMM_WORLD_RANK")) return FromOpenMpi(lookup);
  if (IsSet(lookup, "SLURM_PROCID")) return FromSlurm(lookup);
  return LaunchEnv{};
}

absl::StatusOr<LaunchEnv> DetectLaunchEnv() {
  return DetectLaunchEnv([](absl::string_view name) -> std::optional<std::string> {
    const char* value = std::getenv(std::string(name).c_str());
    if (value == nullptr) return std::nullopt;
    return std::string(value);
  });
}

absl::StatusOr<std::string> FirstHostOfSlurmNodelist(absl::string_view nodelist) {
  std::string host;
  int depth = 0;
  size_t i = 0;
  for (; i < nodelist.size(); ++i) {
    char c = nodelist[i];
    if (c == ',' && depth == 0) break;  // end of the first element
    if (c == '[') {
      if (depth != 0)
        return absl::InvalidArgumentError(absl::StrCat("nested '[' in \"", nodelist, "\""));
      depth = 1;
      // The first value of the range list: digits up to '-', ',' or ']'.
      size_t j = i + 1;
      while (j < nodelist.size() && nodelist[j] != '-' && nodelist[j] != ',' &&
             nodelist[j] != ']') {
        host.push_back(nodelist[j]);
        ++j;
      }
      if (j == i + 1) {
        return absl::InvalidArgumentError(absl::StrCat("empty range in \"", nodelist, "\""));
      }
      size_t close = nodelist.find(']', j);
      if (close == absl::string_view::npos) {
        return absl::InvalidArgumentError(absl::StrCat("unclosed '[' in \"", nodelist, "\""));
      }
      i = close;
      depth = 0;
      continue;
    }
    if (c == ']')
      return absl::InvalidArgumentError(absl::StrCat("stray ']' in \"", nodelist, "\""));
    host.push_back(c);
  }
  if (host.empty())
    return absl::InvalidArgumentError(absl::StrCat("no host in \"", nodelist, "\""));
  return host;
}

absl::StatusOr<int> SlurmTasksOnNode(absl::string_view tasks_per_node, int node_index) {
  if (node_index < 0) return absl::InvalidArgumentError("negative SLURM_NODEID");
  int node = 0;
  for (absl::string_view part : absl::StrSplit(tasks_per_node, ',')) {
    int tasks = 0;
    int repeat = 1;
    size_t paren = part.find('(');
    absl::string_view count = part.substr(0, paren);
    if (!absl::SimpleAtoi(count, &tasks)) {
      return absl::InvalidArgumentError(absl::StrCat("bad task count \"", part, "\""));
    }
    if (paren != absl::string_view::npos) {
      absl::string_view rep = part.substr(paren);
      if (!absl::ConsumePrefix(&rep, "(x") || !absl::ConsumeSuffix(&rep, ")") ||
          !absl::SimpleAtoi(rep, &repeat) || repeat < 1) {
        return absl::InvalidArgumentError(absl::StrCat("bad repeat in \"", part, "\""));
      }
    }
    if (node_index < node + repeat) return tasks;
    node += repeat;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("node ", node_index, " is beyond \"", tasks_per_node, "\" (", node, " nodes)"));
}

bool PrepareLaunchedRank() {
  if (std::getenv("RANK") == nullptr) return false;
  static std::once_flag once;
  std::call_once(once, [] {
    LineBufferStdout();
    ExitOnEarlyPreemption();
  });
  return true;
}

}  // namespace evenstep

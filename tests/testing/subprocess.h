// Test support: start real processes (ranks, the launcher) with a controlled
// environment, capture their combined output, and bound every wait so a hang
// fails the test instead of blocking CI. Not thread-safe; one owner per object.
#pragma once

#include <sys/types.h>

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/time/time.h"

namespace evenstep::testing {

// The one unit every multi-process test's hang bound derives from: `units`
// times 60 s, times EVENSTEP_TEST_TIMEOUT_SCALE (a factor, default 1, for
// slow machines or sanitizers). Generous on purpose: it only turns a hang
// into a failure instead of a blocked ctest, and no test judges timing by it.
absl::Duration HangBound(double units = 1);

struct ProcessSpec {
  std::vector<std::string> argv;
  // Added to the environment. Launcher variables inherited from the test's
  // own environment (RANK, SLURM_*, OMPI_*, MASTER_*, ...) are always removed.
  std::vector<std::pair<std::string, std::string>> env;
};

struct ProcessResult {
  int exit_code = -1;  // when it exited normally
  int signal = 0;      // when a signal ended it
  bool timed_out = false;
  std::string output;  // stdout and stderr, interleaved
};

class Subprocess {
 public:
  // Starts the process in its own process group. Aborts the test binary when
  // fork fails (nothing sensible to test after that).
  explicit Subprocess(const ProcessSpec& spec);
  ~Subprocess();  // kills the process group if still running
  Subprocess(const Subprocess&) = delete;
  Subprocess& operator=(const Subprocess&) = delete;

  pid_t pid() const { return pid_; }
  // Waits until the process exits or `timeout` passes; on timeout its process
  // group is killed with SIGKILL and `timed_out` is set.
  ProcessResult Wait(absl::Duration timeout);
  // True once the process has exited (non-blocking).
  bool Exited();
  // What it has written so far (stdout and stderr, interleaved).
  std::string OutputSoFar() const;
  // Waits until its output contains `text`: false when `timeout` passes or
  // the process exits first.
  bool WaitForOutput(const std::string& text, absl::Duration timeout);

 private:
  ProcessResult Finish(int status, bool timed_out);
  pid_t pid_ = -1;
  bool reaped_ = false;
  int status_ = 0;
  std::string output_path_;
};

// Runs every spec at once and waits for all of them under one deadline.
std::vector<ProcessResult> RunAll(const std::vector<ProcessSpec>& specs, absl::Duration timeout);

// Runs `command` with /bin/sh -c under `timeout`: (exit status, output).
std::pair<int, std::string> RunShell(const std::string& command,
                                     absl::Duration timeout = HangBound(2));

// Specs for `world` ranks of `argv` with the torchrun convention (RANK,
// WORLD_SIZE = declared_world or world, LOCAL_*, MASTER_ADDR/PORT) against a
// store already hosted on 127.0.0.1:`port` (TORCHELASTIC_USE_AGENT_STORE), one
// torch thread each.
std::vector<ProcessSpec> TorchrunRanks(int world, int port, const std::vector<std::string>& argv,
                                       int declared_world = -1);

// Hosts a c10d store on a port the OS picks, runs `world` ranks of `argv`
// against it (TorchrunRanks; placed on simulated `nodes` when given, see
// PlaceOnNodes; `env` added to every rank's) and waits for all under
// `timeout`.
std::vector<ProcessResult> RunRanks(
    int world, const std::vector<std::string>& argv, absl::Duration timeout = HangBound(2),
    const std::vector<int>& nodes = {},
    const std::vector<std::pair<std::string, std::string>>& env = {});

// `program`'s command line with evenstep's collective and rendezvous timeouts
// (60 s) before `args`: a lost peer fails the ranks, naming it, well inside
// the test's own HangBound.
std::vector<std::string> RankArgv(const std::string& program, const std::vector<std::string>& args);

// RunRanks of RankArgv(program, args).
std::vector<ProcessResult> RunProgramOnRanks(int world, const std::string& program,
                                             const std::vector<std::string>& args,
                                             absl::Duration timeout = HangBound(2));

// Places TorchrunRanks' specs on nodes simulated on this host: node k holds
// the next ranks_per_node[k] ranks, each with LOCAL_RANK, LOCAL_WORLD_SIZE
// and GROUP_RANK (torchrun's node index, which evenstep's node layout
// honours) of its node.
void PlaceOnNodes(const std::vector<int>& ranks_per_node, std::vector<ProcessSpec>* specs);

// RunProgramOnRanks on nodes simulated on this host (PlaceOnNodes).
std::vector<ProcessResult> RunProgramOnNodes(const std::vector<int>& ranks_per_node,
                                             const std::string& program,
                                             const std::vector<std::string>& args,
                                             absl::Duration timeout = HangBound(2));

// A network namespace of the test's own (ip netns), for ranks that must
// meet on a fixed port: where rank 0 hosts the store on MASTER_PORT (Slurm,
// Open MPI, torchrun without an agent store), a port the OS picks cannot be
// handed over, and a port picked and released could be taken by a parallel
// test. Inside the namespace nothing else exists to hold kPort. Removed by
// the destructor.
class NetNamespace {
 public:
  static constexpr int kPort = 29500;
  // Null when namespaces cannot be made here (not root, no CAP_SYS_ADMIN).
  static std::unique_ptr<NetNamespace> Create();
  ~NetNamespace();
  NetNamespace(const NetNamespace&) = delete;
  NetNamespace& operator=(const NetNamespace&) = delete;
  // `argv` run inside the namespace (its loopback is up).
  std::vector<std::string> Wrap(const std::vector<std::string>& argv) const;

 private:
  explicit NetNamespace(std::string name) : name_(std::move(name)) {}
  std::string name_;
};

// A port bound but not listening, held open while the object lives:
// connections to it are refused (an unreachable master).
class RefusingPort {
 public:
  RefusingPort();
  ~RefusingPort();
  int port() const { return port_; }

 private:
  int fd_ = -1;
  int port_ = 0;
};

// True while a process with this pid exists (zombies excluded).
bool ProcessAlive(pid_t pid);

// Human-readable summary of results for assertion messages.
std::string Describe(const std::vector<ProcessResult>& results);

}  // namespace evenstep::testing

// A rank program for the multi-process tests. It joins the job described by
// its environment (any launcher convention) and runs one scenario:
//
//   rank_helper [--evenstep_* flags] collectives        an all_reduce and a barrier (the
//                                                        launcher tests' sign of life)
//   rank_helper init                                     rendezvous only
//   rank_helper die_after_init R                         rank R leaves after a barrier,
//                                                        the others all_reduce
//   rank_helper stall_rank R                             rank R sleeps, the others all_reduce
//   rank_helper lose_from R                              ranks R and above leave after a
//                                                        barrier; the others' all_reduce
//                                                        fails, they regroup (run with
//                                                        --evenstep_on_rank_loss=continue)
//                                                        and all_reduce again, exactly
//   rank_helper rejoin R                                 rank R exits 9 after a barrier;
//                                                        the others regroup, wait for a
//                                                        replacement (evenstep-run
//                                                        --respawn), Admit it, and all
//                                                        ranks all_reduce exactly
//   rank_helper exit_code R C                            rank R exits with C, others sleep
//   rank_helper hang                                     sleep (no rendezvous)
//   rank_helper wait_for_sigterm                         exit 0 on SIGTERM
//   rank_helper write_to_closed_pipe [own]               after init, a write to a pipe
//                                                        nobody reads fails with EPIPE
//                                                        instead of ending the rank; with
//                                                        "own", the SIGPIPE handler the
//                                                        program installed first still runs
//
// Every rank writes its pid to $EVENSTEP_TEST_PID_DIR/rank<R>.pid when set.
// Exit codes: 0 scenario passed, 1 check failed, 3 init failed, 4 the expected
// collective failure happened (its status is printed).
#include <ATen/ATen.h>
#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <string>
#include <vector>

#include "absl/flags/parse.h"
#include "absl/strings/numbers.h"
#include "evenstep/dist_context.h"
#include "evenstep/flags.h"

namespace {

int RankFromEnv() {
  for (const char* var : {"RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK"}) {
    int rank = 0;
    const char* v = std::getenv(var);
    if (v != nullptr && absl::SimpleAtoi(v, &rank)) return rank;
  }
  return 0;
}

void WritePidFile() {
  const char* dir = std::getenv("EVENSTEP_TEST_PID_DIR");
  if (dir == nullptr) return;
  const std::string path = std::string(dir) + "/rank" + std::to_string(RankFromEnv()) + ".pid";
  {
    std::ofstream out(path + ".tmp");
    out << getpid() << "\n";
  }
  rename((path + ".tmp").c_str(), path.c_str());
}

// The launcher tests' sign of life: one all-reduce and a barrier over the
// ranks it started (every collective's exact results are specified in
// dist_context_test.cc's CollectivesTest).
int Collectives(evenstep::DistContext& dist) {
  const int w = dist.world_size();
  const int r = dist.rank();
  at::Tensor t = at::full({1}, 1.0 * r, at::kDouble);
  if (auto s = dist.AllReduce(t); !s.ok()) {
    std::cout << s << std::endl;
    return 1;
  }
  if (t.item<double>() != w * (w - 1) / 2.0) {
    std::cout << "MISMATCH all_reduce of the ranks: " << t.item<double>() << std::endl;
    return 1;
  }
  if (auto s = dist.Barrier(); !s.ok()) {
    std::cout << s << std::endl;
    return 1;
  }
  std::cout << "collectives ok: rank " << r << " of " << w << std::endl;
  return 0;
}

volatile sig_atomic_t own_sigpipe_calls = 0;
void OwnSigpipeHandler(int) { own_sigpipe_calls = own_sigpipe_calls + 1; }

// What a Gloo write to a dead peer's socket meets (c10d's TCPStore passes
// MSG_NOSIGNAL): a write to a pipe whose reader is gone.
int WriteToClosedPipe(bool own) {
  int fds[2];
  if (pipe(fds) != 0) return 1;
  close(fds[0]);
  const char byte = 0;
  const ssize_t n = write(fds[1], &byte, 1);
  const int err = errno;
  close(fds[1]);
  std::cout << "write returned " << n << (err == EPIPE ? " EPIPE" : "") << ", own handler ran "
            << own_sigpipe_calls << " time(s)" << std::endl;
  return n == -1 && err == EPIPE && own_sigpipe_calls == (own ? 1 : 0) ? 0 : 1;
}

// The ranks other than `absent` all-reduce and must fail naming it.
int ExpectFailureNaming(evenstep::DistContext& dist, int absent) {
  at::Tensor t = at::ones({8});
  absl::Status s = dist.AllReduce(t);
  if (s.ok()) {
    std::cout << "UNEXPECTED: all_reduce succeeded without rank " << absent << std::endl;
    return 1;
  }
  std::cout << "collective failed: " << s << std::endl;
  return 4;
}

// The ranks below `first_lost` go on without the others.
int LoseFrom(evenstep::DistContext& dist, int first_lost) {
  if (auto s = dist.Barrier(); !s.ok()) {
    std::cout << s << std::endl;
    return 1;
  }
  if (dist.rank() >= first_lost) _exit(0);
  at::Tensor t = at::ones({8});
  absl::Status failed = dist.AllReduce(t);
  std::cout << "collective " << (failed.ok() ? "succeeded" : "failed") << ": " << failed
            << std::endl;
  absl::StatusOr<evenstep::Regrouped> regrouped = dist.Regroup();
  if (!regrouped.ok()) {
    std::cout << "regroup failed: " << regrouped.status() << std::endl;
    return 1;
  }
  t = at::full({8}, static_cast<double>(dist.launch_rank() + 1));
  if (absl::Status s = dist.AllReduce(t); !s.ok()) {
    std::cout << "after the regroup: " << s << std::endl;
    return 1;
  }
  std::cout << "regrouped: " << regrouped->Describe() << "; rank " << dist.rank() << " of "
            << dist.world_size() << ", sum " << t[0].item<double>() << std::endl;
  return 0;
}

// The sum every rank of the launch contributes launch rank + 1 to.
int AllLaunchRanks(evenstep::DistContext& dist, const std::string& what) {
  at::Tensor t = at::full({8}, static_cast<double>(dist.launch_rank() + 1));
  if (absl::Status s = dist.AllReduce(t); !s.ok()) {
    std::cout << what << ": " << s << std::endl;
    return 1;
  }
  const int w = dist.world_size();
  std::cout << what << ": rank " << dist.rank() << " of " << w << ", sum " << t[0].item<double>()
            << std::endl;
  return t[0].item<double>() == w * (w + 1) / 2 ? 0 : 1;
}

int Rejoin(evenstep::DistContext& dist, int victim) {
  if (dist.joined()) return AllLaunchRanks(dist, "joined");
  if (auto s = dist.Barrier(); !s.ok()) {
    std::cout << s << std::endl;
    return 1;
  }
  if (dist.rank() == victim) _exit(9);
  at::Tensor t = at::ones({8});
  std::cout << "collective failed: " << !dist.AllReduce(t).ok() << std::endl;
  absl::StatusOr<evenstep::Regrouped> regrouped = dist.Regroup();
  if (!regrouped.ok()) {
    std::cout << "regroup failed: " << regrouped.status() << std::endl;
    return 1;
  }
  for (int i = 0; i < 3000 && !dist.JoinPending(); ++i) usleep(20000);
  absl::StatusOr<evenstep::Regrouped> admitted = dist.Admit();
  if (!admitted.ok()) {
    std::cout << "admit failed: " << admitted.status() << std::endl;
    return 1;
  }
  std::cout << "admitted: " << admitted->Describe() << std::endl;
  return AllLaunchRanks(dist, "after the admission");
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<char*> args = absl::ParseCommandLine(argc, argv);
  std::cout.setf(std::ios::unitbuf);
  if (args.size() < 2) {
    std::cerr << "usage: rank_helper [flags] SCENARIO [ARGS]" << std::endl;
    return 2;
  }
  const std::string scenario = args[1];
  auto int_arg = [&](size_t i) {
    int v = -1;
    if (i >= args.size() || !absl::SimpleAtoi(args[i], &v)) {
      std::cerr << "scenario " << scenario << " needs integer argument " << i << std::endl;
      std::exit(2);
    }
    return v;
  };
  if (scenario == "wait_for_sigterm") {
    // Blocked before the pid file exists, so a test that signals after seeing
    // the file cannot kill the rank by the default action.
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, SIGTERM);
    sigprocmask(SIG_BLOCK, &set, nullptr);
    WritePidFile();
    std::cout << "waiting for SIGTERM" << std::endl;
    int sig = 0;
    sigwait(&set, &sig);
    std::cout << "got SIGTERM" << std::endl;
    return 0;
  }
  WritePidFile();
  if (scenario == "hang") {
    evenstep::PrepareLaunchedRank();  // as a trainer's main does first
    sleep(600);
    return 0;
  }

  const bool own_sigpipe =
      scenario == "write_to_closed_pipe" && args.size() > 2 && std::string(args[2]) == "own";
  if (own_sigpipe) signal(SIGPIPE, OwnSigpipeHandler);

  auto ctx = evenstep::DistContextFromFlags();
  if (!ctx.ok()) {
    std::cout << "init failed: " << ctx.status() << std::endl;
    return 3;
  }
  evenstep::DistContext& dist = **ctx;
  std::cout << "init ok: " << dist.env().Describe() << std::endl;

  if (scenario == "init") return 0;
  if (scenario == "collectives") return Collectives(dist);
  if (scenario == "die_after_init") {
    const int victim = int_arg(2);
    if (auto s = dist.Barrier(); !s.ok()) {
      std::cout << s << std::endl;
      return 1;
    }
    if (dist.rank() == victim) _exit(0);
    return ExpectFailureNaming(dist, victim);
  }
  if (scenario == "write_to_closed_pipe") return WriteToClosedPipe(own_sigpipe);
  if (scenario == "lose_from") return LoseFrom(dist, int_arg(2));
  if (scenario == "rejoin") return Rejoin(dist, int_arg(2));
  if (scenario == "stall_rank") {
    const int victim = int_arg(2);
    if (dist.rank() == victim) {
      sleep(600);
      return 0;
    }
    return ExpectFailureNaming(dist, victim);
  }
  if (scenario == "exit_code") {
    const int victim = int_arg(2);
    const int code = int_arg(3);
    if (auto s = dist.Barrier(); !s.ok()) {
      std::cout << s << std::endl;
      return 1;
    }
    if (dist.rank() == victim) {
      std::cout << "exiting with " << code << std::endl;
      return code;
    }
    sleep(600);
    return 0;
  }
  std::cerr << "unknown scenario " << scenario << std::endl;
  return 2;
}

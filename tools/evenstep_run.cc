// evenstep-run: starts N local ranks of a program with the torchrun
// environment convention, the way torchrun --standalone does, but in C++ and
// with no Python.
//
//   evenstep-run -n 4 [--master-port P] [--grace 120s] [--stop-grace 3s] -- ./trainer ...
//
// - Hosts the c10d TCPStore itself (port from the OS unless --master-port)
//   and sets TORCHELASTIC_USE_AGENT_STORE=True, so every rank is a client.
// - Prefixes each output line of rank r with "[r] " (stdout to stdout,
//   stderr to stderr).
// - Forwards SIGTERM / SIGUSR1 to every rank, and SIGINT (Ctrl-C) as SIGTERM,
//   and gives them --grace (120 s) to stop before SIGKILL: a Session trainer
//   saves the step it is in and exits with kPreemptedExitCode (83). A second
//   signal kills at once.
// - A rank that exits with 83 (preempted: a signal reached the ranks
//   directly) is not a failure: the others are stopping too and get --grace.
//   When every rank exits with 83, so does the launcher.
// - When a rank fails (another non-zero exit or a signal), sends SIGTERM to
//   the others, SIGKILL after --stop-grace (3 s), and exits with the failed
//   rank's status (128 + signal number for a signal). With --on-rank-loss
//   continue (the default when the program is given
//   --evenstep_on_rank_loss=continue) the others go on without it (a Session
//   regroups them); the launcher exits 0 when one of them finished with 0. With --respawn N it
//   also starts a replacement for the lost rank (EVENSTEP_JOIN=1), up to N in all, which joins
//   the running ranks at their next step boundary. Each rank runs in its
//   own process group (killed as a group) and dies with the launcher (PR_SET_PDEATHSIG); a watchdog
//   in that group kills the whole group, the rank's own children included, once the launcher is
//   gone, even after a SIGKILL (it reads EOF on a pipe only the launcher holds).
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "evenstep/internal/store_server.h"
#include "evenstep/launch_env.h"  // kPreemptedExitCode

namespace {

volatile sig_atomic_t g_signal = 0;
void OnSignal(int sig) { g_signal = sig; }

struct Options {
  int nproc = 0;
  int master_port = 0;
  int nodes = 1;  // simulated nodes: the ranks split into this many groups
  absl::Duration grace = absl::Seconds(120);     // after a forwarded signal or a preemption
  absl::Duration stop_grace = absl::Seconds(3);  // survivors of a failed rank
  // A failed rank leaves the others running (--on-rank-loss continue).
  bool continue_on_loss = false;
  bool on_rank_loss_given = false;
  // With continue_on_loss: replacements started for lost ranks, in all
  // (EVENSTEP_JOIN=1: they join the running ranks, DistOptions::join).
  int respawns = 0;
  std::vector<std::string> command;
};

int Usage(const std::string& error) {
  if (!error.empty()) std::cerr << "evenstep-run: " << error << "\n";
  std::cerr
      << "usage: evenstep-run -n N [--master-port P] [--grace DURATION] [--stop-grace DURATION]"
         " -- PROGRAM [ARGS...]\n"
         "  -n, --nproc-per-node N  number of local ranks to start (>= 1)\n"
         "  --master-port P         port of the c10d store (default: chosen by the OS)\n"
         "  --nodes K               simulate K nodes on this host (tests, preflight): ranks\n"
         "                          split into K contiguous groups, each with its own\n"
         "                          GROUP_RANK, LOCAL_RANK and LOCAL_WORLD_SIZE (K divides N)\n"
         "  --grace DURATION        after SIGTERM/SIGINT/SIGUSR1 (forwarded to every rank) or a\n"
         "                          rank's preemption exit (83): time the ranks get to save and\n"
         "                          stop before SIGKILL (120s; keep it below the scheduler's\n"
         "                          notice, e.g. sbatch --signal=TERM@180). A second signal\n"
         "                          kills at once\n"
         "  --stop-grace DURATION   after a rank fails: SIGTERM-to-SIGKILL time for the others "
         "(3s)\n"
         "  --on-rank-loss stop|continue\n"
         "                          what a failed rank does to the others: stop them (default)\n"
         "                          or leave them running, to regroup and go on (the default\n"
         "                          when PROGRAM is given --evenstep_on_rank_loss=continue)\n"
         "  --respawn N             with continue: start a replacement for a lost rank, up to N\n"
         "                          in all; it joins the running ranks at their next step\n"
         "                          boundary and gets their state over the network\n"
         "                          (EVENSTEP_JOIN=1; BalancedStep::Admit, evenstep::HandOver)\n";
  return 2;
}

bool ParseArgs(int argc, char** argv, Options* options, std::string* error) {
  int i = 1;
  for (; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg == "--") {
      ++i;
      break;
    }
    std::string value;
    auto take = [&](const std::string& name) -> bool {
      if (arg == name) {
        if (i + 1 >= argc) {
          *error = name + " needs a value";
          return false;
        }
        value = argv[++i];
        return true;
      }
      if (arg.rfind(name + "=", 0) == 0) {
        value = arg.substr(name.size() + 1);
        return true;
      }
      return false;
    };
    auto duration = [&](const char* name, absl::Duration* out) {
      if (absl::ParseDuration(value, out) && *out >= absl::ZeroDuration()) return true;
      *error = std::string(name) + " " + value + ": expected a duration such as 120s";
      return false;
    };
    if (take("-n") || take("--nproc-per-node") || take("--nproc_per_node")) {
      if (!absl::SimpleAtoi(value, &options->nproc) || options->nproc < 1) {
        *error = "-n " + value + ": expected a positive integer";
        return false;
      }
    } else if (take("--master-port") || take("--master_port")) {
      if (!absl::SimpleAtoi(value, &options->master_port) || options->master_port < 0 ||
          options->master_port > 65535) {
        *error = "--master-port " + value + ": expected a port number";
        return false;
      }
    } else if (take("--nodes")) {
      if (!absl::SimpleAtoi(value, &options->nodes) || options->nodes < 1) {
        *error = "--nodes " + value + ": expected a positive integer";
        return false;
      }
    } else if (take("--grace")) {
      if (!duration("--grace", &options->grace)) return false;
    } else if (take("--stop-grace") || take("--stop_grace")) {
      if (!duration("--stop-grace", &options->stop_grace)) return false;
    } else if (take("--on-rank-loss") || take("--on_rank_loss")) {
      if (value != "stop" && value != "continue") {
        *error = "--on-rank-loss " + value + ": expected stop or continue";
        return false;
      }
      options->continue_on_loss = value == "continue";
      options->on_rank_loss_given = true;
    } else if (take("--respawn")) {
      if (!absl::SimpleAtoi(value, &options->respawns) || options->respawns < 0) {
        *error = "--respawn " + value + ": expected a non-negative integer";
        return false;
      }
    } else if (!error->empty()) {
      return false;
    } else {
      *error = "unknown option " + arg;
      return false;
    }
  }
  for (; i < argc; ++i) options->command.push_back(argv[i]);
  // The program's own choice, unless the launcher was told otherwise.
  for (size_t k = 0; k < options->command.size() && !options->on_rank_loss_given; ++k) {
    const std::string& a = options->command[k];
    if (a == "--evenstep_on_rank_loss=continue" ||
        (a == "--evenstep_on_rank_loss" && k + 1 < options->command.size() &&
         options->command[k + 1] == "continue")) {
      options->continue_on_loss = true;
    }
  }
  if (options->nproc < 1) {
    *error = "-n N is required";
    return false;
  }
  if (options->command.empty()) {
    *error = "no program given after --";
    return false;
  }
  if (options->respawns > 0 && !options->continue_on_loss) {
    *error = "--respawn needs --on-rank-loss continue (a replacement joins running ranks)";
    return false;
  }
  if (options->nproc % options->nodes != 0) {
    *error = "--nodes " + std::to_string(options->nodes) + " does not divide -n " +
             std::to_string(options->nproc);
    return false;
  }
  return true;
}

// A rank's output pipe with the partial line not yet written.
struct Stream {
  int fd = -1;
  int rank = 0;
  bool is_stderr = false;
  std::string pending;
};

void EmitLines(Stream& s, bool flush_partial) {
  FILE* out = s.is_stderr ? stderr : stdout;
  size_t start = 0;
  while (true) {
    size_t nl = s.pending.find('\n', start);
    if (nl == std::string::npos) break;
    fprintf(out, "[%d] %.*s\n", s.rank, static_cast<int>(nl - start), s.pending.data() + start);
    start = nl + 1;
  }
  s.pending.erase(0, start);
  if (flush_partial && !s.pending.empty()) {
    fprintf(out, "[%d] %s\n", s.rank, s.pending.c_str());
    s.pending.clear();
  }
  fflush(out);
}

struct Rank {
  pid_t pid = -1;
  bool running = false;
  int status = 0;
};

int ExitCodeOf(int status) {
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return 1;
}

std::string DescribeStatus(int status) {
  if (WIFEXITED(status)) return absl::StrCat("exited with status ", WEXITSTATUS(status));
  if (WIFSIGNALED(status)) {
    return absl::StrCat("was killed by signal ", WTERMSIG(status), " (",
                        strsignal(WTERMSIG(status)), ")");
  }
  return "stopped";
}

void SignalAll(const std::vector<Rank>& ranks, int sig) {
  for (const Rank& r : ranks) {
    if (r.running) kill(-r.pid, sig);  // its whole process group
  }
}

// A rank's process after its fork: it waits until its watchdog exists
// (`go_read`: a launcher killed between the two forks would otherwise leave
// a rank whose own children nobody kills), then runs the command as rank
// `r` of the job.
[[noreturn]] void ExecRank(Options& options, int r, int port, const std::string& omp_threads,
                           pid_t launcher, int out_fd, int err_fd, int go_read, int go_write) {
  setpgid(0, 0);
  prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (getppid() != launcher) _exit(1);  // the launcher died before prctl
  close(go_write);
  char ready = 0;
  ssize_t got;
  while ((got = read(go_read, &ready, 1)) < 0 && errno == EINTR) {
  }
  if (got != 1) _exit(1);  // the launcher died before the watchdog was up
  close(go_read);
  signal(SIGINT, SIG_DFL);
  signal(SIGTERM, SIG_DFL);
  signal(SIGUSR1, SIG_DFL);
  signal(SIGPIPE, SIG_DFL);
  dup2(out_fd, STDOUT_FILENO);
  dup2(err_fd, STDERR_FILENO);
  setenv("RANK", std::to_string(r).c_str(), 1);
  const int per_node = options.nproc / options.nodes;
  setenv("LOCAL_RANK", std::to_string(r % per_node).c_str(), 1);
  setenv("GROUP_RANK", std::to_string(r / per_node).c_str(), 1);
  setenv("ROLE_RANK", std::to_string(r).c_str(), 1);
  setenv("WORLD_SIZE", std::to_string(options.nproc).c_str(), 1);
  setenv("LOCAL_WORLD_SIZE", std::to_string(per_node).c_str(), 1);
  setenv("ROLE_WORLD_SIZE", std::to_string(options.nproc).c_str(), 1);
  setenv("MASTER_ADDR", "127.0.0.1", 1);
  setenv("MASTER_PORT", std::to_string(port).c_str(), 1);
  setenv("TORCHELASTIC_USE_AGENT_STORE", "True", 1);
  setenv("OMP_NUM_THREADS", omp_threads.c_str(), 0);
  std::vector<char*> args;
  for (std::string& a : options.command) args.push_back(a.data());
  args.push_back(nullptr);
  execvp(args[0], args.data());
  fprintf(stderr, "evenstep-run: cannot execute %s: %s\n", args[0], strerror(errno));
  _exit(127);
}

// A rank's watchdog, a member of its process group: when the launcher ends
// (`life_read` reads EOF), even by SIGKILL, it kills the rank's whole group.
[[noreturn]] void RunWatchdog(pid_t pid, int life_read) {
  setpgid(0, pid);
  signal(SIGINT, SIG_IGN);  // forwarded signals are for the rank
  signal(SIGTERM, SIG_IGN);
  signal(SIGUSR1, SIG_IGN);
  for (int fd = 3; fd < 1024; ++fd) {
    if (fd != life_read) close(fd);
  }
  char c;
  while (read(life_read, &c, 1) < 0 && errno == EINTR) {
  }
  kill(-pid, SIGKILL);  // the rank's tree, this watchdog included
  _exit(0);
}

// Starts every rank (and its watchdog) with its output streams; false, said,
// when a pipe or a fork fails (the ranks started are killed).
// Starts ranks: every one at first (Start), and later a replacement of one
// (Replace: EVENSTEP_JOIN=1 in its environment).
class Spawner {
 public:
  Spawner(Options& options, int port) : options_(options), port_(port), launcher_(getpid()) {
    // Threads per rank: torchrun's practice is OMP_NUM_THREADS=1 for
    // several ranks; evenstep-run divides the cores instead, unless the
    // user chose.
    const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
    omp_threads_ = std::to_string(std::max(1u, cores / static_cast<unsigned>(options.nproc)));
  }
  bool Start(std::vector<Rank>* ranks, std::vector<Stream>* streams) {
    // Its write end lives only in this process: when the launcher ends,
    // even by SIGKILL, every rank's watchdog reads EOF and kills the rank's
    // whole process group (a rank's children do not die with it by
    // PR_SET_PDEATHSIG).
    int life[2];
    if (pipe2(life, O_CLOEXEC) != 0) {
      perror("evenstep-run: pipe");
      return false;
    }
    life_read_ = life[0];
    ranks->assign(options_.nproc, Rank{});
    for (int r = 0; r < options_.nproc; ++r) {
      if (!StartOne(r, false, &(*ranks)[r], streams)) {
        SignalAll(*ranks, SIGKILL);
        return false;
      }
    }
    return true;
  }
  bool Replace(int r, Rank* rank, std::vector<Stream>* streams) {
    return StartOne(r, true, rank, streams);
  }

 private:
  bool StartOne(int r, bool join, Rank* rank, std::vector<Stream>* streams) {
    int out_pipe[2], err_pipe[2], go[2];
    if (pipe2(out_pipe, O_CLOEXEC) != 0 || pipe2(err_pipe, O_CLOEXEC) != 0 ||
        pipe2(go, O_CLOEXEC) != 0) {
      perror("evenstep-run: pipe");
      return false;
    }
    pid_t pid = fork();
    if (pid < 0) {
      perror("evenstep-run: fork");
      return false;
    }
    if (pid == 0) {
      if (join) setenv("EVENSTEP_JOIN", "1", 1);
      ExecRank(options_, r, port_, omp_threads_, launcher_, out_pipe[1], err_pipe[1], go[0], go[1]);
    }
    setpgid(pid, pid);  // also from the parent, so kill(-pid) works at once
    if (fork() == 0) RunWatchdog(pid, life_read_);
    close(go[0]);
    const char ready = 1;
    while (write(go[1], &ready, 1) < 0 && errno == EINTR) {
    }
    close(go[1]);
    close(out_pipe[1]);
    close(err_pipe[1]);
    rank->pid = pid;
    rank->running = true;
    streams->push_back(Stream{out_pipe[0], r, false, {}});
    streams->push_back(Stream{err_pipe[0], r, true, {}});
    return true;
  }

  Options& options_;
  const int port_;
  const pid_t launcher_;
  std::string omp_threads_;
  int life_read_ = -1;
};

// The launcher's watch over its ranks: signals forwarded, output passed on
// line by line, exits reaped; a failed rank stops the others.
class Supervisor {
 public:
  Supervisor(const Options& options, std::vector<Rank>& ranks, std::vector<Stream>& streams,
             Spawner& spawner)
      : options_(options),
        ranks_(ranks),
        streams_(streams),
        spawner_(spawner),
        open_streams_(streams.size()),
        running_(options.nproc),
        respawns_left_(options.respawns) {}

  // Until every rank ended and every stream closed; the launcher's exit code.
  int Run();

 private:
  // Stops the ranks: `sig` to each (0: none, they are stopping already),
  // SIGKILL once `grace` has passed. A later, shorter deadline never
  // replaces an earlier one's start (the first reason to stop sets it).
  void BeginShutdown(int sig, absl::Duration grace) {
    if (shutting_down_) return;
    shutting_down_ = true;
    if (sig != 0) SignalAll(ranks_, sig);
    kill_deadline_ = absl::Now() + grace;
  }
  void HandleSignals();
  void PumpStreams();
  void Reap();

  const Options& options_;
  std::vector<Rank>& ranks_;
  std::vector<Stream>& streams_;
  Spawner& spawner_;
  size_t open_streams_;
  int running_;
  int respawns_left_;  // --respawn's
  void Respawn(int r);
  int failed_rank_ = -1;
  int failed_status_ = 0;
  int lost_ = 0;  // ranks that failed while the others went on (--on-rank-loss continue)
  int lost_status_ = 0;
  int forwarded_signal_ = 0;
  bool shutting_down_ = false;
  bool killed_ = false;
  absl::Time kill_deadline_ = absl::InfiniteFuture();
};

int Supervisor::Run() {
  while (running_ > 0 || open_streams_ > 0) {
    HandleSignals();
    PumpStreams();
    Reap();
  }
  if (failed_rank_ >= 0) return ExitCodeOf(failed_status_);
  if (lost_ > 0) {
    const bool finished = std::any_of(ranks_.begin(), ranks_.end(), [](const Rank& r) {
      return WIFEXITED(r.status) && WEXITSTATUS(r.status) == 0;
    });
    fprintf(stderr, "evenstep-run: %d rank(s) lost; %s\n", lost_,
            finished ? "the others finished" : "no rank finished");
    if (!finished) return ExitCodeOf(lost_status_);
  }
  // Every rank saved and stopped for preemption: say so to the scheduler
  // (e.g. to requeue), whether the signal came through here or not.
  const bool all_preempted = std::all_of(ranks_.begin(), ranks_.end(), [](const Rank& r) {
    return WIFEXITED(r.status) && WEXITSTATUS(r.status) == evenstep::kPreemptedExitCode;
  });
  if (all_preempted) return evenstep::kPreemptedExitCode;
  if (forwarded_signal_ != 0) return 128 + forwarded_signal_;
  return 0;
}

void Supervisor::HandleSignals() {
  if (g_signal != 0) {
    const int sig = g_signal;
    g_signal = 0;
    if (forwarded_signal_ == 0) {
      // Ctrl-C reaches the launcher alone (each rank has its own process
      // group); the ranks get SIGTERM, which a Session saves on by
      // default (--evenstep_preempt_signals), instead of SIGINT, which
      // would end them with nothing saved.
      const int to_ranks = sig == SIGINT ? SIGTERM : sig;
      forwarded_signal_ = to_ranks;
      fprintf(stderr,
              "evenstep-run: got signal %d (%s), sending %s to %d rank(s); they have %s to "
              "save and stop (--grace), a second signal kills them at once\n",
              sig, strsignal(sig), to_ranks == sig ? "it" : "SIGTERM", running_,
              absl::FormatDuration(options_.grace).c_str());
      if (shutting_down_) {
        SignalAll(ranks_, to_ranks);  // ranks stopping after a preemption exit get it too
      } else {
        BeginShutdown(to_ranks, options_.grace);
      }
    } else if (!killed_) {
      fprintf(stderr, "evenstep-run: second signal %d: killing %d rank(s) now\n", sig, running_);
      kill_deadline_ = absl::Now();
    }
  }
  if (running_ > 0 && !killed_ && absl::Now() >= kill_deadline_) {
    fprintf(stderr, "evenstep-run: %d rank(s) still running after the grace period; killing\n",
            running_);
    SignalAll(ranks_, SIGKILL);
    killed_ = true;
  }
}

void Supervisor::PumpStreams() {
  std::vector<pollfd> fds;
  std::vector<Stream*> owners;
  for (Stream& s : streams_) {
    if (s.fd < 0) continue;
    fds.push_back(pollfd{s.fd, POLLIN, 0});
    owners.push_back(&s);
  }
  if (!fds.empty()) {
    int n = poll(fds.data(), fds.size(), 50);
    if (n > 0) {
      for (size_t i = 0; i < fds.size(); ++i) {
        if (fds[i].revents == 0) continue;
        char buf[65536];
        ssize_t got = read(fds[i].fd, buf, sizeof(buf));
        Stream& s = *owners[i];
        if (got > 0) {
          s.pending.append(buf, static_cast<size_t>(got));
          EmitLines(s, false);
        } else if (got == 0 || (errno != EINTR && errno != EAGAIN)) {
          EmitLines(s, true);
          close(s.fd);
          s.fd = -1;
          --open_streams_;
        }
      }
    }
  } else {
    usleep(20000);
  }
}

void Supervisor::Reap() {
  while (true) {
    int status = 0;
    pid_t pid = waitpid(-1, &status, WNOHANG);
    if (pid <= 0) break;
    for (int r = 0; r < options_.nproc; ++r) {
      if (ranks_[r].pid != pid || !ranks_[r].running) continue;
      ranks_[r].running = false;
      ranks_[r].status = status;
      --running_;
      // A rank's grandchildren die with its process group.
      kill(-pid, SIGKILL);
      const bool preempted =
          WIFEXITED(status) && WEXITSTATUS(status) == evenstep::kPreemptedExitCode;
      const bool failed = !(WIFEXITED(status) && WEXITSTATUS(status) == 0) && !preempted;
      if (preempted && running_ > 0 && !shutting_down_) {
        // The others saw the same agreed stop and are saving too; a
        // SIGTERM now could end one whose handler is already gone.
        fprintf(stderr,
                "evenstep-run: rank %d stopped for preemption (exit %d); the other %d rank(s) "
                "have %s to finish (--grace)\n",
                r, evenstep::kPreemptedExitCode, running_,
                absl::FormatDuration(options_.grace).c_str());
        BeginShutdown(0, options_.grace);
      }
      if (failed && options_.continue_on_loss && running_ > 0 && !shutting_down_ &&
          forwarded_signal_ == 0) {
        if (lost_++ == 0) lost_status_ = status;
        fprintf(stderr,
                "evenstep-run: rank %d %s; the other %d rank(s) go on without it "
                "(--on-rank-loss continue)\n",
                r, DescribeStatus(status).c_str(), running_);
        Respawn(r);
        continue;
      }
      if (failed && failed_rank_ < 0 && forwarded_signal_ == 0) {
        failed_rank_ = r;
        failed_status_ = status;
        fprintf(stderr, "evenstep-run: rank %d %s; stopping the other %d rank(s)\n", r,
                DescribeStatus(status).c_str(), running_);
        if (shutting_down_) {
          SignalAll(ranks_, SIGTERM);
          kill_deadline_ = std::min(kill_deadline_, absl::Now() + options_.stop_grace);
        } else {
          BeginShutdown(SIGTERM, options_.stop_grace);
        }
      }
    }
  }
}

}  // namespace

void Supervisor::Respawn(int r) {
  if (respawns_left_ <= 0) return;
  --respawns_left_;
  if (!spawner_.Replace(r, &ranks_[r], &streams_)) return;
  ++running_;
  open_streams_ += 2;
  fprintf(stderr,
          "evenstep-run: started a replacement for rank %d (EVENSTEP_JOIN=1; --respawn: %d "
          "more); it joins the running ranks at their next step boundary\n",
          r, respawns_left_);
}

int main(int argc, char** argv) {
  Options options;
  std::string error;
  if (!ParseArgs(argc, argv, &options, &error)) return Usage(error);

  auto server = evenstep::internal::StoreServer::Start(options.master_port);
  if (!server.ok()) {
    std::cerr << "evenstep-run: " << server.status().message() << "\n";
    return 1;
  }
  struct sigaction sa;
  memset(&sa, 0, sizeof(sa));
  sa.sa_handler = OnSignal;
  sigaction(SIGINT, &sa, nullptr);
  sigaction(SIGTERM, &sa, nullptr);
  sigaction(SIGUSR1, &sa, nullptr);
  signal(SIGPIPE, SIG_IGN);
  std::vector<Rank> ranks;
  std::vector<Stream> streams;
  Spawner spawner(options, (*server)->port());
  if (!spawner.Start(&ranks, &streams)) return 1;
  return Supervisor(options, ranks, streams, spawner).Run();
}

#include "tests/testing/subprocess.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "evenstep/internal/store_server.h"

extern char** environ;

namespace evenstep::testing {

absl::Duration HangBound(double units) {
  double scale = 1;
  if (const char* env = std::getenv("EVENSTEP_TEST_TIMEOUT_SCALE"); env != nullptr) {
    if (!absl::SimpleAtod(env, &scale) || scale <= 0) scale = 1;
  }
  return absl::Seconds(60) * (units * scale);
}
namespace {

bool IsLauncherVariable(const std::string& name) {
  static const char* const kExact[] = {
      "RANK",      "WORLD_SIZE",  "LOCAL_RANK",  "LOCAL_WORLD_SIZE",  "GROUP_RANK",
      "ROLE_RANK", "MASTER_ADDR", "MASTER_PORT", "GLOO_SOCKET_IFNAME"};
  for (const char* e : kExact) {
    if (name == e) return true;
  }
  return absl::StartsWith(name, "SLURM_") || absl::StartsWith(name, "OMPI_") ||
         absl::StartsWith(name, "TORCHELASTIC_") || absl::StartsWith(name, "PMI_");
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

}  // namespace

Subprocess::Subprocess(const ProcessSpec& spec) {
  char path[] = "/tmp/evenstep_test_output_XXXXXX";
  int out_fd = mkstemp(path);
  if (out_fd < 0) {
    perror("mkstemp");
    abort();
  }
  output_path_ = path;
  std::vector<std::string> env;
  for (char** e = environ; *e != nullptr; ++e) {
    std::string entry = *e;
    if (!IsLauncherVariable(entry.substr(0, entry.find('=')))) env.push_back(entry);
  }
  for (const auto& [name, value] : spec.env) env.push_back(name + "=" + value);

  pid_ = fork();
  if (pid_ < 0) {
    perror("fork");
    abort();
  }
  if (pid_ == 0) {
    setpgid(0, 0);
    dup2(out_fd, STDOUT_FILENO);
    dup2(out_fd, STDERR_FILENO);
    std::vector<char*> argv;
    for (const std::string& a : spec.argv) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    std::vector<char*> envp;
    for (std::string& e : env) envp.push_back(e.data());
    envp.push_back(nullptr);
    execve(argv[0], argv.data(), envp.data());
    fprintf(stderr, "cannot execute %s: %s\n", argv[0], strerror(errno));
    _exit(127);
  }
  setpgid(pid_, pid_);
  close(out_fd);
}

Subprocess::~Subprocess() {
  if (!reaped_ && pid_ > 0) {
    kill(-pid_, SIGKILL);
    waitpid(pid_, &status_, 0);
  }
  if (!output_path_.empty()) unlink(output_path_.c_str());
}

bool Subprocess::Exited() {
  if (reaped_) return true;
  if (waitpid(pid_, &status_, WNOHANG) == pid_) reaped_ = true;
  return reaped_;
}

std::string Subprocess::OutputSoFar() const { return ReadFile(output_path_); }

bool Subprocess::WaitForOutput(const std::string& text, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (absl::Now() < deadline) {
    if (absl::StrContains(OutputSoFar(), text)) return true;
    if (Exited()) return absl::StrContains(OutputSoFar(), text);
    usleep(2000);
  }
  return false;
}

ProcessResult Subprocess::Finish(int status, bool timed_out) {
  ProcessResult result;
  result.timed_out = timed_out;
  if (WIFEXITED(status)) result.exit_code = WEXITSTATUS(status);
  if (WIFSIGNALED(status)) result.signal = WTERMSIG(status);
  result.output = ReadFile(output_path_);
  return result;
}

ProcessResult Subprocess::Wait(absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (!Exited()) {
    if (absl::Now() >= deadline) {
      kill(-pid_, SIGKILL);
      waitpid(pid_, &status_, 0);
      reaped_ = true;
      return Finish(status_, /*timed_out=*/true);
    }
    usleep(5000);
  }
  return Finish(status_, /*timed_out=*/false);
}

std::vector<ProcessResult> RunAll(const std::vector<ProcessSpec>& specs, absl::Duration timeout) {
  std::vector<std::unique_ptr<Subprocess>> procs;
  for (const ProcessSpec& spec : specs) procs.push_back(std::make_unique<Subprocess>(spec));
  const absl::Time deadline = absl::Now() + timeout;
  std::vector<ProcessResult> results;
  for (auto& p : procs) {
    results.push_back(p->Wait(std::max(deadline - absl::Now(), absl::ZeroDuration())));
  }
  return results;
}

std::unique_ptr<NetNamespace> NetNamespace::Create() {
  static int counter = 0;
  const std::string name = absl::StrCat("evenstep-test-", getpid(), "-", counter++);
  auto [rc, out] = RunShell(
      absl::StrCat("ip netns add ", name, " && ip netns exec ", name, " ip link set lo up 2>&1"),
      absl::Seconds(30));
  if (rc != 0) {
    RunShell("ip netns delete " + name + " 2>/dev/null");
    return nullptr;
  }
  return std::unique_ptr<NetNamespace>(new NetNamespace(name));
}

NetNamespace::~NetNamespace() { RunShell("ip netns delete " + name_ + " 2>&1"); }

std::vector<std::string> NetNamespace::Wrap(const std::vector<std::string>& argv) const {
  std::vector<std::string> out = {"/usr/bin/nsenter", "--net=/run/netns/" + name_, "--"};
  out.insert(out.end(), argv.begin(), argv.end());
  return out;
}

RefusingPort::RefusingPort() {
  fd_ = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  bind(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  socklen_t len = sizeof(addr);
  getsockname(fd_, reinterpret_cast<sockaddr*>(&addr), &len);
  port_ = ntohs(addr.sin_port);
}

RefusingPort::~RefusingPort() { close(fd_); }

bool ProcessAlive(pid_t pid) {
  if (kill(pid, 0) != 0) return false;
  // A zombie still answers kill(0); read its state.
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  std::getline(stat, line);
  size_t paren = line.rfind(')');
  if (paren == std::string::npos || paren + 2 >= line.size()) return false;
  return line[paren + 2] != 'Z';
}

std::string Describe(const std::vector<ProcessResult>& results) {
  std::string out;
  for (size_t i = 0; i < results.size(); ++i) {
    const ProcessResult& r = results[i];
    absl::StrAppend(&out, "--- process ", i, ": exit ", r.exit_code, " signal ", r.signal,
                    r.timed_out ? " TIMED OUT" : "", "\n", r.output);
  }
  return out;
}

std::vector<ProcessSpec> TorchrunRanks(int world, int port, const std::vector<std::string>& argv,
                                       int declared_world) {
  const std::string size = std::to_string(declared_world > 0 ? declared_world : world);
  std::vector<ProcessSpec> specs;
  for (int r = 0; r < world; ++r) {
    specs.push_back(ProcessSpec{argv,
                                {{"RANK", std::to_string(r)},
                                 {"WORLD_SIZE", size},
                                 {"LOCAL_RANK", std::to_string(r)},
                                 {"LOCAL_WORLD_SIZE", size},
                                 {"MASTER_ADDR", "127.0.0.1"},
                                 {"MASTER_PORT", std::to_string(port)},
                                 {"TORCHELASTIC_USE_AGENT_STORE", "True"},
                                 {"OMP_NUM_THREADS", "1"}}});
  }
  return specs;
}

std::vector<ProcessResult> RunRanks(int world, const std::vector<std::string>& argv,
                                    absl::Duration timeout, const std::vector<int>& nodes,
                                    const std::vector<std::pair<std::string, std::string>>& env) {
  auto server = internal::StoreServer::Start(0);
  if (!server.ok()) {
    ProcessResult failed;
    failed.output = "could not host the store: " + server.status().ToString();
    return std::vector<ProcessResult>(world, failed);
  }
  std::vector<ProcessSpec> specs = TorchrunRanks(world, (*server)->port(), argv);
  if (!nodes.empty()) PlaceOnNodes(nodes, &specs);
  for (ProcessSpec& spec : specs) spec.env.insert(spec.env.end(), env.begin(), env.end());
  return RunAll(specs, timeout);
}

std::vector<std::string> RankArgv(const std::string& program,
                                  const std::vector<std::string>& args) {
  std::vector<std::string> argv = {program, "--evenstep_timeout=60s",
                                   "--evenstep_rendezvous_timeout=60s"};
  argv.insert(argv.end(), args.begin(), args.end());
  return argv;
}

std::vector<ProcessResult> RunProgramOnRanks(int world, const std::string& program,
                                             const std::vector<std::string>& args,
                                             absl::Duration timeout) {
  return RunRanks(world, RankArgv(program, args), timeout);
}

void PlaceOnNodes(const std::vector<int>& ranks_per_node, std::vector<ProcessSpec>* specs) {
  size_t rank = 0;
  for (size_t node = 0; node < ranks_per_node.size(); ++node) {
    for (int local = 0; local < ranks_per_node[node] && rank < specs->size(); ++local, ++rank) {
      for (auto& [name, value] : (*specs)[rank].env) {
        if (name == "LOCAL_RANK") value = std::to_string(local);
        if (name == "LOCAL_WORLD_SIZE") value = std::to_string(ranks_per_node[node]);
      }
      (*specs)[rank].env.emplace_back("GROUP_RANK", std::to_string(node));
    }
  }
}

std::vector<ProcessResult> RunProgramOnNodes(const std::vector<int>& ranks_per_node,
                                             const std::string& program,
                                             const std::vector<std::string>& args,
                                             absl::Duration timeout) {
  int world = 0;
  for (int n : ranks_per_node) world += n;
  return RunRanks(world, RankArgv(program, args), timeout, ranks_per_node);
}

std::pair<int, std::string> RunShell(const std::string& command, absl::Duration timeout) {
  const auto results = RunAll({ProcessSpec{{"/bin/sh", "-c", command}, {}}}, timeout);
  return {results[0].exit_code, results[0].output};
}

}  // namespace evenstep::testing

// See netns.h.
#include "tests/testing/netns.h"

#include <fcntl.h>
#include <sched.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <functional>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "evenstep/env.h"

namespace evenstep::testing {
namespace {

// Runs a shell command; its output (on failure) in the error.
absl::Status Sh(const std::string& command) {
  const std::string full = command + " 2>&1";
  FILE* pipe = popen(full.c_str(), "r");
  if (pipe == nullptr) return absl::InternalError("popen failed: " + command);
  std::string output;
  char buf[512];
  while (fgets(buf, sizeof(buf), pipe) != nullptr) output += buf;
  const int rc = pclose(pipe);
  if (rc != 0) {
    return absl::FailedPreconditionError(absl::StrCat("`", command, "` failed: ", output));
  }
  return absl::OkStatus();
}

}  // namespace

std::string SimulatedCluster::interface(int k) const {
  return absl::StrCat(prefix_, "v", k);  // <= 15 characters
}

std::string SimulatedCluster::address(int k) const { return absl::StrCat("10.77.0.", k + 1); }

absl::StatusOr<std::unique_ptr<SimulatedCluster>> SimulatedCluster::Create(int hosts,
                                                                           Options options) {
  if (geteuid() != 0) return absl::FailedPreconditionError("network namespaces need root");
  for (const char* tool : {"/usr/sbin/ip", "/usr/sbin/tc", "/usr/bin/unshare"}) {
    if (access(tool, X_OK) != 0) {
      return absl::FailedPreconditionError(absl::StrCat(tool, " is missing"));
    }
  }
  std::unique_ptr<SimulatedCluster> c(new SimulatedCluster);
  c->prefix_ = absl::StrFormat("es%d", getpid() % 100000);
  c->switch_space_ = c->prefix_ + "sw";
  // Made first: the destructor removes whatever exists when a step fails.
  if (absl::Status s = Sh("ip netns add " + c->switch_space_); !s.ok()) return s;
  const std::string in_switch = "ip netns exec " + c->switch_space_ + " ";
  if (absl::Status s = Sh(in_switch + "ip link add br0 type bridge && " + in_switch +
                          "ip link set br0 up && " + in_switch + "ip link set lo up");
      !s.ok()) {
    return s;
  }
  for (int k = 0; k < hosts; ++k) {
    c->names_.push_back(absl::StrCat("node-", k));
    c->spaces_.push_back(absl::StrCat(c->prefix_, "h", k));
  }
  for (int k = 0; k < hosts; ++k) {
    const std::string& ns = c->spaces_[k];
    if (absl::Status s = Sh("ip netns add " + ns); !s.ok()) return s;
    const std::string in_host = "ip netns exec " + ns + " ";
    const std::string host_end = c->interface(k);
    const std::string switch_end = absl::StrCat(c->prefix_, "s", k);
    std::string setup = absl::StrCat(
        "ip link add ", host_end, " netns ", ns, " type veth peer name ", switch_end, " netns ",
        c->switch_space_, " && ", in_switch, "ip link set ", switch_end, " master br0 up && ",
        in_host, "ip link set lo up && ", in_host, "ip addr add ", c->address(k), "/24 dev ",
        host_end, " && ", in_host, "ip link set ", host_end, " up");
    const double mbit = k < static_cast<int>(options.mbit.size()) ? options.mbit[k] : 0;
    if (mbit > 0) {
      // Both directions: the host's egress and, on the switch side, its ingress.
      for (const auto& [space, dev] :
           {std::pair{in_host, host_end}, std::pair{in_switch, switch_end}}) {
        absl::StrAppend(
            &setup, " && ", space, "tc qdisc add dev ", dev,
            absl::StrFormat(" root tbf rate %.0fkbit burst 64kb latency 50ms", mbit * 1000));
      }
    }
    if (absl::Status s = Sh(setup); !s.ok()) return s;
    // Debian's /etc/hosts: the host's own name on 127.0.1.1.
    const std::string dir = "/etc/netns/" + ns;
    internal::MakeDirs(dir).IgnoreError();  // failing, writing the hosts file says so
    std::ofstream hosts_file(dir + "/hosts");
    hosts_file << "127.0.0.1\tlocalhost\n127.0.1.1\t" << c->names_[k] << "\n";
    for (int j = 0; j < hosts; ++j) {
      if (j != k) hosts_file << c->address(j) << "\t" << c->names_[j] << "\n";
    }
    if (!hosts_file) return absl::InternalError("could not write " + dir + "/hosts");
  }
  return c;
}

SimulatedCluster::~SimulatedCluster() {
  for (const std::string& ns : spaces_) {
    Sh("ip netns del " + ns).IgnoreError();
    internal::RemoveTree("/etc/netns/" + ns).IgnoreError();
  }
  if (!switch_space_.empty()) Sh("ip netns del " + switch_space_).IgnoreError();
}

ProcessSpec SimulatedCluster::On(int k, const std::vector<std::string>& argv,
                                 std::vector<std::pair<std::string, std::string>> env) const {
  std::vector<std::string> full = {"/usr/sbin/ip",
                                   "netns",
                                   "exec",
                                   spaces_[k],
                                   "/usr/bin/unshare",
                                   "--uts",
                                   "/bin/sh",
                                   "-c",
                                   "hostname \"$0\" && exec \"$@\"",
                                   names_[k]};
  full.insert(full.end(), argv.begin(), argv.end());
  return ProcessSpec{full, std::move(env)};
}

absl::Status SimulatedCluster::AddIsolatedInterface(int k, const std::string& name,
                                                    const std::string& address) const {
  const std::string in_host = "ip netns exec " + spaces_[k] + " ";
  // A veth pair with both ends in the host (this kernel may lack `dummy`).
  const std::string peer = name.substr(0, 13) + "_p";
  return Sh(absl::StrCat(in_host, "ip link add ", name, " type veth peer name ", peer, " && ",
                         in_host, "ip addr add ", address, "/24 dev ", name, " && ", in_host,
                         "ip link set ", peer, " up && ", in_host, "ip link set ", name, " up"));
}

absl::Status SimulatedCluster::InHost(int k, const std::function<void()>& fn) const {
  const int home = open("/proc/thread-self/ns/net", O_RDONLY | O_CLOEXEC);
  const int there = open(("/var/run/netns/" + spaces_[k]).c_str(), O_RDONLY | O_CLOEXEC);
  absl::Status status;
  if (home < 0 || there < 0 || setns(there, CLONE_NEWNET) != 0) {
    status = absl::InternalError("could not enter the network namespace " + spaces_[k]);
  } else {
    fn();
    if (setns(home, CLONE_NEWNET) != 0) std::abort();  // the thread must not stay there
  }
  if (home >= 0) close(home);
  if (there >= 0) close(there);
  return status;
}

}  // namespace evenstep::testing

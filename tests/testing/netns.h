// A cluster on one machine: K hosts as Linux network namespaces, each with
// its own host name (a UTS namespace per command) and an /etc/hosts view like
// a Debian/Ubuntu host's (its own name on 127.0.1.1, the others' names on
// their addresses; `ip netns exec` binds /etc/netns/<ns>/hosts over
// /etc/hosts), joined through a bridge in a switch namespace, each host's
// link shaped with `tc ... tbf` when a rate is given (this kernel has no
// netem). Private addresses (10.77.x.0/24) live only inside the namespaces
// made here: nothing touches the machine's own network or leaves it.
//
//   auto cluster = SimulatedCluster::Create(2);            // or a reason to skip
//   ProcessSpec spec = (*cluster)->On(0, {"./rank", ...}, env);
//
// Needs root (CAP_SYS_ADMIN, CAP_NET_ADMIN) and `ip`, `tc`, `unshare`; Create
// returns the reason when they are missing, for GTEST_SKIP. The namespaces
// and /etc/netns entries are removed by the destructor.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "tests/testing/subprocess.h"

namespace evenstep::testing {

class SimulatedCluster {
 public:
  struct Options {
    // Each host's link rate in Mbit/s (tbf on the host's side of its link,
    // both directions through the switch); 0 = unshaped.
    std::vector<double> mbit;
  };
  static absl::StatusOr<std::unique_ptr<SimulatedCluster>> Create(int hosts, Options options = {});
  ~SimulatedCluster();
  SimulatedCluster(const SimulatedCluster&) = delete;
  SimulatedCluster& operator=(const SimulatedCluster&) = delete;

  int hosts() const { return static_cast<int>(names_.size()); }
  // Host k's name ("node-0", ...) and its address on the cluster's link.
  const std::string& name(int k) const { return names_[k]; }
  std::string address(int k) const;
  // Host k's interface on the cluster's link, as seen inside the host (for
  // GLOO_SOCKET_IFNAME, or its byte counters in /proc/net/dev).
  std::string interface(int k) const;
  // `argv` run on host k: in its network namespace, under its host name,
  // with its /etc/hosts; `env` added as ProcessSpec::env.
  ProcessSpec On(int k, const std::vector<std::string>& argv,
                 std::vector<std::pair<std::string, std::string>> env = {}) const;
  // Runs `fn` with the calling thread in host k's network namespace (a
  // socket made there stays there: e.g. a store server bound to port 0).
  absl::Status InHost(int k, const std::function<void()>& fn) const;
  // Gives host k a second interface `name` (<= 15 characters) with
  // `address`, which no other host routes to: a docker0 bridge or a NIC on
  // a private network, what a mis-set GLOO_SOCKET_IFNAME points at.
  absl::Status AddIsolatedInterface(int k, const std::string& name,
                                    const std::string& address) const;

 private:
  SimulatedCluster() = default;
  std::string prefix_;               // unique per cluster: namespaces "<prefix>h<k>", "<prefix>sw"
  std::vector<std::string> names_;   // host names
  std::vector<std::string> spaces_;  // their namespaces
  std::string switch_space_;
};

}  // namespace evenstep::testing

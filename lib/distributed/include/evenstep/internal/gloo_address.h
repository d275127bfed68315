// Which local address Gloo binds to, so that ranks on other hosts can reach
// it. c10d's default device binds to the address the host name resolves to,
// which on a Debian/Ubuntu host whose /etc/hosts maps its name to 127.0.1.1
// is loopback: the peers on other hosts are refused, or wait for the
// connect timeout, without a word of the cause.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace evenstep::internal {

// What the choice depends on (gathered by DistContext; plain data for tests).
struct GlooAddressInputs {
  std::string host;              // this host's name (in messages)
  std::string ifname;            // GLOO_SOCKET_IFNAME ("" = not set)
  bool ifname_loopback = false;  // it names a loopback interface (lo)
  std::string master_addr;       // MASTER_ADDR as given
  int world_size = 1;
  int local_world_size = 1;
  // The local address a packet to MASTER_ADDR leaves from ("" when it could
  // not be found: MASTER_ADDR does not resolve, no route).
  std::string route_address;
  std::string route_error;  // why route_address is empty
  // The addresses the ranks on other hosts reached MASTER_ADDR at (what
  // the name resolves to there; loopback ones left out).
  std::vector<std::string> master_seen;
  // This host's non-loopback IPv4/IPv6 addresses of interfaces that are up,
  // as "name=address".
  std::vector<std::string> interfaces;
};

// The device spec for compat::MakeGlooGroup: "if:NAME" for GLOO_SOCKET_IFNAME,
// an address to bind to, or FailedPrecondition naming the host, MASTER_ADDR,
// what it resolves to here and what to set, when no address can serve a
// job that spans hosts:
// - GLOO_SOCKET_IFNAME wins, unless it names a loopback interface in a job
//   that spans hosts (an error: the other hosts could never connect);
// - a job on one host (LOCAL_WORLD_SIZE == WORLD_SIZE) whose master is
//   reached over loopback binds to 127.0.0.1;
// - else the address on the route to MASTER_ADDR, when it is not loopback;
// - a job spanning hosts whose MASTER_ADDR is loopback here (its name on
//   127.0.1.1 in /etc/hosts, as torchrun's rendezvous hands the first
//   agent's host name to every worker): this host's address that the ranks
//   on other hosts reached MASTER_ADDR at, else the one non-loopback
//   interface address, else the error.
absl::StatusOr<std::string> ChooseGlooAddress(const GlooAddressInputs& in);
// Why Gloo binds where `spec` (ChooseGlooAddress(in)'s) says, in words.
std::string GlooWhy(const GlooAddressInputs& in, const std::string& spec);

// The route a packet to host:port takes: the local address it leaves from
// and the remote address the name resolved to.
struct Route {
  std::string local, remote;
};
absl::StatusOr<Route> RouteTowards(const std::string& host, int port);

// True for 127.0.0.0/8, ::1 and "localhost".
bool IsLoopbackAddress(const std::string& address);

// The local address of a UDP socket connected to host:port (the routing
// table's choice; nothing is sent), or an error naming the host.
absl::StatusOr<std::string> LocalAddressTowards(const std::string& host, int port);

// This host's non-loopback interface addresses that are up ("name=address").
std::vector<std::string> UpInterfaceAddresses();
// True when `ifname` is a loopback interface of this host.
bool IsLoopbackInterface(const std::string& ifname);

// The address Gloo binds to for a device spec of ChooseGlooAddress:
// "if:NAME" -> that interface's address (IPv4 first), "" -> what the host
// name resolves to (c10d's default device), else the spec itself.
absl::StatusOr<std::string> GlooBindAddress(const std::string& device_spec);

// The reachability check that runs before Gloo connects in a job across
// hosts. Gloo's own pair connect waits (Gloo's clock, not the flags: 25 s
// and more past a 5 s --evenstep_timeout) and then names one address
// without a cause; this check connects from every rank to a listener on
// every other rank's Gloo address, bounded by the timeout, and says which
// pair failed and why.
class ReachListener {
 public:
  // A TCP listener on `address`, port from the OS.
  static absl::StatusOr<std::unique_ptr<ReachListener>> Open(const std::string& address);
  ~ReachListener();
  ReachListener(const ReachListener&) = delete;
  ReachListener& operator=(const ReachListener&) = delete;
  int port() const { return port_; }
  int fd() const { return fd_; }

 private:
  ReachListener(int fd, int port) : fd_(fd), port_(port) {}
  int fd_;
  int port_;
};

struct ReachTarget {
  int rank = 0;
  std::string address;
  int port = 0;
};
struct ReachFailure {
  int rank = 0;        // the target
  std::string reason;  // "Connection refused", "no answer within 5s", ...
  std::string cause;   // the likely cause, in words
};

// Connects to every target at once (non-blocking), accepting and closing
// what arrives on `listener` meanwhile, until each connect is done or
// `timeout` has passed; the targets it could not reach.
std::vector<ReachFailure> ConnectToEach(const std::vector<ReachTarget>& targets,
                                        const ReachListener& listener, absl::Duration timeout);

}  // namespace evenstep::internal

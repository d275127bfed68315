// Which local address Gloo binds to, so that ranks on other hosts can reach
// it. c10d's default device binds to the address the host name resolves to,
// which on a Debian/Ubuntu host whose /etc/hosts maps its name to 127.0.1.1
// is loopback: the peers on other hosts are refused, or wait for the
// connect timeout, without a word of the cause.
#pragma once

#include <string>
#include <vector>

#include "absl/status/statusor.h"

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
//   127.0.1.1 in /etc/hosts): the one non-loopback interface address, or the
//   error when there are none or several.
absl::StatusOr<std::string> ChooseGlooAddress(const GlooAddressInputs& in);

// True for 127.0.0.0/8, ::1 and "localhost".
bool IsLoopbackAddress(const std::string& address);

// The local address of a UDP socket connected to host:port (the routing
// table's choice; nothing is sent), or an error naming the host.
absl::StatusOr<std::string> LocalAddressTowards(const std::string& host, int port);

// This host's non-loopback interface addresses that are up ("name=address").
std::vector<std::string> UpInterfaceAddresses();
// True when `ifname` is a loopback interface of this host.
bool IsLoopbackInterface(const std::string& ifname);

}  // namespace evenstep::internal

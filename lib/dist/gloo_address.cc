// Gloo's bind address; see internal/gloo_address.h.
#include "evenstep/internal/gloo_address.h"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netdb.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstring>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace evenstep::internal {
namespace {

std::string AddressText(const sockaddr* addr) {
  char text[INET6_ADDRSTRLEN] = {};
  if (addr->sa_family == AF_INET) {
    inet_ntop(AF_INET, &reinterpret_cast<const sockaddr_in*>(addr)->sin_addr, text, sizeof(text));
  } else if (addr->sa_family == AF_INET6) {
    inet_ntop(AF_INET6, &reinterpret_cast<const sockaddr_in6*>(addr)->sin6_addr, text,
              sizeof(text));
  }
  return text;
}

std::string Fix(const GlooAddressInputs& in) {
  return absl::StrCat(
      "set MASTER_ADDR to an address the other hosts reach (not a name this host maps to "
      "loopback in /etc/hosts), or GLOO_SOCKET_IFNAME to the interface that reaches them (",
      in.interfaces.empty() ? std::string("this host has no non-loopback interface up")
                            : absl::StrCat("up here: ", absl::StrJoin(in.interfaces, ", ")),
      ")");
}

}  // namespace

bool IsLoopbackAddress(const std::string& address) {
  return absl::StartsWith(address, "127.") || address == "::1" || address == "localhost";
}

absl::StatusOr<std::string> ChooseGlooAddress(const GlooAddressInputs& in) {
  const bool one_host = in.local_world_size >= in.world_size;
  if (!in.ifname.empty()) {
    if (in.ifname_loopback && !one_host) {
      return absl::FailedPreconditionError(
          absl::StrCat("host ", in.host, ": GLOO_SOCKET_IFNAME=", in.ifname,
                       " is a loopback interface but the job spans hosts (", in.world_size,
                       " ranks, ", in.local_world_size,
                       " on this host): the ranks on other hosts could never connect; ", Fix(in)));
    }
    return absl::StrCat("if:", in.ifname);
  }
  const bool route_loopback = in.route_address.empty() ? IsLoopbackAddress(in.master_addr)
                                                       : IsLoopbackAddress(in.route_address);
  if (in.world_size == 1 || (one_host && route_loopback)) return std::string("127.0.0.1");
  if (!in.route_address.empty() && !route_loopback) return in.route_address;
  if (in.route_address.empty() && !route_loopback) {
    // No route found: c10d's default (the host name's address) as before;
    // the rendezvous, which needs the same route, reports what is wrong.
    return std::string();
  }
  // The job spans hosts but MASTER_ADDR is loopback here: the one address
  // this host has (IPv4 first).
  for (bool v4 : {true, false}) {
    std::vector<std::string> of_family;
    for (const std::string& i : in.interfaces) {
      const std::string address = i.substr(i.find('=') + 1);
      if ((address.find(':') == std::string::npos) == v4) of_family.push_back(address);
    }
    if (of_family.size() == 1) return of_family[0];
    if (of_family.size() > 1) break;
  }
  return absl::FailedPreconditionError(absl::StrCat(
      "host ", in.host, ": MASTER_ADDR=", in.master_addr, " is loopback here (",
      in.route_address.empty() ? in.master_addr : in.route_address, ") but the job spans hosts (",
      in.world_size, " ranks, ", in.local_world_size,
      " on this host): Gloo bound there would refuse the ranks on other hosts; ", Fix(in)));
}

absl::StatusOr<std::string> LocalAddressTowards(const std::string& host, int port) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* found = nullptr;
  const std::string service = std::to_string(port);
  if (int rc = getaddrinfo(host.c_str(), service.c_str(), &hints, &found); rc != 0) {
    return absl::UnavailableError(
        absl::StrCat("MASTER_ADDR=", host, " does not resolve: ", gai_strerror(rc)));
  }
  std::string error = "no address";
  std::string local;
  for (addrinfo* a = found; a != nullptr && local.empty(); a = a->ai_next) {
    const int fd = socket(a->ai_family, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    if (fd < 0) continue;
    sockaddr_storage mine{};
    socklen_t len = sizeof(mine);
    if (connect(fd, a->ai_addr, a->ai_addrlen) == 0 &&
        getsockname(fd, reinterpret_cast<sockaddr*>(&mine), &len) == 0) {
      local = AddressText(reinterpret_cast<const sockaddr*>(&mine));
    } else {
      error = std::strerror(errno);
    }
    close(fd);
  }
  freeaddrinfo(found);
  if (local.empty()) {
    return absl::UnavailableError(absl::StrCat("no route to MASTER_ADDR=", host, ": ", error));
  }
  return local;
}

std::vector<std::string> UpInterfaceAddresses() {
  std::vector<std::string> out;
  ifaddrs* list = nullptr;
  if (getifaddrs(&list) != 0) return out;
  for (ifaddrs* i = list; i != nullptr; i = i->ifa_next) {
    if (i->ifa_addr == nullptr || !(i->ifa_flags & IFF_UP) || (i->ifa_flags & IFF_LOOPBACK)) {
      continue;
    }
    if (i->ifa_addr->sa_family != AF_INET && i->ifa_addr->sa_family != AF_INET6) continue;
    const std::string address = AddressText(i->ifa_addr);
    // Link-local IPv6 needs a scope to bind to; Gloo's device would not take it.
    if (address.empty() || absl::StartsWith(address, "fe80:")) continue;
    out.push_back(absl::StrCat(i->ifa_name, "=", address));
  }
  freeifaddrs(list);
  return out;
}

bool IsLoopbackInterface(const std::string& ifname) {
  ifaddrs* list = nullptr;
  if (getifaddrs(&list) != 0) return false;
  bool loopback = false;
  for (ifaddrs* i = list; i != nullptr; i = i->ifa_next) {
    if (ifname == i->ifa_name && (i->ifa_flags & IFF_LOOPBACK)) loopback = true;
  }
  freeifaddrs(list);
  return loopback;
}

}  // namespace evenstep::internal

// Gloo's bind address; see internal/gloo_address.h.
#include "evenstep/internal/gloo_address.h"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "evenstep/status_macros.h"

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
  // The job spans hosts but MASTER_ADDR is loopback here. The address the
  // ranks on other hosts reached it at, when it is this host's: the one
  // they reach.
  for (const std::string& seen : in.master_seen) {
    for (const std::string& i : in.interfaces) {
      if (i.substr(i.find('=') + 1) == seen) return seen;
    }
  }
  // Else the one address this host has (IPv4 first).
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

std::string GlooWhy(const GlooAddressInputs& in, const std::string& spec) {
  if (spec.rfind("if:", 0) == 0) {
    return absl::StrCat("interface ", spec.substr(3), " from GLOO_SOCKET_IFNAME");
  }
  if (spec.empty()) return "the address its host name resolves to";
  const bool route_loopback = in.route_address.empty() ? IsLoopbackAddress(in.master_addr)
                                                       : IsLoopbackAddress(in.route_address);
  if (route_loopback && !IsLoopbackAddress(spec)) {
    const bool seen =
        std::find(in.master_seen.begin(), in.master_seen.end(), spec) != in.master_seen.end();
    return absl::StrCat(seen ? "the address the ranks on other hosts reach MASTER_ADDR "
                             : "the one interface address here; MASTER_ADDR ",
                        in.master_addr, seen ? " at; it is loopback here" : " is loopback here");
  }
  return absl::StrCat("the address that reaches MASTER_ADDR ", in.master_addr);
}

absl::StatusOr<std::string> LocalAddressTowards(const std::string& host, int port) {
  EVENSTEP_ASSIGN_OR_RETURN(Route route, RouteTowards(host, port));
  return route.local;
}

absl::StatusOr<Route> RouteTowards(const std::string& host, int port) {
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
  Route route;
  for (addrinfo* a = found; a != nullptr && route.local.empty(); a = a->ai_next) {
    const int fd = socket(a->ai_family, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    if (fd < 0) continue;
    sockaddr_storage mine{};
    socklen_t len = sizeof(mine);
    if (connect(fd, a->ai_addr, a->ai_addrlen) == 0 &&
        getsockname(fd, reinterpret_cast<sockaddr*>(&mine), &len) == 0) {
      route.local = AddressText(reinterpret_cast<const sockaddr*>(&mine));
      route.remote = AddressText(a->ai_addr);
    } else {
      error = std::strerror(errno);
    }
    close(fd);
  }
  freeaddrinfo(found);
  if (route.local.empty()) {
    return absl::UnavailableError(absl::StrCat("no route to MASTER_ADDR=", host, ": ", error));
  }
  return route;
}

namespace {

// "name=address" of the interfaces that are up, loopback ones too or not.
std::vector<std::string> InterfaceAddresses(bool with_loopback) {
  std::vector<std::string> out;
  ifaddrs* list = nullptr;
  if (getifaddrs(&list) != 0) return out;
  for (ifaddrs* i = list; i != nullptr; i = i->ifa_next) {
    if (i->ifa_addr == nullptr || !(i->ifa_flags & IFF_UP) ||
        (!with_loopback && (i->ifa_flags & IFF_LOOPBACK))) {
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

}  // namespace

std::vector<std::string> UpInterfaceAddresses() { return InterfaceAddresses(false); }

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

absl::StatusOr<std::string> GlooBindAddress(const std::string& device_spec) {
  if (device_spec.rfind("if:", 0) == 0) {
    const std::string ifname = device_spec.substr(3);
    std::string found;
    for (const std::string& i : InterfaceAddresses(/*with_loopback=*/true)) {
      const auto eq = i.find('=');
      if (i.substr(0, eq) != ifname) continue;
      const std::string address = i.substr(eq + 1);
      if (found.empty() ||
          (address.find(':') == std::string::npos && found.find(':') != std::string::npos)) {
        found = address;  // IPv4 first
      }
    }
    if (found.empty()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "GLOO_SOCKET_IFNAME=", ifname, " is not an interface that is up with an address here"));
    }
    return found;
  }
  if (!device_spec.empty()) return device_spec;
  char host[256] = {};
  gethostname(host, sizeof(host) - 1);
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  if (int rc = getaddrinfo(host, nullptr, &hints, &found); rc != 0) {
    return absl::UnavailableError(
        absl::StrCat("the host name ", host, " does not resolve: ", gai_strerror(rc)));
  }
  const std::string address = AddressText(found->ai_addr);
  freeaddrinfo(found);
  return address;
}

namespace {

// A numeric address and port as a socket address.
bool ToSockaddr(const std::string& address, int port, sockaddr_storage* out, socklen_t* len) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICHOST | AI_NUMERICSERV;
  addrinfo* found = nullptr;
  if (getaddrinfo(address.c_str(), std::to_string(port).c_str(), &hints, &found) != 0) {
    return false;
  }
  std::memcpy(out, found->ai_addr, found->ai_addrlen);
  *len = found->ai_addrlen;
  freeaddrinfo(found);
  return true;
}

std::string CauseOf(int error) {
  switch (error) {
    case ECONNREFUSED:
      return "the address answers but nothing listens there: it is another machine's, or a "
             "firewall rejects the port";
    case ENETUNREACH:
    case EHOSTUNREACH:
      return "no route from here to that address: it is on a network only its own host is on "
             "(a docker or VPN bridge, a second NIC)";
    default:
      return "the address does not work from here";
  }
}

}  // namespace

absl::StatusOr<std::unique_ptr<ReachListener>> ReachListener::Open(const std::string& address) {
  sockaddr_storage at{};
  socklen_t len = 0;
  if (!ToSockaddr(address, 0, &at, &len)) {
    return absl::InvalidArgumentError(absl::StrCat("'", address, "' is not a numeric address"));
  }
  const int fd = socket(at.ss_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) return absl::UnavailableError(absl::StrCat("socket: ", std::strerror(errno)));
  if (bind(fd, reinterpret_cast<const sockaddr*>(&at), len) != 0 || listen(fd, SOMAXCONN) != 0 ||
      getsockname(fd, reinterpret_cast<sockaddr*>(&at), &len) != 0) {
    const int error = errno;
    close(fd);
    return absl::UnavailableError(
        absl::StrCat("cannot listen on ", address, ": ", std::strerror(error)));
  }
  const int port =
      ntohs(at.ss_family == AF_INET ? reinterpret_cast<const sockaddr_in*>(&at)->sin_port
                                    : reinterpret_cast<const sockaddr_in6*>(&at)->sin6_port);
  return std::unique_ptr<ReachListener>(new ReachListener(fd, port));
}

ReachListener::~ReachListener() { close(fd_); }

std::vector<ReachFailure> ConnectToEach(const std::vector<ReachTarget>& targets,
                                        const ReachListener& listener, absl::Duration timeout) {
  std::vector<ReachFailure> failures;
  std::vector<pollfd> polls;    // [0] = the listener, then the pending connects
  std::vector<size_t> of_poll;  // polls[i] (i >= 1) connects to targets[of_poll[i - 1]]
  polls.push_back({listener.fd(), POLLIN, 0});
  auto fail = [&](const ReachTarget& t, int error) {
    failures.push_back({t.rank, std::strerror(error), CauseOf(error)});
  };
  for (size_t i = 0; i < targets.size(); ++i) {
    const ReachTarget& t = targets[i];
    sockaddr_storage at{};
    socklen_t len = 0;
    if (!ToSockaddr(t.address, t.port, &at, &len)) {
      failures.push_back({t.rank, absl::StrCat("'", t.address, "' is not a numeric address"),
                          "its rank published an address this host cannot parse"});
      continue;
    }
    const int fd = socket(at.ss_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (fd < 0) {
      fail(t, errno);
      continue;
    }
    if (connect(fd, reinterpret_cast<const sockaddr*>(&at), len) == 0) {
      close(fd);
    } else if (errno == EINPROGRESS) {
      polls.push_back({fd, POLLOUT, 0});
      of_poll.push_back(i);
    } else {
      fail(targets[i], errno);
      close(fd);
    }
  }
  const absl::Time deadline = absl::Now() + timeout;
  while (polls.size() > 1 && absl::Now() < deadline) {
    const int wait_ms = static_cast<int>(
        std::clamp<int64_t>(absl::ToInt64Milliseconds(deadline - absl::Now()), 1, 100));
    if (poll(polls.data(), polls.size(), wait_ms) < 0 && errno != EINTR) break;
    if (polls[0].revents & POLLIN) {
      for (int in; (in = accept4(listener.fd(), nullptr, nullptr, SOCK_CLOEXEC)) >= 0;) close(in);
    }
    for (size_t p = polls.size() - 1; p >= 1; --p) {
      if (polls[p].revents == 0) continue;
      int error = 0;
      socklen_t len = sizeof(error);
      getsockopt(polls[p].fd, SOL_SOCKET, SO_ERROR, &error, &len);
      if (error != 0) fail(targets[of_poll[p - 1]], error);
      close(polls[p].fd);
      polls.erase(polls.begin() + static_cast<std::ptrdiff_t>(p));
      of_poll.erase(of_poll.begin() + static_cast<std::ptrdiff_t>(p - 1));
    }
  }
  for (size_t p = 1; p < polls.size(); ++p) {
    failures.push_back({targets[of_poll[p - 1]].rank,
                        absl::StrCat("no answer within ", absl::FormatDuration(timeout)),
                        "the packets are dropped on the way (a firewall, or an address on a "
                        "network this host does not reach)"});
    close(polls[p].fd);
  }
  return failures;
}

}  // namespace evenstep::internal

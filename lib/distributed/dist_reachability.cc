// DistContext::CheckGlooReachable: every rank publishes the address its
// Gloo device binds to and checks that it reaches every peer's, naming the
// hosts, addresses and what to set when one does not.
#include <ATen/ATen.h>
#include <netdb.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <limits>
#include <map>
#include <set>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "dist_context_internal.h"
#include "evenstep/dist_context.h"
#include "evenstep/internal/c10d_compat.h"
#include "evenstep/internal/collective.h"
#include "evenstep/internal/error_text.h"
#include "evenstep/internal/gloo_address.h"
#include "evenstep/log.h"
#include "evenstep/status_macros.h"
#include "nlohmann/json.hpp"

namespace evenstep {

using internal::Bytes;
using internal::HostName;
using internal::Text;

namespace {

// What a rank publishes for the reachability check, and how it names itself.
struct ReachEndpoint {
  int rank = 0;
  std::string host;
  std::string address;
  int port = 0;
  std::string how;         // why Gloo binds there
  std::string interfaces;  // that host's interfaces, for the fix
};

std::string Describe(const ReachEndpoint& e) {
  return absl::StrCat("rank ", e.rank, " (host ", e.host, ", Gloo on ", e.address, ", ", e.how,
                      ")");
}

// One error for every rank: which ranks cannot reach which, why, and what
// to set on the host whose address fails.
absl::Status UnreachableError(
    int rank, const std::vector<ReachEndpoint>& endpoints,
    const std::map<int, std::vector<std::pair<int, std::string>>>& by_target) {
  std::vector<std::string> parts;
  std::set<std::string> hosts;
  for (const auto& [target, sources] : by_target) {
    std::vector<int> from;
    for (const auto& [source, why] : sources) from.push_back(source);
    const ReachEndpoint& t = endpoints[target];
    hosts.insert(t.host);
    if (parts.size() < 3) {
      parts.push_back(absl::StrCat(from.size() == 1 ? "rank " : "ranks ", absl::StrJoin(from, ", "),
                                   " (host ", endpoints[from[0]].host,
                                   from.size() > 1 ? ", ..." : "", ") cannot reach ", Describe(t),
                                   ": ", sources[0].second));
    }
  }
  if (by_target.size() > parts.size()) {
    absl::StrAppend(&parts.back(), "; and ", by_target.size() - parts.size(), " more rank(s)");
  }
  std::vector<std::string> fixes;
  for (const std::string& host : hosts) {
    for (const ReachEndpoint& e : endpoints) {
      if (e.host != host) continue;
      fixes.push_back(absl::StrCat(host, " (up there: ", e.interfaces, ")"));
      break;
    }
  }
  return absl::UnavailableError(absl::StrCat(
      "rank ", rank,
      ": the Gloo connections between hosts cannot form: ", absl::StrJoin(parts, "; "),
      ". Every rank's Gloo address must be reachable from every host: set GLOO_SOCKET_IFNAME to "
      "the interface on the network the hosts share, on ",
      absl::StrJoin(fixes, ", ")));
}

}  // namespace

absl::Status DistContext::CheckGlooReachable() {
  c10d::Store& store = *groups_->ctx_store;
  const std::string& device = gloo_device_;
  ReachEndpoint mine;
  mine.rank = env_.rank;
  mine.host = HostName();
  mine.how = gloo_why_;
  mine.interfaces = absl::StrJoin(internal::UpInterfaceAddresses(), ", ");
  absl::StatusOr<std::string> address = internal::GlooBindAddress(device);
  if (!address.ok()) {
    return absl::FailedPreconditionError(
        absl::StrCat("rank ", env_.rank, " (host ", mine.host, "): ", address.status().message()));
  }
  mine.address = *address;
  auto listener = internal::ReachListener::Open(mine.address);
  if (!listener.ok()) {
    return absl::UnavailableError(absl::StrCat("rank ", env_.rank, " (host ", mine.host, ", ",
                                               mine.how, "): ", listener.status().message()));
  }
  mine.port = (*listener)->port();
  std::vector<ReachEndpoint> endpoints(env_.world_size);
  std::map<int, std::vector<std::pair<int, std::string>>> by_target;
  try {
    store.set(absl::StrCat("reach/", env_.rank),
              Bytes(nlohmann::json{{"host", mine.host},
                                   {"address", mine.address},
                                   {"port", mine.port},
                                   {"how", mine.how},
                                   {"interfaces", mine.interfaces}}
                        .dump()));
    std::vector<internal::ReachTarget> targets;
    for (int r = 0; r < env_.world_size; ++r) {
      if (r == env_.rank) {
        endpoints[r] = mine;
        continue;
      }
      const auto j = nlohmann::json::parse(Text(store.get(absl::StrCat("reach/", r))));
      endpoints[r] = {r,
                      j.at("host").get<std::string>(),
                      j.at("address").get<std::string>(),
                      j.at("port").get<int>(),
                      j.at("how").get<std::string>(),
                      j.at("interfaces").get<std::string>()};
      targets.push_back({r, endpoints[r].address, endpoints[r].port});
    }
    nlohmann::json failed = nlohmann::json::array();
    for (const internal::ReachFailure& f :
         internal::ConnectToEach(targets, **listener, options_.collective_timeout)) {
      failed.push_back({f.rank, absl::StrCat(f.reason, " (", f.cause, ")")});
    }
    store.set(absl::StrCat("reach/result/", env_.rank), Bytes(failed.dump()));
    // Every rank's result, read before this rank's listener closes: the
    // others have finished connecting to it when they publish theirs.
    for (int r = 0; r < env_.world_size; ++r) {
      const auto j = nlohmann::json::parse(Text(store.get(absl::StrCat("reach/result/", r))));
      for (const auto& f : j) {
        by_target[f.at(0).get<int>()].emplace_back(r, f.at(1).get<std::string>());
      }
    }
  } catch (const std::exception& e) {
    return absl::UnavailableError(absl::StrCat(
        "rank ", env_.rank, " (host ", mine.host,
        "): the check that every rank's Gloo address is reachable failed (a rank left, or the "
        "store at MASTER_ADDR did not answer within --evenstep_rendezvous_timeout=",
        absl::FormatDuration(options_.rendezvous_timeout), "): ", internal::ErrorText(e)));
  }
  if (by_target.empty()) return absl::OkStatus();
  return UnreachableError(env_.rank, endpoints, by_target);
}

}  // namespace evenstep

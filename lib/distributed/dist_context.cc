// Distributed context: rendezvous through a c10d store, Gloo/NCCL process
// groups, and collectives whose failures name the missing ranks.
//
// Rendezvous protocol (keys under "evenstep/ctx/" in the job's store):
//   1. compareSet("rdzv/world_size", "", "<W> <rank>"): the first rank fixes
//      the world size; a rank that reads a different W fails at once with
//      InvalidArgument and publishes its message under "rdzv/error".
//   2. add("rdzv/rank/<r>", 1) > 1 means two processes claim rank r.
//   3. add("rdzv/joined", 1), then poll until joined == W, "rdzv/error" shows
//      up (abort with that message), or the rendezvous timeout passes
//      (DeadlineExceeded naming the ranks whose "rdzv/rank/<r>" key is absent).
// Collectives: before each one a rank increments "seq/<rank>"; when one fails,
// the ranks whose counter is below this rank's sequence number never arrived.
#include "evenstep/dist_context.h"

#include <ATen/ATen.h>
#include <netdb.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <limits>
#include <map>
#include <set>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "evenstep/checkpoint_writer.h"
#include "evenstep/internal/c10d_compat.h"
#include "evenstep/internal/collective.h"
#include "evenstep/internal/error_text.h"
#include "evenstep/internal/gloo_address.h"
#include "evenstep/internal/group_registry.h"
#include "evenstep/internal/launch_generation.h"
#include "evenstep/internal/store_server.h"
#include "evenstep/log.h"
#include "evenstep/status_macros.h"
#include "nlohmann/json.hpp"

#if EVENSTEP_HAVE_NCCL
#include <c10/cuda/CUDAFunctions.h>
#endif

namespace evenstep {
namespace compat = internal::c10d_compat;

struct DistContext::Groups {
  compat::StorePtr raw_store;  // the job's store (TCPStore, or HashStore for world 1)
  compat::StorePtr store;      // this launch's namespace of it (LaunchEnv::run_namespace)
  std::string launch_prefix;   // that namespace's key prefix ("" for none)
  compat::StorePtr ctx_store;  // "evenstep/ctx/" view of it
  compat::ProcessGroupPtr control;
  compat::ProcessGroupPtr data;
  // Made with the first NewDataGroup: where the syncs over several data
  // groups announce which one and which step they are at
  // (internal::SyncOrder).
  compat::ProcessGroupPtr sync_order;
  // CommitStores made so far: each gets keys of its own.
  int commit_stores = 0;
  // The first collective that timed out or lost a peer: c10d cannot cancel
  // it, so a later collective on these groups would queue behind it or pair
  // with the wrong operation. Every later one fails at once with it.
  absl::Mutex mu;
  absl::Status broken ABSL_GUARDED_BY(mu);
};

namespace {

std::vector<uint8_t> Bytes(absl::string_view s) { return std::vector<uint8_t>(s.begin(), s.end()); }
std::string Text(const std::vector<uint8_t>& v) { return std::string(v.begin(), v.end()); }

std::string HostName() {
  char host[256] = {};
  gethostname(host, sizeof(host) - 1);
  return host;
}

// Why Gloo binds where it does, for device spec `device` (GlooDevice()).
std::string GlooWhy(const std::string& device, const std::string& master_addr) {
  if (device.rfind("if:", 0) == 0) {
    return absl::StrCat("interface ", device.substr(3), " from GLOO_SOCKET_IFNAME");
  }
  if (device.empty()) return "the address its host name resolves to";
  return absl::StrCat("the address that reaches MASTER_ADDR ", master_addr);
}

c10d::ReduceOp ToC10d(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
      return c10d::ReduceOp::SUM;
    case ReduceOp::kProduct:
      return c10d::ReduceOp::PRODUCT;
    case ReduceOp::kMin:
      return c10d::ReduceOp::MIN;
    case ReduceOp::kMax:
      return c10d::ReduceOp::MAX;
  }
  return c10d::ReduceOp::SUM;
}

std::string DescribeTensor(const at::Tensor& t) {
  return absl::StrCat(c10::toString(t.scalar_type()), "[", t.numel(), "]");
}

}  // namespace

namespace {
// DistContexts alive in this process: a second one would rendezvous as the
// same rank of the same job again.
std::atomic<int> live_contexts{0};
}  // namespace

DistContext::DistContext(LaunchEnv env, DistOptions options)
    : env_(std::move(env)), options_(options), groups_(std::make_unique<Groups>()) {
  ++live_contexts;
}

DistContext::~DistContext() {
  --live_contexts;
  if (groups_ == nullptr) return;
  internal::ForgetGroup(groups_->control.get());
  internal::ForgetGroup(groups_->data.get());
  internal::ForgetGroup(groups_->sync_order.get());
}

namespace {

void IgnorePipeSignal(int) {}

// Gloo's TCP transport writes to its sockets with writev() (c10d's TCPStore
// passes MSG_NOSIGNAL; Gloo does not): when a peer has died, the write raises
// SIGPIPE, whose default action ends this rank at once, without a word,
// before the collective's error (which names the rank that never arrived) can
// be reported. A no-op handler turns that into EPIPE on the write. A
// handler, not SIG_IGN: handlers are reset by exec, so programs the trainer
// starts keep the default. A handler (or SIG_IGN) the program installed
// itself is kept.
void CatchPipeSignal() {
  struct sigaction old {};
  if (sigaction(SIGPIPE, nullptr, &old) != 0) return;
  if ((old.sa_flags & SA_SIGINFO) != 0 || old.sa_handler != SIG_DFL) return;
  struct sigaction action {};
  action.sa_handler = IgnorePipeSignal;
  sigemptyset(&action.sa_mask);
  action.sa_flags = SA_RESTART;
  sigaction(SIGPIPE, &action, nullptr);
}

}  // namespace

absl::StatusOr<std::unique_ptr<DistContext>> DistContext::Create(const DistOptions& options) {
  PrepareLaunchedRank();  // line-buffered stdout, early preemption exits 83
  EVENSTEP_ASSIGN_OR_RETURN(LaunchEnv env, DetectLaunchEnv());
  return Create(env, options);
}

absl::StatusOr<std::unique_ptr<DistContext>> DistContext::Create(const LaunchEnv& env,
                                                                 const DistOptions& options) {
  if (env.rank < 0 || env.rank >= env.world_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("rank ", env.rank, " is not in [0, world size ", env.world_size, ")"));
  }
  if (live_contexts.load() > 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "rank ", env.rank, ": this process (pid ", getpid(),
        ") already holds a DistContext; one per process: pass the same DistContext to every "
        "Session, GradSync and BalancedStep (a second one would join the job again as rank ",
        env.rank, ")"));
  }
  CatchPipeSignal();
  std::unique_ptr<DistContext> ctx(new DistContext(env, options));
  EVENSTEP_RETURN_IF_ERROR(ctx->Connect());
  EVENSTEP_RETURN_IF_ERROR(ctx->Rendezvous());
  EVENSTEP_RETURN_IF_ERROR(ctx->CreateGroups());
  // A rank that finished creating its groups may still have a peer in the
  // last handshake: one barrier, so that no rank goes on (and perhaps stops
  // at once, on a bad flag every rank will report) while a peer still needs
  // it to finish connecting.
  if (env.world_size > 1) {
    EVENSTEP_RETURN_IF_ERROR(ctx->Barrier(), "rank ", env.rank,
                             ": the barrier after creating the process groups");
  }
  return ctx;
}

namespace {

// A host name that does not resolve fails in seconds naming it and where it
// came from, instead of after the rendezvous timeout.
absl::Status CheckResolves(const LaunchEnv& env) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* result = nullptr;
  const int rc = getaddrinfo(env.master_addr.c_str(), nullptr, &hints, &result);
  if (result != nullptr) freeaddrinfo(result);
  if (rc == 0) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      "rank ", env.rank, ": the store host '", env.master_addr, "' (", env.master_addr_source,
      ") does not resolve: ", gai_strerror(rc), " (", LauncherName(env.launcher), " launch)"));
}

// The store prefix of this launch's keys ("" for none): under torchrun, the
// run id's launch generation (each restart meets in fresh keys).
absl::StatusOr<std::string> LaunchPrefix(const LaunchEnv& env, absl::Duration timeout,
                                         const compat::StorePtr& store) {
  if (env.run_namespace.empty()) return std::string();
  const std::string run = absl::StrCat("evenstep/run/", env.run_namespace);
  absl::StatusOr<int64_t> generation = absl::InternalError("not run");
  try {
    generation = internal::JoinLaunchGeneration(*compat::MakePrefixStore(run, store), env.rank,
                                                env.world_size, timeout);
  } catch (const std::exception& e) {
    generation = absl::UnavailableError(internal::ErrorText(e));
  }
  if (!generation.ok()) {
    return absl::Status(generation.status().code(),
                        absl::StrCat("rank ", env.rank, ": rendezvous at ", env.master_addr, ":",
                                     env.master_port, " (torchrun run ", env.run_namespace,
                                     ") failed: ", generation.status().message()));
  }
  return absl::StrCat(run, "/gen-", *generation);
}

compat::StorePtr Namespaced(const std::string& prefix, compat::StorePtr store) {
  return prefix.empty() ? store : compat::MakePrefixStore(prefix, std::move(store));
}

}  // namespace

absl::Status DistContext::Connect() {
  if (env_.world_size == 1) {
    groups_->store = compat::MakeHashStore();
  } else {
    EVENSTEP_RETURN_IF_ERROR(CheckResolves(env_));
    const bool is_server = env_.rank == 0 && !env_.agent_store;
    try {
      groups_->store = compat::MakeTcpStore(env_.master_addr, env_.master_port, is_server,
                                            internal::ToChronoMillis(options_.rendezvous_timeout));
    } catch (const std::exception& e) {
      if (is_server) {
        return absl::UnavailableError(absl::StrCat("rank 0: cannot host the c10d TCPStore on port ",
                                                   env_.master_port,
                                                   " (MASTER_PORT): ", internal::ErrorText(e)));
      }
      return absl::UnavailableError(absl::StrCat(
          "rank ", env_.rank, ": cannot reach the c10d TCPStore at ", env_.master_addr, ":",
          env_.master_port, " (MASTER_ADDR:MASTER_PORT) within ",
          absl::FormatDuration(options_.rendezvous_timeout), ": ", internal::ErrorText(e)));
    }
    groups_->store->setTimeout(internal::ToChronoMillis(options_.rendezvous_timeout));
  }
  groups_->raw_store = groups_->store;
  EVENSTEP_ASSIGN_OR_RETURN(groups_->launch_prefix,
                            LaunchPrefix(env_, options_.rendezvous_timeout, groups_->store));
  groups_->store = Namespaced(groups_->launch_prefix, groups_->store);
  groups_->ctx_store = compat::MakePrefixStore("evenstep/ctx", groups_->store);
  return absl::OkStatus();
}

absl::Status DistContext::Rendezvous() {
  if (env_.world_size == 1) return absl::OkStatus();
  c10d::Store& store = *groups_->ctx_store;
  const std::string where = absl::StrCat(env_.master_addr, ":", env_.master_port);
  auto fail = [&](absl::Status status) {
    try {
      store.set("rdzv/error", Bytes(status.message()));
    } catch (const std::exception&) {
      // The store is gone; the other ranks will time out on their own.
    }
    return status;
  };
  try {
    const std::string mine = absl::StrCat(env_.world_size, " ", env_.rank);
    const std::string agreed = Text(store.compareSet("rdzv/world_size", {}, Bytes(mine)));
    std::vector<std::string> parts = absl::StrSplit(agreed, ' ');
    int agreed_world = 0;
    if (parts.size() != 2 || !absl::SimpleAtoi(parts[0], &agreed_world)) {
      return absl::InternalError(absl::StrCat("rank ", env_.rank, ": unreadable rendezvous key \"",
                                              agreed, "\" in the store at ", where));
    }
    if (agreed_world != env_.world_size) {
      return fail(absl::InvalidArgumentError(
          absl::StrCat("world size mismatch: rank ", env_.rank, " has WORLD_SIZE=", env_.world_size,
                       " but rank ", parts[1], " joined with WORLD_SIZE=", agreed_world)));
    }
    if (store.add(absl::StrCat("rdzv/rank/", env_.rank), 1) > 1) {
      return fail(absl::AlreadyExistsError(absl::StrCat(
          "two processes claim rank ", env_.rank, " (check RANK / SLURM_PROCID of the job)")));
    }
    store.add("rdzv/joined", 1);
    const absl::Time deadline = absl::Now() + options_.rendezvous_timeout;
    absl::Duration pause = absl::Milliseconds(1);
    while (true) {
      if (store.check({"rdzv/error"})) {
        return absl::FailedPreconditionError(absl::StrCat(
            "rank ", env_.rank, ": rendezvous aborted: ", Text(store.get("rdzv/error"))));
      }
      const int64_t joined = store.add("rdzv/joined", 0);
      if (joined >= env_.world_size) break;
      if (absl::Now() >= deadline) {
        std::vector<int> missing;
        for (int r = 0; r < env_.world_size; ++r) {
          if (!store.check({absl::StrCat("rdzv/rank/", r)})) missing.push_back(r);
        }
        return absl::DeadlineExceededError(absl::StrCat(
            "rank ", env_.rank, ": rendezvous at ", where, " timed out after ",
            absl::FormatDuration(options_.rendezvous_timeout), " with ", joined, " of ",
            env_.world_size, " ranks joined; missing rank(s) ", absl::StrJoin(missing, ", ")));
      }
      absl::SleepFor(pause);
      pause = std::min(pause * 2, absl::Milliseconds(50));
    }
  } catch (const std::exception& e) {
    return absl::UnavailableError(absl::StrCat("rank ", env_.rank, ": rendezvous at ", where,
                                               " failed: ", internal::ErrorText(e)));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> DistContext::GlooDevice() const {
  internal::GlooAddressInputs in;
  in.host = HostName();
  if (const char* ifname = std::getenv("GLOO_SOCKET_IFNAME"); ifname && *ifname) {
    in.ifname = ifname;
    in.ifname_loopback = internal::IsLoopbackInterface(in.ifname);
  }
  in.master_addr = env_.master_addr;
  in.world_size = env_.world_size;
  in.local_world_size = env_.local_world_size;
  if (env_.world_size > 1) {
    in.interfaces = internal::UpInterfaceAddresses();  // also named in errors
  }
  if (env_.world_size > 1 && in.ifname.empty()) {
    absl::StatusOr<std::string> route =
        internal::LocalAddressTowards(env_.master_addr, env_.master_port);
    if (route.ok()) {
      in.route_address = *route;
    } else {
      in.route_error = std::string(route.status().message());
    }
  }
  return internal::ChooseGlooAddress(in);
}

absl::Status DistContext::CreateGroups() {
  absl::StatusOr<std::string> chosen = GlooDevice();
  if (!chosen.ok()) {
    return absl::FailedPreconditionError(
        absl::StrCat("rank ", env_.rank, ": ", chosen.status().message()));
  }
  gloo_device_ = *chosen;
  const std::string& device = gloo_device_;
  if (env_.world_size > env_.local_world_size && env_.local_rank == 0) {
    // One line per host: where its ranks listen, before anything connects.
    Log(LogLevel::kWarning, absl::StrCat("host ", HostName(), " (rank ", env_.rank, "): Gloo on ",
                                         device.rfind("if:", 0) == 0 ? device.substr(3) : device,
                                         " (", GlooWhy(device, env_.master_addr), ")"));
  }
  if (env_.world_size > env_.local_world_size) {
    EVENSTEP_RETURN_IF_ERROR(CheckGlooReachable());
  }
  const auto timeout = internal::ToChronoMillis(options_.collective_timeout);
  try {
    groups_->control =
        compat::MakeGlooGroup(compat::MakePrefixStore("evenstep/gloo", groups_->store), env_.rank,
                              env_.world_size, timeout, device);
  } catch (const std::exception& e) {
    return absl::UnavailableError(absl::StrCat(
        "rank ", env_.rank, ": creating the Gloo process group failed: ", internal::ErrorText(e)));
  }
  groups_->data = groups_->control;
  bool want_nccl = options_.backend == CommBackend::kNccl;
#if EVENSTEP_HAVE_NCCL
  if (options_.backend == CommBackend::kAuto) want_nccl = at::hasCUDA();
  if (want_nccl) {
    try {
      c10::cuda::set_device(
          static_cast<c10::DeviceIndex>(env_.local_rank % c10::cuda::device_count()));
      groups_->data =
          compat::MakeNcclGroup(compat::MakePrefixStore("evenstep/nccl", groups_->store), env_.rank,
                                env_.world_size, timeout);
    } catch (const std::exception& e) {
      return absl::UnavailableError(
          absl::StrCat("rank ", env_.rank,
                       ": creating the NCCL process group failed: ", internal::ErrorText(e)));
    }
  }
#else
  if (want_nccl) {
    return absl::FailedPreconditionError(
        "--evenstep_backend=nccl, but this libtorch was built without NCCL; use "
        "--evenstep_backend=gloo or auto");
  }
#endif
  groups_->raw_store->setTimeout(timeout);
  return absl::OkStatus();
}

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
  mine.how = GlooWhy(device, env_.master_addr);
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

std::string DistContext::backend_name() const { return compat::BackendName(*groups_->data); }

c10d::Store& DistContext::store() { return *groups_->store; }

namespace {

class C10dCommitStore : public CommitStore {
 public:
  explicit C10dCommitStore(compat::StorePtr store) : store_(std::move(store)) {}
  absl::Status Set(const std::string& key, const std::string& value) override {
    try {
      store_->set(key, std::vector<uint8_t>(value.begin(), value.end()));
      return absl::OkStatus();
    } catch (const std::exception& e) {
      return absl::UnavailableError(absl::StrCat("store set ", key, ": ", internal::ErrorText(e)));
    }
  }
  absl::StatusOr<std::string> Get(const std::string& key) override {
    try {
      const std::vector<uint8_t> v = store_->get(key);
      return std::string(v.begin(), v.end());
    } catch (const std::exception& e) {
      return absl::DeadlineExceededError(
          absl::StrCat("store get ", key, ": ", internal::ErrorText(e)));
    }
  }
  absl::StatusOr<int64_t> Add(const std::string& key, int64_t delta) override {
    try {
      return store_->add(key, delta);
    } catch (const std::exception& e) {
      return absl::UnavailableError(absl::StrCat("store add ", key, ": ", internal::ErrorText(e)));
    }
  }

 private:
  compat::StorePtr store_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<CommitStore>> DistContext::NewCommitStore() {
  compat::StorePtr base = groups_->store;  // a HashStore (world 1) is thread-safe
  if (env_.world_size > 1) {
    try {
      base = compat::MakeTcpStore(env_.master_addr, env_.master_port, /*is_server=*/false,
                                  internal::ToChronoMillis(options_.rendezvous_timeout));
      base->setTimeout(internal::ToChronoMillis(options_.collective_timeout));
      base = Namespaced(groups_->launch_prefix, std::move(base));
    } catch (const std::exception& e) {
      return absl::UnavailableError(absl::StrCat(
          "rank ", env_.rank, ": second store connection for I/O: ", internal::ErrorText(e)));
    }
  }
  // Each writer numbers its saves from 0 in its keys: a second one (the
  // next Session's) in the same keys would read the first one's outcomes
  // and never commit. Every rank makes them in the same order.
  const int n = groups_->commit_stores++;
  return std::unique_ptr<CommitStore>(new C10dCommitStore(
      compat::MakePrefixStore(absl::StrCat("evenstep/io/", n), std::move(base))));
}
c10d::ProcessGroup& DistContext::control_group() { return *groups_->control; }
c10d::ProcessGroup& DistContext::data_group() { return *groups_->data; }

int64_t DistContext::MarkArrival() {
  ++op_seq_;
  if (env_.world_size > 1) {
    try {
      groups_->ctx_store->add(absl::StrCat("seq/", env_.rank), 1);
    } catch (const std::exception&) {
      // An unreachable store shows up in the collective itself and in Diagnose.
    }
  }
  return op_seq_;
}

absl::Status DistContext::Broken(const std::string& what) {
  absl::MutexLock lock(&groups_->mu);
  // A gradient sync over one of these groups that failed, timed out or
  // found its buckets mispaired (GradSync marks its group): a peer's late
  // bucket would pair with this collective.
  for (const c10d::ProcessGroup* g : {groups_->data.get(), groups_->control.get()}) {
    if (!groups_->broken.ok() || g == nullptr) break;
    absl::Status sync = internal::GroupBroken(g);
    if (!sync.ok()) groups_->broken = sync;
  }
  if (groups_->broken.ok()) return absl::OkStatus();
  return absl::Status(groups_->broken.code(),
                      absl::StrCat("rank ", env_.rank, ": ", what,
                                   " not started: an earlier collective failed and c10d cannot "
                                   "cancel it, so this job's process groups cannot be used any "
                                   "more (restart the job; a checkpoint resumes it): ",
                                   groups_->broken.message()));
}

absl::Status DistContext::Wait(c10d::Work& work, int64_t seq, const std::string& what) {
  EVENSTEP_RETURN_IF_ERROR(Broken(what));
  const internal::CollectiveWait outcome =
      internal::WaitCollective(&work, options_.collective_timeout);
  return outcome.failed ? Diagnose(seq, what, outcome.elapsed, outcome.error) : absl::OkStatus();
}

absl::Status DistContext::Diagnose(int64_t seq, const std::string& what, absl::Duration elapsed,
                                   const std::string& error) {
  std::vector<std::string> missing;
  std::string store_note;
  try {
    for (int r = 0; r < env_.world_size; ++r) {
      if (r == env_.rank) continue;
      const int64_t reached = groups_->ctx_store->add(absl::StrCat("seq/", r), 0);
      if (reached < seq) missing.push_back(absl::StrCat(r, " (last at #", reached, ")"));
    }
  } catch (const std::exception& e) {
    store_note = absl::StrCat("; the store is unreachable too, so missing ranks cannot be named (",
                              internal::ErrorText(e), ")");
  }
  std::string message =
      absl::StrFormat("rank %d: %s (collective #%d) failed after %s", env_.rank, what, seq,
                      absl::FormatDuration(absl::Trunc(elapsed, absl::Milliseconds(1))));
  if (!missing.empty()) {
    absl::StrAppend(&message, ": rank(s) ", absl::StrJoin(missing, ", "), " never arrived");
  }
  absl::StrAppend(&message, store_note, "; c10d: ", error);
  absl::Status status = absl::InternalError(message);
  if (internal::TimedOut(elapsed, options_.collective_timeout, error)) {
    status = absl::DeadlineExceededError(message);
  } else if (!missing.empty() || !store_note.empty() || absl::StrContains(error, "onnection")) {
    status = absl::UnavailableError(message);
  }
  if (absl::IsDeadlineExceeded(status) || absl::IsUnavailable(status)) {
    absl::MutexLock lock(&groups_->mu);
    if (groups_->broken.ok()) groups_->broken = status;
  }
  return status;
}

template <typename Launch>
absl::Status DistContext::Run(const std::string& what, Launch&& launch) {
  EVENSTEP_RETURN_IF_ERROR(Broken(what));
  const int64_t seq = MarkArrival();
  const internal::CollectiveWait outcome =
      internal::RunCollective(std::forward<Launch>(launch), options_.collective_timeout);
  return outcome.failed ? Diagnose(seq, what, outcome.elapsed, outcome.error) : absl::OkStatus();
}

namespace {
c10d::ProcessGroup& GroupFor(const at::Tensor& t, c10d::ProcessGroup& control,
                             c10d::ProcessGroup& data) {
  return t.is_cuda() ? data : control;
}

// c10d's collectives work on dense, contiguous buffers only.
absl::Status RequireContiguous(const at::Tensor& t, int rank, const std::string& what) {
  if (t.is_contiguous()) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("rank ", rank, ": ", what, " needs a contiguous tensor"));
}
}  // namespace

absl::Status DistContext::AllReduce(at::Tensor& tensor, ReduceOp op) {
  const std::string what = absl::StrCat("all_reduce of ", DescribeTensor(tensor));
  EVENSTEP_RETURN_IF_ERROR(RequireContiguous(tensor, env_.rank, what));
  c10d::ProcessGroup& group = GroupFor(tensor, *groups_->control, *groups_->data);
  return Run(what, [&] {
    std::vector<at::Tensor> tensors{tensor};
    c10d::AllreduceOptions options;
    options.reduceOp = ToC10d(op);
    return group.allreduce(tensors, options);
  });
}

absl::Status DistContext::AllGather(const at::Tensor& in, std::vector<at::Tensor>* out) {
  const std::string what = absl::StrCat("all_gather of ", DescribeTensor(in));
  EVENSTEP_RETURN_IF_ERROR(RequireContiguous(in, env_.rank, what));
  std::vector<std::vector<at::Tensor>> outputs(1);
  for (int r = 0; r < env_.world_size; ++r) outputs[0].push_back(at::empty_like(in));
  c10d::ProcessGroup& group = GroupFor(in, *groups_->control, *groups_->data);
  absl::Status status = Run(what, [&] {
    std::vector<at::Tensor> inputs{in};
    return group.allgather(outputs, inputs);
  });
  if (status.ok()) *out = std::move(outputs[0]);
  return status;
}

absl::Status DistContext::Broadcast(at::Tensor& tensor, int root) {
  const std::string what =
      absl::StrCat("broadcast from rank ", root, " of ", DescribeTensor(tensor));
  if (root < 0 || root >= env_.world_size) {
    return absl::InvalidArgumentError(absl::StrCat("rank ", env_.rank, ": ", what,
                                                   ": root is not in [0, ", env_.world_size, ")"));
  }
  EVENSTEP_RETURN_IF_ERROR(RequireContiguous(tensor, env_.rank, what));
  c10d::ProcessGroup& group = GroupFor(tensor, *groups_->control, *groups_->data);
  return Run(what, [&] {
    std::vector<at::Tensor> tensors{tensor};
    c10d::BroadcastOptions options;
    options.rootRank = root;
    return group.broadcast(tensors, options);
  });
}

absl::Status DistContext::Barrier() {
  return Run("barrier", [&] { return groups_->control->barrier(); });
}

// ---------------------------------------------------------------------------
// Subgroup

struct Subgroup::Impl {
  compat::ProcessGroupPtr group;
};

Subgroup::Subgroup(std::string name, std::vector<int> ranks, int index, int global_rank,
                   absl::Duration timeout, std::unique_ptr<Impl> impl)
    : name_(std::move(name)),
      ranks_(std::move(ranks)),
      index_(index),
      global_rank_(global_rank),
      timeout_(timeout),
      impl_(std::move(impl)) {}

Subgroup::~Subgroup() {
  if (impl_ != nullptr) internal::ForgetGroup(impl_->group.get());
}

template <typename Launch>
absl::Status Subgroup::Run(const std::string& what, Launch&& launch) {
  const internal::CollectiveWait outcome =
      internal::RunCollective(std::forward<Launch>(launch), timeout_);
  if (!outcome.failed) return absl::OkStatus();
  return internal::CollectiveFailed(
      global_rank_,
      absl::StrCat(what, " in group ", name_, " (ranks ", absl::StrJoin(ranks_, ","), ")"), outcome,
      timeout_);
}

absl::Status Subgroup::AllReduce(at::Tensor& tensor) {
  EVENSTEP_RETURN_IF_ERROR(RequireContiguous(tensor, global_rank_, "all_reduce"));
  return Run(absl::StrCat("all_reduce of ", DescribeTensor(tensor)), [&] {
    std::vector<at::Tensor> tensors{tensor};
    return impl_->group->allreduce(tensors);
  });
}

absl::Status Subgroup::Barrier() {
  return Run("barrier", [&] { return impl_->group->barrier(); });
}

c10d::ProcessGroup& Subgroup::process_group() { return *impl_->group; }

absl::StatusOr<double> MeasureBusBandwidth(int n, size_t bytes, int iters,
                                           const std::function<absl::Status(at::Tensor&)>& reduce) {
  at::Tensor t = at::ones({static_cast<int64_t>(bytes / sizeof(float))});
  EVENSTEP_RETURN_IF_ERROR(reduce(t));  // warm-up
  double per = std::numeric_limits<double>::infinity();
  for (int i = 0; i < iters; ++i) {
    const absl::Time begin = absl::Now();
    EVENSTEP_RETURN_IF_ERROR(reduce(t));
    per = std::min(per, absl::ToDoubleSeconds(absl::Now() - begin));
  }
  const double algbw = static_cast<double>(bytes) / per / 1e9;
  return n > 1 ? algbw * 2.0 * (n - 1) / n : algbw;
}

// ---------------------------------------------------------------------------
// Nodes

int NodeLayout::place_of(int rank) const {
  const std::vector<int>& mine = ranks[node_of[rank]];
  return static_cast<int>(std::find(mine.begin(), mine.end(), rank) - mine.begin());
}

bool NodeLayout::even() const {
  for (const auto& members : ranks) {
    if (members.size() != ranks.front().size()) return false;
  }
  return true;
}

std::string NodeLayout::Describe() const {
  std::vector<std::string> parts;
  for (const auto& members : ranks) {
    parts.push_back(absl::StrCat(names[members.front()], ": ", members.size(), " rank",
                                 members.size() == 1 ? "" : "s", " (", absl::StrJoin(members, ","),
                                 ")"));
  }
  return absl::StrJoin(parts, "; ");
}

namespace {

// This rank's node key: the host name, with the launcher's node index when
// it gives one.
std::string NodeKey() {
  const std::string host = HostName();
  for (const char* var : {"GROUP_RANK", "SLURM_NODEID"}) {
    if (const char* v = std::getenv(var); v != nullptr && *v) return absl::StrCat(host, "#", v);
  }
  return host;
}

}  // namespace

absl::StatusOr<NodeLayout> DistContext::Nodes() {
  if (nodes_.has_value()) return *nodes_;
  const int world = env_.world_size;
  std::vector<std::string> keys;
  {
    const std::string key = NodeKey().substr(0, 127);
    at::Tensor in = at::zeros({128}, at::kByte);
    std::memcpy(in.data_ptr<uint8_t>(), key.data(), key.size());
    std::vector<at::Tensor> all;
    EVENSTEP_RETURN_IF_ERROR(AllGather(in, &all), "exchanging node names");
    for (const at::Tensor& t : all) {
      keys.emplace_back(reinterpret_cast<const char*>(t.data_ptr<uint8_t>()));
    }
  }
  std::vector<std::string> in_order;  // distinct keys, by first rank
  for (const std::string& k : keys) {
    if (std::find(in_order.begin(), in_order.end(), k) == in_order.end()) in_order.push_back(k);
  }
  std::set<std::string> hosts;
  for (const std::string& k : in_order) hosts.insert(k.substr(0, k.find('#')));
  NodeLayout layout;
  layout.ranks.resize(in_order.size());
  for (int r = 0; r < world; ++r) {
    const int node =
        static_cast<int>(std::find(in_order.begin(), in_order.end(), keys[r]) - in_order.begin());
    layout.node_of.push_back(node);
    layout.ranks[node].push_back(r);
    layout.names.push_back(hosts.size() == in_order.size() ? keys[r].substr(0, keys[r].find('#'))
                                                           : absl::StrCat("node", node));
  }
  nodes_ = layout;
  return layout;
}

absl::StatusOr<std::unique_ptr<Subgroup>> DistContext::NewSubgroup(const std::string& name,
                                                                   std::vector<int> ranks) {
  std::sort(ranks.begin(), ranks.end());
  const auto me = std::find(ranks.begin(), ranks.end(), env_.rank);
  if (ranks.empty() || ranks.front() < 0 || ranks.back() >= env_.world_size ||
      std::adjacent_find(ranks.begin(), ranks.end()) != ranks.end() || me == ranks.end()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "rank ", env_.rank, ": subgroup ", name, " of ranks [", absl::StrJoin(ranks, ","),
        "]: the ranks must be distinct, below the world size ", env_.world_size,
        " and include this rank"));
  }
  const int index = static_cast<int>(me - ranks.begin());
  auto impl = std::make_unique<Subgroup::Impl>();
  try {
    impl->group = compat::MakeGlooGroup(
        compat::MakePrefixStore(absl::StrCat("evenstep/sub/", name), groups_->store), index,
        static_cast<int>(ranks.size()), internal::ToChronoMillis(options_.collective_timeout),
        gloo_device_);
  } catch (const std::exception& e) {
    return absl::UnavailableError(absl::StrCat("rank ", env_.rank, ": creating subgroup ", name,
                                               " (ranks ", absl::StrJoin(ranks, ","),
                                               "): ", internal::ErrorText(e)));
  }
  return std::unique_ptr<Subgroup>(new Subgroup(name, std::move(ranks), index, env_.rank,
                                                options_.collective_timeout, std::move(impl)));
}

absl::StatusOr<std::unique_ptr<Subgroup>> DistContext::NewDataGroup() {
  EVENSTEP_RETURN_IF_ERROR(Broken("creating a data group"));
  const std::string name = absl::StrCat("data", data_groups_++);
  std::vector<int> ranks(env_.world_size);
  for (int r = 0; r < env_.world_size; ++r) ranks[r] = r;
  auto impl = std::make_unique<Subgroup::Impl>();
  const auto timeout = internal::ToChronoMillis(options_.collective_timeout);
  const std::string backend = backend_name();
  try {
    if (!groups_->sync_order) {
      groups_->sync_order =
          compat::MakeGlooGroup(compat::MakePrefixStore("evenstep/sync_order", groups_->store),
                                env_.rank, env_.world_size, timeout, gloo_device_);
      internal::ShareSyncOrder(groups_->data.get(), groups_->sync_order.get(), 1);
    }
    auto store = compat::MakePrefixStore(absl::StrCat("evenstep/", name), groups_->store);
#if EVENSTEP_HAVE_NCCL
    if (backend == "nccl") {
      impl->group = compat::MakeNcclGroup(store, env_.rank, env_.world_size, timeout);
    }
#endif
    if (!impl->group) {
      impl->group = compat::MakeGlooGroup(store, env_.rank, env_.world_size, timeout, gloo_device_);
    }
  } catch (const std::exception& e) {
    return absl::UnavailableError(absl::StrCat("rank ", env_.rank, ": creating ", backend,
                                               " data group ", name, ": ", internal::ErrorText(e)));
  }
  internal::ShareSyncOrder(impl->group.get(), groups_->sync_order.get(), data_groups_ + 1);
  return std::unique_ptr<Subgroup>(new Subgroup(name, std::move(ranks), env_.rank, env_.rank,
                                                options_.collective_timeout, std::move(impl)));
}

// ---------------------------------------------------------------------------
// StoreServer

namespace internal {

struct StoreServer::Impl {
  compat::StorePtr store;
};

StoreServer::StoreServer(std::unique_ptr<Impl> impl, int port)
    : impl_(std::move(impl)), port_(port) {}
StoreServer::~StoreServer() = default;

absl::StatusOr<std::unique_ptr<StoreServer>> StoreServer::Start(int port) {
  auto impl = std::make_unique<Impl>();
  try {
    impl->store = compat::MakeTcpStore("127.0.0.1", port, /*is_server=*/true,
                                       std::chrono::milliseconds(30000));
  } catch (const std::exception& e) {
    return absl::UnavailableError(
        absl::StrCat("cannot host a c10d TCPStore on port ", port, ": ", ErrorText(e)));
  }
  const int actual = compat::TcpStorePort(*impl->store);
  return std::unique_ptr<StoreServer>(new StoreServer(std::move(impl), actual));
}

}  // namespace internal
}  // namespace evenstep

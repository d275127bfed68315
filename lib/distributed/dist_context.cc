// Distributed context: rendezvous through a c10d store, Gloo/NCCL process
// groups, and collectives whose failures name the missing ranks. The
// rendezvous and the other stages agreed through the store: dist_agree.cc.
//
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
#include <functional>
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
#include "dist_context_internal.h"
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

using internal::Bytes;
using internal::DescribeTensor;
using internal::HostName;
using internal::RequireContiguous;
using internal::Text;

namespace {

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

}  // namespace

namespace {
// DistContexts alive in this process: a second one would rendezvous as the
// same rank of the same job again.
std::atomic<int> live_contexts{0};
}  // namespace

DistContext::DistContext(LaunchEnv env, DistOptions options)
    : env_(std::move(env)),
      launch_rank_(env_.rank),
      options_(options),
      groups_(std::make_unique<Groups>()) {
  for (int r = 0; r < env_.world_size; ++r) groups_->members.push_back(r);
  groups_->launch_world = env_.world_size;
  ++live_contexts;
}

DistContext::~DistContext() {
  --live_contexts;
  if (groups_ == nullptr) return;
  internal::ForgetGroup(groups_->control.get());
  internal::ForgetGroup(groups_->data.get());
  internal::ForgetGroup(groups_->sync_order.get());
  for (const compat::ProcessGroupPtr& g : groups_->retired) internal::ForgetGroup(g.get());
  groups_->StopHeartbeat();
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
  DistOptions with_env = options;
  if (const char* join = std::getenv("EVENSTEP_JOIN");
      join != nullptr && std::string(join) == "1") {
    with_env.join = true;
  }
  return Create(env, with_env);
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
  if (options.join) {
    EVENSTEP_RETURN_IF_ERROR(ctx->Join());
    return ctx;
  }
  EVENSTEP_RETURN_IF_ERROR(ctx->Connect());
  EVENSTEP_RETURN_IF_ERROR(ctx->Rendezvous());
  EVENSTEP_RETURN_IF_ERROR(ctx->CreateGroups());
  EVENSTEP_RETURN_IF_ERROR(ctx->StartHeartbeat());
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

std::string DistContext::MasterSeenHere() const {
  if (env_.world_size == 1) return "";
  absl::StatusOr<internal::Route> route =
      internal::RouteTowards(env_.master_addr, env_.master_port);
  if (!route.ok() || internal::IsLoopbackAddress(route->remote)) return "";
  return route->remote;
}

absl::Status DistContext::ChooseGlooDevice() {
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
  if (env_.world_size > env_.local_world_size && in.ifname.empty() &&
      internal::IsLoopbackAddress(in.route_address.empty() ? in.master_addr : in.route_address)) {
    // MASTER_ADDR is loopback here: where the other hosts' ranks reach it.
    try {
      c10d::Store& store = *groups_->ctx_store;
      for (int r = 0; r < env_.world_size; ++r) {
        const std::string key = absl::StrCat("rdzv/master_seen/", r);
        if (!store.check({key})) continue;
        const std::string seen = Text(store.get(key));
        if (!seen.empty()) in.master_seen.push_back(seen);
      }
    } catch (const std::exception&) {
      // The store is gone: the choice below names what is missing.
    }
  }
  absl::StatusOr<std::string> chosen = internal::ChooseGlooAddress(in);
  if (!chosen.ok()) {
    return absl::FailedPreconditionError(
        absl::StrCat("rank ", env_.rank, ": ", chosen.status().message()));
  }
  if (!in.ifname.empty() && env_.world_size > 1) {
    // An interface that is not here fails now, naming it, rather than
    // inside Gloo's connect.
    if (absl::StatusOr<std::string> bound = internal::GlooBindAddress(*chosen); !bound.ok()) {
      return absl::FailedPreconditionError(
          absl::StrCat("rank ", env_.rank, " (host ", in.host, "): ", bound.status().message()));
    }
  }
  gloo_device_ = *chosen;
  gloo_why_ = internal::GlooWhy(in, gloo_device_);
  return absl::OkStatus();
}

absl::Status DistContext::CreateGroups() {
  if (env_.world_size == 1) {
    EVENSTEP_RETURN_IF_ERROR(ChooseGlooDevice());
  } else if (absl::Status chosen = ChooseGlooDevice(); !chosen.ok()) {
    return internal::PublishFailure(*groups_->ctx_store, env_, internal::StartUpStage(), chosen);
  } else {
    // Agreed before Gloo connects, which would wait for a rank that stopped
    // until its timeout and then say only "Broken pipe".
    EVENSTEP_RETURN_IF_ERROR(internal::AwaitStage(
        *groups_->ctx_store, env_, options_.rendezvous_timeout, internal::StartUpStage(),
        "gloo_address", "past choosing their Gloo address"));
  }
  const std::string& device = gloo_device_;
  if (env_.world_size > env_.local_world_size && env_.local_rank == 0) {
    // One line per host: where its ranks listen, before anything connects.
    Log(LogLevel::kWarning, absl::StrCat("host ", HostName(), " (rank ", env_.rank, "): Gloo on ",
                                         device.rfind("if:", 0) == 0 ? device.substr(3) : device,
                                         " (", gloo_why_, ")"));
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
  EVENSTEP_ASSIGN_OR_RETURN(groups_->nccl, internal::PrepareNccl(options_, env_));
#if EVENSTEP_HAVE_NCCL
  if (groups_->nccl) {
    try {
      groups_->data =
          compat::MakeNcclGroup(compat::MakePrefixStore("evenstep/nccl", groups_->store), env_.rank,
                                env_.world_size, timeout);
    } catch (const std::exception& e) {
      return absl::UnavailableError(
          absl::StrCat("rank ", env_.rank,
                       ": creating the NCCL process group failed: ", internal::ErrorText(e)));
    }
  }
#endif
  groups_->raw_store->setTimeout(timeout);
  return absl::OkStatus();
}

absl::StatusOr<bool> internal::PrepareNccl(const DistOptions& options, const LaunchEnv& env) {
  bool want_nccl = options.backend == CommBackend::kNccl;
#if EVENSTEP_HAVE_NCCL
  if (options.backend == CommBackend::kAuto) want_nccl = at::hasCUDA();
  if (want_nccl) {
    try {
      c10::cuda::set_device(
          static_cast<c10::DeviceIndex>(env.local_rank % c10::cuda::device_count()));
    } catch (const std::exception& e) {
      return absl::UnavailableError(
          absl::StrCat("rank ", env.rank, ": selecting the CUDA device: ", internal::ErrorText(e)));
    }
  }
#else
  if (want_nccl) {
    return absl::FailedPreconditionError(
        "--evenstep_backend=nccl, but this libtorch was built without NCCL; use "
        "--evenstep_backend=gloo or auto");
  }
#endif
  return want_nccl;
}

std::string DistContext::backend_name() const { return compat::BackendName(*groups_->data); }

c10d::Store& DistContext::store() { return *groups_->store; }

namespace {

class C10dCommitStore : public CommitStore {
 public:
  using Connect = std::function<absl::StatusOr<compat::StorePtr>()>;
  // `connect`: a new connection to the same keys (null: `store` is safe to
  // share between threads).
  C10dCommitStore(compat::StorePtr store, Connect connect)
      : store_(std::move(store)), connect_(std::move(connect)) {}
  absl::StatusOr<std::unique_ptr<CommitStore>> Reconnect() override {
    if (!connect_) return std::unique_ptr<CommitStore>();
    EVENSTEP_ASSIGN_OR_RETURN(compat::StorePtr store, connect_());
    return std::unique_ptr<CommitStore>(new C10dCommitStore(std::move(store), connect_));
  }
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
  Connect connect_;
};

}  // namespace

namespace internal {

absl::StatusOr<compat::StorePtr> OwnStoreConnection(const LaunchEnv& env,
                                                    absl::Duration rendezvous_timeout,
                                                    const std::string& launch_prefix,
                                                    absl::Duration timeout,
                                                    const std::string& what) {
  try {
    compat::StorePtr store =
        compat::MakeTcpStore(env.master_addr, env.master_port,
                             /*is_server=*/false, ToChronoMillis(rendezvous_timeout));
    store->setTimeout(ToChronoMillis(timeout));
    return Namespaced(launch_prefix, std::move(store));
  } catch (const std::exception& e) {
    return absl::UnavailableError(absl::StrCat("rank ", env.rank, ": second store connection for ",
                                               what, ": ", ErrorText(e)));
  }
}

}  // namespace internal

absl::StatusOr<std::unique_ptr<CommitStore>> DistContext::NewCommitStore() {
  // Each writer numbers its saves from 0 in its keys: a second one (the
  // next Session's) in the same keys would read the first one's outcomes
  // and never commit. Every rank makes them in the same order.
  const std::string prefix = Scoped(absl::StrCat("evenstep/io/", groups_->commit_stores++));
  if (env_.world_size == 1 && groups_->generation == 0) {
    // A HashStore is thread-safe: one connection serves every thread. (A
    // world left with one rank by a regroup still talks to a TCPStore.)
    return std::unique_ptr<CommitStore>(
        new C10dCommitStore(compat::MakePrefixStore(prefix, groups_->store), nullptr));
  }
  // A TCPStore client is one socket: a thread blocked in a get on it holds
  // it, so another thread needs a connection of its own (Reconnect).
  C10dCommitStore::Connect connect =
      [env = env_, rendezvous = options_.rendezvous_timeout, launch = groups_->launch_prefix,
       timeout = options_.collective_timeout, prefix]() -> absl::StatusOr<compat::StorePtr> {
    EVENSTEP_ASSIGN_OR_RETURN(compat::StorePtr base, internal::OwnStoreConnection(
                                                         env, rendezvous, launch, timeout, "I/O"));
    return compat::MakePrefixStore(prefix, std::move(base));
  };
  EVENSTEP_ASSIGN_OR_RETURN(compat::StorePtr store, connect());
  return std::unique_ptr<CommitStore>(new C10dCommitStore(std::move(store), std::move(connect)));
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
      internal::WaitCollective(&work, options_.collective_timeout, absl::Now(), Abandon());
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
    // Where rank 0 hosts the store (no launcher's agent store), a store
    // that is gone says which rank stopped.
    const bool rank0_hosts = !env_.agent_store && env_.rank != 0;
    store_note = absl::StrCat(
        "; the store is unreachable too",
        rank0_hosts ? " (rank 0 hosts it, so rank 0 has stopped or cannot be reached)" : "",
        ", so missing ranks cannot be named (", internal::ErrorText(e), ")");
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
  } else if (!missing.empty() || !store_note.empty() || absl::StrContains(error, "onnection") ||
             absl::StrContains(error, internal::kAbandonedWait)) {
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
      internal::RunCollective(std::forward<Launch>(launch), options_.collective_timeout, Abandon());
  return outcome.failed ? Diagnose(seq, what, outcome.elapsed, outcome.error) : absl::OkStatus();
}

namespace {
c10d::ProcessGroup& GroupFor(const at::Tensor& t, c10d::ProcessGroup& control,
                             c10d::ProcessGroup& data) {
  return t.is_cuda() ? data : control;
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

}  // namespace evenstep

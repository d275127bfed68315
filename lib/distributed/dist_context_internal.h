// What DistContext's source files share (not installed): the process
// groups and store of a context, and small helpers.
#pragma once

#include <ATen/ATen.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <exception>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "evenstep/dist_context.h"
#include "evenstep/internal/c10d_compat.h"

namespace evenstep {
namespace compat = internal::c10d_compat;

struct DistContext::Groups {
  compat::StorePtr raw_store;  // the job's store (TCPStore, or HashStore for world 1)
  compat::StorePtr store;      // this launch's namespace of it (LaunchEnv::run_namespace)
  std::string launch_prefix;   // that namespace's key prefix ("" for none)
  compat::StorePtr ctx_store;  // "evenstep/ctx/" view of it
  compat::ProcessGroupPtr control;
  compat::ProcessGroupPtr data;
  bool nccl = false;  // data is an NCCL group (internal::PrepareNccl)
  // Made with the first NewDataGroup: where the syncs over several data
  // groups announce which one and which step they are at
  // (internal::SyncOrder).
  compat::ProcessGroupPtr sync_order;
  // CommitStores made so far: each gets keys of its own.
  int commit_stores = 0;
  // DistContext::Agree calls so far: each gets keys of its own.
  int agreements = 0;
  // Regroup's: how many so far, the launch ranks of the current world
  // (index = rank), and the groups of the worlds before (never destroyed:
  // a Gloo thread may still wait in them for a lost peer until its timeout).
  int generation = 0;
  std::vector<int> members;
  int launch_world = 0;  // the launch's world size: launch ranks are below it
  std::vector<compat::ProcessGroupPtr> retired;
  // The heartbeat (DistOptions::on_rank_loss kContinue): a thread that adds
  // 1 to "evenstep/alive/<launch rank>" through a store connection of its
  // own, until StopHeartbeat.
  std::thread heartbeat;
  // A listening socket that never accepts, at "evenstep/alive_at/<launch
  // rank>": a connection to it is refused once this process is gone, so a
  // killed rank is known lost at once (a frozen one still accepts).
  int liveness_fd = -1;
  // The heartbeat thread's finding: another rank set "evenstep/regroup/
  // <generation + 1>/begun" (RegroupBegun).
  std::atomic<int> watched_generation{0};
  std::atomic<bool> regroup_begun{false};
  // ... and that a replacement asked to join ("evenstep/join/requests"
  // counted past joins_seen, the count the last admission read).
  std::atomic<int64_t> joins_seen{0};
  std::atomic<bool> join_pending{false};
  std::vector<std::unique_ptr<Subgroup>> retired_subgroups;  // Retire's
  absl::Mutex beat_mu;
  bool stop_beating ABSL_GUARDED_BY(beat_mu) = false;
  void StopHeartbeat();
  // The heartbeat thread's loop: a beat into `key` every `period`, a look
  // for the next regroup's "begun" and for join requests every 200 ms,
  // until StopHeartbeat.
  void Beat(compat::StorePtr beat_store, std::string key, absl::Duration period);
  // NextPrefix's counts per family, and Claim's owners.
  std::map<std::string, int> prefixes ABSL_GUARDED_BY(mu);
  std::set<std::string> claimed ABSL_GUARDED_BY(mu);
  // The first collective that timed out or lost a peer: c10d cannot cancel
  // it, so a later collective on these groups would queue behind it or pair
  // with the wrong operation. Every later one fails at once with it.
  absl::Mutex mu;
  absl::Status broken ABSL_GUARDED_BY(mu);
};

namespace internal {

// A stage every rank passes before any goes on, agreed through the store
// (dist_agree.cc): its keys under `prefix` ("rdzv/" for start-up,
// "agree/<n>/" for DistContext::Agree).
struct Stage {
  std::string prefix;
  std::string stopped;  // "rank R: <stopped> stopped on every rank because one failed: ..."
  std::string waited;   // "rank R: <waited> at HOST:PORT timed out after ..."
};
// DistContext::Create's stages (the rendezvous, the Gloo address chosen).
const Stage& StartUpStage();
// This rank failed `stage`: its message published for the other ranks (the
// first failure's stays); a rank 0 that hosts the store keeps it up until
// every rank has read it (at most 10 s). Returns `status`.
absl::Status PublishFailure(c10d::Store& store, const LaunchEnv& env, const Stage& stage,
                            absl::Status status);
// Waits up to `timeout` for every rank to pass `stage`'s step `step`
// (`passed` says what that means, for the timeout's message), or for a
// rank's failure (FailedPrecondition quoting it).
absl::Status AwaitStage(c10d::Store& store, const LaunchEnv& env, absl::Duration timeout,
                        const Stage& stage, const std::string& step, const std::string& passed);
// Whether the data group is NCCL (DistOptions::backend, CUDA present),
// with this rank's CUDA device selected when it is; FailedPrecondition for
// nccl asked of a libtorch without it.
absl::StatusOr<bool> PrepareNccl(const DistOptions& options, const LaunchEnv& env);
// A store connection of the caller's own (a TCPStore client serves one
// thread at a time) to the job's store, in this launch's namespace
// (`launch_prefix`), its operations bounded by `timeout`. Unavailable naming
// `what` when it cannot be made.
absl::StatusOr<compat::StorePtr> OwnStoreConnection(const LaunchEnv& env,
                                                    absl::Duration rendezvous_timeout,
                                                    const std::string& launch_prefix,
                                                    absl::Duration timeout,
                                                    const std::string& what);

// The keys of regroup `generation` ("evenstep/regroup/<generation>/<what>":
// begun, in/<launch rank>, view, gloo, nccl) and of each rank's heartbeat
// ("evenstep/alive/<launch rank>") and liveness socket
// ("evenstep/alive_at/<launch rank>"), in one place (dist_regroup.cc).
inline std::string RegroupKey(int generation, absl::string_view what) {
  return absl::StrCat("evenstep/regroup/", generation, "/", what);
}
// The keys of joining replacements ("evenstep/join/<what>": requests,
// want/<launch rank>, admitted/<launch rank>; dist_regroup.cc).
inline std::string JoinKey(absl::string_view what) { return absl::StrCat("evenstep/join/", what); }
inline std::string AliveKey(int launch_rank) {
  return absl::StrCat("evenstep/alive/", launch_rank);
}
inline std::string AliveAtKey(int launch_rank) {
  return absl::StrCat("evenstep/alive_at/", launch_rank);
}

// A store operation of `what` that threw: the message, naming rank 0 as the
// store's host where it is.
std::string StoreLost(const LaunchEnv& env, const std::string& what, const std::exception& e);

inline std::vector<uint8_t> Bytes(absl::string_view s) {
  return std::vector<uint8_t>(s.begin(), s.end());
}
inline std::string Text(const std::vector<uint8_t>& v) { return std::string(v.begin(), v.end()); }

inline std::string HostName() {
  char host[256] = {};
  gethostname(host, sizeof(host) - 1);
  return host;
}

inline std::string DescribeTensor(const at::Tensor& t) {
  return absl::StrCat(c10::toString(t.scalar_type()), "[", t.numel(), "]");
}

// c10d's collectives work on dense, contiguous buffers only.
inline absl::Status RequireContiguous(const at::Tensor& t, int rank, const std::string& what) {
  if (t.is_contiguous()) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("rank ", rank, ": ", what, " needs a contiguous tensor"));
}

}  // namespace internal
}  // namespace evenstep

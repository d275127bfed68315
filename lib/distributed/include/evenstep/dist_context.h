// The distributed context: who this process is (rank, world size, local rank)
// and the c10d store and process groups it talks through. Created once per
// process from the launcher's environment (see launch_env.h); every other
// evenstep component takes a DistContext&.
//
//   absl::StatusOr<std::unique_ptr<evenstep::DistContext>> ctx =
//       evenstep::DistContextFromFlags();
//   if (!ctx.ok()) { std::cerr << ctx.status() << "\n"; return 1; }
//   at::Tensor t = at::ones({4});
//   absl::Status s = (*ctx)->AllReduce(t);   // t == world_size everywhere
//
// Failures come back as absl::Status naming this rank, the operation and, when
// peers never arrived, which ranks are missing (found through per-rank arrival
// counters in the store). Rendezvous problems (rank >= world size, ranks that
// disagree on the world size, two processes with one rank, an unreachable
// master, missing ranks) fail within the rendezvous timeout, never hang.
//
// Thread-safety: the collective methods may be called from one thread at a
// time (c10d's ordering rule: every rank issues the same collectives in the
// same order). Accessors are thread-safe.
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "evenstep/launch_env.h"

namespace at {
class Tensor;
}
namespace c10d {
class Store;
class ProcessGroup;
class Work;
}  // namespace c10d

namespace evenstep {

class CommitStore;

enum class CommBackend { kAuto, kGloo, kNccl };

struct DistOptions {
  // kAuto: NCCL for the data group when this libtorch has it and CUDA is
  // available, Gloo otherwise. The control group is always Gloo on CPU.
  CommBackend backend = CommBackend::kAuto;
  // Longest a collective may take before it fails with DeadlineExceeded.
  absl::Duration collective_timeout = absl::Minutes(10);
  // Longest the rendezvous (store connect + all ranks joining) may take.
  absl::Duration rendezvous_timeout = absl::Minutes(5);
  // kContinue: every rank beats a heartbeat in the store, so that Regroup
  // can tell a lost rank from a slow one. kStop: a lost rank ends the job.
  enum class OnRankLoss { kStop, kContinue } on_rank_loss = OnRankLoss::kStop;
  // With kContinue: a rank whose heartbeat has not moved for this long is
  // lost (it beats five times as often).
  absl::Duration lost_after = absl::Seconds(10);
  // This process replaces a lost rank of a running job (its launch rank is
  // the lost one's): Create does not rendezvous with the launch's ranks but
  // asks the running ones to admit it, and returns once they did, at their
  // next step boundary (Admit), with this process a member of their new
  // world. Needs kContinue. Also set by EVENSTEP_JOIN=1 in the environment
  // (evenstep-run --respawn sets it).
  bool join = false;
};

// Who is left after a regroup (DistContext::Regroup).
struct Regrouped {
  int generation = 0;          // 1 for the first regroup of a context
  std::vector<int> survivors;  // their ranks before it, ascending: new rank = index
  std::vector<int> lost;       // the ranks before it that are gone
  // Admit's: the new ranks of the processes that joined (after the
  // survivors, whose ranks stay theirs).
  std::vector<int> joined;
  // "rank(s) 1, 3 lost; 2 survivors, regroup 1", for messages.
  std::string Describe() const;
};

enum class ReduceOp { kSum, kProduct, kMin, kMax };

class DistContext;

// Which ranks share a node (DistContext::Nodes).
struct NodeLayout {
  // Per rank: its node's name (the host name; "node<i>" when one host holds
  // several nodes, e.g. evenstep-run --nodes) and its node's index (nodes
  // numbered in the order of their first rank).
  std::vector<std::string> names;
  std::vector<int> node_of;
  // Per node: its ranks, ascending.
  std::vector<std::vector<int>> ranks;
  int nodes() const { return static_cast<int>(ranks.size()); }
  // `rank`'s place among its node's ranks (0 for the node's first).
  int place_of(int rank) const;
  // Every node holds the same number of ranks.
  bool even() const;
  // "node-0: 2 ranks (0,1); node-1: 2 ranks (2,3)".
  std::string Describe() const;
};

// A process group of some of the job's ranks (Gloo, CPU tensors): for
// measurements over node-local, cross-node or pairs of ranks; or of every
// rank with the data backend (DistContext::NewDataGroup), for a gradient
// sync of its own.
class Subgroup {
 public:
  ~Subgroup();
  Subgroup(const Subgroup&) = delete;
  Subgroup& operator=(const Subgroup&) = delete;
  const std::string& name() const { return name_; }
  // This rank's index in the group, and the group's size.
  int rank() const { return index_; }
  int size() const { return static_cast<int>(ranks_.size()); }
  const std::vector<int>& ranks() const { return ranks_; }
  // Sum over the group, up to the context's collective timeout; a failure
  // names this rank, the group and its ranks.
  absl::Status AllReduce(at::Tensor& tensor);
  absl::Status Barrier();
  // The c10d group itself, for layers that launch their own work on it
  // (hierarchical gradient sync); valid while this Subgroup lives.
  c10d::ProcessGroup& process_group();

 private:
  friend class DistContext;
  struct Impl;
  Subgroup(std::string name, std::vector<int> ranks, int index, int global_rank,
           absl::Duration timeout, std::unique_ptr<Impl> impl);
  template <typename Launch>
  absl::Status Run(const std::string& what, Launch&& launch);
  std::string name_;
  std::vector<int> ranks_;
  int index_ = 0;
  int global_rank_ = 0;
  absl::Duration timeout_;
  std::unique_ptr<Impl> impl_;
};

class DistContext {
 public:
  // Rendezvous with the environment of this process (DetectLaunchEnv()).
  static absl::StatusOr<std::unique_ptr<DistContext>> Create(const DistOptions& options);
  // From the --evenstep_* flags: DistContextFromFlags() (evenstep/flags.h).
  // Rendezvous with an explicit environment (tests, embedding launchers).
  static absl::StatusOr<std::unique_ptr<DistContext>> Create(const LaunchEnv& env,
                                                             const DistOptions& options);
  ~DistContext();
  DistContext(const DistContext&) = delete;
  DistContext& operator=(const DistContext&) = delete;

  int rank() const { return env_.rank; }
  int world_size() const { return env_.world_size; }
  int local_rank() const { return env_.local_rank; }
  int local_world_size() const { return env_.local_world_size; }
  const LaunchEnv& env() const { return env_; }
  const DistOptions& options() const { return options_; }
  // "gloo" or "nccl": the backend of data_group().
  std::string backend_name() const;

  // The store every rank shares (keys are namespaced by the caller).
  c10d::Store& store();
  // A CommitStore for background I/O threads over its own connection to the
  // job's store (keys under "evenstep/io/<n>/", n counting the stores made
  // on this context), so I/O never interleaves with the training thread's
  // store traffic and two writers' keys never meet. Collective in order:
  // every rank makes its stores in the same order.
  absl::StatusOr<std::unique_ptr<CommitStore>> NewCommitStore();
  // Gloo over CPU tensors; for small control messages (fingerprints, cost fits).
  c10d::ProcessGroup& control_group();
  // The group for gradients and other bulk data: NCCL for CUDA tensors when
  // selected, otherwise the same Gloo group as control_group().
  c10d::ProcessGroup& data_group();

  // Blocking collectives with diagnosis. The group is chosen by the tensor's
  // device (CUDA -> data group, CPU -> control group).
  absl::Status AllReduce(at::Tensor& tensor, ReduceOp op = ReduceOp::kSum);
  // `out` is resized to world_size() tensors shaped like `in`.
  absl::Status AllGather(const at::Tensor& in, std::vector<at::Tensor>* out);
  absl::Status Broadcast(at::Tensor& tensor, int root);
  absl::Status Barrier();
  // Every rank's outcome of a stage it runs alone (its files, its options),
  // agreed through the store before the ranks go on to a collective that a
  // failed rank would never join: OK on every rank when all succeeded, else
  // on every rank at once (not after a collective's timeout)
  // FailedPrecondition "rank R: <what> stopped on every rank because one
  // failed: <the first failure's message>". Every rank calls it, in the
  // same order; up to the collective timeout for the slowest rank.
  absl::Status Agree(const std::string& what, const absl::Status& mine);

  // A group of `ranks` (distinct, each < world_size; this rank among them),
  // created by exactly those ranks with the same `name` and `ranks`; a name
  // is used once per job. InvalidArgument for bad ranks.
  absl::StatusOr<std::unique_ptr<Subgroup>> NewSubgroup(const std::string& name,
                                                        std::vector<int> ranks);
  // After a collective failed because a peer is gone (needs
  // DistOptions::on_rank_loss = kContinue and a store that outlives the
  // lost rank: the launcher's agent store, or rank 0's while rank 0 lives).
  // Every rank still running calls it. They check in through the store;
  // a rank that has neither checked in nor beaten its heartbeat for
  // `lost_after` is lost. The first rank to see every rank checked in or
  // lost writes the view, and every survivor goes on with it: rank() is its
  // place among the survivors, world_size() their number, and the control
  // and data groups are new ones among them. Subgroups, data groups and
  // commit stores made before are of the old world: make them again.
  // FailedPrecondition on a rank left out of the view (it checked in after
  // the view was written: it was frozen longer than `lost_after`).
  // Collective over the survivors; not thread-safe with any other call.
  absl::StatusOr<Regrouped> Regroup();
  // The rank this process had when the context was created (its identity
  // across regroups).
  int launch_rank() const { return launch_rank_; }
  // True once another rank began the next regroup (kContinue only; seen by
  // the heartbeat thread within 200 ms). Waits for collectives ask it, so a
  // rank blocked on a live peer that stopped waiting stops too. Thread-safe.
  bool RegroupBegun() const;
  // A replacement process (DistOptions::join) asked to be admitted: a hint
  // from the heartbeat thread (kContinue only), which ranks may see at
  // different times; BalancedStep agrees on it in its exchange, and every
  // rank then calls Admit at the same step boundary. Thread-safe.
  bool JoinPending() const;
  // Admits the replacements that asked to join (and are still alive): a new
  // world of this world's ranks (their ranks unchanged) followed by the
  // joiners, with new control and data groups, the same way Regroup makes
  // them. Regrouped::joined names the joiners' ranks (empty when every one
  // was gone by then). Collective over this world, at the same point on
  // every rank; the joiners' Create returns from the same admission. A
  // replacement whose launch rank is still a member is refused (told so).
  absl::StatusOr<Regrouped> Admit();
  // True when this process joined a running job (DistOptions::join).
  bool joined() const { return joined_; }
  // Keeps `group` (of the world before a regroup) until this context goes:
  // destroying it now would wait for a collective a lost peer never joins.
  void Retire(std::unique_ptr<Subgroup> group);

  // "<family>/<n>/": a key prefix of its own for the n-th family of
  // objects (subgroups made together, say) that every rank of this context
  // makes in the same order. Counted per context and world (a regroup or an
  // admission starts the counts again, in keys of the new world), so two
  // contexts in one process (ranks as threads), and a process that joined,
  // hand out the same prefixes in the same order.
  std::string NextPrefix(const std::string& family);
  // Marks this context as carrying one `owner` kind (a Session, say); false
  // when one already does. Release(owner) ends the claim.
  bool Claim(const std::string& owner);
  void Release(const std::string& owner);

  // A group of every rank with data_group()'s backend (NCCL or Gloo), on
  // connections of its own: for a second gradient sync (GradSync::Attach
  // refuses a group that another GradSync already synchronises over, since
  // c10d would pair one's buckets with the other's). Collective: every rank
  // calls it, in the same order as its other NewDataGroup calls. The first
  // call also makes a small Gloo group where every synchronisation over any
  // of these data groups (and data_group()) first checks that every rank
  // begins the same step's (grad_sync.h's SetStep; design.md).
  absl::StatusOr<std::unique_ptr<Subgroup>> NewDataGroup();

  // Which ranks share a node: every rank's host name, with the launcher's
  // node index when it gives one (torchrun's GROUP_RANK, Slurm's
  // SLURM_NODEID), so ranks on one host split into several nodes count as
  // such. Exchanged once through the control group (collective on the first
  // call: every rank makes it at the same point), then kept.
  absl::StatusOr<NodeLayout> Nodes();

  // For lower layers that launch their own c10d work: records that this rank
  // arrived at operation `what` (call before launching it), so a failure can be
  // diagnosed. Returns the operation's sequence number.
  int64_t MarkArrival();
  // Waits for `work` up to the collective timeout. On failure, returns a
  // status naming this rank, `what`, the elapsed time and the ranks that never
  // arrived at operation `seq`.
  absl::Status Wait(c10d::Work& work, int64_t seq, const std::string& what);
  // The failure status for operation `seq` (from MarkArrival) that failed
  // with `error` after `elapsed`: names this rank and the ranks that never
  // arrived at it (through the store), DeadlineExceeded past the timeout.
  // A DeadlineExceeded or Unavailable failure leaves the groups unusable
  // (c10d cannot cancel the operation): every later AllReduce, AllGather,
  // Broadcast, Barrier and Wait fails at once with it instead of blocking.
  absl::Status Diagnose(int64_t seq, const std::string& what, absl::Duration elapsed,
                        const std::string& error);

 private:
  struct Groups;
  DistContext(LaunchEnv env, DistOptions options);
  absl::Status Connect();
  absl::Status Rendezvous();
  absl::Status CreateGroups();
  // The Gloo transport device into gloo_device_ and why into gloo_why_:
  // GLOO_SOCKET_IFNAME, loopback, or the address that reaches MASTER_ADDR
  // (internal::ChooseGlooAddress; after Rendezvous, which gathered where the
  // ranks on other hosts reach MASTER_ADDR).
  absl::Status ChooseGlooDevice();
  // The address MASTER_ADDR resolves to on this host, or "" when it is
  // loopback here (or unresolved).
  std::string MasterSeenHere() const;
  // In a job across hosts, before Gloo connects: every rank connects to a
  // listener on every other rank's Gloo address (bounded by the collective
  // timeout) and every rank stops with the same error naming the pairs that
  // failed, why, and the interfaces of the host to fix.
  absl::Status CheckGlooReachable();
  std::string gloo_device_;          // ChooseGlooDevice()'s choice, for the subgroups too
  std::string gloo_why_;             // ... and why, in messages
  std::optional<NodeLayout> nodes_;  // Nodes(), once exchanged
  template <typename Launch>
  absl::Status Run(const std::string& what, Launch&& launch);
  // OK, or the failure that made the groups unusable, for `what`.
  absl::Status Broken(const std::string& what);

  // The survivors' view `view` (launch ranks) of regroup `generation`:
  // env_ renumbered, new groups among them (dist_regroup.cc).
  absl::Status AdoptView(int generation, const std::vector<int>& view,
                         const std::vector<std::string>& hosts);
  // `key` in this world's keys: unchanged before any regroup, under
  // "evenstep/g<generation>/" after one (a name used again after a regroup
  // must not meet the old world's keys).
  std::string Scoped(const std::string& key) const;
  // What a wait asks to end early: RegroupBegun under kContinue, else
  // nothing (a blocking wait).
  std::function<bool()> Abandon() const;
  // The heartbeat thread (DistOptions::on_rank_loss kContinue).
  absl::Status StartHeartbeat();
  // Create's path for a replacement (DistOptions::join): asks to be
  // admitted and adopts the admitting world (dist_regroup.cc).
  absl::Status Join();

  LaunchEnv env_;  // renumbered by Regroup
  const int launch_rank_;
  const DistOptions options_;
  std::unique_ptr<Groups> groups_;
  int64_t op_seq_ = 0;
  int data_groups_ = 0;  // NewDataGroup's in this world, for their names
  bool joined_ = false;  // DistOptions::join: this process joined a running job
};

// Bus bandwidth in GB/s of an all-reduce of `bytes` over a group of `n`
// ranks (nccl-tests: algbw x 2(n-1)/n), timed around `reduce` (which
// all-reduces the float tensor it is given): the fastest of `iters` after a
// warm-up (one slow iteration is noise, not a slow link). Collective as
// `reduce` is.
absl::StatusOr<double> MeasureBusBandwidth(int n, size_t bytes, int iters,
                                           const std::function<absl::Status(at::Tensor&)>& reduce);

}  // namespace evenstep

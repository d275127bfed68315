// GradSync: bucketed gradient all-reduce launched from gradient-accumulator
// hooks; see grad_sync.h for the contract.
//
// One synchronisation issues, on every rank and in this order:
//   1. the buffer broadcast (a snapshot of rank 0's buffers), at its start;
//   2. the dense buckets, in index order, each once all its gradients are
//      ready (from a hook while backward runs, or at the end);
//   3. one sparse all_reduce per sparse parameter, in parameter order;
//   4. the control all_reduce (failure flags per rank, each rank's
//      synchronisation number in its own slot, then a used count per
//      parameter), unless it rides in the last bucket's tail (built-in hooks);
//   5. once, after the first successful one: the broadcast of rank 0's ready
//      order, from which every rank rebuilds the same buckets.
// A rank that fails locally still issues all of them (zeros and its failure
// flag), so every rank learns of the failure in the same synchronisation.
//
// Pairing. c10d pairs collectives by their order on a group, so a bucket can
// only be reduced with a bucket of another synchronisation when a rank issued
// another sequence of collectives on the group. Two guards: a group carries
// one GradSync (internal::ClaimGroupForSync at Attach), and every rank's
// synchronisation number rides in the control values, checked by every rank
// before anything is written back: ranks at different synchronisations end
// it with the same FailedPrecondition naming each rank's number, their
// gradients reset, and the group marked broken (internal::MarkGroupBroken)
// so no later collective of any component pairs with a late peer. Every
// payload's size and layout is fixed by the agreed bucket layout, and
// sparse gradients are brought to one layout (sparse_dim 1) before their
// all_reduce, so no rank hands Gloo a message its peer does not expect.
#include "evenstep/grad_sync.h"

#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/embedding.h>
#include <xxhash.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <map>
#include <mutex>
#include <set>
#include <stdexcept>
#include <unordered_map>
#include <unordered_set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "evenstep/internal/collective.h"
#include "evenstep/internal/error_text.h"
#include "evenstep/internal/group_registry.h"
#include "evenstep/status_macros.h"

namespace evenstep {
namespace internal {

struct ParamSlot {
  std::string name;
  at::Tensor param;
  bool sparse = false;
  // Dense: where its gradient lives in which bucket, and how it is viewed.
  int bucket = -1;
  int64_t offset = 0;
  std::vector<int64_t> sizes, strides;  // the parameter's own when dense, else contiguous
  bool alias = true;                    // bucket dtype == parameter dtype: grad shares storage
  // Per synchronisation.
  bool ready = false;
  bool used = false;  // its accumulator ran since the last synchronisation
  // The gradient the last synchronisation wrote (which tensor, at which
  // version): still that, unchanged, when the next one begins to accumulate
  // means it was kept (no zero_grad), and this rank contributes only what
  // was added on top of it.
  const c10::TensorImpl* written_impl = nullptr;
  int64_t written_version = -1;
  bool touched = false;  // the kept-gradient check ran since the last write
  at::Tensor base;       // the kept reduced gradient, when it was kept
  // The gradient as this rank's last accumulation (or the last write) left
  // it: a gradient found otherwise was zeroed, set to none, replaced or
  // changed in place by the program since, and what was recorded about it
  // (its use, its kept copy) no longer holds (Revalidate).
  const c10::TensorImpl* seen_impl = nullptr;
  int64_t seen_version = -1;
  // std::shared_ptr<Node> in libtorch 1.13 to 2.11, c10::intrusive_ptr<Node> by 2.15.
  decltype(torch::autograd::impl::grad_accumulator(std::declval<const at::Tensor&>())) accumulator;
  uintptr_t hook_key = 0;
  const torch::autograd::FunctionPreHook* pre_hook = nullptr;
};

struct Bucket {
  std::vector<int> params;
  std::vector<BucketParam> info;
  at::Tensor buffer;       // gradients, then (last bucket) the control tail
  int64_t grad_numel = 0;  // elements that are gradients
  int pending = 0;
  bool ready = false;
  bool launched = false;
  BucketFuture result;
};

struct GradSyncState : std::enable_shared_from_this<GradSyncState> {
  c10d::ProcessGroup* group = nullptr;
  SyncOrder order;  // with other GradSyncs' data groups (group_registry.h)
  int rank = 0;
  int world = 1;
  at::Device device = at::kCPU;
  GradSyncOptions options;
  std::vector<ParamSlot> params;
  std::vector<NamedTensor> frozen, buffers;
  std::vector<Bucket> buckets;
  std::vector<int> sparse;  // indices into params, in order

  mutable std::mutex mu;
  bool sync_enabled = true;
  bool step_open = false;
  bool prepared = false;        // PrepareForBackward ran for the coming backward
  std::vector<char> reachable;  // from PrepareForBackward
  // The last synchronisation failed inside a backward (its own exception,
  // or a failure mark from a peer) and no synchronisation began since: an
  // AbandonStep now refers to it and starts nothing.
  bool failed_in_backward = false;
  int next_launch = 0;
  int params_ready = 0;
  int64_t collectives = 0;
  int64_t seq = 0;          // synchronisations begun
  int64_t next_step = -1;   // SetStep's number for the coming synchronisation(s)
  bool step_set = false;    // SetStep was called since the last synchronisation began
  int64_t step = -1;        // ... and the one this synchronisation carries
  int64_t completed = 0;    // synchronisations completed
  int64_t arrival_seq = 0;  // SyncDiagnosis's number for this one
  int rebuild_attempts = 0;
  bool rebuilt = false;
  std::vector<int> ready_order;  // hooks' order in this synchronisation
  absl::Status local_failure;    // this rank's, carried as its failure flag
  absl::Status fatal;
  absl::Status last;
  SyncStats stats;
  // In flight during one synchronisation.
  std::vector<std::pair<std::vector<int>, at::Tensor>> buffer_flat;  // (buffer indices, flat)
  std::vector<c10::intrusive_ptr<c10d::Work>> buffer_work;
  std::vector<std::pair<at::Tensor, c10::intrusive_ptr<c10d::Work>>> sparse_work;
  at::Tensor control;
  c10::intrusive_ptr<c10d::Work> control_work;

  // Failure flags, synchronisation numbers, caller's step numbers (one slot
  // per rank each), then a used flag per parameter.
  int64_t control_numel() const { return 3 * world + static_cast<int64_t>(params.size()); }
  bool control_in_bucket() const {
    return !buckets.empty() && IsZeroPreservingHook(options.comm_hook);
  }

  void Layout(const std::vector<int>& order);
  void BeginStep(int first);
  // A synchronisation about to begin without SetStep since the last one.
  absl::Status NoStepError() const;
  absl::Status CheckOrder();
  void OnGradReady(int index);
  void OnGradAccumulating(int index);
  void CheckKept(ParamSlot& p);
  void Revalidate(ParamSlot& p);
  void Seen(ParamSlot& p);
  absl::Status CheckPairing(const double* agreed) const;
  void OnBackwardEnded(int64_t sync, bool completed);
  void CopyIn(ParamSlot& p);
  void LaunchReady();
  void Fail(absl::Status why);
  absl::Status AbandonStale();
  std::vector<int32_t> ControlValues() const;
  absl::Status Finish();
  // Finish's parts: the sparse gradients' all-reduces (3), the control
  // bitmap's when it did not ride in the last bucket (4), every wait, and
  // the agreement's verdict with the write-back.
  void LaunchSparse();
  void LaunchControl();
  void WaitForAll();
  absl::Status Conclude();
  void ResetGradients();
  void WriteBack(const std::vector<char>& used_anywhere);
  void MaybeRebuild();
  std::string DescribeBucket(int b) const;
  // Start or wait for a collective: false when it failed, the error then
  // in `fatal` (the sync cannot go on).
  bool Collective(const std::string& what, const std::function<void()>& fn);
  bool WaitFor(c10d::Work* work, const std::string& what, absl::Time since);
  void WaitFailed(const std::string& what, const CollectiveWait& outcome);
};

namespace {

class ReadyHook : public torch::autograd::FunctionPostHook {
 public:
  ReadyHook(std::weak_ptr<GradSyncState> state, int index)
      : state_(std::move(state)), index_(index) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list&) override {
    if (auto state = state_.lock()) state->OnGradReady(index_);
    return outputs;
  }

 private:
  std::weak_ptr<GradSyncState> state_;
  int index_;
};

// Runs before the accumulator adds a new gradient into param.grad().
class AccumulatingHook : public torch::autograd::FunctionPreHook {
 public:
  AccumulatingHook(std::weak_ptr<GradSyncState> state, int index)
      : state_(std::move(state)), index_(index) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& grads) override {
    if (auto state = state_.lock()) state->OnGradAccumulating(index_);
    return grads;
  }

 private:
  std::weak_ptr<GradSyncState> state_;
  int index_;
};

// Held by the end-of-backward callback of a synchronised backward. The
// autograd engine runs that callback only when backward completes; when a
// node throws, the engine drops its graph task, callbacks unrun, and this
// guard's destructor completes the synchronisation with a failure mark.
class BackwardGuard {
 public:
  BackwardGuard(std::weak_ptr<GradSyncState> state, int64_t sync)
      : state_(std::move(state)), sync_(sync) {}
  ~BackwardGuard() {
    if (ran_) return;
    try {
      if (auto state = state_.lock()) state->OnBackwardEnded(sync_, /*completed=*/false);
    } catch (...) {  // a destructor must not throw; the failure is kept in the state
    }
  }
  BackwardGuard(const BackwardGuard&) = delete;
  BackwardGuard& operator=(const BackwardGuard&) = delete;
  void Ran() { ran_ = true; }

 private:
  std::weak_ptr<GradSyncState> state_;
  int64_t sync_;
  bool ran_ = false;
};

at::ScalarType ReduceType(at::ScalarType t, c10d::ProcessGroup& group) {
  const bool low = t == at::kBFloat16 || t == at::kHalf;
  return low && group.getBackendName() != "nccl" ? at::kFloat : t;
}

// Gloo moves no bf16 (nor int16): broadcasts carry its bit patterns as fp16,
// which a broadcast copies without arithmetic.
at::Tensor Wire(const at::Tensor& flat) {
  return flat.scalar_type() == at::kBFloat16 ? flat.view(at::kHalf) : flat;
}

std::vector<int64_t> ContiguousStrides(at::IntArrayRef sizes) {
  std::vector<int64_t> strides(sizes.size(), 1);
  for (int i = static_cast<int>(sizes.size()) - 2; i >= 0; --i) {
    strides[i] = strides[i + 1] * std::max<int64_t>(sizes[i + 1], 1);
  }
  return strides;
}

}  // namespace

bool GradSyncState::Collective(const std::string& what, const std::function<void()>& fn) {
  try {
    fn();
  } catch (const std::exception& e) {
    fatal = absl::UnavailableError(
        absl::StrCat("rank ", rank, ": starting ", what, " failed: ", ErrorText(e)));
    return false;
  }
  return true;
}

void GradSyncState::WaitFailed(const std::string& what, const CollectiveWait& outcome) {
  fatal = options.diagnosis.diagnose
              ? options.diagnosis.diagnose(arrival_seq, what, outcome.elapsed, outcome.error)
              : CollectiveFailed(rank, what, outcome, options.timeout);
}

bool GradSyncState::WaitFor(c10d::Work* work, const std::string& what, absl::Time since) {
  const CollectiveWait outcome =
      WaitCollective(work, options.timeout, since, options.diagnosis.abandon);
  if (outcome.failed) WaitFailed(what, outcome);
  return !outcome.failed;
}

// Buckets over the dense parameters in `order` (launch order), one open
// bucket per reduce dtype and device; the last bucket gets the control tail.
void GradSyncState::Layout(const std::vector<int>& order) {
  buckets.clear();
  std::map<std::pair<int, std::string>, int> open;
  std::vector<int64_t> numel;
  for (int i : order) {
    ParamSlot& p = params[i];
    const at::ScalarType type = ReduceType(p.param.scalar_type(), *group);
    const auto key = std::make_pair(static_cast<int>(type), p.param.device().str());
    const int64_t bytes = p.param.numel() * c10::elementSize(type);
    auto it = open.find(key);
    if (it != open.end()) {
      const int64_t cap =
          it->second == 0 ? options.first_bucket_cap_bytes : options.bucket_cap_bytes;
      if ((numel[it->second] * c10::elementSize(type)) + bytes > cap) open.erase(it);
    }
    it = open.find(key);
    if (it == open.end()) {
      buckets.emplace_back();
      numel.push_back(0);
      it = open.emplace(key, static_cast<int>(buckets.size()) - 1).first;
    }
    Bucket& b = buckets[it->second];
    p.bucket = it->second;
    p.offset = numel[it->second];
    p.alias = type == p.param.scalar_type();
    numel[it->second] += p.param.numel();
    b.params.push_back(i);
    b.info.push_back({p.name, p.offset, p.param.numel(), p.param.sizes().vec()});
  }
  for (size_t b = 0; b < buckets.size(); ++b) {
    const ParamSlot& first = params[buckets[b].params[0]];
    const int64_t tail = b + 1 == buckets.size() ? control_numel() : 0;
    buckets[b].grad_numel = numel[b];
    buckets[b].buffer =
        at::zeros({numel[b] + tail}, first.param.options()
                                         .dtype(ReduceType(first.param.scalar_type(), *group))
                                         .requires_grad(false));
  }
}

void GradSyncState::BeginStep(int first) {
  step_open = true;
  failed_in_backward = false;
  ++seq;
  step = next_step;
  step_set = false;
  next_launch = 0;
  params_ready = 0;
  ready_order.clear();
  for (ParamSlot& p : params) p.ready = false;
  for (Bucket& b : buckets) {
    b.pending = static_cast<int>(b.params.size());
    b.ready = false;
    b.launched = false;
    b.result = BucketFuture();
  }
  stats = SyncStats();
  stats.seq = seq;
  stats.buckets = static_cast<int>(buckets.size());
  stats.sparse = static_cast<int>(sparse.size());
  arrival_seq = options.diagnosis.arrive ? options.diagnosis.arrive() : 0;
  buffer_flat.clear();
  buffer_work.clear();
  sparse_work.clear();
  control = at::Tensor();
  control_work.reset();

  // What this rank can check before any collective; a failure rides along.
  for (const ParamSlot& p : params) {
    if (!p.param.requires_grad()) {
      Fail(absl::FailedPreconditionError(
          absl::StrCat("parameter '", p.name,
                       "' no longer requires grad (changed after GradSync::Attach): "
                       "attach again after changing requires_grad")));
      break;
    }
  }
  for (const NamedTensor& f : frozen) {
    if (f.second.requires_grad()) {
      Fail(absl::FailedPreconditionError(
          absl::StrCat("parameter '", f.first,
                       "' was frozen at GradSync::Attach and requires grad now: "
                       "attach again after changing requires_grad")));
      break;
    }
  }
  // 0. With other GradSyncs on the context: every rank at this one.
  if (absl::Status out_of_order = CheckOrder(); !out_of_order.ok()) {
    fatal = out_of_order;
    return;
  }
  // 1. The buffers, as they are now (after this step's forward), from root.
  if (options.buffers_from_root_every_step && world > 1 && !buffers.empty()) {
    std::map<std::pair<int, std::string>, std::vector<int>> groups;
    for (size_t i = 0; i < buffers.size(); ++i) {
      const at::Tensor& t = buffers[i].second;
      groups[{static_cast<int>(t.scalar_type()), t.device().str()}].push_back(static_cast<int>(i));
    }
    at::NoGradGuard no_grad;
    for (auto& [key, members] : groups) {
      std::vector<at::Tensor> parts;
      for (int i : members) parts.push_back(buffers[i].second.detach().reshape({-1}));
      at::Tensor flat = at::cat(parts);
      buffer_flat.emplace_back(members, flat);
      std::vector<at::Tensor> v{Wire(flat)};
      c10d::BroadcastOptions o;
      o.rootRank = options.broadcast_root;
      if (!Collective("the buffer broadcast",
                      [&] { buffer_work.push_back(group->broadcast(v, o)); })) {
        return;
      }
      ++collectives;
    }
  }
  // Parameters the loss's graph cannot reach are ready now.
  if (prepared) {
    for (size_t i = 0; i < params.size(); ++i) {
      if (!reachable[i] && static_cast<int>(i) != first) CopyIn(params[i]);
    }
  }
}

// Where a DistContext has several data groups (a GradSync per model or
// part), every rank first says which data group, step (SetStep) and
// synchronisation it begins (group_registry.h's sync order): a rank that
// left a step between two models' backward passes without AbandonStep
// begins the next step's first one while its peers begin this step's
// second. Then every rank ends this synchronisation with the same error
// before any gradient is exchanged, and the order group is marked broken
// so that every later synchronisation of any of them fails at once (the
// ranks' sequences cannot be trusted to pair any more).
absl::Status GradSyncState::CheckOrder() {
  // One GradSync over the context's data groups (a single BalancedStep):
  // nothing to be out of order with, no exchange.
  if (order.group == nullptr || world == 1 || internal::SyncsSharingOrder(order.group) < 2) {
    return absl::OkStatus();
  }
  if (absl::Status broken = GroupBroken(order.group); !broken.ok()) {
    return absl::FailedPreconditionError(
        absl::StrCat("rank ", rank, ": gradient synchronisation #", seq,
                     " not started: an earlier one left the ranks' gradient syncs out of "
                     "order (",
                     broken.message(), ")"));
  }
  // Slots: data group number, step number (+1; 0 for none) and
  // synchronisation number of each rank.
  at::Tensor mine = at::zeros({3 * world}, at::kLong);
  auto* m = mine.data_ptr<int64_t>();
  m[rank] = order.id;
  m[world + rank] = step + 1;
  m[2 * world + rank] = seq;
  std::vector<at::Tensor> v{mine};
  c10::intrusive_ptr<c10d::Work> work;
  const absl::Time start = absl::Now();
  try {
    work = order.group->allreduce(v);
  } catch (const std::exception& e) {
    return absl::UnavailableError(absl::StrCat(
        "rank ", rank, ": starting the gradient sync's order exchange failed: ", ErrorText(e)));
  }
  ++collectives;
  const CollectiveWait outcome =
      WaitCollective(work.get(), options.timeout, start, options.diagnosis.abandon);
  if (outcome.failed) {
    WaitFailed("the gradient sync's order exchange", outcome);  // names who never arrived
    absl::Status why = fatal;
    MarkGroupBroken(order.group, why);
    return why;
  }
  const int64_t* a = mine.data_ptr<int64_t>();
  bool one_group = true, steps_given = true, same_step = true, same_seq = true;
  for (int r = 0; r < world; ++r) {
    one_group &= a[r] == order.id;
    steps_given &= a[world + r] > 0;
    same_step &= a[world + r] == step + 1;
    same_seq &= a[2 * world + r] == seq;
  }
  // One backward may drive several GradSyncs, each beginning at its first
  // gradient, in an order that differs per rank: exchanges of different
  // groups then pair legitimately, and only the caller's step numbers
  // (GradSync::SetStep) can tell such a pairing from a skipped step.
  const bool in_order =
      one_group ? same_seq && (!steps_given || same_step) : !steps_given || same_step;
  if (in_order) return absl::OkStatus();
  auto at = [&](int r) {
    return absl::StrCat("rank ", r, r == rank ? " (here)" : "", " at data group ", a[r],
                        a[world + r] > 0 ? absl::StrCat(" step ", a[world + r] - 1) : "",
                        " synchronisation #", a[2 * world + r]);
  };
  std::vector<std::string> where;
  for (int r = 0; r < world; ++r) where.push_back(at(r));
  absl::Status why = absl::FailedPreconditionError(absl::StrCat(
      "rank ", rank, ": the ranks' gradient syncs are out of order (", absl::StrJoin(where, ", "),
      "): a rank left a step between two models' synchronised backward passes (an exception "
      "caught without GradSync::AbandonStep on every GradSync of the step) or ran them in "
      "another order; nothing of this synchronisation was exchanged or applied, and every "
      "GradSync of this DistContext stops here"));
  MarkGroupBroken(order.group, why);
  return why;
}

// A synchronised backward that never reached its end (it threw): complete
// its synchronisation with a failure mark, so every rank learns.
absl::Status GradSyncState::AbandonStale() {
  Fail(absl::FailedPreconditionError(absl::StrCat(
      "synchronisation #", seq,
      " never completed on this rank (an exception inside a synchronised backward without "
      "GradSync::AbandonStep)")));
  return Finish();
}

// A synchronisation number as it rides in the control values: small enough
// that a bf16 bucket holds it exactly (every slot holds one rank's value and
// zeros elsewhere, so the sum, and an averaging hook's uniform scaling, keep
// equal numbers equal).
constexpr int kSeqModulus = 251;
int32_t SeqSlotValue(int64_t seq) { return static_cast<int32_t>(seq % kSeqModulus) + 1; }

// This rank's control vector: its failure flag, its synchronisation number
// and its caller's step number (0: none given; each in this rank's slot),
// then a used flag per parameter.
std::vector<int32_t> GradSyncState::ControlValues() const {
  std::vector<int32_t> values(control_numel(), 0);
  if (!local_failure.ok()) values[rank] = 1;
  values[world + rank] = SeqSlotValue(seq);
  values[2 * world + rank] = step >= 0 ? SeqSlotValue(step) : 0;
  for (size_t i = 0; i < params.size(); ++i) values[3 * world + i] = params[i].used ? 1 : 0;
  return values;
}

// Every rank reduced the same synchronisation of the same step: the number
// slots all hold one value, and so do the step slots (a rank at another
// issued its buckets with this one's, so the sums mix two steps' gradients
// and must not be written back).
absl::Status GradSyncState::CheckPairing(const double* agreed) const {
  auto same = [&](int slots, double mine) {
    bool all = true;
    for (int r = 0; r < world; ++r) all &= agreed[slots + r] == mine;
    return all;
  };
  // Undo a uniform scaling (an averaging hook) by this rank's own number.
  const double scale = agreed[world + rank] / SeqSlotValue(seq);
  const bool steps_agree = same(2 * world, agreed[2 * world + rank]);
  if (same(world, agreed[world + rank]) && steps_agree) return absl::OkStatus();
  const bool by_step = !steps_agree && step >= 0;
  const int slots = by_step ? 2 * world : world;
  const int64_t here = by_step ? step : seq;
  std::vector<std::string> where;
  for (int r = 0; r < world; ++r) {
    const double v = scale > 0 ? agreed[slots + r] / scale : 0;
    where.push_back(r == rank ? absl::StrCat("rank ", r, " (here) at #", here)
                    : v < 0.5
                        ? absl::StrCat("rank ", r, " at none")
                        : absl::StrFormat("rank %d at another (#%d modulo %d)", r,
                                          static_cast<int64_t>(std::lround(v)) - 1, kSeqModulus));
  }
  return absl::FailedPreconditionError(absl::StrCat(
      "rank ", rank, ": gradient synchronisation #", seq,
      by_step ? absl::StrCat(" of step ", step, " (GradSync::SetStep)") : std::string(),
      " was reduced together with another ", by_step ? "step's" : "synchronisation",
      " on some rank (", by_step ? "steps: " : "", absl::StrJoin(where, ", "),
      "): a rank skipped a synchronisation (a step it left after an exception before its "
      "synchronised backward, without GradSync::AbandonStep) or ran one more; nothing of it was "
      "applied, the step's gradients were reset, and this GradSync stops here (its process "
      "group cannot be trusted to pair any more)"));
}

void GradSyncState::Fail(absl::Status why) {
  if (local_failure.ok()) {
    local_failure = Annotate(std::move(why), absl::StrCat("rank ", rank));
  }
}

void GradSyncState::Seen(ParamSlot& p) {
  const at::Tensor& grad = p.param.grad();
  p.seen_impl = grad.defined() ? grad.unsafeGetTensorImpl() : nullptr;
  p.seen_version = grad.defined() ? grad._version() : -1;
}

namespace {
bool AllZero(const at::Tensor& grad) {
  at::NoGradGuard no_grad;
  if (grad.is_sparse()) return grad._nnz() == 0 || !grad._values().ne(0).any().item<bool>();
  return !grad.ne(0).any().item<bool>();
}
}  // namespace

// What a backward recorded about `p` since the last synchronisation (its
// use; its kept copy, when it found the gradient as the last one wrote it)
// holds only while the gradient is as that backward left it. Set to none or
// zeroed since (zero_grad after an input-gradient probe, a GAN loop that
// clears D's gradients after G's backward through D): forgotten, as one
// process forgets them. Replaced by another tensor: the kept copy no longer
// applies, the new value is this rank's own. Changed in place while a kept
// copy is recorded (scaled, clipped): refused by name, since no rank can
// tell its own part of the result from the kept one. Checks values (a pass
// over the gradient) only where a backward without a synchronisation was
// followed by a change of its gradient, never on a plain training step.
void GradSyncState::Revalidate(ParamSlot& p) {
  if (!p.used && !p.base.defined()) return;
  const at::Tensor& grad = p.param.grad();
  if (grad.defined() && grad.unsafeGetTensorImpl() == p.seen_impl &&
      grad._version() == p.seen_version) {
    return;
  }
  const bool replaced = grad.defined() && grad.unsafeGetTensorImpl() != p.seen_impl;
  if (!grad.defined() || (!replaced && AllZero(grad))) {
    p.used = false;
    p.base = at::Tensor();
  } else if (replaced) {
    p.base = at::Tensor();
  } else if (p.base.defined()) {
    Fail(absl::FailedPreconditionError(absl::StrCat(
        "the gradient of '", p.name, "' was kept from synchronisation #", seq,
        " (no zero_grad), then a backward added to it and the program changed it in place (",
        "scaled or clipped) before the next synchronisation: no rank can tell its own part "
        "from the kept one. Zero it or set it to none between synchronisations, or change it "
        "only after the synchronisation it belongs to")));
    p.base = at::Tensor();
  }
  Seen(p);
}

// Before the first accumulation into `p` since the last synchronisation wrote
// its gradient (or at this synchronisation, when nothing accumulated): a
// gradient still exactly as written was kept (no zero_grad). It is the same
// on every rank, so each contributes what it added on top, and the kept
// value is added back once after the reduction: the sum a single process
// accumulates, as DDP's mean gives it.
//
// One the program changed in place since (scaled, clipped) but did not zero
// cannot be told apart: counting it as the rank's own would add it once
// per rank. Refused by name on every rank instead.
void GradSyncState::CheckKept(ParamSlot& p) {
  if (p.touched) return;
  p.touched = true;
  const at::Tensor& grad = p.param.grad();
  if (!grad.defined() || grad.unsafeGetTensorImpl() != p.written_impl) return;
  if (grad._version() == p.written_version) {
    at::NoGradGuard no_grad;
    p.base = grad.detach().clone();
  } else if (!AllZero(grad)) {
    Fail(absl::FailedPreconditionError(absl::StrCat(
        "the gradient of '", p.name,
        "' was kept from the last synchronisation (no zero_grad) and changed in place (scaled "
        "or clipped) before this backward added to it: every rank holds it, so counting it as "
        "this rank's own would add it once per rank. Zero it or set it to none before the next "
        "backward, or change it only after the synchronisation that completes it")));
  }
}

void GradSyncState::OnGradAccumulating(int index) {
  std::lock_guard<std::mutex> lock(mu);
  Revalidate(params[index]);
  CheckKept(params[index]);
}

void GradSyncState::CopyIn(ParamSlot& p) {
  if (p.ready) return;
  p.ready = true;
  ++params_ready;
  Revalidate(p);
  CheckKept(p);
  if (p.sparse) return;  // reduced after the buckets
  at::NoGradGuard no_grad;
  Bucket& b = buckets[p.bucket];
  at::Tensor view = b.buffer.as_strided(p.sizes, p.strides, p.offset);
  const at::Tensor& grad = p.param.grad();
  if (!grad.defined() || !local_failure.ok()) {
    view.zero_();
  } else if (grad.is_sparse()) {
    Fail(absl::InvalidArgumentError(absl::StrCat(
        "parameter '", p.name,
        "' received a sparse gradient but is synchronised densely: name it "
        "in GradSyncOptions::sparse_parameters (Embedding/EmbeddingBag with sparse(true) are "
        "found by Attach(module))")));
    view.zero_();
  } else {
    if (!(p.alias && grad.data_ptr() == view.data_ptr() && grad.strides() == view.strides())) {
      view.copy_(grad);
    }
    if (p.base.defined()) view.sub_(p.base);
  }
  if (--b.pending == 0) b.ready = true;
}

void GradSyncState::LaunchReady() {
  while (next_launch < static_cast<int>(buckets.size()) && buckets[next_launch].ready) {
    Bucket& b = buckets[next_launch];
    const bool last = next_launch + 1 == static_cast<int>(buckets.size());
    if (last && control_in_bucket()) {
      // The bitmap it carries is final only once every parameter is ready:
      // every dense one is by now, a sparse one (reduced after the buckets)
      // may still be in backward.
      if (params_ready < static_cast<int>(params.size())) return;
      at::Tensor tail = b.buffer.narrow(0, b.grad_numel, control_numel());
      tail.copy_(at::tensor(ControlValues(), at::kInt));  // cast to the bucket's dtype
    }
    CommHookContext ctx{group, rank,    world, next_launch, static_cast<int>(buckets.size()),
                        last,  &b.info, seq};
    if (fatal.ok()) {
      try {
        if (control_in_bucket()) {
          b.result = options.comm_hook(ctx, b.buffer);
        } else {
          at::Tensor grads = b.buffer.narrow(0, 0, b.grad_numel);
          b.result = options.comm_hook(ctx, grads);
        }
      } catch (const std::exception& e) {
        fatal = absl::InternalError(absl::StrCat("rank ", rank, ": comm hook failed on ",
                                                 DescribeBucket(next_launch), ": ", ErrorText(e)));
      }
    }
    b.launched = true;
    ++collectives;
    stats.bytes += b.buffer.numel() * b.buffer.element_size();
    if (params_ready < static_cast<int>(params.size())) ++stats.buckets_launched_during_backward;
    ++next_launch;
  }
}

void GradSyncState::OnGradReady(int index) {
  std::unique_lock<std::mutex> lock(mu);
  ParamSlot& p = params[index];
  p.used = true;
  Seen(p);
  if (!sync_enabled) return;
  // Never a silently unsynchronised gradient after a failed collective.
  if (!fatal.ok()) throw std::runtime_error(fatal.ToString());
  if (!step_open && !step_set) throw std::runtime_error(NoStepError().ToString());
  if (!step_open) {
    BeginStep(index);
    std::weak_ptr<GradSyncState> weak = weak_from_this();
    auto guard = std::make_shared<BackwardGuard>(weak, seq);
    torch::autograd::Engine::get_default_engine().queue_callback([weak, guard, sync = seq] {
      guard->Ran();
      if (auto state = weak.lock()) state->OnBackwardEnded(sync, /*completed=*/true);
    });
  } else if (p.ready) {
    // A second gradient in one synchronisation (or one PrepareForBackward
    // called unreachable): complete it with a failure mark, so every rank
    // learns, and stop this backward.
    Fail(absl::FailedPreconditionError(absl::StrCat(
        "the gradient of '", p.name, "' became ready twice in synchronisation #", seq,
        prepared && !reachable[index] ? " (PrepareForBackward was given another loss)" : "",
        ": reentrant activation checkpointing, or a backward() after one that threw without "
        "GradSync::AbandonStep")));
    absl::Status s = Finish();
    failed_in_backward = true;
    throw std::runtime_error(s.ToString());
  }
  ready_order.push_back(index);
  CopyIn(p);
  if (p.sparse || buckets[p.bucket].ready) LaunchReady();
}

// The end of synchronised backward `sync`: `completed` from the engine's
// end-of-backward callback, else from the guard of a backward that threw
// (this rank's exception: join with a failure mark, so no rank finishes
// with a gradient that lacks this rank's part and no later backward of
// this rank lands in this synchronisation).
void GradSyncState::OnBackwardEnded(int64_t sync, bool completed) {
  absl::Status s;
  {
    std::lock_guard<std::mutex> lock(mu);
    if (!step_open || sync != seq) return;
    if (!completed) {
      Fail(absl::AbortedError(
          absl::StrCat("an exception inside the synchronised backward of synchronisation #", sync,
                       " (GradSync joined it with a failure mark)")));
    }
    s = Finish();
    // Also when the sync succeeded (the exception came after every gradient
    // was in it): AbandonStep must not start another.
    failed_in_backward = !completed || !s.ok();
  }
  if (completed && !s.ok()) throw std::runtime_error(s.ToString());
}

std::string GradSyncState::DescribeBucket(int b) const {
  const Bucket& bucket = buckets[b];
  std::vector<std::string> names;
  for (size_t i = 0; i < bucket.params.size() && i < 3; ++i) {
    names.push_back(params[bucket.params[i]].name);
  }
  if (bucket.params.size() > 3) names.push_back("...");
  return absl::StrFormat("gradient bucket %d of %d (%d params: %s; %.2f MiB)", b, buckets.size(),
                         bucket.params.size(), absl::StrJoin(names, ", "),
                         bucket.buffer.numel() * bucket.buffer.element_size() / 1048576.0);
}

void GradSyncState::ResetGradients() {
  for (ParamSlot& p : params) {
    if (p.param.grad().defined()) p.param.mutable_grad() = at::Tensor();
    p.used = false;
    p.touched = false;
    p.base = at::Tensor();
    p.written_impl = nullptr;
  }
  // A parameter frozen at Attach that requires grad now got a local one.
  for (NamedTensor& f : frozen) {
    if (f.second.grad().defined()) f.second.mutable_grad() = at::Tensor();
  }
}

absl::Status GradSyncState::Finish() {
  step_open = false;
  prepared = false;
  stats.arrived = absl::Now();
  if (options.on_arrival) options.on_arrival();
  for (ParamSlot& p : params) CopyIn(p);
  LaunchReady();
  LaunchSparse();
  LaunchControl();
  WaitForAll();
  ++completed;
  if (!fatal.ok()) {
    ResetGradients();
    local_failure = absl::OkStatus();
    last = fatal;
  } else {
    last = Conclude();
  }
  // A failed, timed-out or mispaired collective leaves the group unusable
  // for every component (DistContext's collectives check it too).
  if (!fatal.ok()) MarkGroupBroken(group, fatal);
  return last;
}

namespace {

// No rows: what a rank without a gradient contributes.
at::Tensor EmptyRows(const at::Tensor& param) {
  std::vector<int64_t> values_shape = param.sizes().vec();
  values_shape[0] = 0;
  return at::sparse_coo_tensor(at::zeros({1, 0}, param.options().dtype(at::kLong)),
                               at::zeros(values_shape, param.options()), param.sizes())
      .coalesce();
}

// The one layout every rank's sparse payload has: COO over the first
// dimension (sparse_dim 1, rows of dense values), coalesced, in the
// parameter's dtype. A gradient in another layout (libtorch 1.13's
// zero_grad() leaves a sparse gradient with every dimension sparse and no
// rows; a dense gradient set by the program) is converted, so the ranks'
// all_reduce never disagrees on the shape of what it exchanges.
at::Tensor RowSparse(const at::Tensor& grad, const at::Tensor& param) {
  at::NoGradGuard no_grad;
  at::Tensor g = grad.scalar_type() == param.scalar_type() ? grad : grad.to(param.scalar_type());
  if (!g.is_sparse()) return g.to_sparse(1).coalesce();
  if (g._nnz() == 0) return EmptyRows(param);
  if (g.sparse_dim() != 1) return g.coalesce().to_dense().to_sparse(1).coalesce();
  return g.coalesce();
}

}  // namespace

void GradSyncState::LaunchSparse() {
  // 3. Sparse gradients, in one layout; an empty one where this rank has none.
  for (int i : sparse) {
    ParamSlot& p = params[i];
    at::Tensor grad = p.param.grad();
    at::Tensor mine;
    if (grad.defined() && local_failure.ok()) {
      at::NoGradGuard no_grad;
      at::Tensor added = RowSparse(grad, p.param);
      if (p.base.defined()) added = added - RowSparse(p.base, p.param);
      mine = added.coalesce().clone();
    } else {
      mine = EmptyRows(p.param);
    }
    if (fatal.ok() && world > 1) {
      std::vector<at::Tensor> v{mine};
      Collective(absl::StrCat("the sparse all_reduce of '", p.name, "'"),
                 [&] { sparse_work.emplace_back(mine, group->allreduce(v)); });
      ++collectives;
    } else {
      sparse_work.emplace_back(mine, c10::intrusive_ptr<c10d::Work>());
    }
  }
}

void GradSyncState::LaunchControl() {
  // 4. The control bitmap on its own, unless it rode in the last bucket.
  if (control_in_bucket()) return;
  control = at::tensor(ControlValues(), at::kInt).to(device);
  if (fatal.ok() && world > 1) {
    std::vector<at::Tensor> v{control};
    Collective("the gradient sync's control all_reduce",
               [&] { control_work = group->allreduce(v); });
    ++collectives;
  }
}

void GradSyncState::WaitForAll() {
  const absl::Time wait_start = absl::Now();
  for (int b = 0; b < static_cast<int>(buckets.size()) && fatal.ok(); ++b) {
    Bucket& bucket = buckets[b];
    try {
      at::Tensor reduced =
          bucket.result.valid()
              ? bucket.result.Wait(ToChronoMillis(options.timeout), options.diagnosis.abandon)
              : bucket.buffer;
      at::Tensor target =
          control_in_bucket() ? bucket.buffer : bucket.buffer.narrow(0, 0, bucket.grad_numel);
      if (!reduced.is_same(target)) target.copy_(reduced);
    } catch (const std::exception& e) {
      WaitFailed(absl::StrCat("all_reduce of ", DescribeBucket(b)),
                 {true, ErrorText(e), absl::Now() - wait_start});
    }
    bucket.result = BucketFuture();
  }
  for (auto& [tensor, work] : sparse_work) {
    if (fatal.ok()) WaitFor(work.get(), "a sparse gradient all_reduce", wait_start);
  }
  if (fatal.ok()) WaitFor(control_work.get(), "the control all_reduce", wait_start);
  for (auto& work : buffer_work) {
    if (fatal.ok()) WaitFor(work.get(), "the buffer broadcast", wait_start);
  }
  stats.wait = absl::Now() - wait_start;
}

absl::Status GradSyncState::Conclude() {
  // The agreement: who failed, which parameters were used anywhere.
  at::Tensor agreed = control_in_bucket() ? buckets.back().buffer.narrow(
                                                0, buckets.back().grad_numel, control_numel())
                                          : control;
  agreed = agreed.to(at::kCPU, at::kDouble);
  const double* a = agreed.data_ptr<double>();
  std::vector<int> failed;
  for (int r = 0; r < world; ++r) {
    if (a[r] != 0) failed.push_back(r);
  }
  std::vector<char> used_anywhere(params.size());
  for (size_t i = 0; i < params.size(); ++i) used_anywhere[i] = a[3 * world + i] != 0;
  if (absl::Status pairing = CheckPairing(a); !pairing.ok()) {
    fatal = pairing;
    ResetGradients();
    local_failure = absl::OkStatus();
    last = fatal;
    return fatal;
  }

  if (!failed.empty()) {
    ResetGradients();
    last = absl::AbortedError(
        absl::StrCat("rank ", rank, ": gradient synchronisation #", seq,
                     " abandoned on every rank: rank(s) ", absl::StrJoin(failed, ","), " failed",
                     local_failure.ok() ? std::string(" (see their output)")
                                        : absl::StrCat(" (here: ", local_failure.message(), ")"),
                     "; the step's gradients were reset"));
    local_failure = absl::OkStatus();
    return last;
  }
  // A failure of this rank that came after every gradient was in the
  // reduction (an exception late in backward) could not ride along: the sum
  // is complete, and it must not mark the next synchronisation.
  local_failure = absl::OkStatus();
  // Buffers from root.
  if (rank != options.broadcast_root) {
    at::NoGradGuard no_grad;
    for (auto& [members, flat] : buffer_flat) {
      int64_t offset = 0;
      for (int i : members) {
        at::Tensor t = buffers[i].second.detach();
        t.copy_(flat.narrow(0, offset, t.numel()).view(t.sizes()));
        offset += t.numel();
      }
    }
  }
  MaybeRebuild();
  if (!fatal.ok()) {
    last = fatal;
    return fatal;
  }
  WriteBack(used_anywhere);
  stats.done = absl::Now();
  last = absl::OkStatus();
  return last;
}

void GradSyncState::WriteBack(const std::vector<char>& used_anywhere) {
  at::NoGradGuard no_grad;
  std::vector<char> written(params.size(), 0);
  for (size_t i = 0; i < params.size(); ++i) {
    ParamSlot& p = params[i];
    if (!p.used) ++stats.unused_here;
    p.used = false;
    at::Tensor view =
        p.sparse ? at::Tensor() : buckets[p.bucket].buffer.as_strided(p.sizes, p.strides, p.offset);
    // A kept gradient: every rank contributed its increment; add the kept
    // value back once (into the storage a kept gradient may share, too).
    if (view.defined() && p.base.defined()) view.add_(p.base);
    if (!used_anywhere[i]) {
      ++stats.unused_everywhere;  // untouched, as a single process would leave it
      continue;
    }
    written[i] = 1;
    if (p.sparse) continue;
    const at::Tensor& buffer = buckets[p.bucket].buffer;
    const at::Tensor& grad = p.param.grad();
    if (!p.alias) {
      p.param.mutable_grad() = view.to(p.param.scalar_type());
    } else if (!(grad.defined() && grad.data_ptr() == view.data_ptr() &&
                 grad.strides() == view.strides())) {
      // A tensor that shares the bucket's storage without being an autograd
      // view: optimizers' zero_grad() calls detach_(), which views refuse.
      at::Tensor alias = at::empty({0}, buffer.options());
      alias.set_(buffer.storage(), buffer.storage_offset() + p.offset, p.sizes, p.strides);
      p.param.mutable_grad() = alias;
    }
  }
  size_t s = 0;
  for (auto& [tensor, work] : sparse_work) {
    ParamSlot& p = params[sparse[s++]];
    if (!written[&p - params.data()]) continue;
    p.param.mutable_grad() =
        p.base.defined() ? (tensor + RowSparse(p.base, p.param)).coalesce() : tensor.coalesce();
  }
  for (size_t i = 0; i < params.size(); ++i) {
    ParamSlot& p = params[i];
    p.touched = false;
    p.base = at::Tensor();
    if (!written[i]) continue;  // untouched: what it held before, as it was
    p.written_impl = p.param.grad().unsafeGetTensorImpl();
    p.written_version = p.param.grad()._version();
  }
}

// Once: the buckets follow the order rank 0's gradients became ready.
void GradSyncState::MaybeRebuild() {
  if (!options.rebuild_buckets || rebuilt || world == 1 || rebuild_attempts >= 3) return;
  ++rebuild_attempts;
  std::vector<int64_t> mine(params.size() + 1, -1);
  std::vector<int> dense_order;
  for (int i : ready_order) {
    if (!params[i].sparse) dense_order.push_back(i);
  }
  mine[0] = static_cast<int64_t>(dense_order.size());
  for (size_t k = 0; k < dense_order.size(); ++k) mine[k + 1] = dense_order[k];
  at::Tensor order = at::tensor(mine, at::kLong).to(device);
  std::vector<at::Tensor> v{order};
  c10d::BroadcastOptions o;
  o.rootRank = 0;
  c10::intrusive_ptr<c10d::Work> work;
  if (!Collective("the bucket order broadcast", [&] { work = group->broadcast(v, o); })) return;
  ++collectives;
  if (!WaitFor(work.get(), "the bucket order broadcast", absl::Now())) return;
  order = order.cpu();
  const int64_t* ord = order.data_ptr<int64_t>();
  if (ord[0] <= 0) return;  // rank 0 saw no gradient: try again next time
  rebuilt = true;
  std::vector<int> new_order;
  std::vector<char> seen(params.size(), 0);
  for (int64_t k = 0; k < ord[0]; ++k) {
    const int64_t i = ord[k + 1];
    if (i >= 0 && i < static_cast<int64_t>(params.size()) && !seen[i] && !params[i].sparse) {
      new_order.push_back(static_cast<int>(i));
      seen[i] = 1;
    }
  }
  for (int i = static_cast<int>(params.size()) - 1; i >= 0; --i) {
    if (!seen[i] && !params[i].sparse) new_order.push_back(i);
  }
  std::vector<int> current;
  for (const Bucket& b : buckets) current.insert(current.end(), b.params.begin(), b.params.end());
  if (new_order == current) return;
  // Move the reduced gradients into the new layout before writing them back.
  std::vector<at::Tensor> reduced;
  for (const ParamSlot& p : params) {
    reduced.push_back(p.sparse ? at::Tensor()
                               : buckets[p.bucket].buffer.as_strided(p.sizes, p.strides, p.offset));
  }
  std::vector<Bucket> old = std::move(buckets);
  Layout(new_order);
  for (size_t i = 0; i < params.size(); ++i) {
    const ParamSlot& p = params[i];
    if (!p.sparse)
      buckets[p.bucket].buffer.as_strided(p.sizes, p.strides, p.offset).copy_(reduced[i]);
  }
}

}  // namespace internal

namespace {

using internal::GradSyncState;

// All-gathers `values` (same length on every rank) as int64: result[r][i].
absl::StatusOr<std::vector<std::vector<int64_t>>> AllGatherInts(c10d::ProcessGroup& group,
                                                                const std::vector<int64_t>& values,
                                                                const at::Device& device,
                                                                absl::Duration timeout,
                                                                absl::string_view what) {
  const int world = group.getSize();
  at::Tensor in = at::tensor(values, at::kLong).to(device);
  std::vector<std::vector<at::Tensor>> out(1);
  for (int r = 0; r < world; ++r) out[0].push_back(at::empty_like(in));
  std::vector<at::Tensor> inputs{in};
  const internal::CollectiveWait outcome =
      internal::RunCollective([&] { return group.allgather(out, inputs); }, timeout);
  if (outcome.failed) return internal::CollectiveFailed(group.getRank(), what, outcome, timeout);
  std::vector<std::vector<int64_t>> result;
  for (const at::Tensor& t : out[0]) {
    at::Tensor cpu = t.cpu();
    result.emplace_back(cpu.data_ptr<int64_t>(), cpu.data_ptr<int64_t>() + cpu.numel());
  }
  return result;
}

std::string DescribeParam(const NamedTensor& p) {
  return absl::StrCat("'", p.first, "' ", c10::toString(p.second.scalar_type()), "[",
                      absl::StrJoin(p.second.sizes(), ", "), "] ",
                      c10::DeviceTypeName(p.second.device().type(), /*lower_case=*/true),
                      p.second.requires_grad() ? "" : " frozen");
}

int64_t Hash(const std::string& s) { return static_cast<int64_t>(XXH64(s.data(), s.size(), 0)); }

// Checks that every rank holds the same tensors; on mismatch, names the
// first differing one and which ranks hold which variant.
absl::Status CheckReplicasMatch(c10d::ProcessGroup& group, const std::vector<NamedTensor>& params,
                                const at::Device& device, absl::Duration timeout) {
  const int world = group.getSize();
  if (world == 1) return absl::OkStatus();
  std::vector<int64_t> hashes;
  int64_t combined = 0;
  for (const NamedTensor& p : params) {
    hashes.push_back(Hash(DescribeParam(p)));
    combined = Hash(absl::StrCat(combined, ":", hashes.back()));
  }
  EVENSTEP_ASSIGN_OR_RETURN(const std::vector<std::vector<int64_t>> summary,
                            AllGatherInts(group, {static_cast<int64_t>(params.size()), combined},
                                          device, timeout, "parameter fingerprint all_gather"),
                            "GradSync::Attach: checking that every rank holds the same parameters");
  bool same = true;
  int64_t max_count = 0;
  for (const auto& s : summary) {
    same &= s == summary[0];
    max_count = std::max(max_count, s[0]);
  }
  if (same) return absl::OkStatus();

  // Slow path, all ranks take it: find the first index that differs.
  std::vector<int64_t> padded(max_count, 0);
  std::copy(hashes.begin(), hashes.end(), padded.begin());
  EVENSTEP_ASSIGN_OR_RETURN(
      const std::vector<std::vector<int64_t>> all,
      AllGatherInts(group, padded, device, timeout, "parameter list all_gather"),
      "GradSync::Attach: finding the first parameter that differs between ranks");
  int64_t first = 0;
  for (; first < max_count; ++first) {
    bool differs = false;
    for (int r = 1; r < world; ++r) differs |= all[r][first] != all[0][first];
    for (int r = 0; r < world; ++r) differs |= first >= summary[r][0];
    if (differs) break;
  }
  // Gather the description of that tensor from every rank (fixed width).
  constexpr int kWidth = 160;
  std::string mine = first < static_cast<int64_t>(params.size())
                         ? DescribeParam(params[first])
                         : absl::StrCat("no parameter #", first, " (", params.size(), " in all)");
  std::vector<int64_t> chars(kWidth, 0);
  for (int i = 0; i < kWidth && i < static_cast<int>(mine.size()); ++i) chars[i] = mine[i];
  EVENSTEP_ASSIGN_OR_RETURN(
      const std::vector<std::vector<int64_t>> descs,
      AllGatherInts(group, chars, device, timeout, "parameter description all_gather"),
      "GradSync::Attach: describing parameter #", first, " on every rank");
  std::map<std::string, std::vector<int>> variants;
  for (int r = 0; r < world; ++r) {
    std::string d;
    for (int64_t c : descs[r]) {
      if (c == 0) break;
      d.push_back(static_cast<char>(c));
    }
    variants[d].push_back(r);
  }
  std::vector<std::string> parts;
  for (const auto& [d, ranks] : variants) {
    parts.push_back(absl::StrCat("rank(s) ", absl::StrJoin(ranks, ","), " have ", d));
  }
  return absl::FailedPreconditionError(absl::StrCat("rank ", group.getRank(),
                                                    ": model replicas differ at parameter #", first,
                                                    ": ", absl::StrJoin(parts, "; ")));
}

// Broadcasts `tensors` from `root`, one flat collective per dtype/device.
absl::Status BroadcastTensors(c10d::ProcessGroup& group, const std::vector<NamedTensor>& tensors,
                              int root, absl::Duration timeout,
                              const char* what = "initial parameter broadcast") {
  if (group.getSize() == 1) return absl::OkStatus();
  std::map<std::pair<int, std::string>, std::vector<at::Tensor>> groups;
  for (const NamedTensor& t : tensors) {
    groups[{static_cast<int>(t.second.scalar_type()), t.second.device().str()}].push_back(t.second);
  }
  at::NoGradGuard no_grad;
  for (auto& [key, members] : groups) {
    std::vector<at::Tensor> flat_parts;
    for (const at::Tensor& t : members) flat_parts.push_back(t.detach().reshape({-1}));
    at::Tensor flat = at::cat(flat_parts);
    std::vector<at::Tensor> v{internal::Wire(flat)};
    c10d::BroadcastOptions options;
    options.rootRank = root;
    const internal::CollectiveWait outcome =
        internal::RunCollective([&] { return group.broadcast(v, options); }, timeout);
    if (outcome.failed) {
      return internal::CollectiveFailed(group.getRank(), what, outcome, timeout);
    }
    int64_t offset = 0;
    for (at::Tensor& t : members) {
      t.detach().copy_(flat.narrow(0, offset, t.numel()).view(t.sizes()));
      offset += t.numel();
    }
  }
  return absl::OkStatus();
}

// Before anything is exchanged on `group`: it is usable, and no other
// GradSync synchronises over it (every rank claims it, or fails, the same
// way: Attach is collective).
absl::Status ClaimGroup(c10d::ProcessGroup& group, const std::vector<NamedTensor>& trainable) {
  const int rank = group.getRank();
  if (absl::Status broken = internal::GroupBroken(&group); !broken.ok()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "rank ", rank, ": GradSync::Attach: this process group cannot be used any more (",
        broken.message(), ")"));
  }
  EVENSTEP_RETURN_IF_ERROR(
      internal::ClaimGroupForSync(
          &group, absl::StrCat("the GradSync of ", trainable.size(), " parameters from '",
                               trainable.front().first, "'")),
      "rank ", rank, ": GradSync::Attach");
  return absl::OkStatus();
}

// Keeps the first name of each tensor registered under several (tied).
std::vector<NamedTensor> Unique(std::vector<NamedTensor> tensors) {
  std::unordered_set<const c10::TensorImpl*> seen;
  std::vector<NamedTensor> out;
  for (NamedTensor& t : tensors) {
    if (t.second.defined() && seen.insert(t.second.unsafeGetTensorImpl()).second) {
      out.push_back(std::move(t));
    }
  }
  return out;
}

}  // namespace

GradSync::GradSync(std::shared_ptr<internal::GradSyncState> state) : state_(std::move(state)) {}

GradSync::~GradSync() {
  internal::ReleaseGroupForSync(state_->group);
  for (internal::ParamSlot& p : state_->params) {
    if (!p.accumulator) continue;
    p.accumulator->del_post_hook(p.hook_key);
    auto& pre = p.accumulator->pre_hooks();  // no del_pre_hook in libtorch
    pre.erase(std::remove_if(pre.begin(), pre.end(),
                             [&](const auto& h) { return h.get() == p.pre_hook; }),
              pre.end());
  }
}

absl::StatusOr<std::unique_ptr<GradSync>> GradSync::Attach(torch::nn::Module& module,
                                                           c10d::ProcessGroup& group,
                                                           GradSyncOptions options) {
  std::vector<NamedTensor> params, buffers;
  for (const auto& item : module.named_parameters(/*recurse=*/true)) {
    params.emplace_back(item.key(), item.value());
  }
  for (const auto& item : module.named_buffers(/*recurse=*/true)) {
    buffers.emplace_back(item.key(), item.value());
  }
  // Embedding layers that produce sparse gradients.
  // Not modules(include_self=true): that needs the module held by a
  // shared_ptr, and a model on the stack is a model too.
  std::unordered_set<const c10::TensorImpl*> sparse;
  auto find_sparse = [&](torch::nn::Module* m) {
    if (auto* e = dynamic_cast<torch::nn::EmbeddingImpl*>(m)) {
      if (e->options.sparse()) sparse.insert(e->weight.unsafeGetTensorImpl());
    } else if (auto* b = dynamic_cast<torch::nn::EmbeddingBagImpl*>(m)) {
      if (b->options.sparse()) sparse.insert(b->weight.unsafeGetTensorImpl());
    }
  };
  find_sparse(&module);
  for (const auto& m : module.modules(/*include_self=*/false)) find_sparse(m.get());
  for (const NamedTensor& p : params) {
    if (p.second.defined() && sparse.count(p.second.unsafeGetTensorImpl())) {
      options.sparse_parameters.push_back(p.first);
    }
  }
  return Attach(std::move(params), std::move(buffers), group, std::move(options));
}

absl::StatusOr<std::unique_ptr<GradSync>> GradSync::Attach(std::vector<NamedTensor> parameters,
                                                           std::vector<NamedTensor> buffers,
                                                           c10d::ProcessGroup& group,
                                                           GradSyncOptions options) {
  const int rank = group.getRank();
  if (options.bucket_cap_bytes <= 0 || options.first_bucket_cap_bytes <= 0) {
    return absl::InvalidArgumentError("GradSync: bucket caps must be positive");
  }
  if (!options.comm_hook) return absl::InvalidArgumentError("GradSync: no comm hook");
  parameters = Unique(std::move(parameters));
  buffers = Unique(std::move(buffers));
  std::vector<NamedTensor> trainable, frozen;
  for (NamedTensor& p : parameters) (p.second.requires_grad() ? trainable : frozen).push_back(p);
  if (trainable.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("rank ", rank, ": GradSync::Attach got no parameters that require grad"));
  }
  const std::set<std::string> sparse_names(options.sparse_parameters.begin(),
                                           options.sparse_parameters.end());
  for (const NamedTensor& p : trainable) {
    if (p.second.is_sparse() || p.second.layout() != at::kStrided) {
      return absl::InvalidArgumentError(absl::StrCat(
          "rank ", rank, ": parameter '", p.first, "' is a ", c10::str(p.second.layout()),
          " tensor: GradSync synchronises strided (dense) parameters, with dense or sparse "
          "gradients"));
    }
    if (sparse_names.count(p.first) && p.second.dim() < 1) {
      return absl::InvalidArgumentError(
          absl::StrCat("rank ", rank, ": parameter '", p.first,
                       "' is a scalar and cannot have a sparse gradient"));
    }
  }
  const at::Device device = trainable.front().second.device();
  EVENSTEP_RETURN_IF_ERROR(ClaimGroup(group, trainable));
  struct Unclaim {
    c10d::ProcessGroup* group;
    ~Unclaim() {
      if (group != nullptr) internal::ReleaseGroupForSync(group);
    }
  } unclaim{&group};
  // Names, dtypes, shapes and devices of everything that is broadcast must
  // match across ranks (trainable first, so their indices are as before).
  std::vector<NamedTensor> to_broadcast = trainable;
  to_broadcast.insert(to_broadcast.end(), frozen.begin(), frozen.end());
  to_broadcast.insert(to_broadcast.end(), buffers.begin(), buffers.end());
  EVENSTEP_RETURN_IF_ERROR(CheckReplicasMatch(group, to_broadcast, device, options.timeout));
  if (options.broadcast_at_attach) {
    EVENSTEP_RETURN_IF_ERROR(
        BroadcastTensors(group, to_broadcast, options.broadcast_root, options.timeout));
  }

  auto state = std::make_shared<GradSyncState>();
  state->group = &group;
  state->order = internal::SyncOrderOf(&group);
  state->rank = rank;
  state->world = group.getSize();
  state->device = device;
  state->options = std::move(options);
  state->frozen = std::move(frozen);
  state->buffers = std::move(buffers);
  for (const NamedTensor& p : trainable) {
    internal::ParamSlot slot;
    slot.name = p.first;
    slot.param = p.second;
    slot.sparse = sparse_names.count(p.first) > 0;
    slot.sizes = p.second.sizes().vec();
    slot.strides = p.second.is_non_overlapping_and_dense()
                       ? p.second.strides().vec()
                       : internal::ContiguousStrides(p.second.sizes());
    if (slot.sparse) state->sparse.push_back(static_cast<int>(state->params.size()));
    state->params.push_back(std::move(slot));
  }
  std::vector<int> order;  // reverse registration order
  for (int i = static_cast<int>(state->params.size()) - 1; i >= 0; --i) {
    if (!state->params[i].sparse) order.push_back(i);
  }
  state->Layout(order);
  state->reachable.assign(state->params.size(), 1);
  std::unique_ptr<GradSync> sync(new GradSync(state));
  unclaim.group = nullptr;  // the GradSync releases it
  for (int i = 0; i < static_cast<int>(state->params.size()); ++i) {
    internal::ParamSlot& p = state->params[i];
    p.accumulator = torch::autograd::impl::grad_accumulator(p.param);
    if (!p.accumulator) {
      return absl::InvalidArgumentError(absl::StrCat("rank ", rank, ": parameter '", p.name,
                                                     "' is not a leaf that requires grad"));
    }
    p.hook_key = p.accumulator->add_post_hook(std::make_unique<internal::ReadyHook>(state, i));
    auto pre_hook = std::make_unique<internal::AccumulatingHook>(state, i);
    p.pre_hook = pre_hook.get();
    p.accumulator->add_pre_hook(std::move(pre_hook));
  }
  return sync;
}

void GradSync::set_sync_enabled(bool enabled) {
  std::lock_guard<std::mutex> lock(state_->mu);
  state_->sync_enabled = enabled;
}

void GradSync::ForgetUse() {
  std::lock_guard<std::mutex> lock(state_->mu);
  if (state_->step_open) return;
  for (internal::ParamSlot& p : state_->params) p.used = false;
}

absl::Status GradSync::BroadcastBuffers() {
  std::lock_guard<std::mutex> lock(state_->mu);
  internal::GradSyncState& s = *state_;
  if (s.step_open) {
    return absl::FailedPreconditionError(absl::StrCat("GradSync::BroadcastBuffers on rank ", s.rank,
                                                      ": synchronisation #", s.seq, " is open"));
  }
  if (!s.fatal.ok()) return s.fatal;
  if (s.world == 1 || s.buffers.empty()) return absl::OkStatus();
  absl::Status outcome = BroadcastTensors(*s.group, s.buffers, s.options.broadcast_root,
                                          s.options.timeout, "the buffer broadcast");
  if (!outcome.ok()) {
    s.fatal = outcome;
    internal::MarkGroupBroken(s.group, outcome);
  }
  return outcome;
}

void GradSync::SetStep(int64_t step) {
  std::lock_guard<std::mutex> lock(state_->mu);
  state_->next_step = step;
  state_->step_set = true;
}

absl::Status GradSyncState::NoStepError() const {
  return absl::FailedPreconditionError(absl::StrCat(
      "GradSync (rank ", rank, "): synchronisation #", seq + 1,
      " began without GradSync::SetStep since the last one; call sync->SetStep(step) before each "
      "step's synchronised backward (or SyncNow), with the step's number, the same on every "
      "rank, so that a rank that left a step early is named instead of its gradients being "
      "summed with another step's. Nothing was synchronised"));
}

void GradSync::ForgetFailure() {
  std::lock_guard<std::mutex> lock(state_->mu);
  state_->failed_in_backward = false;
}

bool GradSync::sync_enabled() const {
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->sync_enabled;
}

absl::Status GradSync::SyncNow() {
  std::lock_guard<std::mutex> lock(state_->mu);
  if (!state_->fatal.ok()) return state_->fatal;
  if (state_->step_open) return state_->AbandonStale();
  if (!state_->step_set) return state_->NoStepError();
  state_->BeginStep(-1);
  return state_->Finish();
}

absl::Status GradSync::PrepareForBackward(const at::Tensor& loss) {
  std::lock_guard<std::mutex> lock(state_->mu);
  if (!state_->fatal.ok()) return state_->fatal;
  if (state_->step_open) return state_->AbandonStale();
  if (!state_->sync_enabled) return absl::OkStatus();
  // DDP's find_unused_parameters: every node the loss's graph reaches.
  std::unordered_set<const torch::autograd::Node*> seen;
  std::vector<torch::autograd::Node*> stack;
  if (loss.defined() && loss.grad_fn()) stack.push_back(loss.grad_fn().get());
  while (!stack.empty()) {
    torch::autograd::Node* node = stack.back();
    stack.pop_back();
    if (!seen.insert(node).second) continue;
    for (const torch::autograd::Edge& e : node->next_edges()) {
      if (e.function && !seen.count(e.function.get())) stack.push_back(e.function.get());
    }
  }
  for (size_t i = 0; i < state_->params.size(); ++i) {
    state_->reachable[i] = seen.count(state_->params[i].accumulator.get()) > 0;
  }
  state_->prepared = true;
  return absl::OkStatus();
}

absl::Status GradSync::AbandonStep(const absl::Status& why) {
  std::lock_guard<std::mutex> lock(state_->mu);
  if (!state_->fatal.ok()) return state_->fatal;
  if (state_->failed_in_backward) {
    // The exception came out of a backward whose synchronisation has already
    // failed on every rank: nothing more to join.
    state_->failed_in_backward = false;
    return state_->last;
  }
  state_->Fail(why.ok() ? absl::AbortedError("abandoned") : why);
  if (!state_->step_open) state_->BeginStep(-1);
  return state_->Finish();
}

int64_t GradSync::syncs_completed() const {
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->completed;
}

void GradSync::set_comm_hook(CommHook hook) {
  std::lock_guard<std::mutex> lock(state_->mu);
  state_->options.comm_hook = std::move(hook);
}

absl::Status GradSync::status() const {
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->fatal.ok() ? state_->last : state_->fatal;
}

absl::Status GradSync::fatal_status() const {
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->fatal;
}

SyncStats GradSync::last_stats() const {
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->stats;
}

int64_t GradSync::collectives_started() const {
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->collectives;
}

int GradSync::num_buckets() const {
  std::lock_guard<std::mutex> lock(state_->mu);
  return static_cast<int>(state_->buckets.size());
}

}  // namespace evenstep

// GradSync: bucketed gradient all-reduce launched from gradient-accumulator
// hooks; see grad_sync.h for the contract.
//
// Per synchronised backward:
//   hook(param i)  -> copy grad into its bucket slice; when the bucket is
//                     complete, launch every ready bucket in index order.
//   first hook     -> queue Finalize on the autograd engine.
//   Finalize       -> treat params without a hook call as zeros, launch the
//                     rest in order, wait for all, write param.grad() as aliases of the bucket
//                     slices.
#include "evenstep/grad_sync.h"

#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/nn/module.h>
#include <xxhash.h>

#include <algorithm>
#include <atomic>
#include <map>
#include <mutex>
#include <stdexcept>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "evenstep/internal/error_text.h"

namespace evenstep {
namespace internal {

struct ParamSlot {
  std::string name;
  at::Tensor param;
  int bucket = 0;
  int64_t offset = 0;
  bool ready = false;
  std::shared_ptr<torch::autograd::Node> accumulator;
  uintptr_t hook_key = 0;
};

struct Bucket {
  std::vector<int> params;
  at::Tensor buffer;
  int pending = 0;
  bool ready = false;
  bool launched = false;
  ReducedBucket result;
};

struct GradSyncState : std::enable_shared_from_this<GradSyncState> {
  c10d::ProcessGroup* group = nullptr;
  int rank = 0;
  int world = 1;
  GradSyncOptions options;
  std::vector<ParamSlot> params;
  std::vector<Bucket> buckets;

  mutable std::mutex mu;
  bool sync_enabled = true;
  bool step_open = false;  // a synchronised step began (hooks fired or SyncNow)
  int next_launch = 0;
  int params_ready = 0;
  int64_t collectives = 0;
  int64_t arrival_seq = 0;  // this synchronisation's number (SyncDiagnosis)
  absl::Status status;
  SyncStats stats;

  void BeginStep();
  void OnGradReady(int index);
  void CopyIn(ParamSlot& p);
  void LaunchReady();
  absl::Status Finish();
  std::string DescribeBucket(int b) const;
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

std::chrono::milliseconds ToMillis(absl::Duration d) {
  return std::chrono::milliseconds(absl::ToInt64Milliseconds(d));
}

}  // namespace

void GradSyncState::BeginStep() {
  step_open = true;
  next_launch = 0;
  params_ready = 0;
  for (ParamSlot& p : params) p.ready = false;
  for (Bucket& b : buckets) {
    b.pending = static_cast<int>(b.params.size());
    b.ready = false;
    b.launched = false;
    b.result = ReducedBucket();
  }
  stats = SyncStats();
  stats.buckets = static_cast<int>(buckets.size());
  arrival_seq = options.diagnosis.arrive ? options.diagnosis.arrive() : 0;
}

void GradSyncState::CopyIn(ParamSlot& p) {
  Bucket& b = buckets[p.bucket];
  at::Tensor slice = b.buffer.narrow(0, p.offset, p.param.numel());
  const at::Tensor& grad = p.param.grad();
  if (!grad.defined()) {
    slice.zero_();
  } else if (grad.data_ptr() != slice.data_ptr()) {
    slice.copy_(grad.reshape({-1}));
  }
  p.ready = true;
  ++params_ready;
  if (--b.pending == 0) b.ready = true;
}

void GradSyncState::LaunchReady() {
  while (next_launch < static_cast<int>(buckets.size()) && buckets[next_launch].ready) {
    Bucket& b = buckets[next_launch];
    CommHookContext ctx{group, rank, world, next_launch};
    if (status.ok()) {
      try {
        b.result = options.comm_hook(ctx, b.buffer);
      } catch (const std::exception& e) {
        status = absl::InternalError(absl::StrCat("rank ", rank, ": comm hook failed on ",
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
  std::lock_guard<std::mutex> lock(mu);
  if (!sync_enabled) return;
  if (!step_open) {
    BeginStep();
    std::weak_ptr<GradSyncState> weak = weak_from_this();
    torch::autograd::Engine::get_default_engine().queue_callback([weak] {
      auto state = weak.lock();
      if (!state) return;
      absl::Status s;
      {
        std::lock_guard<std::mutex> lock(state->mu);
        s = state->Finish();
      }
      if (!s.ok()) throw std::runtime_error(s.ToString());
    });
  }
  ParamSlot& p = params[index];
  if (p.ready) return;
  CopyIn(p);
  if (buckets[p.bucket].ready) LaunchReady();
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

absl::Status GradSyncState::Finish() {
  step_open = false;
  stats.arrived = absl::Now();
  if (options.on_arrival) options.on_arrival();
  for (ParamSlot& p : params) {
    if (!p.ready) CopyIn(p);
  }
  LaunchReady();
  const absl::Time wait_start = absl::Now();
  for (int b = 0; b < static_cast<int>(buckets.size()) && status.ok(); ++b) {
    Bucket& bucket = buckets[b];
    try {
      at::Tensor reduced = bucket.result.Wait(ToMillis(options.timeout));
      if (!reduced.is_same(bucket.buffer)) bucket.buffer.copy_(reduced);
    } catch (const std::exception& e) {
      const std::string error = ErrorText(e);
      const absl::Duration waited = absl::Now() - wait_start;
      if (options.diagnosis.diagnose) {
        status = options.diagnosis.diagnose(
            arrival_seq, absl::StrCat("all_reduce of ", DescribeBucket(b)), waited, error);
      } else {
        std::string message = absl::StrCat(
            "rank ", rank, ": all_reduce of ", DescribeBucket(b), " failed after ",
            absl::FormatDuration(absl::Trunc(waited, absl::Milliseconds(1))), ": ", error);
        status = waited >= options.timeout ? absl::DeadlineExceededError(message)
                                           : absl::UnavailableError(message);
      }
    }
    bucket.result = ReducedBucket();
  }
  stats.wait = absl::Now() - wait_start;
  if (!status.ok()) return status;
  for (ParamSlot& p : params) {
    const at::Tensor& buffer = buckets[p.bucket].buffer;
    const at::Tensor& grad = p.param.grad();
    if (grad.defined() && grad.data_ptr() == static_cast<char*>(buffer.data_ptr()) +
                                                 p.offset * buffer.element_size()) {
      continue;  // already aliases its bucket slice
    }
    // A tensor that shares the bucket's storage without being an autograd
    // view: optimizers' zero_grad() calls detach_(), which views refuse.
    at::Tensor alias = at::empty({0}, buffer.options());
    alias.set_(buffer.storage(), buffer.storage_offset() + p.offset, p.param.sizes(),
               p.param.strides());
    p.param.mutable_grad() = alias;
  }
  stats.done = absl::Now();
  return absl::OkStatus();
}

}  // namespace internal

namespace {

using internal::GradSyncState;

absl::Status WaitWork(c10d::Work& work, absl::Duration timeout, int rank, absl::string_view what) {
  try {
    work.wait(std::chrono::milliseconds(absl::ToInt64Milliseconds(timeout)));
  } catch (const std::exception& e) {
    return absl::UnavailableError(
        absl::StrCat("rank ", rank, ": ", what, " failed: ", internal::ErrorText(e)));
  }
  return absl::OkStatus();
}

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
  absl::Status s;
  try {
    auto work = group.allgather(out, inputs);
    s = WaitWork(*work, timeout, group.getRank(), what);
  } catch (const std::exception& e) {
    s = absl::UnavailableError(
        absl::StrCat("rank ", group.getRank(), ": ", what, ": ", internal::ErrorText(e)));
  }
  if (!s.ok()) return s;
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
                      c10::DeviceTypeName(p.second.device().type(), /*lower_case=*/true));
}

int64_t Hash(const std::string& s) { return static_cast<int64_t>(XXH64(s.data(), s.size(), 0)); }

// Checks that every rank holds the same parameters; on mismatch, names the
// first differing parameter and which ranks hold which variant.
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
  auto summary = AllGatherInts(group, {static_cast<int64_t>(params.size()), combined}, device,
                               timeout, "parameter fingerprint all_gather");
  if (!summary.ok()) return summary.status();
  bool same = true;
  int64_t max_count = 0;
  for (const auto& s : *summary) {
    same &= s == (*summary)[0];
    max_count = std::max(max_count, s[0]);
  }
  if (same) return absl::OkStatus();

  // Slow path, all ranks take it: find the first index that differs.
  std::vector<int64_t> padded(max_count, 0);
  std::copy(hashes.begin(), hashes.end(), padded.begin());
  auto all = AllGatherInts(group, padded, device, timeout, "parameter list all_gather");
  if (!all.ok()) return all.status();
  int64_t first = 0;
  for (; first < max_count; ++first) {
    bool differs = false;
    for (int r = 1; r < world; ++r) differs |= (*all)[r][first] != (*all)[0][first];
    for (int r = 0; r < world; ++r) differs |= first >= (*summary)[r][0];
    if (differs) break;
  }
  // Gather the description of that parameter from every rank (fixed width).
  constexpr int kWidth = 160;
  std::string mine = first < static_cast<int64_t>(params.size())
                         ? DescribeParam(params[first])
                         : absl::StrCat("no parameter #", first, " (", params.size(), " in all)");
  std::vector<int64_t> chars(kWidth, 0);
  for (int i = 0; i < kWidth && i < static_cast<int>(mine.size()); ++i) chars[i] = mine[i];
  auto descs = AllGatherInts(group, chars, device, timeout, "parameter description all_gather");
  if (!descs.ok()) return descs.status();
  std::map<std::string, std::vector<int>> variants;
  for (int r = 0; r < world; ++r) {
    std::string d;
    for (int64_t c : (*descs)[r]) {
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
                              int root, absl::Duration timeout) {
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
    std::vector<at::Tensor> v{flat};
    c10d::BroadcastOptions options;
    options.rootRank = root;
    try {
      auto work = group.broadcast(v, options);
      absl::Status s = WaitWork(*work, timeout, group.getRank(), "initial parameter broadcast");
      if (!s.ok()) return s;
    } catch (const std::exception& e) {
      return absl::UnavailableError(absl::StrCat(
          "rank ", group.getRank(), ": initial parameter broadcast: ", internal::ErrorText(e)));
    }
    int64_t offset = 0;
    for (at::Tensor& t : members) {
      t.detach().copy_(flat.narrow(0, offset, t.numel()).view(t.sizes()));
      offset += t.numel();
    }
  }
  return absl::OkStatus();
}

}  // namespace

GradSync::GradSync(std::shared_ptr<internal::GradSyncState> state) : state_(std::move(state)) {}

GradSync::~GradSync() {
  for (internal::ParamSlot& p : state_->params) {
    if (p.accumulator) p.accumulator->del_post_hook(p.hook_key);
  }
}

absl::StatusOr<std::unique_ptr<GradSync>> GradSync::Attach(torch::nn::Module& module,
                                                           c10d::ProcessGroup& group,
                                                           GradSyncOptions options) {
  std::vector<NamedTensor> params;
  // Frozen parameters are not synced, but every replica must start from the
  // same values (as DDP broadcasts every parameter at construction): they
  // are fingerprinted and broadcast with the buffers, whatever
  // broadcast_buffers says.
  std::vector<NamedTensor> buffers;
  for (const auto& item : module.named_parameters(/*recurse=*/true)) {
    if (!item.value().defined()) continue;
    (item.value().requires_grad() ? params : buffers).emplace_back(item.key(), item.value());
  }
  if (options.broadcast_buffers) {
    for (const auto& item : module.named_buffers(/*recurse=*/true)) {
      if (item.value().defined()) buffers.emplace_back(item.key(), item.value());
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
  if (parameters.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("rank ", rank, ": GradSync::Attach got no parameters that require grad"));
  }
  for (const NamedTensor& p : parameters) {
    if (!p.second.defined() || !p.second.is_contiguous() || p.second.is_sparse()) {
      return absl::InvalidArgumentError(absl::StrCat("rank ", rank, ": parameter '", p.first,
                                                     "' must be a dense, contiguous tensor"));
    }
  }
  const at::Device device = parameters.front().second.device();
  // Names, dtypes, shapes and devices of everything that is broadcast must
  // match across ranks (parameters first, so their indices are as before).
  std::vector<NamedTensor> to_broadcast = parameters;
  to_broadcast.insert(to_broadcast.end(), buffers.begin(), buffers.end());
  absl::Status s = CheckReplicasMatch(group, to_broadcast, device, options.timeout);
  if (!s.ok()) return s;
  s = BroadcastTensors(group, to_broadcast, options.broadcast_root, options.timeout);
  if (!s.ok()) return s;

  auto state = std::make_shared<GradSyncState>();
  state->group = &group;
  state->rank = rank;
  state->world = group.getSize();
  state->options = std::move(options);
  // Buckets in reverse registration order, one open bucket per dtype/device.
  std::map<std::pair<int, std::string>, int> open;
  std::vector<int64_t> bucket_bytes;
  for (int i = static_cast<int>(parameters.size()) - 1; i >= 0; --i) {
    const at::Tensor& t = parameters[i].second;
    const auto key = std::make_pair(static_cast<int>(t.scalar_type()), t.device().str());
    const int64_t bytes = t.numel() * t.element_size();
    auto it = open.find(key);
    if (it != open.end()) {
      const int64_t cap =
          it->second == 0 ? state->options.first_bucket_cap_bytes : state->options.bucket_cap_bytes;
      if (bucket_bytes[it->second] + bytes > cap) open.erase(it);
    }
    it = open.find(key);
    if (it == open.end()) {
      state->buckets.emplace_back();
      bucket_bytes.push_back(0);
      it = open.emplace(key, static_cast<int>(state->buckets.size()) - 1).first;
    }
    internal::ParamSlot slot;
    slot.name = parameters[i].first;
    slot.param = t;
    slot.bucket = it->second;
    slot.offset = bucket_bytes[it->second] / t.element_size();
    bucket_bytes[it->second] += bytes;
    state->buckets[it->second].params.push_back(static_cast<int>(state->params.size()));
    state->params.push_back(std::move(slot));
  }
  for (size_t b = 0; b < state->buckets.size(); ++b) {
    const at::Tensor& first = state->params[state->buckets[b].params[0]].param;
    state->buckets[b].buffer =
        at::zeros({bucket_bytes[b] / first.element_size()}, first.options().requires_grad(false));
  }
  std::unique_ptr<GradSync> sync(new GradSync(state));
  for (int i = 0; i < static_cast<int>(state->params.size()); ++i) {
    internal::ParamSlot& p = state->params[i];
    p.accumulator = torch::autograd::impl::grad_accumulator(p.param);
    if (!p.accumulator) {
      return absl::InvalidArgumentError(absl::StrCat("rank ", rank, ": parameter '", p.name,
                                                     "' is not a leaf that requires grad"));
    }
    p.hook_key = p.accumulator->add_post_hook(std::make_unique<internal::ReadyHook>(state, i));
  }
  return sync;
}

void GradSync::set_sync_enabled(bool enabled) {
  std::lock_guard<std::mutex> lock(state_->mu);
  state_->sync_enabled = enabled;
}

bool GradSync::sync_enabled() const {
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->sync_enabled;
}

absl::Status GradSync::SyncNow() {
  std::lock_guard<std::mutex> lock(state_->mu);
  if (!state_->status.ok()) return state_->status;
  state_->BeginStep();
  return state_->Finish();
}

void GradSync::set_comm_hook(CommHook hook) {
  std::lock_guard<std::mutex> lock(state_->mu);
  state_->options.comm_hook = std::move(hook);
}

absl::Status GradSync::status() const {
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->status;
}

SyncStats GradSync::last_stats() const {
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->stats;
}

int64_t GradSync::collectives_started() const {
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->collectives;
}

int GradSync::num_buckets() const { return static_cast<int>(state_->buckets.size()); }

std::vector<std::vector<std::string>> GradSync::bucket_layout() const {
  std::vector<std::vector<std::string>> layout;
  for (const internal::Bucket& b : state_->buckets) {
    layout.emplace_back();
    for (int i : b.params) layout.back().push_back(state_->params[i].name);
  }
  return layout;
}

}  // namespace evenstep

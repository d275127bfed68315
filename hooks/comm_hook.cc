// Built-in communication hooks; see comm_hook.h.
#include "evenstep/comm_hook.h"

#include <ATen/CPUGeneratorImpl.h>

#include <algorithm>
#include <condition_variable>
#include <deque>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "evenstep/internal/choice.h"
#include "evenstep/internal/collective.h"
#include "evenstep/internal/error_text.h"
#include "evenstep/status_macros.h"

namespace evenstep {

BucketFuture::BucketFuture(c10::intrusive_ptr<c10d::Work> work, std::function<at::Tensor()> finish)
    : work_(std::move(work)), finish_(std::move(finish)) {}

BucketFuture BucketFuture::Ready(at::Tensor value) {
  return BucketFuture(c10::intrusive_ptr<c10d::Work>(), [value] { return value; });
}

BucketFuture BucketFuture::Then(BucketFuture inner, std::function<at::Tensor(at::Tensor)> fn) {
  return BucketFuture(inner.work_, [finish = std::move(inner.finish_), fn = std::move(fn)] {
    return fn(finish());
  });
}

at::Tensor BucketFuture::Wait(std::chrono::milliseconds timeout) {
  if (work_) work_->wait(timeout);
  return finish_();
}

at::Tensor BucketFuture::Wait(std::chrono::milliseconds timeout,
                              const std::function<bool()>& abandon) {
  if (!abandon) return Wait(timeout);
  const internal::CollectiveWait outcome = internal::WaitCollective(
      work_.get(), absl::Milliseconds(timeout.count()), absl::Now(), abandon);
  if (outcome.failed) throw std::runtime_error(outcome.error);
  return finish_();
}

namespace {

// Starts an in-place SUM all_reduce of `t`; `finish` maps the result.
BucketFuture AllReduceSum(const CommHookContext& ctx, at::Tensor t,
                          std::function<at::Tensor(at::Tensor)> finish) {
  if (ctx.world_size == 1) return BucketFuture::Ready(finish(t));
  std::vector<at::Tensor> tensors{t};
  c10d::AllreduceOptions options;
  options.reduceOp = c10d::ReduceOp::SUM;
  auto work = ctx.group->allreduce(tensors, options);
  return BucketFuture(std::move(work), [t, finish = std::move(finish)] { return finish(t); });
}

// Compressed SUM: scale by 1/world before the cast so the low-precision sum
// cannot overflow, reduce, cast back and undo the scale.
BucketFuture CompressedSum(const CommHookContext& ctx, at::Tensor& bucket, at::ScalarType type) {
  const double world = ctx.world_size;
  const at::ScalarType original = bucket.scalar_type();
  at::Tensor compressed = bucket.div(world).to(type);
  const bool gloo_bf16 = type == at::kBFloat16 && ctx.group != nullptr &&
                         ctx.group->getBackendName() == "gloo" && ctx.world_size > 1;
  if (!gloo_bf16) {
    return AllReduceSum(ctx, compressed, [world, original](at::Tensor reduced) {
      return reduced.to(original).mul_(world);
    });
  }
  // Gloo has no bf16 reduction: gather the bf16 bit patterns (as fp16, a type
  // Gloo moves) and sum them locally in fp32.
  std::vector<std::vector<at::Tensor>> outputs(1);
  for (int r = 0; r < ctx.world_size; ++r) outputs[0].push_back(at::empty_like(compressed));
  std::vector<at::Tensor> inputs{compressed.view(at::kHalf)};
  for (auto& o : outputs[0]) o = o.view(at::kHalf);
  auto work = ctx.group->allgather(outputs, inputs);
  return BucketFuture(std::move(work), [outputs, world, original] {
    at::Tensor sum = at::zeros(outputs[0][0].sizes(), outputs[0][0].options().dtype(at::kFloat));
    for (const at::Tensor& part : outputs[0]) sum.add_(part.view(at::kBFloat16).to(at::kFloat));
    return sum.to(original).mul_(world);
  });
}

// The built-in hooks are one callable type, so GradSync can tell them from
// user hooks (internal::IsZeroPreservingHook).
struct BuiltinHook {
  enum Kind { kSum, kAvg, kFp16, kBf16 } kind;
  BucketFuture operator()(const CommHookContext& ctx, at::Tensor& bucket) const {
    switch (kind) {
      case kSum:
        return AllReduceSum(ctx, bucket, [](at::Tensor t) { return t; });
      case kAvg: {
        const double world = ctx.world_size;
        return AllReduceSum(ctx, bucket, [world](at::Tensor t) { return t.div_(world); });
      }
      case kFp16:
        return CompressedSum(ctx, bucket, at::kHalf);
      case kBf16:
        return CompressedSum(ctx, bucket, at::kBFloat16);
    }
    return BucketFuture();
  }
};

// PowerSGD state of one bucket: the error left by the last approximation
// and the warm-start Q of each compressed gradient.
struct PowerSgdBucket {
  std::vector<int64_t> layout;  // numel of each gradient: a rebuilt bucket resets
  at::Tensor error;
  std::vector<at::Tensor> q;
};

struct PowerSgdState {
  PowerSgdOptions options;
  std::map<int, PowerSgdBucket> buckets;
};

// Orthonormal columns (Gram-Schmidt; rank is small).
void Orthonormalize(at::Tensor& m) {
  for (int64_t c = 0; c < m.size(1); ++c) {
    at::Tensor col = m.select(1, c);
    for (int64_t k = 0; k < c; ++k) col.sub_(m.select(1, k) * (m.select(1, k) * col).sum());
    col.div_(col.norm().clamp_min(1e-12));
  }
}

BucketFuture PowerSgd(const std::shared_ptr<PowerSgdState>& state, const CommHookContext& ctx,
                      at::Tensor& bucket) {
  const PowerSgdOptions& o = state->options;
  if (ctx.seq < o.start_seq || ctx.params == nullptr) {
    return AllReduceSum(ctx, bucket, [](at::Tensor t) { return t; });
  }
  PowerSgdBucket& b = state->buckets[ctx.bucket_index];
  std::vector<int64_t> layout;
  for (const BucketParam& p : *ctx.params) layout.push_back(p.numel);
  if (layout != b.layout || !b.error.defined() || b.error.numel() != bucket.numel()) {
    b = PowerSgdBucket();
    b.layout = layout;
    b.error = at::zeros_like(bucket);
  }
  bucket.add_(b.error);  // error feedback
  struct Part {
    int64_t offset, rows, cols;
    int q;  // index into b.q, -1 = sent exactly
  };
  std::vector<Part> parts;
  std::vector<at::Tensor> first;  // exact gradients, then every P
  int64_t exact_numel = 0;
  for (const BucketParam& p : *ctx.params) {
    const int64_t rows = p.sizes.size() >= 2 ? p.sizes[0] : p.numel;
    const int64_t cols = rows > 0 ? p.numel / rows : 0;
    const bool compress = p.sizes.size() >= 2 && o.rank < std::min(rows, cols);
    parts.push_back({p.offset, rows, cols, compress ? static_cast<int>(parts.size()) : -1});
    if (!compress) {
      first.push_back(bucket.narrow(0, p.offset, p.numel));
      exact_numel += p.numel;
    }
  }
  b.q.resize(parts.size());
  std::vector<at::Tensor> ms(parts.size());
  for (Part& part : parts) {
    if (part.q < 0) continue;
    at::Tensor& q = b.q[part.q];
    if (!q.defined()) {
      // The same start on every rank: seeded by (seed, bucket, gradient).
      auto gen = at::make_generator<at::CPUGeneratorImpl>(o.seed * 1000003 +
                                                          ctx.bucket_index * 1009 + part.q);
      q = at::randn({part.cols, o.rank}, gen, bucket.options().device(at::kCPU))
              .to(bucket.device());
    }
    ms[part.q] = bucket.narrow(0, part.offset, part.rows * part.cols).view({part.rows, part.cols});
    first.push_back(ms[part.q].mm(q).reshape({-1}));
  }
  at::Tensor sent = at::cat(first);
  auto finish = [state, &b, parts, ms, exact_numel, sent, bucket, ctx]() mutable {
    const int world = ctx.world_size;
    // Exact part back into the bucket.
    int64_t at_ = 0;
    for (const Part& part : parts) {
      if (part.q >= 0) continue;
      bucket.narrow(0, part.offset, part.rows * part.cols)
          .copy_(sent.narrow(0, at_, part.rows * part.cols));
      at_ += part.rows * part.cols;
    }
    // P: orthonormalise, then Q = M^T P summed over ranks.
    std::vector<at::Tensor> ps(parts.size()), qs;
    const int r = state->options.rank;
    for (const Part& part : parts) {
      if (part.q < 0) continue;
      ps[part.q] = sent.narrow(0, at_, part.rows * r).view({part.rows, r}).clone();
      at_ += part.rows * r;
      Orthonormalize(ps[part.q]);
      qs.push_back(ms[part.q].t().mm(ps[part.q]).reshape({-1}));
    }
    if (!qs.empty()) {
      at::Tensor q_all = at::cat(qs);
      if (world > 1) {
        std::vector<at::Tensor> tensors{q_all};
        ctx.group->allreduce(tensors)->wait();
      }
      int64_t q_at = 0;
      for (const Part& part : parts) {
        if (part.q < 0) continue;
        at::Tensor q = q_all.narrow(0, q_at, part.cols * r).view({part.cols, r});
        q_at += part.cols * r;
        at::Tensor approx = ps[part.q].mm(q.t());  // the approximate SUM
        // What this rank's share of the approximation missed stays here.
        b.error.narrow(0, part.offset, part.rows * part.cols)
            .copy_((ms[part.q] - approx / world).reshape({-1}));
        ms[part.q].copy_(approx);
        b.q[part.q] = q.clone();
      }
    }
    return bucket;
  };
  if (ctx.world_size == 1) return BucketFuture(c10::intrusive_ptr<c10d::Work>(), finish);
  std::vector<at::Tensor> tensors{sent};
  c10d::AllreduceOptions options;
  options.reduceOp = c10d::ReduceOp::SUM;
  return BucketFuture(ctx.group->allreduce(tensors, options), finish);
}

// One bucket on its way through HierarchicalHook's phases.
struct HierarchicalJob {
  CommHookContext ctx;  // params cleared: they describe the whole bucket
  at::Tensor bucket;    // flat
  int64_t chunk = 0;    // elements per local rank (the bucket padded to L x chunk)
  at::Tensor part;      // after the scatter: this rank's summed chunk
  std::promise<at::Tensor> done;
};

// HierarchicalHook's threads and queues; see comm_hook.h.
class HierarchicalState {
 public:
  HierarchicalState(HierarchicalGroups groups, CommHook cross, bool average)
      : g_(std::move(groups)), cross_(std::move(cross)), average_(average) {
    scatter_thread_ = std::thread([this] { Loop(&scatter_queue_, &HierarchicalState::Scatter); });
    across_thread_ = std::thread([this] { Loop(&across_queue_, &HierarchicalState::Across); });
  }
  ~HierarchicalState() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    scatter_thread_.join();
    across_thread_.join();
  }

  BucketFuture Start(const CommHookContext& ctx, const at::Tensor& bucket) {
    auto job = std::make_shared<HierarchicalJob>();
    job->ctx = ctx;
    job->ctx.params = nullptr;
    job->bucket = bucket.reshape({-1});
    const int64_t l = g_.local_size;
    job->chunk = (job->bucket.numel() + l - 1) / l;
    std::shared_future<at::Tensor> result = job->done.get_future().share();
    Push(&scatter_queue_, job);
    // Each phase is bounded by the timeout; the whole by the three of them.
    const auto bound = internal::ToChronoMillis(g_.timeout * 3 + absl::Seconds(1));
    const at::IntArrayRef sizes = bucket.sizes();
    std::vector<int64_t> shape(sizes.begin(), sizes.end());
    return BucketFuture(
        c10::intrusive_ptr<c10d::Work>(), [result, bound, shape, index = ctx.bucket_index] {
          if (result.wait_for(bound) != std::future_status::ready) {
            throw std::runtime_error(absl::StrCat("hierarchical sync: bucket ", index,
                                                  " not reduced within ",
                                                  absl::FormatDuration(absl::FromChrono(bound))));
          }
          return result.get().view(shape);
        });
  }

 private:
  using Queue = std::deque<std::shared_ptr<HierarchicalJob>>;
  using Phase = void (HierarchicalState::*)(const std::shared_ptr<HierarchicalJob>&);

  void Push(Queue* q, std::shared_ptr<HierarchicalJob> job) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      q->push_back(std::move(job));
    }
    cv_.notify_all();
  }

  // Runs `phase` on each job of `q` in order; a failure fails this job and,
  // since the groups are then unusable, every later one at once.
  void Loop(Queue* q, Phase phase) {
    for (;;) {
      std::shared_ptr<HierarchicalJob> job;
      std::string broken;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return stop_ || !q->empty(); });
        if (q->empty()) return;
        job = std::move(q->front());
        q->pop_front();
        broken = broken_;
      }
      try {
        if (!broken.empty()) throw std::runtime_error(broken);
        (this->*phase)(job);
      } catch (const std::exception& e) {
        const std::string text = internal::ErrorText(e);
        {
          std::lock_guard<std::mutex> lock(mu_);
          if (broken_.empty()) broken_ = text;
        }
        job->done.set_exception(std::make_exception_ptr(std::runtime_error(text)));
      }
    }
  }

  // Waits for `work` (one phase of bucket `index`) or throws what failed.
  void Await(const c10::intrusive_ptr<c10d::Work>& work, const char* phase, int index) {
    const internal::CollectiveWait outcome = internal::WaitCollective(work.get(), g_.timeout);
    if (outcome.failed) {
      throw std::runtime_error(absl::StrCat("hierarchical sync, bucket ", index, ": ", phase,
                                            " failed after ", absl::FormatDuration(outcome.elapsed),
                                            ": ", outcome.error));
    }
  }

  // Within the node: chunk j of every local rank's bucket to local rank j,
  // summed there (a reduce-scatter made of an all-to-all, which Gloo has in
  // every libtorch; the sum is in local rank order on every node).
  void Scatter(const std::shared_ptr<HierarchicalJob>& shared) {
    HierarchicalJob& job = *shared;
    const int64_t l = g_.local_size, n = job.bucket.numel();
    if (l == 1) {
      job.part = job.bucket;
    } else {
      at::Tensor padded = job.bucket;
      if (n != l * job.chunk) {
        padded = at::zeros({l * job.chunk}, job.bucket.options());
        padded.narrow(0, 0, n).copy_(job.bucket);
      }
      at::Tensor received = at::empty({l * job.chunk}, job.bucket.options());
      std::vector<int64_t> equal;  // empty split sizes: equal chunks
      c10d::AllToAllOptions options;
      Await(g_.scatter->alltoall_base(received, padded, equal, equal, options),
            "within-node reduce-scatter", job.ctx.bucket_index);
      job.part = received.view({l, job.chunk}).sum(0);
    }
    Push(&across_queue_, shared);
  }

  // Across nodes: the cross-node hook on this rank's part; then the node's
  // parts gathered back into a whole bucket.
  void Across(const std::shared_ptr<HierarchicalJob>& shared) {
    HierarchicalJob& job = *shared;
    at::Tensor reduced = job.part;
    if (g_.nodes > 1) {
      CommHookContext ctx = job.ctx;
      ctx.group = g_.across;
      ctx.rank = g_.node;
      ctx.world_size = g_.nodes;
      at::Tensor part = job.part;
      BucketFuture f = cross_(ctx, part);
      reduced = f.Wait(internal::ToChronoMillis(g_.timeout));
    }
    at::Tensor whole = reduced;
    const int64_t l = g_.local_size, n = job.bucket.numel();
    if (l > 1) {
      at::Tensor gathered = at::empty({l * job.chunk}, job.bucket.options());
      std::vector<std::vector<at::Tensor>> outputs(1);
      for (int64_t j = 0; j < l; ++j) {
        outputs[0].push_back(gathered.narrow(0, j * job.chunk, job.chunk));
      }
      std::vector<at::Tensor> inputs{reduced.contiguous()};
      Await(g_.gather->allgather(outputs, inputs), "within-node all-gather", job.ctx.bucket_index);
      whole = gathered.narrow(0, 0, n);
    }
    if (average_) whole = whole.div(job.ctx.world_size);
    job.done.set_value(whole);
  }

  HierarchicalGroups g_;
  CommHook cross_;
  bool average_;
  std::mutex mu_;
  std::condition_variable cv_;
  Queue scatter_queue_, across_queue_;
  bool stop_ = false;
  std::string broken_;
  std::thread scatter_thread_, across_thread_;
};

// The hook object: a type of its own, so GradSync can tell that it keeps
// zeros zero (internal::IsZeroPreservingHook) like its built-in inner hook.
struct HierarchicalHookFn {
  std::shared_ptr<HierarchicalState> state;
  BucketFuture operator()(const CommHookContext& ctx, at::Tensor& bucket) const {
    return state->Start(ctx, bucket);
  }
};
}  // namespace

CommHook SumHook() { return BuiltinHook{BuiltinHook::kSum}; }
CommHook AvgHook() { return BuiltinHook{BuiltinHook::kAvg}; }
CommHook Fp16CompressHook() { return BuiltinHook{BuiltinHook::kFp16}; }
CommHook Bf16CompressHook() { return BuiltinHook{BuiltinHook::kBf16}; }

CommHook PowerSgdHook(PowerSgdOptions options) {
  auto state = std::make_shared<PowerSgdState>();
  state->options = options;
  return [state](const CommHookContext& ctx, at::Tensor& bucket) {
    return PowerSgd(state, ctx, bucket);
  };
}

absl::StatusOr<CommHook> HierarchicalHook(HierarchicalGroups groups, CommHook cross_node) {
  const BuiltinHook* builtin = cross_node.target<BuiltinHook>();
  if (builtin == nullptr) {
    return absl::InvalidArgumentError(
        "hierarchical sync applies the comm hook to each rank's part of a bucket: only the "
        "element-wise built-in hooks (sum, avg, fp16, bf16) can be its cross-node part; powersgd "
        "and user hooks need whole gradients (use the flat sync with them)");
  }
  if ((groups.local_size > 1 && (groups.scatter == nullptr || groups.gather == nullptr)) ||
      (groups.nodes > 1 && groups.across == nullptr) || groups.local_size < 1 || groups.nodes < 1) {
    return absl::InvalidArgumentError("HierarchicalHook: a group is missing for the layout given");
  }
  const bool average = builtin->kind == BuiltinHook::kAvg;
  if (average) cross_node = SumHook();
  return CommHook(HierarchicalHookFn{
      std::make_shared<HierarchicalState>(std::move(groups), std::move(cross_node), average)});
}

namespace internal {
bool IsZeroPreservingHook(const CommHook& hook) {
  return hook.target<BuiltinHook>() != nullptr || hook.target<HierarchicalHookFn>() != nullptr;
}
bool IsElementwiseHook(const CommHook& hook) { return hook.target<BuiltinHook>() != nullptr; }
}  // namespace internal

absl::StatusOr<CommHook> CommHookByName(absl::string_view name) {
  using Make = CommHook (*)();
  EVENSTEP_ASSIGN_OR_RETURN(const Make make,
                            internal::Choose<Make>("--evenstep_comm_hook", name,
                                                   {{"sum", &SumHook},
                                                    {"avg", &AvgHook},
                                                    {"bf16", &Bf16CompressHook},
                                                    {"fp16", &Fp16CompressHook},
                                                    {"powersgd", [] { return PowerSgdHook(); }}}));
  return make();
}

}  // namespace evenstep

// Built-in communication hooks; see comm_hook.h.
#include "evenstep/comm_hook.h"

#include <ATen/CPUGeneratorImpl.h>

#include <algorithm>
#include <map>
#include <memory>
#include <vector>

#include "absl/strings/str_cat.h"

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

namespace internal {
bool IsZeroPreservingHook(const CommHook& hook) { return hook.target<BuiltinHook>() != nullptr; }
}  // namespace internal

absl::StatusOr<CommHook> CommHookByName(absl::string_view name) {
  if (name == "sum") return SumHook();
  if (name == "avg") return AvgHook();
  if (name == "fp16") return Fp16CompressHook();
  if (name == "bf16") return Bf16CompressHook();
  if (name == "powersgd") return PowerSgdHook();
  return absl::InvalidArgumentError(
      absl::StrCat("--evenstep_comm_hook=", name, ": expected sum, avg, bf16, fp16 or powersgd"));
}

}  // namespace evenstep

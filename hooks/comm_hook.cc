// Built-in communication hooks; see comm_hook.h.
#include "evenstep/comm_hook.h"

#include <vector>

#include "absl/strings/str_cat.h"

namespace evenstep {

ReducedBucket::ReducedBucket(c10::intrusive_ptr<c10d::Work> work,
                             std::function<at::Tensor()> finish)
    : work_(std::move(work)), finish_(std::move(finish)) {}

ReducedBucket ReducedBucket::Ready(at::Tensor value) {
  return ReducedBucket(c10::intrusive_ptr<c10d::Work>(), [value] { return value; });
}

ReducedBucket ReducedBucket::Then(ReducedBucket inner, std::function<at::Tensor(at::Tensor)> fn) {
  return ReducedBucket(inner.work_, [finish = std::move(inner.finish_), fn = std::move(fn)] {
    return fn(finish());
  });
}

at::Tensor ReducedBucket::Wait(std::chrono::milliseconds timeout) {
  if (work_) work_->wait(timeout);
  return finish_();
}

namespace {

// Starts an in-place SUM all_reduce of `t`; `finish` maps the result.
ReducedBucket AllReduceSum(const CommHookContext& ctx, at::Tensor t,
                           std::function<at::Tensor(at::Tensor)> finish) {
  if (ctx.world_size == 1) return ReducedBucket::Ready(finish(t));
  std::vector<at::Tensor> tensors{t};
  c10d::AllreduceOptions options;
  options.reduceOp = c10d::ReduceOp::SUM;
  auto work = ctx.group->allreduce(tensors, options);
  return ReducedBucket(std::move(work), [t, finish = std::move(finish)] { return finish(t); });
}

// Compressed SUM: scale by 1/world before the cast so the low-precision sum
// cannot overflow, reduce, cast back and undo the scale.
ReducedBucket CompressedSum(const CommHookContext& ctx, at::Tensor& bucket, at::ScalarType type) {
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
  return ReducedBucket(std::move(work), [outputs, world, original] {
    at::Tensor sum = at::zeros(outputs[0][0].sizes(), outputs[0][0].options().dtype(at::kFloat));
    for (const at::Tensor& part : outputs[0]) sum.add_(part.view(at::kBFloat16).to(at::kFloat));
    return sum.to(original).mul_(world);
  });
}

}  // namespace

CommHook SumHook() {
  return [](const CommHookContext& ctx, at::Tensor& bucket) {
    return AllReduceSum(ctx, bucket, [](at::Tensor t) { return t; });
  };
}

CommHook AvgHook() {
  return [](const CommHookContext& ctx, at::Tensor& bucket) {
    const double world = ctx.world_size;
    return AllReduceSum(ctx, bucket, [world](at::Tensor t) { return t.div_(world); });
  };
}

CommHook Fp16CompressHook() {
  return [](const CommHookContext& ctx, at::Tensor& bucket) {
    return CompressedSum(ctx, bucket, at::kHalf);
  };
}

CommHook Bf16CompressHook() {
  return [](const CommHookContext& ctx, at::Tensor& bucket) {
    return CompressedSum(ctx, bucket, at::kBFloat16);
  };
}

absl::StatusOr<CommHook> CommHookByName(absl::string_view name) {
  if (name == "sum") return SumHook();
  if (name == "avg") return AvgHook();
  if (name == "fp16") return Fp16CompressHook();
  if (name == "bf16") return Bf16CompressHook();
  return absl::InvalidArgumentError(
      absl::StrCat("--evenstep_comm_hook=", name, ": expected sum, avg, bf16 or fp16"));
}

}  // namespace evenstep

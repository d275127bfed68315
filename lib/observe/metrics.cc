// MetricsLogger and Evaluate; see metrics.h.
#include "evenstep/metrics.h"

#include <ATen/ATen.h>
#include <xxhash.h>

#include <iostream>
#include <nlohmann/json.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "evenstep/async_appender.h"
#include "evenstep/dist_context.h"
#include "evenstep/internal/error_text.h"
#include "evenstep/log.h"
#include "evenstep/status_macros.h"

namespace evenstep {
namespace {
constexpr size_t kMaxMetrics = 64;
}  // namespace

struct MetricsLogger::Interval {
  int64_t index = 0;
  int64_t step = 0;
  std::vector<std::string> names;
  at::Tensor values;  // [sum_0, count_0, ..., sum_63, count_63, hash of the names]
  c10::intrusive_ptr<c10d::Work> work;
  int64_t seq = 0;
  int world = 0;  // the ranks the all-reduce summed over
};

absl::StatusOr<std::unique_ptr<MetricsLogger>> MetricsLogger::Create(DistContext& ctx,
                                                                     MetricsOptions options) {
  if (options.dir.empty()) return absl::InvalidArgumentError("metrics: no directory");
  if (options.interval < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("metrics: interval ", options.interval, " must be >= 1"));
  }
  std::unique_ptr<MetricsLogger> m(new MetricsLogger(ctx, options));
  EVENSTEP_ASSIGN_OR_RETURN(
      m->own_,
      AsyncAppender::CreateSegment(absl::StrFormat("%s/metrics-%05d", options.dir, ctx.rank()),
                                   ".jsonl", 64 << 10));
  EVENSTEP_ASSIGN_OR_RETURN(
      m->aggregate_, AsyncAppender::CreateSegment(
                         absl::StrFormat("%s/metrics-aggregate-%05d", options.dir, ctx.rank()),
                         ".jsonl", 64 << 10));
  return m;
}

MetricsLogger::MetricsLogger(DistContext& ctx, MetricsOptions options)
    : ctx_(ctx), options_(std::move(options)) {}

MetricsLogger::~MetricsLogger() { Close().IgnoreError(); }

void MetricsLogger::Log(int64_t step, const std::string& name, double value) {
  auto& [sum, count] = current_[name];
  sum += value;
  count += 1;
  current_lines_ +=
      nlohmann::json({{"step", step}, {"rank", ctx_.rank()}, {"name", name}, {"value", value}})
          .dump() +
      "\n";
}

void MetricsLogger::Log(int64_t step, const std::string& name, const at::Tensor& value) {
  pending_tensors_.push_back({step, name, std::make_shared<at::Tensor>(value.detach())});
}

void MetricsLogger::ResolveTensors() {
  for (const PendingTensor& p : pending_tensors_) {
    Log(p.step, p.name, p.value->to(at::kDouble).mean().item<double>());
  }
  pending_tensors_.clear();
}

absl::Status MetricsLogger::Consume() {
  if (!in_flight_) return absl::OkStatus();
  std::unique_ptr<Interval> done = std::move(in_flight_);
  EVENSTEP_RETURN_IF_ERROR(
      ctx_.Wait(*done->work, done->seq, absl::StrCat("metrics all_reduce #", done->index)));
  const double* v = done->values.data_ptr<double>();
  const size_t n = done->names.size();
  // The last slot sums every rank's hash of its names: all ranks logged the
  // same names iff it is world * this rank's hash.
  const double world = done->world;
  const double own_hash = static_cast<double>(
      XXH64(absl::StrJoin(done->names, "\n").data(), absl::StrJoin(done->names, "\n").size(), 0) %
      (1ULL << 40));
  if (v[2 * kMaxMetrics] != world * own_hash) {
    return absl::FailedPreconditionError(absl::StrCat(
        "metrics: ranks logged different metric names in the interval ending at step ", done->step,
        " (rank ", ctx_.rank(), " logged ", absl::StrJoin(done->names, ", "), ")"));
  }
  last_means_.clear();
  nlohmann::json line = {{"step", done->step}, {"interval", done->index}};
  for (size_t i = 0; i < n; ++i) {
    const double mean = v[2 * i + 1] > 0 ? v[2 * i] / v[2 * i + 1] : 0;
    last_means_[done->names[i]] = mean;
    line[done->names[i]] = mean;
  }
  if (done->index % ctx_.world_size() == ctx_.rank()) {
    aggregate_->Append(line.dump() + "\n");
    if (options_.console) {
      std::string text = absl::StrFormat("step %d", done->step);
      for (const auto& [name, mean] : last_means_)
        absl::StrAppendFormat(&text, "  %s %.4g", name, mean);
      ::evenstep::Log(LogLevel::kInfo, text);
    }
  }
  return absl::OkStatus();
}

void MetricsLogger::AfterRegroup() {
  if (!in_flight_) return;
  bool done = false;
  try {
    done = in_flight_->work->isCompleted() && !in_flight_->work->exception();
  } catch (const std::exception&) {
    done = false;
  }
  const int64_t step = in_flight_->step;
  // Written by the survivor its index names in the new world: one line.
  if (done && Consume().ok()) return;
  if (ctx_.rank() == 0) {
    ::evenstep::Log(
        LogLevel::kWarning,
        absl::StrCat("metrics: the cross-rank means of the interval ending at step ", step,
                     " are lost with the lost rank (each rank's own "
                     "metrics file still has its values)"));
  }
  in_flight_.reset();
}

absl::Status MetricsLogger::EndStep(int64_t step) {
  if (closed_) return absl::FailedPreconditionError("metrics: closed");
  if ((step % options_.interval) != 0) return absl::OkStatus();
  ResolveTensors();
  own_->Append(current_lines_);
  current_lines_.clear();
  // The previous interval's reduction finished long ago: write it.
  EVENSTEP_RETURN_IF_ERROR(Consume());
  auto next = std::make_unique<Interval>();
  next->index = interval_index_++;
  next->step = step;
  for (const auto& [name, v] : current_) next->names.push_back(name);
  const size_t n = next->names.size();
  if (n > kMaxMetrics) {
    return absl::InvalidArgumentError(absl::StrCat(
        "metrics: ", n, " names in the interval ending at step ", step, "; at most ", kMaxMetrics));
  }
  // A fixed size on every rank, so differing name sets are detected (by the
  // hash) instead of mismatching the collective.
  next->values = at::zeros({static_cast<int64_t>(2 * kMaxMetrics + 1)}, at::kDouble);
  double* v = next->values.data_ptr<double>();
  size_t i = 0;
  for (const auto& [name, sc] : current_) {
    v[2 * i] = sc.first;
    v[2 * i + 1] = sc.second;
    ++i;
  }
  const std::string joined = absl::StrJoin(next->names, "\n");
  v[2 * kMaxMetrics] = static_cast<double>(XXH64(joined.data(), joined.size(), 0) % (1ULL << 40));
  current_.clear();
  next->seq = ctx_.MarkArrival();
  next->world = ctx_.world_size();
  std::vector<at::Tensor> tensors{next->values};
  try {
    next->work = ctx_.control_group().allreduce(tensors);
  } catch (const std::exception& e) {
    return absl::UnavailableError(absl::StrCat("metrics all_reduce: ", internal::ErrorText(e)));
  }
  in_flight_ = std::move(next);
  return absl::OkStatus();
}

bool MetricsLogger::reduction_in_flight() const {
  return in_flight_ != nullptr && !in_flight_->work->isCompleted();
}

absl::Status MetricsLogger::Close() {
  if (closed_) return absl::OkStatus();
  closed_ = true;
  absl::Status s = Consume();
  ResolveTensors();
  own_->Append(current_lines_);
  absl::Status a = own_->Close();
  absl::Status b = aggregate_->Close();
  if (!s.ok()) return s;
  return a.ok() ? b : a;
}

EvalShare EvalSplit(const Sampler& eval_set, int rank, int world) {
  GlobalBatch all;
  for (int64_t i = 0; i < eval_set.num_samples(); ++i) {
    all.samples.push_back(i);
    all.cost += eval_set.cost(i);
  }
  auto parts = eval_set.Partition(all, std::vector<double>(world, 1.0), PartitionBy::kCost);
  EvalShare share;
  for (const auto& part : parts) {
    double cost = 0;
    for (int64_t i : part) cost += eval_set.cost(i);
    share.rank_cost.push_back(cost);
  }
  share.micro_batches = eval_set.Pack(std::move(parts[rank]));
  return share;
}

absl::StatusOr<std::vector<double>> Evaluate(
    DistContext& ctx, const Sampler& eval_set,
    const std::function<at::Tensor(const MicroBatch&)>& fn) {
  const EvalShare share = EvalSplit(eval_set, ctx.rank(), ctx.world_size());
  at::Tensor total;
  at::NoGradGuard no_grad;  // no autograd graph is kept for metrics
  try {
    for (const MicroBatch& mb : share.micro_batches) {
      at::Tensor m = fn(mb).detach().to(at::kCPU, at::kDouble).reshape({-1});
      total = total.defined() ? total + m : m;
    }
  } catch (const std::exception& e) {
    return absl::InternalError(
        absl::StrCat("evaluate: rank ", ctx.rank(), ": ", internal::ErrorText(e)));
  }
  // Ranks without micro-batches still join, with zeros of the agreed length.
  at::Tensor length = at::full({1}, total.defined() ? total.numel() : 0, at::kLong);
  EVENSTEP_RETURN_IF_ERROR(ctx.AllReduce(length, ReduceOp::kMax),
                           "evaluate: agreeing on the number of metrics");
  if (!total.defined()) total = at::zeros({length.item<int64_t>()}, at::kDouble);
  if (total.numel() != length.item<int64_t>()) {
    return absl::InvalidArgumentError(absl::StrCat("evaluate: rank ", ctx.rank(), " returned ",
                                                   total.numel(), " metrics, another rank ",
                                                   length.item<int64_t>()));
  }
  total = total.contiguous();
  EVENSTEP_RETURN_IF_ERROR(ctx.AllReduce(total), "evaluate: summing the metrics of every rank");
  return std::vector<double>(total.data_ptr<double>(), total.data_ptr<double>() + total.numel());
}

}  // namespace evenstep

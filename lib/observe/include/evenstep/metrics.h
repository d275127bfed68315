// Metrics logging and evaluation without extra duties on rank 0.
//
// MetricsLogger: Log() only records (never a collective, never I/O on the
// training thread). Every `interval` steps EndStep() packs the interval's
// values into one tensor and starts one non-blocking all-reduce on the
// control group; its result is consumed at the next interval boundary (long
// finished by then), so nobody waits. Every rank writes its own values to
// DIR/metrics-RRRRR.jsonl; the cross-rank means of interval k are written by
// rank k % world (a rotating rank, never always rank 0) to its
// DIR/metrics-aggregate-RRRRR.jsonl, and with `console` that rank prints the
// progress line. All ranks must log the same metric names in an interval
// (checked: a mismatch is an error naming the interval); at most 64 names.
//
//   auto metrics = evenstep::MetricsLogger::Create(*ctx, {run_dir, /*interval=*/10});
//   (*metrics)->Log(step, "loss", report->loss);
//   (*metrics)->EndStep(step);
//
// Evaluate: splits an evaluation set across all ranks by work (the same cost
// units and micro-batch caps as training), runs `fn` on this rank's
// micro-batches and sums the returned metric vectors over ranks (one
// all-reduce). No rank does more than its share plus one micro-batch.
// Thread-safety: one training thread.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "evenstep/sampler.h"

namespace at {
class Tensor;
}
namespace c10d {
class Work;
}

namespace evenstep {

class DistContext;
class AsyncAppender;

struct MetricsOptions {
  std::string dir;
  int interval = 10;
  bool console = false;
};

class MetricsLogger {
 public:
  static absl::StatusOr<std::unique_ptr<MetricsLogger>> Create(DistContext& ctx,
                                                               MetricsOptions options);
  ~MetricsLogger();
  void Log(int64_t step, const std::string& name, double value);
  // A tensor's mean; read (one device sync) only at the interval boundary,
  // never inside Log.
  void Log(int64_t step, const std::string& name, const at::Tensor& value);
  absl::Status EndStep(int64_t step);
  // After DistContext::Regroup: the last interval's cross-rank means are
  // written if their all-reduce completed before the rank was lost, else
  // dropped (the old world's collective never completes); later intervals
  // are reduced over the survivors. Per-rank lines are kept as logged.
  void AfterRegroup();
  // Waits for the last reduction, writes it, closes the files.
  absl::Status Close();
  // True while the last interval's all-reduce has not completed (tests use
  // it to show that EndStep returned without waiting for the other ranks).
  bool reduction_in_flight() const;

 private:
  struct Interval;
  MetricsLogger(DistContext& ctx, MetricsOptions options);
  absl::Status Consume();

  DistContext& ctx_;
  MetricsOptions options_;
  std::unique_ptr<AsyncAppender> own_, aggregate_;
  std::map<std::string, std::pair<double, double>> current_;  // name -> (sum, count)
  struct PendingTensor {
    int64_t step;
    std::string name;
    std::shared_ptr<at::Tensor> value;
  };
  std::vector<PendingTensor> pending_tensors_;
  void ResolveTensors();
  std::string current_lines_;
  int64_t interval_index_ = 0;
  std::unique_ptr<Interval> in_flight_;
  std::map<std::string, double> last_means_;
  bool closed_ = false;
};

struct EvalShare {
  std::vector<MicroBatch> micro_batches;  // this rank's
  std::vector<double> rank_cost;          // every rank's cost units
};

// This rank's share of an evaluation set: all samples, split by cost units
// into equal shares (longest first), packed under the sampler's caps.
EvalShare EvalSplit(const Sampler& eval_set, int rank, int world);

// Runs fn(micro_batch) -> 1-D double tensor of metric sums on this rank's
// share, under a NoGradGuard, and returns the element-wise sum over all
// ranks. (Session::Evaluate also puts the model in eval mode and caps the
// micro-batches.)
absl::StatusOr<std::vector<double>> Evaluate(
    DistContext& ctx, const Sampler& eval_set,
    const std::function<at::Tensor(const MicroBatch&)>& fn);

}  // namespace evenstep

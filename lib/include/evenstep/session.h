// Session: everything evenstep does for a training loop, behind one object —
// balanced steps (BalancedStep), resume and sharded background checkpoints
// (Checkpointer), the per-rank timeline (Timeline) and logs (MetricsLogger),
// evaluation split across all ranks (Evaluate). Every part is switched by
// --evenstep_* flags; this is what keeps the diff to a user's loop small:
//
//   auto es = evenstep::Session::Create(**ctx, *model, optimizer, lengths, run_dir);
//   for (int64_t s = (*es)->first_step(); s <= steps; ++s) {
//     auto report = (*es)->Step(loss_sum);   // + timeline, logs, checkpoint
//   }
//   (*es)->Finish();                         // waits for the last checkpoint
//
// Thread-safety: one training thread; Create, Step, Evaluate and Finish are
// collective.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/clock.h"
#include "evenstep/balanced_step.h"

namespace evenstep {

class Checkpointer;
class MetricsLogger;
class Timeline;

class Session {
 public:
  // Creates the parts from the flags, with RUN_DIR as the default place for
  // checkpoints (RUN_DIR/ckpt), timelines and logs, and resumes from the
  // latest checkpoint if there is one.
  static absl::StatusOr<std::unique_ptr<Session>> Create(DistContext& ctx, torch::nn::Module& model,
                                                         torch::optim::Optimizer& optimizer,
                                                         std::vector<int64_t> lengths,
                                                         const std::string& run_dir,
                                                         std::vector<double> counts = {});
  ~Session();

  // The first step to run: 1, or the resumed checkpoint's step + 1.
  int64_t first_step() const { return first_step_; }
  BalancedStep& balanced_step() { return *step_; }

  // One step (see BalancedStep::Step), then: timeline, log of loss and
  // balance efficiency, and every --evenstep_ckpt_every steps a checkpoint.
  template <typename Load, typename LossSum>
  absl::StatusOr<StepReport> Step(Load&& load, LossSum&& loss_sum) {
    absl::StatusOr<StepReport> report =
        step_->Step(std::forward<Load>(load), std::forward<LossSum>(loss_sum));
    if (!report.ok()) return report;
    EVENSTEP_RETURN_IF_ERROR(AfterStep(*report));
    return report;
  }
  // The same with the loop's own loss: `loss_sum(samples)` gets a
  // micro-batch's dataset indices (const std::vector<int64_t>&), loads them
  // and returns the SUM of their losses (data and compute timed as one).
  template <typename LossSum>
  absl::StatusOr<StepReport> Step(LossSum&& loss_sum) {
    return Step([](const MicroBatch& mb) -> const MicroBatch* { return &mb; },
                [&](const MicroBatch* mb) { return loss_sum(mb->samples); });
  }
  // Evaluation split across all ranks by work (Evaluate in metrics.h), with
  // a timeline span; `fn(samples)` returns the metric sums of some of the
  // evaluation set's indices. The sums over the whole set, on every rank.
  absl::StatusOr<std::vector<double>> Evaluate(
      const std::vector<int64_t>& lengths,
      const std::function<at::Tensor(const std::vector<int64_t>&)>& fn);
  // Saves a checkpoint of the current step now (in the background).
  absl::Status Checkpoint();
  // Waits for checkpoints in flight, closes logs and timeline.
  absl::Status Finish();

 private:
  Session(DistContext& ctx, torch::nn::Module& model, torch::optim::Optimizer& optimizer);
  absl::Status AfterStep(const StepReport& report);

  DistContext& ctx_;
  torch::nn::Module& model_;
  torch::optim::Optimizer& optimizer_;
  std::unique_ptr<BalancedStep> step_;
  std::unique_ptr<Checkpointer> checkpointer_;
  std::unique_ptr<Timeline> timeline_;
  std::unique_ptr<MetricsLogger> metrics_;
  int64_t first_step_ = 1;
  int64_t last_step_ = 0;
  int64_t last_saved_ = 0;
  bool finished_ = false;
};

}  // namespace evenstep

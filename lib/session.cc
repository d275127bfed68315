// Session: BalancedStep + Checkpointer + Timeline + MetricsLogger, from flags.
#include "evenstep/session.h"

#include <ATen/ATen.h>

#include <iostream>

#include "absl/flags/flag.h"
#include "evenstep/checkpointer.h"
#include "evenstep/flags.h"
#include "evenstep/internal/flag_checks.h"
#include "evenstep/metrics.h"
#include "evenstep/status_macros.h"
#include "evenstep/timeline.h"

ABSL_FLAG(int, evenstep_ckpt_every, 0,
          "Session: save a checkpoint every this many steps (and at Finish); 0 = only at "
          "Finish. Checkpoints need a directory: --evenstep_ckpt_dir, or RUN_DIR/ckpt.");
ABSL_FLAG(bool, evenstep_resume, true,
          "Session: resume from the latest committed checkpoint when there is one.");
ABSL_FLAG(bool, evenstep_timeline, true,
          "Session: write this rank's timeline (RUN_DIR/trace-RRRRR.json) for evenstep-report.");
ABSL_FLAG(int, evenstep_log_every, 10,
          "Session: metrics interval in steps (one non-blocking all-reduce per interval); logs "
          "go to RUN_DIR/metrics-*.jsonl.");

namespace evenstep {

Session::Session(DistContext& ctx, torch::nn::Module& model, torch::optim::Optimizer& optimizer)
    : ctx_(ctx), model_(model), optimizer_(optimizer) {}

Session::~Session() { Finish().IgnoreError(); }

absl::StatusOr<std::unique_ptr<Session>> Session::Create(DistContext& ctx, torch::nn::Module& model,
                                                         torch::optim::Optimizer& optimizer,
                                                         std::vector<int64_t> lengths,
                                                         const std::string& run_dir,
                                                         std::vector<double> counts) {
  std::unique_ptr<Session> s(new Session(ctx, model, optimizer));
  EVENSTEP_ASSIGN_OR_RETURN(BalanceConfig config, BalanceConfig::FromFlags());
  EVENSTEP_ASSIGN_OR_RETURN(
      s->step_, BalancedStep::Create(ctx, model, optimizer, std::move(lengths), std::move(config),
                                     std::move(counts)));
  EVENSTEP_ASSIGN_OR_RETURN(CheckpointOptions options, CheckpointOptionsFromFlags());
  if (options.dir.empty()) options.dir = run_dir + "/ckpt";
  EVENSTEP_RETURN_IF_ERROR(
      internal::NotBelow("evenstep_ckpt_every", absl::GetFlag(FLAGS_evenstep_ckpt_every), 0));
  EVENSTEP_ASSIGN_OR_RETURN(s->checkpointer_, Checkpointer::Create(ctx, options));
  if (absl::GetFlag(FLAGS_evenstep_timeline)) {
    EVENSTEP_ASSIGN_OR_RETURN(s->timeline_, Timeline::Open(run_dir, ctx.rank()));
  }
  MetricsOptions metrics;
  metrics.dir = run_dir;
  metrics.interval = absl::GetFlag(FLAGS_evenstep_log_every);
  EVENSTEP_ASSIGN_OR_RETURN(s->metrics_, MetricsLogger::Create(ctx, metrics));
  if (absl::GetFlag(FLAGS_evenstep_resume)) {
    absl::StatusOr<LoadResult> loaded =
        s->checkpointer_->Load({&model, &optimizer, s->step_.get(), "{}"});
    if (loaded.ok()) {
      if (ctx.rank() == 0) {
        std::cout << "[evenstep] resuming from " << loaded->path << " (step " << loaded->step << ")"
                  << std::endl;
      }
      s->first_step_ = loaded->step + 1;
      s->last_step_ = s->last_saved_ = loaded->step;
    } else if (!absl::IsNotFound(loaded.status())) {
      return loaded.status();
    }
  }
  return s;
}

absl::Status Session::AfterStep(const StepReport& report) {
  last_step_ = report.step;
  if (timeline_) timeline_->AddStep(report);
  metrics_->Log(report.step, "loss", report.loss);
  metrics_->Log(report.step, "balance_efficiency", report.balance_efficiency);
  EVENSTEP_RETURN_IF_ERROR(metrics_->EndStep(report.step));
  const int every = absl::GetFlag(FLAGS_evenstep_ckpt_every);
  if (every > 0 && report.step % every == 0) return Checkpoint();
  return absl::OkStatus();
}

absl::Status Session::Checkpoint() {
  const absl::Time begin = absl::Now();
  absl::StatusOr<SaveTicket> ticket =
      checkpointer_->Save(last_step_, {&model_, &optimizer_, step_.get(), "{}"});
  if (timeline_) timeline_->Span("checkpoint", begin, absl::Now(), last_step_);
  if (!ticket.ok()) return ticket.status();
  last_saved_ = last_step_;
  return absl::OkStatus();
}

absl::StatusOr<std::vector<double>> Session::Evaluate(
    const std::vector<int64_t>& lengths,
    const std::function<at::Tensor(const std::vector<int64_t>&)>& fn) {
  SamplerOptions options = step_->sampler().options();
  options.shuffle = false;
  options.min_micro_batches = 0;
  EVENSTEP_ASSIGN_OR_RETURN(Sampler set, Sampler::Create(lengths, options));
  const absl::Time begin = absl::Now();
  absl::StatusOr<std::vector<double>> result =
      evenstep::Evaluate(ctx_, set, [&](const MicroBatch& mb) { return fn(mb.samples); });
  if (timeline_) timeline_->Span("eval", begin, absl::Now(), last_step_);
  return result;
}

absl::Status Session::Finish() {
  if (finished_) return absl::OkStatus();
  finished_ = true;
  absl::Status s;
  if (last_step_ > last_saved_) s = Checkpoint();
  absl::Status w = checkpointer_->WaitAll();
  if (s.ok()) s = w;
  absl::Status m = metrics_->Close();
  if (s.ok()) s = m;
  if (timeline_) {
    absl::Status t = timeline_->Close();
    if (s.ok()) s = t;
  }
  return s;
}

}  // namespace evenstep

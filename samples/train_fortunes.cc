// The evenstep sample trainer: a byte-level transformer learns fortune
// cookies on every local rank, wrapped with evenstep — balanced
// accumulation, gradient sync from hooks, sharded background checkpoints,
// logging and evaluation on all ranks, a timeline for evenstep-report.
// Running it again resumes from the latest checkpoint.
//
//   evenstep-run -n 2 -- train_fortunes [--steps 300] [--run NAME] [--evenstep_* ...]
//
// Everything lands in RUNS/NAME/: ckpt/ (checkpoints), trace-*.json
// (timelines), metrics-*.jsonl (logs). samples/train_fortunes_plain.cc is
// the same trainer written the usual way; the README shows the diff.
#include <signal.h>
#include <torch/torch.h>
#include <unistd.h>

#include <algorithm>
#include <iostream>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "evenstep/balanced_step.h"
#include "evenstep/checkpointer.h"
#include "evenstep/flags.h"
#include "evenstep/metrics.h"
#include "evenstep/timeline.h"
#include "samples/byte_lm.h"
#include "samples/fortunes.h"

ABSL_FLAG(int, steps, 300, "Optimizer steps in total (a resumed run continues up to this).");
ABSL_FLAG(std::string, runs_dir, "runs", "Where runs live.");
ABSL_FLAG(std::string, run, "fortunes", "This run's name: RUNS_DIR/NAME.");
ABSL_FLAG(int, max_len, 192, "Bytes per fortune kept (longer ones are cut).");
ABSL_FLAG(int, dim, 64, "Model width.");
ABSL_FLAG(int, layers, 2, "Transformer blocks.");
ABSL_FLAG(double, lr, 3e-3, "Adam learning rate.");
ABSL_FLAG(int, ckpt_every, 50, "Save a checkpoint every this many steps (and at the end).");
ABSL_FLAG(int, eval_every, 100, "Evaluate on the held-out fortunes every this many steps.");
ABSL_FLAG(int, log_every, 10, "Progress line every this many steps.");
ABSL_FLAG(bool, print_losses, false, "Print every step's global loss exactly (tests).");
ABSL_FLAG(int, kill_at_step, 0, "Rank 0 SIGKILLs itself after this step (the resume test).");

namespace {

using evenstep::samples::ByteLM;

struct Data {
  std::vector<std::string> train, eval;
};

absl::StatusOr<Data> LoadData(int max_len) {
  auto all = evenstep::samples::LoadFortunes();
  if (!all.ok()) return all.status();
  Data d;
  for (size_t i = 0; i < all->size(); ++i) {
    std::string t = (*all)[i].substr(0, max_len);
    (i % 20 == 0 ? d.eval : d.train).push_back(std::move(t));  // 5 % held out
  }
  return d;
}

}  // namespace

int main(int argc, char** argv) {
  // The sample's defaults; --evenstep_* on the command line override them.
  absl::SetFlag(&FLAGS_evenstep_global_batch, 32);
  absl::SetFlag(&FLAGS_evenstep_micro_batch_tokens, 2048);
  absl::SetFlag(&FLAGS_evenstep_normalize, "tokens");
  absl::ParseCommandLine(argc, argv);
  torch::set_num_threads(1);
  const std::string run_dir = absl::GetFlag(FLAGS_runs_dir) + "/" + absl::GetFlag(FLAGS_run);
  if (absl::GetFlag(FLAGS_evenstep_ckpt_dir).empty()) {
    absl::SetFlag(&FLAGS_evenstep_ckpt_dir, run_dir + "/ckpt");
  }
  auto ctx = evenstep::DistContext::CreateFromFlags();
  auto data = LoadData(absl::GetFlag(FLAGS_max_len));
  if (!ctx.ok() || !data.ok()) {
    std::cerr << (ctx.ok() ? data.status() : ctx.status()) << "\n";
    return 1;
  }
  const int rank = (*ctx)->rank();
  torch::manual_seed(0);
  ByteLM model(absl::GetFlag(FLAGS_dim), absl::GetFlag(FLAGS_layers), 4,
               absl::GetFlag(FLAGS_max_len));
  torch::optim::Adam optimizer(model->parameters(),
                               torch::optim::AdamOptions(absl::GetFlag(FLAGS_lr)));

  // --- evenstep: balanced steps, checkpoints, timeline, logs -------------
  std::vector<int64_t> lengths = evenstep::samples::Lengths(data->train);
  auto config = evenstep::BalanceConfig::FromFlags();
  auto options = evenstep::CheckpointOptionsFromFlags();
  if (!config.ok() || !options.ok()) {
    std::cerr << (config.ok() ? options.status() : config.status()) << "\n";
    return 1;
  }
  auto step = evenstep::BalancedStep::Create(**ctx, *model, optimizer, lengths, *config);
  auto ckpt = step.ok() ? evenstep::Checkpointer::Create(**ctx, *options)
                        : absl::StatusOr<std::unique_ptr<evenstep::Checkpointer>>(step.status());
  auto timeline = evenstep::Timeline::Open(run_dir, rank);
  auto metrics = evenstep::MetricsLogger::Create(**ctx, {run_dir, absl::GetFlag(FLAGS_log_every)});
  if (!ckpt.ok() || !timeline.ok() || !metrics.ok()) {
    std::cerr << (!ckpt.ok()       ? ckpt.status()
                  : !timeline.ok() ? timeline.status()
                                   : metrics.status())
              << "\n";
    return 1;
  }
  const evenstep::TrainState state{model.ptr().get(), &optimizer, step->get(), "{}"};
  int64_t first = 1;
  if (auto loaded = (*ckpt)->Load(state); loaded.ok()) {
    first = loaded->step + 1;
    if (rank == 0)
      std::cout << "resuming from " << loaded->path << " (step " << loaded->step << ")\n";
  } else if (!absl::IsNotFound(loaded.status())) {
    std::cerr << loaded.status() << "\n";
    return 1;
  }
  auto eval_set = evenstep::Sampler::Create(evenstep::samples::Lengths(data->eval), [] {
    evenstep::SamplerOptions o;
    o.shuffle = false;
    o.micro_batch_tokens = 2048;
    return o;
  }());
  // ------------------------------------------------------------------------

  const int64_t steps = absl::GetFlag(FLAGS_steps);
  const absl::Time start = absl::Now();
  double tokens = 0;
  for (int64_t s = first; s <= steps; ++s) {
    auto report = (*step)->Step([&](const evenstep::MicroBatch& mb) { return mb.samples; },
                                [&](const std::vector<int64_t>& samples) {
                                  return evenstep::samples::LossSum(model, data->train, samples);
                                });
    if (!report.ok()) {
      std::cerr << report.status() << "\n";
      return 1;
    }
    (*timeline)->AddStep(*report);
    if (absl::GetFlag(FLAGS_print_losses) && rank == 0) {
      std::cout << absl::StrFormat("loss %d %.9g", s, report->loss) << std::endl;
    }
    if (s == absl::GetFlag(FLAGS_kill_at_step) && rank == 0) ::kill(::getpid(), SIGKILL);
    tokens += (*step)->global_batch().tokens;
    (*metrics)->Log(s, "loss", report->loss);
    (*metrics)->Log(s, "balance_efficiency", report->balance_efficiency);
    if (absl::Status m = (*metrics)->EndStep(s); !m.ok()) {
      std::cerr << m << "\n";
      return 1;
    }
    if (s % absl::GetFlag(FLAGS_ckpt_every) == 0 || s == steps) {
      const absl::Time t = absl::Now();
      auto ticket = (*ckpt)->Save(s, state);
      if (!ticket.ok()) std::cerr << "checkpoint: " << ticket.status() << "\n";
      (*timeline)->Span("checkpoint", t, absl::Now(), s);
    }
    if (s % absl::GetFlag(FLAGS_eval_every) == 0 || s == steps) {
      const absl::Time t = absl::Now();
      auto result = evenstep::Evaluate(**ctx, *eval_set, [&](const evenstep::MicroBatch& mb) {
        torch::NoGradGuard no_grad;
        std::vector<int64_t> ids(mb.samples.begin(), mb.samples.end());
        return torch::stack({evenstep::samples::LossSum(model, data->eval, ids),
                             torch::tensor(static_cast<float>(mb.tokens))});
      });
      (*timeline)->Span("eval", t, absl::Now(), s);
      if (result.ok() && rank == 0) {
        std::cout << absl::StrFormat("step %d eval loss %.4f (bits/byte %.3f)\n", s,
                                     (*result)[0] / (*result)[1],
                                     (*result)[0] / (*result)[1] / std::log(2.0));
      }
    }
    if (rank == 0 && (s % absl::GetFlag(FLAGS_log_every) == 0 || s == first || s == steps)) {
      const double elapsed = absl::ToDoubleSeconds(absl::Now() - start);
      const double left = elapsed / (s - first + 1) * (steps - s);
      std::cout << absl::StrFormat(
                       "step %d/%d loss %.4f  %.0f tokens/s  balance %.3f  %s  %.0fs left", s,
                       steps, report->loss, tokens / elapsed, report->balance_efficiency,
                       std::string(static_cast<size_t>(20.0 * s / steps), '#') +
                           std::string(20 - static_cast<size_t>(20.0 * s / steps), '.'),
                       left)
                << std::endl;
    }
  }
  absl::Status done = (*ckpt)->WaitAll();
  if (done.ok()) done = (*metrics)->Close();
  if (done.ok()) done = (*timeline)->Close();
  if (!done.ok()) {
    std::cerr << done << "\n";
    return 1;
  }
  (*ctx)->Barrier().IgnoreError();
  if (rank == 0) {
    std::cout << "\nsample: "
              << evenstep::samples::Generate(model, "The ", 200, absl::GetFlag(FLAGS_max_len), 1)
              << "\n\ncheckpoints: " << absl::GetFlag(FLAGS_evenstep_ckpt_dir)
              << "\ntimelines: " << run_dir << "/trace-*.json (report: evenstep-report " << run_dir
              << ")\n";
  }
  return 0;
}

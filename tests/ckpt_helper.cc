// The Session trainer that the resume, preemption and restart tests stop
// from outside (SIGTERM, SIGKILL, a launcher's restart: a separate process is
// the point there), on tests/testing/ckpt_model.h's model:
//   ckpt_helper --run_dir=R [--steps=N] [--evenstep_*]
// trains through evenstep::Session (resume, periodic checkpoints, save
// failure reports); prints "first step S", "step K loss L" per step and
// "finished" after Finish(). --second_session: a second Session on the same
// DistContext and a second DistContext must be refused first.
// Exit codes: 0 ok, 2 evenstep error, 3 init, 83 preempted.
#include <torch/torch.h>

#include <algorithm>
#include <csignal>
#include <iostream>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "evenstep/dist_context.h"
#include "evenstep/flags.h"
#include "evenstep/session.h"
#include "tests/testing/ckpt_model.h"

ABSL_FLAG(std::string, run_dir, "", "The run directory.");
ABSL_FLAG(bool, second_session, false,
          "Also try a second Session on the same DistContext and a second "
          "DistContext in this process (both must be refused), then train with the first.");
ABSL_FLAG(int, signal_at_step, 0, "After this step, --signal_rank raises --signal at itself.");
ABSL_FLAG(int, signal_rank, 1, "The rank that raises the signal.");
ABSL_FLAG(std::string, signal, "TERM",
          "TERM (a preemption notice) or KILL (the rank dies; a launcher restarts the group).");
ABSL_FLAG(bool, evaluate, false,
          "After training, Session::Evaluate on 300 held-out lengths, printing "
          "each evaluation micro-batch's padded tokens and the modes seen inside and after.");
ABSL_FLAG(std::string, optimizer, "adam", "sgd, adam, adamw, rmsprop or adagrad");
ABSL_FLAG(int, steps, 3, "Steps to train.");
ABSL_FLAG(int64_t, width, 300, "Hidden width (>= 262144: tensors of over 1 MiB, loaded in place).");
ABSL_FLAG(int64_t, frozen_mb, 0,
          "A frozen parameter of this many MiB (like frozen embeddings): "
          "checkpointed, but neither synced nor stepped, so saves outlast steps.");

namespace {

using ::evenstep::testing::CkptLengths;
using ::evenstep::testing::CkptLossSum;
using ::evenstep::testing::MakeCkptOptimizer;

int RunSession(evenstep::DistContext& ctx) {
  torch::nn::Sequential model = evenstep::testing::MakeCkptModel(
      absl::GetFlag(FLAGS_width), /*noncontiguous=*/false, torch::kCPU, /*seed=*/0);
  if (const int64_t mb = absl::GetFlag(FLAGS_frozen_mb); mb > 0) {
    model->register_parameter("frozen", torch::rand({mb << 18}), /*requires_grad=*/false);
  }
  auto optimizer = MakeCkptOptimizer(*model, absl::GetFlag(FLAGS_optimizer));
  const std::vector<int64_t> lengths = CkptLengths();
  auto session =
      evenstep::Session::Create(ctx, *model, *optimizer, lengths, absl::GetFlag(FLAGS_run_dir));
  if (!session.ok()) {
    std::cerr << "session: " << session.status() << std::endl;
    return 2;
  }
  if (absl::GetFlag(FLAGS_second_session)) {
    torch::nn::Linear other(4, 1);
    auto other_optimizer = MakeCkptOptimizer(*other, "sgd");
    auto second = evenstep::Session::Create(ctx, *other, *other_optimizer, lengths,
                                            absl::GetFlag(FLAGS_run_dir) + "/other");
    std::cout << "second session: " << second.status() << std::endl;
    auto second_ctx = evenstep::DistContextFromFlags();
    std::cout << "second context: " << second_ctx.status() << std::endl;
    if (second.ok() || second_ctx.ok()) return 1;
  }
  std::cout << "first step " << (*session)->first_step() << std::endl;
  for (int64_t s = (*session)->first_step(); s <= absl::GetFlag(FLAGS_steps); ++s) {
    auto report = (*session)->Step(
        [&](const std::vector<int64_t>& samples) { return CkptLossSum(*model, samples); });
    if (!report.ok()) {
      std::cerr << "step " << s << ": " << report.status() << std::endl;
      if ((*session)->preempted()) return evenstep::kPreemptedExitCode;
      return 2;
    }
    std::cout << "step " << s << " loss " << report->loss << " checkpoint_failures "
              << report->checkpoint_failures << std::endl;
    if (s == absl::GetFlag(FLAGS_signal_at_step) &&
        ctx.rank() == absl::GetFlag(FLAGS_signal_rank)) {
      raise(absl::GetFlag(FLAGS_signal) == "KILL" ? SIGKILL : SIGTERM);
    }
  }
  if (absl::GetFlag(FLAGS_evaluate)) {
    // A submodule already in eval mode (frozen, like a BatchNorm kept in
    // eval) must stay so after the evaluation; the rest go back to training.
    model[1]->eval();
    std::vector<int64_t> eval_lengths(300);
    for (size_t i = 0; i < eval_lengths.size(); ++i) eval_lengths[i] = 2 + (i * 7) % 23;
    auto sums = (*session)->Evaluate(eval_lengths, [&](const std::vector<int64_t>& samples) {
      int64_t longest = 0;
      for (int64_t i : samples) longest = std::max(longest, eval_lengths[i]);
      std::cout << "eval micro-batch samples " << samples.size() << " padded "
                << samples.size() * longest << std::endl;
      torch::Tensor x = torch::zeros({static_cast<int64_t>(samples.size()), 4});
      torch::Tensor loss = model->forward(x).pow(2).sum();
      return torch::stack({loss, torch::tensor(static_cast<double>(samples.size())),
                           torch::tensor(torch::GradMode::is_enabled() ? 1.0 : 0.0),
                           torch::tensor(model->is_training() ? 1.0 : 0.0),
                           torch::tensor(model[1]->is_training() ? 1.0 : 0.0),
                           torch::tensor(loss.requires_grad() ? 1.0 : 0.0)});
    });
    if (!sums.ok()) {
      std::cerr << "evaluate: " << sums.status() << std::endl;
      return 2;
    }
    std::cout << "eval samples " << (*sums)[1] << " grad_enabled " << (*sums)[2] << " training "
              << (*sums)[3] << " frozen_training " << (*sums)[4] << " requires_grad " << (*sums)[5]
              << std::endl;
    std::cout << "after eval training " << model->is_training() << " frozen_training "
              << model[1]->is_training() << " linear_training " << model[0]->is_training()
              << std::endl;
  }
  if (absl::Status done = (*session)->Finish(); !done.ok()) {
    std::cerr << "finish: " << done << std::endl;
    // A preemption agreed at the last step is saved by Finish.
    return (*session)->preempted() ? evenstep::kPreemptedExitCode : 2;
  }
  std::cout << "finished" << std::endl;
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  torch::set_num_threads(1);
  auto ctx = evenstep::DistContextFromFlags();
  if (!ctx.ok()) {
    std::cerr << ctx.status() << "\n";
    return 3;
  }
  return RunSession(**ctx);
}

// Rank program for the distributed checkpoint tests (train_checkpointer_test.cc):
//   ckpt_helper --mode=save --evenstep_ckpt_dir=D [--optimizer=adam] [--steps=3]
//     trains a few BalancedSteps, saves at the last step, waits for the
//     commit, prints "digest <hex>" of every model and optimizer tensor.
//     With --steps_after_save=N the digest is taken before the save and N
//     more steps run while the checkpoint is written (the snapshot must hold
//     the save step's state, not a later one).
//   ckpt_helper --mode=load --evenstep_ckpt_dir=D [--optimizer=adam]
//     builds the same model from another seed, loads the latest checkpoint
//     (any world size) and prints "digest <hex>", the step and the sampler
//     position it resumed.
//   ckpt_helper --mode=session --run_dir=R [--steps=N] [--evenstep_*]
//     trains through evenstep::Session (resume, periodic checkpoints, save
//     failure reports); prints "first step S", "step K loss L" per step and
//     "finished" after Finish(). --second_session: a second Session on the
//     same DistContext and a second DistContext must be refused first.
// --device=cuda puts the model (and so the optimizer state) on the GPU
// (tests/cuda_test.cc).
// Exit codes: 0 ok, 2 evenstep error, 3 init.
#include <torch/torch.h>
#include <xxhash.h>

#include <algorithm>
#include <csignal>
#include <cstdlib>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_format.h"
#include "evenstep/balanced_step.h"
#include "evenstep/dist_context.h"
#include "evenstep/flags.h"
#include "evenstep/session.h"
#include "evenstep/train_checkpointer.h"

ABSL_FLAG(std::string, mode, "save", "save, load or session");
ABSL_FLAG(std::string, run_dir, "", "--mode=session: the run directory.");
ABSL_FLAG(bool, second_session, false,
          "--mode=session: also try a second Session on the same DistContext and a second "
          "DistContext in this process (both must be refused), then train with the first.");
ABSL_FLAG(int, signal_at_step, 0,
          "--mode=session: after this step, --signal_rank raises --signal at itself.");
ABSL_FLAG(int, signal_rank, 1, "The rank that raises the signal.");
ABSL_FLAG(std::string, signal, "TERM",
          "TERM (a preemption notice) or KILL (the rank dies; a launcher restarts the group).");
ABSL_FLAG(bool, evaluate, false,
          "--mode=session: after training, Session::Evaluate on 300 held-out lengths, printing "
          "each evaluation micro-batch's padded tokens and the modes seen inside and after.");
ABSL_FLAG(std::string, optimizer, "adam", "sgd, adam, adamw, rmsprop or adagrad");
ABSL_FLAG(int, steps, 3, "Steps before the save.");
ABSL_FLAG(int, steps_after_save, 0,
          "--mode=save: steps run after Save returns, while the checkpoint is written.");
ABSL_FLAG(std::string, device, "cpu", "Where the model and its optimizer state live.");
ABSL_FLAG(bool, noncontiguous, false,
          "--mode=save/load: one more parameter, a transposed (non-contiguous) [width, 4] "
          "tensor in the loss, so it and its optimizer state are saved from strided memory.");
ABSL_FLAG(int64_t, width, 300, "Hidden width (>= 262144: tensors of over 1 MiB, loaded in place).");
ABSL_FLAG(int64_t, frozen_mb, 0,
          "--mode=session: a frozen parameter of this many MiB (like frozen embeddings): "
          "checkpointed, but neither synced nor stepped, so saves outlast steps.");

namespace {

torch::Device Device() { return torch::Device(absl::GetFlag(FLAGS_device)); }

// Scales by a buffer (model state that is not a parameter; the same on
// every rank, as DDP keeps buffers).
struct ScaleImpl : torch::nn::Module {
  explicit ScaleImpl(int64_t n) { scale = register_buffer("scale", torch::rand({n}) + 0.5); }
  torch::Tensor forward(torch::Tensor x) { return x * scale; }
  torch::Tensor scale;
};
TORCH_MODULE(Scale);

std::unique_ptr<torch::optim::Optimizer> MakeOptimizer(torch::nn::Module& model,
                                                       const std::string& name) {
  auto params = model.parameters();
  if (name == "sgd") {
    return std::make_unique<torch::optim::SGD>(params, torch::optim::SGDOptions(0.1).momentum(0.9));
  }
  if (name == "adamw") return std::make_unique<torch::optim::AdamW>(params);
  if (name == "rmsprop") {
    return std::make_unique<torch::optim::RMSprop>(
        params, torch::optim::RMSpropOptions(0.01).momentum(0.5).centered(true));
  }
  if (name == "adagrad") return std::make_unique<torch::optim::Adagrad>(params);
  return std::make_unique<torch::optim::Adam>(params,
                                              torch::optim::AdamOptions(1e-2).amsgrad(true));
}

std::string Digest(torch::nn::Module& model, torch::optim::Optimizer& optimizer) {
  auto tensors = evenstep::CaptureTensors(&model, &optimizer);
  std::sort(tensors->begin(), tensors->end(),
            [](const auto& a, const auto& b) { return a.first < b.first; });
  XXH64_state_t* state = XXH64_createState();
  XXH64_reset(state, 0);
  for (const auto& [name, t] : *tensors) {
    const at::Tensor c = t.contiguous().cpu();
    XXH64_update(state, name.data(), name.size());
    XXH64_update(state, c.data_ptr(), c.numel() * c.element_size());
    if (std::getenv("CKPT_DEBUG")) {
      std::cerr << name << " " << c.scalar_type() << " " << c.sizes() << " "
                << XXH64(c.data_ptr(), c.numel() * c.element_size(), 0) << "\n";
    }
  }
  const uint64_t h = XXH64_digest(state);
  XXH64_freeState(state);
  return absl::StrFormat("%016x (%d tensors)", h, tensors->size());
}

torch::Tensor LossSum(torch::nn::Module& model, const std::vector<int64_t>& samples) {
  torch::Tensor x = torch::zeros({static_cast<int64_t>(samples.size()), 4});
  for (size_t k = 0; k < samples.size(); ++k) x[k].fill_(samples[k] * 0.01);
  torch::Tensor loss = model.as<torch::nn::Sequential>()->forward(x.to(Device())).pow(2).sum();
  const auto own = model.named_parameters(/*recurse=*/false);
  if (const torch::Tensor* skew = own.find("skew")) {
    loss = loss + 1e-3 * skew->pow(2).sum();
  }
  return loss;
}

int RunSession(evenstep::DistContext& ctx) {
  torch::manual_seed(0);
  const int64_t width = absl::GetFlag(FLAGS_width);
  torch::nn::Sequential model(torch::nn::Linear(4, width), torch::nn::Tanh(), Scale(width),
                              torch::nn::Linear(width, 1));
  if (const int64_t mb = absl::GetFlag(FLAGS_frozen_mb); mb > 0) {
    model->register_parameter("frozen", torch::rand({mb << 18}), /*requires_grad=*/false);
  }
  auto optimizer = MakeOptimizer(*model, absl::GetFlag(FLAGS_optimizer));
  std::vector<int64_t> lengths(200);
  for (size_t i = 0; i < lengths.size(); ++i) lengths[i] = 1 + static_cast<int64_t>(i % 13);
  auto session =
      evenstep::Session::Create(ctx, *model, *optimizer, lengths, absl::GetFlag(FLAGS_run_dir));
  if (!session.ok()) {
    std::cerr << "session: " << session.status() << std::endl;
    return 2;
  }
  if (absl::GetFlag(FLAGS_second_session)) {
    torch::nn::Linear other(4, 1);
    auto other_optimizer = MakeOptimizer(*other, "sgd");
    auto second = evenstep::Session::Create(ctx, *other, *other_optimizer, lengths,
                                            absl::GetFlag(FLAGS_run_dir) + "/other");
    std::cout << "second session: " << second.status() << std::endl;
    auto second_ctx = evenstep::DistContext::CreateFromFlags();
    std::cout << "second context: " << second_ctx.status() << std::endl;
    if (second.ok() || second_ctx.ok()) return 1;
  }
  std::cout << "first step " << (*session)->first_step() << std::endl;
  for (int64_t s = (*session)->first_step(); s <= absl::GetFlag(FLAGS_steps); ++s) {
    auto report = (*session)->Step(
        [&](const std::vector<int64_t>& samples) { return LossSum(*model, samples); });
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
    return 2;
  }
  std::cout << "finished" << std::endl;
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  torch::set_num_threads(1);
  auto ctx = evenstep::DistContext::CreateFromFlags();
  if (!ctx.ok()) {
    std::cerr << ctx.status() << "\n";
    return 3;
  }
  const std::string mode = absl::GetFlag(FLAGS_mode);
  if (mode == "session") return RunSession(**ctx);
  const bool save = mode == "save";
  torch::manual_seed(save ? 0 : 99);
  const int64_t width = absl::GetFlag(FLAGS_width);
  torch::nn::Sequential model(torch::nn::Linear(4, width), torch::nn::Tanh(), Scale(width),
                              torch::nn::Linear(width, 1));
  if (absl::GetFlag(FLAGS_noncontiguous))
    model->register_parameter("skew", torch::rand({4, width}).t());
  model->to(Device());
  auto optimizer = MakeOptimizer(*model, absl::GetFlag(FLAGS_optimizer));
  auto config = evenstep::BalanceConfig::FromFlags();
  std::vector<int64_t> lengths(200);
  for (size_t i = 0; i < lengths.size(); ++i) lengths[i] = 1 + static_cast<int64_t>(i % 13);
  auto step = evenstep::BalancedStep::Create(**ctx, *model, *optimizer, lengths, *config);
  auto options = evenstep::CheckpointOptionsFromFlags();
  if (!step.ok() || !options.ok()) {
    std::cerr << (step.ok() ? options.status() : step.status()) << "\n";
    return 3;
  }
  auto ckpt = evenstep::TrainCheckpointer::Create(**ctx, *options);
  if (!ckpt.ok()) {
    std::cerr << ckpt.status() << "\n";
    return 3;
  }
  const evenstep::TrainState state{model.ptr().get(), optimizer.get(), step->get(),
                                   "{\"note\": \"hello\"}"};
  if (save) {
    auto train = [&](int steps) {
      for (int s = 1; s <= steps; ++s) {
        auto report = (*step)->Step(
            [](const evenstep::MicroBatch& mb) { return mb.samples; },
            [&](const std::vector<int64_t>& samples) { return LossSum(*model, samples); });
        if (!report.ok()) {
          std::cerr << report.status() << "\n";
          return false;
        }
      }
      return true;
    };
    if (!train(absl::GetFlag(FLAGS_steps))) return 2;
    const std::string saved = Digest(*model, *optimizer);
    auto ticket = (*ckpt)->Save(absl::GetFlag(FLAGS_steps), state);
    // The next steps write the parameters and the optimizer state while the
    // checkpoint is written.
    if (ticket.ok() && !train(absl::GetFlag(FLAGS_steps_after_save))) return 2;
    if (!ticket.ok() || !ticket->done.get().ok()) {
      std::cerr << (ticket.ok() ? ticket->done.get() : ticket.status()) << "\n";
      return 2;
    }
    // Every rank's part is durable; wait until the commit is visible.
    (*ctx)->Barrier().IgnoreError();
    std::cout << "digest " << saved << std::endl;
    if (absl::GetFlag(FLAGS_steps_after_save) > 0) {
      std::cout << "digest after " << Digest(*model, *optimizer) << std::endl;
    }
  } else {
    auto loaded = (*ckpt)->Load(state);
    if (!loaded.ok()) {
      std::cerr << loaded.status() << "\n";
      return 2;
    }
    std::cout << "loaded step " << loaded->step << " user " << loaded->user_json << " read "
              << loaded->bytes_read << " bytes, sampler at epoch " << (*step)->state().sampler.epoch
              << " step " << (*step)->state().sampler.step << std::endl;
    std::cout << "digest " << Digest(*model, *optimizer) << std::endl;
  }
  return 0;
}

// The loop-shaped form (Session::Batches + Session::Backward) against the
// callback form (Session::Step with a Loader) and the plain torch::data loop
// it replaces, side by side in one process (one rank): the same MLP, data,
// optimizer and batch of 64, each for the same number of steps after the
// same warm-up. It prints each form's mean step time and the ratios
// loop-shaped / callback (what the two stacks cost) and callback / plain
// (what a Session step costs on one rank: the exchange, logs, timing).
// Last line: SUMMARY {json}.
//   evenstep_bench_loop_form [--steps 300] [--quick]
#include <torch/torch.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <string>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_format.h"
#include "evenstep/evenstep.h"

ABSL_FLAG(bool, quick, false, "30 steps each (the smoke test).");
ABSL_FLAG(int, steps, 300, "Measured steps per form (full mode).");

namespace {

constexpr int64_t kBatch = 64, kIn = 128, kHidden = 512, kClasses = 10;

class Points : public torch::data::datasets::Dataset<Points> {
 public:
  explicit Points(int64_t n) : x_(torch::randn({n, kIn})), y_(torch::randint(0, kClasses, {n})) {}
  torch::data::Example<> get(size_t i) override {
    return {x_[static_cast<int64_t>(i)], y_[static_cast<int64_t>(i)]};
  }
  torch::optional<size_t> size() const override { return x_.size(0); }

 private:
  torch::Tensor x_, y_;
};

torch::nn::Sequential Mlp() {
  torch::manual_seed(0);
  return torch::nn::Sequential(torch::nn::Linear(kIn, kHidden), torch::nn::ReLU(),
                               torch::nn::Linear(kHidden, kClasses));
}

using Clock = std::chrono::steady_clock;
double Ms(Clock::duration d) { return std::chrono::duration<double, std::milli>(d).count(); }

// ms per step of the plain torch::data loop over `steps` steps.
double Plain(int steps, int64_t n) {
  auto model = Mlp();
  torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(0.01));
  auto loader = torch::data::make_data_loader<torch::data::samplers::SequentialSampler>(
      Points(n).map(torch::data::transforms::Stack<>()), kBatch);
  int done = 0;
  Clock::time_point begin;
  while (done < steps + 5) {
    for (auto& batch : *loader) {
      if (done == 5) begin = Clock::now();
      if (done++ == steps + 5) break;
      optimizer.zero_grad();
      torch::nn::functional::cross_entropy(model->forward(batch.data), batch.target).backward();
      optimizer.step();
    }
  }
  return Ms(Clock::now() - begin) / steps;
}

// ms per step of a Session in either form over `steps` steps.
double Evenstep(evenstep::DistContext& ctx, bool loop_shaped, int steps, int64_t n,
                const std::string& dir) {
  auto model = Mlp();
  torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(0.01));
  auto es = evenstep::Session::Create(ctx, *model, optimizer, evenstep::UniformLengths(n), dir);
  if (!es.ok()) {
    std::cerr << es.status() << std::endl;
    std::exit(1);
  }
  auto loader = evenstep::LoaderOf(Points(n).map(torch::data::transforms::Stack<>()));
  auto loss_of = [&](const torch::data::Example<>& b) {
    return torch::nn::functional::cross_entropy(model->forward(b.data), b.target);
  };
  Clock::time_point begin;
  int done = 0;
  while (done < steps + 5) {
    if (loop_shaped) {
      for (auto& batch : (*es)->Batches(loader)) {
        (*es)->Backward(loss_of(batch));
        if (!(*es)->step_ended()) continue;
        if (++done == 5) begin = Clock::now();
        if (done == steps + 5) break;
      }
    } else {
      if (!(*es)->Step(loader, loss_of).ok()) std::exit(1);
      if (++done == 5) begin = Clock::now();
    }
  }
  const double ms = Ms(Clock::now() - begin) / steps;
  (*es)->Finish().IgnoreError();
  return ms;
}

}  // namespace

int main(int argc, char** argv) {
  evenstep::SetFlagDefaults(
      "global_batch=64 loss_reduction=mean shuffle=false timeline=false balance=static "
      "data_workers=0");
  absl::ParseCommandLine(argc, argv);
  torch::set_num_threads(1);
  const int steps = absl::GetFlag(FLAGS_quick) ? 30 : absl::GetFlag(FLAGS_steps);
  const int64_t n = 64 * 64;
  auto ctx = evenstep::DistContextFromFlags();
  if (!ctx.ok()) {
    std::cerr << ctx.status() << std::endl;
    return 1;
  }
  const std::string dir = std::filesystem::temp_directory_path() /
                          ("evenstep_bench_loop_form_" + std::to_string(::getpid()));
  std::printf("loop form: %d steps of batch %ld (MLP %ld-%ld-%ld), one rank, one thread\n", steps,
              kBatch, kIn, kHidden, kClasses);
  const double plain = Plain(steps, n);
  const double callback = Evenstep(**ctx, false, steps, n, dir + "/callback");
  const double loop = Evenstep(**ctx, true, steps, n, dir + "/loop");
  std::filesystem::remove_all(dir);
  std::printf("  plain torch::data loop   %.3f ms/step\n", plain);
  std::printf("  Session::Step (callback) %.3f ms/step\n", callback);
  std::printf("  Session::Batches (loop)  %.3f ms/step\n", loop);
  std::printf("  loop-shaped / callback %.3f; callback / plain %.3f\n", loop / callback,
              callback / plain);
  std::printf(
      "SUMMARY {\"bench\": \"loop_form\", \"steps\": %d, \"plain_ms\": %.4f, \"callback_ms\": "
      "%.4f, \"loop_ms\": %.4f, \"loop_over_callback\": %.4f, \"callback_over_plain\": %.4f}\n",
      steps, plain, callback, loop, loop / callback, callback / plain);
  return 0;
}

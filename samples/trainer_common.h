// What the plain and the evenstep fortune trainers share besides the model:
// flags, data, evaluation sums, progress output and the test hooks. Keeping
// it here leaves only the distribution of the training loop different
// between samples/train_fortunes_plain.cc and samples/train_fortunes.cc.
#pragma once

#include <signal.h>
#include <torch/torch.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <numeric>
#include <random>
#include <string>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "evenstep/balanced_step.h"
#include "evenstep/dist_context.h"
#include "evenstep/flags.h"
#include "evenstep/session.h"
#include "evenstep/timeline.h"
#include "samples/byte_lm.h"
#include "samples/fortunes.h"

ABSL_FLAG(int, steps, 300, "Optimizer steps in total (a resumed run continues up to this).");
ABSL_FLAG(std::string, runs_dir, "runs", "Where runs live.");
ABSL_FLAG(std::string, run, "fortunes", "This run's name: RUNS_DIR/NAME.");
ABSL_FLAG(int, max_len, 192, "Bytes per fortune kept (longer ones are cut).");
ABSL_FLAG(int, dim, 64, "Model width.");
ABSL_FLAG(std::string, device, "cpu", "Where the model trains: cpu, cuda, cuda:1, ...");
ABSL_FLAG(std::string, fortunes_dir, "",
          "The fortune files; empty = $EVENSTEP_FORTUNES_DIR when set (scripts/gpu_check.sh "
          "sets it to the bundle's copy), else Debian's /usr/share/games/fortunes.");
ABSL_FLAG(int, layers, 2, "Transformer blocks.");
ABSL_FLAG(double, lr, 3e-3, "Adam learning rate.");
ABSL_FLAG(int, batch, 32, "Samples per optimizer step over all ranks (plain trainer).");
ABSL_FLAG(int, eval_every, 100, "Evaluate on the held-out fortunes every this many steps.");
ABSL_FLAG(int, log_every, 10, "Progress line every this many steps.");
ABSL_FLAG(bool, print_losses, false, "Print every step's global loss exactly (tests).");
ABSL_FLAG(int, kill_at_step, 0, "Rank 0 SIGKILLs itself after this step (the resume test).");
ABSL_FLAG(bool, trace, false,
          "Plain trainer: write RUN_DIR/trace-RRRRR.json like the evenstep trainer's timeline, for "
          "evenstep-report (bench/sample_vs_plain).");

namespace evenstep::samples {

struct Data {
  std::vector<std::string> train, eval;
};

// RUNS_DIR/NAME, created when missing; a directory that cannot be created
// stops the trainer with status 2 naming the flags, the directory and why.
inline std::string RunDir() {
  const std::string dir = absl::GetFlag(FLAGS_runs_dir) + "/" + absl::GetFlag(FLAGS_run);
  std::error_code error;
  std::filesystem::create_directories(dir, error);
  if (error) {
    std::cerr << "--runs_dir=" << absl::GetFlag(FLAGS_runs_dir)
              << " --run=" << absl::GetFlag(FLAGS_run) << ": cannot create the run directory "
              << dir << ": " << error.message() << std::endl;
    std::exit(2);
  }
  return dir;
}

// Fortunes cut to --max_len bytes; every 20th held out for evaluation.
inline absl::StatusOr<Data> LoadData() {
  std::string dir = absl::GetFlag(FLAGS_fortunes_dir);
  if (const char* env = std::getenv("EVENSTEP_FORTUNES_DIR"); dir.empty() && env != nullptr) {
    dir = env;
  }
  auto all = LoadFortunes(dir.empty() ? kFortunesDir : dir);
  if (!all.ok()) return all.status();
  Data d;
  for (size_t i = 0; i < all->size(); ++i) {
    std::string t = (*all)[i].substr(0, absl::GetFlag(FLAGS_max_len));
    (i % 20 == 0 ? d.eval : d.train).push_back(std::move(t));
  }
  return d;
}

// --device, checked: exits with status 2 naming the flag when it is not a
// device or names a CUDA device this process cannot use.
inline torch::Device DeviceFlag() {
  const std::string name = absl::GetFlag(FLAGS_device);
  std::string why;
  try {
    const torch::Device device(name);
    if (device.is_cpu()) return device;
    if (!device.is_cuda()) {
      why = "only cpu and cuda are supported by this sample";
    } else if (!torch::cuda::is_available()) {
      why = "this process sees no CUDA device (or this libtorch was built without CUDA)";
    } else if (device.has_index() &&
               device.index() >= static_cast<int64_t>(torch::cuda::device_count())) {
      why = absl::StrFormat("only %d CUDA devices here", torch::cuda::device_count());
    } else {
      return device;
    }
  } catch (const std::exception&) {
    why = "not a device (cpu, cuda, cuda:1, ...)";
  }
  std::cerr << "--device=" << name << ": " << why << std::endl;
  std::exit(2);
}

inline ByteLM MakeModel() {
  torch::manual_seed(0);
  ByteLM model(absl::GetFlag(FLAGS_dim), absl::GetFlag(FLAGS_layers), 4,
               absl::GetFlag(FLAGS_max_len));
  model->to(DeviceFlag());
  return model;
}

inline int64_t Tokens(const std::vector<std::string>& texts, const std::vector<int64_t>& ids) {
  int64_t n = 0;
  for (int64_t i : ids) n += static_cast<int64_t>(texts[i].size());
  return n;
}

// [loss sum, tokens] of some held-out fortunes.
inline torch::Tensor EvalSums(ByteLM& model, const std::vector<std::string>& texts,
                              const std::vector<int64_t>& ids) {
  torch::NoGradGuard no_grad;
  const torch::Tensor loss = LossSum(model, texts, ids);
  return torch::stack(
      {loss, torch::tensor(static_cast<float>(Tokens(texts, ids))).to(loss.device())});
}

// The same as the evaluation step of both trainers: a function of the ids.
inline auto EvalFn(ByteLM& model, const std::vector<std::string>& texts) {
  return [&model, &texts](const std::vector<int64_t>& ids) { return EvalSums(model, texts, ids); };
}

inline void PrintEval(int64_t step, double loss_sum, double tokens) {
  std::cout << absl::StrFormat("step %d eval loss %.4f (%.3f bits/byte)\n", step, loss_sum / tokens,
                               loss_sum / tokens / std::log(2.0));
}

// The plain trainer's timeline (--trace): its steps' phases recorded the way
// evenstep's Timeline records a BalancedStep (compute until the rank reaches
// the gradient all-reduce, sync, optimizer), so evenstep-report measures
// both trainers alike. Rank 0's duties between steps show as "other".
class PlainTrace {
 public:
  static PlainTrace& Get() {
    static PlainTrace* trace = new PlainTrace;  // closed by End of the last step
    return *trace;
  }
  void Begin(int rank, int64_t step) {
    if (!absl::GetFlag(FLAGS_trace)) return;
    if (timeline_ == nullptr) {
      auto opened = Timeline::Open(RunDir(), rank);
      if (!opened.ok()) std::cerr << "--trace: " << opened.status() << "\n";
      if (opened.ok()) timeline_ = std::move(*opened);
    }
    report_ = StepReport();
    report_.step = step;
    report_.begin = absl::Now();
  }
  void Arrived() { report_.arrived = absl::Now(); }
  void Synced() { report_.synced = absl::Now(); }
  void Span(const std::string& phase, absl::Time begin) {
    if (timeline_ != nullptr) timeline_->Span(phase, begin, absl::Now(), report_.step);
  }
  void End(int64_t last_step) {
    if (timeline_ == nullptr || report_.step == 0) return;
    report_.end = absl::Now();
    report_.micro = {MicroTiming{report_.begin, report_.begin, report_.arrived}};
    report_.optimizer_begin = report_.synced;
    report_.optimizer = report_.end - report_.synced;
    timeline_->AddStep(report_);
    if (report_.step == last_step) (void)timeline_->Close();
  }

 private:
  std::unique_ptr<Timeline> timeline_;
  StepReport report_;
};

// Prints the error; main's exit status.
// The exit status for `status`: kPreemptedExitCode for a preemption stop
// (Session saved the step; CANCELLED comes from nothing else here), else 1.
inline int Fail(const absl::Status& status) {
  std::cerr << status << "\n";
  return evenstep::ExitCode(status);
}

// The progress line (rank 0) and the test hooks, after every step.
class Progress {
 public:
  explicit Progress(int64_t first) : first_(first) {}

  // `tokens`: this step's tokens over all ranks; `balance` < 0: not measured.
  void After(int rank, int64_t step, double loss, double tokens, double balance) {
    const int64_t steps = absl::GetFlag(FLAGS_steps);
    tokens_ += tokens;
    PlainTrace::Get().End(steps);
    if (absl::GetFlag(FLAGS_print_losses) && rank == 0) {
      std::cout << absl::StrFormat("loss %d %.9g", step, loss) << std::endl;
    }
    if (step == absl::GetFlag(FLAGS_kill_at_step) && rank == 0) ::kill(::getpid(), SIGKILL);
    if (rank != 0 || (step % absl::GetFlag(FLAGS_log_every) != 0 && step != steps)) return;
    const double elapsed = absl::ToDoubleSeconds(absl::Now() - start_);
    const int done = static_cast<int>(20.0 * step / steps);
    std::cout << absl::StrFormat(
                     "step %d/%d loss %.4f  %.0f tokens/s  balance %s  [%s%s]  %.0fs left", step,
                     steps, loss, tokens_ / elapsed,
                     balance < 0 ? "-" : absl::StrFormat("%.3f", balance), std::string(done, '#'),
                     std::string(20 - done, '.'), elapsed / (step - first_ + 1) * (steps - step))
              << std::endl;
    if (step == steps) {
      std::cout << absl::StrFormat("done: %d steps in %.1fs, %.0f tokens/s\n", step - first_ + 1,
                                   elapsed, tokens_ / elapsed);
    }
  }

 private:
  const int64_t first_;
  const absl::Time start_ = absl::Now();
  double tokens_ = 0;
};

// --- The usual practice, for the plain trainer --------------------------

// A fixed shuffle of the training set.
inline std::vector<int64_t> ShuffledOrder(size_t n) {
  std::vector<int64_t> order(n);
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), std::mt19937(0));
  return order;
}

// This rank's samples of step `step`: every world-th of the global batch
// (equal sample counts, whatever their lengths).
inline std::vector<int64_t> RankSlice(const std::vector<int64_t>& order, int64_t step, int rank,
                                      int world) {
  const int64_t batch = absl::GetFlag(FLAGS_batch);
  PlainTrace::Get().Begin(rank, step);
  std::vector<int64_t> mine;
  for (int64_t k = rank; k < batch; k += world) {
    mine.push_back(order[((step - 1) * batch + k) % order.size()]);
  }
  return mine;
}

// Gradients all-reduced one tensor at a time after backward, then averaged.
inline void AllReduceGradients(ByteLM& model, DistContext& ctx) {
  PlainTrace::Get().Arrived();
  for (auto& p : model->parameters()) {
    std::vector<at::Tensor> grads{p.grad()};
    ctx.data_group().allreduce(grads)->wait();
    p.mutable_grad().div_(ctx.world_size());
  }
  PlainTrace::Get().Synced();
}

// The mean over ranks of a per-rank mean loss.
inline double GlobalMean(DistContext& ctx, const torch::Tensor& loss) {
  at::Tensor global = loss.detach() / ctx.world_size();
  (void)ctx.AllReduce(global);
  return global.item<double>();
}

// Rank 0 evaluates the whole held-out set while the others wait.
inline void EvalOnRank0(int rank, int64_t step, ByteLM& model,
                        const std::vector<std::string>& eval) {
  if (rank != 0) return;
  const absl::Time begin = absl::Now();
  torch::Tensor sums = torch::zeros({2});
  for (size_t b = 0; b < eval.size(); b += 16) {
    std::vector<int64_t> ids(16);
    std::iota(ids.begin(), ids.end(), static_cast<int64_t>(b));
    ids.resize(std::min<size_t>(16, eval.size() - b));
    sums += EvalSums(model, eval, ids).cpu();
  }
  PrintEval(step, sums[0].item<double>(), sums[1].item<double>());
  PlainTrace::Get().Span("eval", begin);
}

// --- Both ---------------------------------------------------------------

// Generated text and where the run's files are.
inline void PrintSample(ByteLM& model) {
  std::cout << "\nsample: " << Generate(model, "The ", 200, absl::GetFlag(FLAGS_max_len), 1)
            << "\nrun: " << RunDir() << "\n";
}

}  // namespace evenstep::samples

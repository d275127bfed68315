// Rank program of the model-parts tests (parts_test.cc): a small GAN — a
// discriminator and a generator, each with its own Adam — trained through one
// evenstep::Session with two ModelParts, beside a single-process reference
// trained on the whole global batch in the same process (the same global
// batches, read from the Session). The reference runs the plain GAN loop:
// the discriminator's step on real samples and detached fakes, then the
// generator's step through the (already stepped) discriminator.
//
// Every sample's noise comes from a generator seeded by (epoch, sample), so
// the fakes do not depend on how the global batch is split. The
// discriminator's learning rate follows a function of the step
// (Session::ScheduleLearningRate), the generator's a torch::optim::StepLR
// stepped every step (Session::Schedule); the reference applies the same.
// The loop's running sum of generator losses is its user state. Step sums
// (Session::DeclareSum / AddToSum): the samples seen and the real samples the
// discriminator calls real, checked against the reference every step.
// --bad=undeclared_sum adds to a sum never declared: the step fails naming it.
//
//   parts_helper --run_dir D [--steps N] [--preempt_at K] [--dropout] [--bad B]
//                [--evenstep_*...]
//
// --preempt_at: rank 0 sends itself SIGTERM before step K; the Session saves
// step K and returns CANCELLED, and rank 0 prints "preempted at step K
// d_loss X g_loss Y" from Session::last_report(). --bad: a misuse whose
// error is printed (exit 3): dup_name, shared_param, one_loss, no_part.
//
// Rank 0 prints "step S d_loss X g_loss Y" per step, then "parts ok max_rel_diff E"
// (or MISMATCH lines; not with --dropout, whose masks the reference cannot
// repeat) and "final <checksum> running <sum>".
// Exit codes: 0 passed, 1 mismatch, 2 Session error, 3 init, 83 preempted.
#include <torch/torch.h>

#include <cmath>
#include <csignal>
#include <cstdio>
#include <iostream>
#include <stdexcept>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "evenstep/dist_context.h"
#include "evenstep/flags.h"
#include "evenstep/session.h"

ABSL_FLAG(std::string, run_dir, "", "The Session's run directory.");
ABSL_FLAG(int, steps, 5, "Optimizer steps (of both parts).");
ABSL_FLAG(int, preempt_at, 0, "Rank 0 sends itself SIGTERM before this step (0 = never).");
ABSL_FLAG(std::string, bad, "", "A misuse: dup_name, shared_param, one_loss, no_part.");
ABSL_FLAG(int, throw_at, 0,
          "Rank 1's generator loss throws in this step (0 = never): every rank prints the "
          "step's error and goes on (no reference comparison).");
ABSL_FLAG(bool, dropout, false, "Dropout in the discriminator (reseeded per micro-batch).");
ABSL_FLAG(int, samples, 60, "Samples in the dataset.");

namespace {

constexpr int kData = 4, kNoise = 3, kHidden = 8;

struct Nets {
  torch::nn::Sequential d, g;
};

Nets MakeNets(bool dropout) {
  torch::manual_seed(7);  // the same initial values on every rank and in the reference
  Nets n;
  n.d = torch::nn::Sequential(torch::nn::Linear(kData, kHidden), torch::nn::Tanh());
  if (dropout) n.d->push_back(torch::nn::Dropout(0.2));
  n.d->push_back(torch::nn::Linear(kHidden, 1));
  n.g = torch::nn::Sequential(torch::nn::Linear(kNoise, kHidden), torch::nn::Tanh(),
                              torch::nn::Linear(kHidden, kData));
  return n;
}

torch::Tensor Real(const std::vector<int64_t>& samples) {
  std::vector<float> v;
  for (int64_t s : samples) {
    for (int j = 0; j < kData; ++j) v.push_back(std::sin(0.37f * s + j) + 0.1f * j);
  }
  return torch::tensor(v).view({static_cast<int64_t>(samples.size()), kData});
}

torch::Tensor Noise(const std::vector<int64_t>& samples, int64_t epoch) {
  std::vector<torch::Tensor> rows;
  for (int64_t s : samples) {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(1000003 * epoch + s);
    rows.push_back(at::randn({kNoise}, gen));
  }
  return torch::stack(rows);
}

torch::Tensor Bce(const torch::Tensor& logits, double label) {
  return torch::binary_cross_entropy_with_logits(logits, torch::full_like(logits, label), {}, {},
                                                 at::Reduction::Sum);
}

// Sums of the GAN losses over `samples` (the micro-batch's or the whole batch's).
torch::Tensor DLoss(Nets& n, const std::vector<int64_t>& samples, int64_t epoch) {
  const torch::Tensor fake = n.g->forward(Noise(samples, epoch)).detach();
  return Bce(n.d->forward(Real(samples)), 1) + Bce(n.d->forward(fake), 0);
}
torch::Tensor GLoss(Nets& n, const std::vector<int64_t>& samples, int64_t epoch) {
  return Bce(n.d->forward(n.g->forward(Noise(samples, epoch))), 1);
}

double DLr(int64_t step, int64_t /*epoch*/) { return 0.01 / (1 + 0.1 * step); }

double Checksum(torch::nn::Module& m) {
  double sum = 0;
  int k = 1;
  for (const auto& p : m.parameters()) sum += (k++) * p.to(torch::kDouble).sum().item<double>();
  return sum;
}

}  // namespace

int main(int argc, char** argv) {
  if (!evenstep::ParseEvenstepFlags(&argc, argv).ok()) return 3;
  absl::ParseCommandLine(argc, argv);
  const bool dropout = absl::GetFlag(FLAGS_dropout);
  auto ctx = evenstep::DistContext::Create(*evenstep::DistOptions::FromFlags());
  if (!ctx.ok()) {
    std::cerr << ctx.status() << "\n";
    return 3;
  }
  const int rank = (*ctx)->rank();
  Nets nets = MakeNets(dropout), ref = MakeNets(dropout);
  torch::optim::Adam d_opt(nets.d->parameters(), torch::optim::AdamOptions(0.01));
  torch::optim::Adam g_opt(nets.g->parameters(), torch::optim::AdamOptions(0.02));
  torch::optim::Adam d_ref(ref.d->parameters(), torch::optim::AdamOptions(0.01));
  torch::optim::Adam g_ref(ref.g->parameters(), torch::optim::AdamOptions(0.02));
  torch::optim::StepLR g_decay(g_opt, /*step_size=*/2, /*gamma=*/0.5);
  torch::optim::StepLR g_ref_decay(g_ref, 2, 0.5);
  const std::vector<int64_t> lengths(absl::GetFlag(FLAGS_samples), 1);
  const std::string bad = absl::GetFlag(FLAGS_bad);
  std::vector<evenstep::ModelPart> parts = {{"discriminator", *nets.d, d_opt},
                                            {"generator", *nets.g, g_opt}};
  if (bad == "dup_name") parts[1].name = "discriminator";
  if (bad == "shared_param") parts[1] = {"generator", *nets.d, g_opt};
  if (bad == "no_part") parts.clear();
  auto es = evenstep::Session::Create(**ctx, parts, lengths, absl::GetFlag(FLAGS_run_dir));
  if (!es.ok()) {
    std::cout << "create failed: " << es.status() << std::endl;
    return 3;
  }
  (*es)->DeclareSum("samples");
  (*es)->DeclareSum("real_called_real");
  // Setup misuse: nothing is returned; the next Step fails naming it.
  if (bad == "sum_twice") (*es)->DeclareSum("samples");
  if (bad == "schedule_unknown_part") (*es)->ScheduleLearningRate(DLr, "critic");
  if (bad == "sum_twice" || bad == "schedule_unknown_part") {
    auto report =
        (*es)->Step({[&](const evenstep::MicroBatch& mb) {
                       std::cout << "A STEP RAN" << std::endl;
                       return DLoss(nets, mb.samples, 0);
                     },
                     [&](const evenstep::MicroBatch& mb) { return GLoss(nets, mb.samples, 0); }});
    std::cout << "setup misuse: " << report.status() << std::endl;
    return report.ok() ? 0 : 3;
  }
  if (bad == "undeclared_sum") {
    auto report =
        (*es)->Step({[&](const evenstep::MicroBatch& mb) {
                       (*es)->AddToSum("typo", 1.0);
                       return DLoss(nets, mb.samples, 0);
                     },
                     [&](const evenstep::MicroBatch& mb) { return GLoss(nets, mb.samples, 0); }});
    std::cout << "undeclared sum: " << report.status() << std::endl;
    return report.ok() ? 0 : 3;
  }
  if (bad == "one_loss") {
    auto report = (*es)->Step([&](const std::vector<int64_t>& s) { return DLoss(nets, s, 0); });
    std::cout << "one loss: " << report.status() << std::endl;
    return report.ok() ? 0 : 3;
  }
  (*es)->ScheduleLearningRate(DLr, "discriminator");
  (*es)->Schedule(g_decay, evenstep::Session::Every::kStep);
  double running = 0;  // the loop's own state: the sum of the generator's losses so far
  if ((*es)->resumed_user_state() != "{}") running = std::stod((*es)->resumed_user_state());
  (*es)->set_user_state([&running](const evenstep::StepReport& r) { running += r.part_losses[1]; },
                        [&running] {
                          char text[64];
                          std::snprintf(text, sizeof(text), "%.17g", running);
                          return std::string(text);
                        });
  int code = 0;
  const bool compare = !dropout && (*es)->first_step() == 1 && absl::GetFlag(FLAGS_throw_at) == 0;
  const int steps = absl::GetFlag(FLAGS_steps);
  for (int64_t s = (*es)->first_step(); s <= steps; ++s) {
    if (s == absl::GetFlag(FLAGS_preempt_at) && rank == 0) std::raise(SIGTERM);
    const int64_t epoch = (*es)->epoch();
    auto report = (*es)->Step({
        [&](const evenstep::MicroBatch& mb) {
          (*es)->AddToSum("samples", static_cast<double>(mb.samples.size()));
          (*es)->AddToSum("real_called_real", (nets.d->forward(Real(mb.samples)) > 0).sum());
          return DLoss(nets, mb.samples, epoch);
        },
        [&](const evenstep::MicroBatch& mb) {
          if (s == absl::GetFlag(FLAGS_throw_at) && rank == 1) {
            throw std::runtime_error("the generator's loss failed");
          }
          return GLoss(nets, mb.samples, epoch);
        },
    });
    if (!report.ok() && s == absl::GetFlag(FLAGS_throw_at)) {
      std::printf("step %lld failed: %s\n", static_cast<long long>(s),
                  std::string(report.status().ToString()).c_str());
      continue;  // the caller goes on with the next step
    }
    if (!report.ok() && (*es)->preempted()) {
      const evenstep::StepReport& last = (*es)->last_report();
      if (rank == 0) {
        std::printf("preempted at step %lld d_loss %.9g g_loss %.9g\n",
                    static_cast<long long>(last.step), last.part_losses[0], last.part_losses[1]);
      }
      std::fflush(stdout);
      return evenstep::kPreemptedExitCode;
    }
    if (!report.ok()) {
      std::cerr << "rank " << rank << ": " << report.status() << "\n";
      return 2;
    }
    if (rank == 0) {
      std::printf("step %lld d_loss %.9g g_loss %.9g\n", static_cast<long long>(s),
                  report->part_losses[0], report->part_losses[1]);
    }
    if (!compare) continue;
    // The plain loop on the whole global batch.
    const std::vector<int64_t>& batch = (*es)->balanced_step().global_batch().samples;
    const double n = static_cast<double>(batch.size());
    const double called_real = (ref.d->forward(Real(batch)) > 0).sum().item<double>();
    if (report->sums.at("samples") != n || report->sums.at("real_called_real") != called_real) {
      std::printf(
          "MISMATCH rank %d step %lld sums: samples %g (want %g), real_called_real %g (want %g)\n",
          rank, static_cast<long long>(s), report->sums.at("samples"), n,
          report->sums.at("real_called_real"), called_real);
      code = 1;
    }
    for (auto& g : d_ref.param_groups()) g.options().set_lr(DLr(s, epoch));
    d_ref.zero_grad();
    (DLoss(ref, batch, epoch) / n).backward();
    d_ref.step();
    g_ref.zero_grad();
    (GLoss(ref, batch, epoch) / n).backward();
    g_ref.step();
    g_ref_decay.step();
  }
  if (absl::Status f = (*es)->Finish(); !f.ok()) {
    std::cerr << "rank " << rank << ": " << f << "\n";
    return 2;
  }
  if (compare) {
    double worst = 0;
    auto check = [&](torch::nn::Module& mine, torch::nn::Module& theirs, const char* part) {
      auto a = mine.named_parameters(), b = theirs.named_parameters();
      for (const auto& p : a) {
        const torch::Tensor want = b[p.key()];
        const double rel =
            ((p.value() - want).abs().max() / (want.abs().max() + 1e-12)).item<double>();
        worst = std::max(worst, rel);
        if (rel > 1e-5) {
          std::printf("MISMATCH rank %d %s.%s relative %.3g\n", rank, part, p.key().c_str(), rel);
          code = 1;
        }
      }
    };
    check(*nets.d, *ref.d, "discriminator");
    check(*nets.g, *ref.g, "generator");
    if (code == 0) std::printf("parts ok rank %d max_rel_diff %.3g\n", rank, worst);
  }
  if (rank == 0 || absl::GetFlag(FLAGS_throw_at) > 0) {
    std::printf("final %.12g %.12g running %.12g lr %.9g %.9g\n", Checksum(*nets.d),
                Checksum(*nets.g), running, d_opt.param_groups()[0].options().get_lr(),
                g_opt.param_groups()[0].options().get_lr());
  }
  std::fflush(stdout);
  return code;
}

// Several models in one Session, a small GAN over real ranks: a
// discriminator and a generator, each with its own Adam, trained through one
// evenstep::Session with two ModelParts beside the plain single-process GAN
// loop on the whole global batch (the same batches, read from the Session):
// the discriminator's step on real samples and detached fakes, then the
// generator's step through the (already stepped) discriminator. Both parts'
// parameters equal the plain loop's after 5 steps; a preempted run resumes
// both parts, their optimizers, the learning-rate schedules, the reseeded
// dropout and the loop's own state exactly; a throw in one part is abandoned
// on every rank alike; misuse is refused by name. Each scenario's per-rank
// code and checks sit inside its TEST (RunOnRanks).
//
// Every sample's noise comes from a generator seeded by (epoch, sample), so
// the fakes do not depend on how the global batch is split. The
// discriminator's learning rate follows a function of the step
// (Session::ScheduleLearningRate), the generator's a torch::optim::StepLR
// stepped every step (Session::Schedule); the plain loop applies the same.
// The loop's running sum of generator losses is its user state. Step sums
// (Session::DeclareSum / AddToSum): the samples seen and the real samples the
// discriminator calls real, checked against the plain loop every step.
#include <torch/torch.h>

#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "absl/algorithm/container.h"
#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "evenstep/flags.h"
#include "evenstep/loader.h"
#include "evenstep/session.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/on_ranks.h"

namespace evenstep {
namespace {

using ::evenstep::testing::OnRanksOptions;
using ::evenstep::testing::RanksDir;
using ::evenstep::testing::RunOnRanks;
using ::testing::HasSubstr;

constexpr int kData = 4, kNoise = 3, kHidden = 8;

struct Nets {
  torch::nn::Sequential d, g;
};

Nets MakeNets(bool dropout) {
  torch::manual_seed(7);  // the same initial values on every rank and in the plain loop
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

// Three ranks get 6, 6 and 5 samples of each global batch of 17, in
// micro-batches of at most 2: uneven shares, several micro-batches.
void SetSessionFlags() {
  absl::SetFlag(&FLAGS_evenstep_balance, "static");
  absl::SetFlag(&FLAGS_evenstep_global_batch, 17);
  absl::SetFlag(&FLAGS_evenstep_micro_batch_samples, 2);
  absl::SetFlag(&FLAGS_evenstep_timeline, false);
}

// A GAN and its plain single-process loop; the rank's Session over both parts.
struct Gan {
  explicit Gan(bool dropout)
      : nets(MakeNets(dropout)),
        plain(MakeNets(dropout)),
        d_opt(nets.d->parameters(), torch::optim::AdamOptions(0.01)),
        g_opt(nets.g->parameters(), torch::optim::AdamOptions(0.02)),
        d_plain(plain.d->parameters(), torch::optim::AdamOptions(0.01)),
        g_plain(plain.g->parameters(), torch::optim::AdamOptions(0.02)),
        g_decay(g_opt, /*step_size=*/2, /*gamma=*/0.5),
        g_plain_decay(g_plain, 2, 0.5) {}
  std::vector<ModelPart> Parts() {
    return {{"discriminator", *nets.d, d_opt}, {"generator", *nets.g, g_opt}};
  }
  // The plain loop's step on the whole global batch `batch` at `step`.
  void PlainStep(const std::vector<int64_t>& batch, int64_t step, int64_t epoch) {
    const double n = static_cast<double>(batch.size());
    for (auto& group : d_plain.param_groups()) group.options().set_lr(DLr(step, epoch));
    d_plain.zero_grad();
    (DLoss(plain, batch, epoch) / n).backward();
    d_plain.step();
    g_plain.zero_grad();
    (GLoss(plain, batch, epoch) / n).backward();
    g_plain.step();
    g_plain_decay.step();
  }
  // Both parts' parameters equal the plain loop's (to float rounding).
  void ExpectEqualToPlain(const std::string& when) {
    auto expect_equal = [&](torch::nn::Module& mine, torch::nn::Module& plain, const char* part) {
      auto want = plain.named_parameters();
      for (const auto& p : mine.named_parameters()) {
        const torch::Tensor w = want[p.key()];
        EXPECT_LE(((p.value() - w).abs().max() / (w.abs().max() + 1e-12)).item<double>(), 1e-5)
            << part << "." << p.key() << "'s relative difference from the plain loop's, " << when;
      }
    };
    expect_equal(*nets.d, *plain.d, "discriminator");
    expect_equal(*nets.g, *plain.g, "generator");
  }
  // "final <checksums> running <sum> lr <rates>": what a resumed run must end with.
  std::string FinalLine(double running) {
    return absl::StrFormat("final %.12g %.12g running %.12g lr %.9g %.9g", Checksum(*nets.d),
                           Checksum(*nets.g), running, d_opt.param_groups()[0].options().get_lr(),
                           g_opt.param_groups()[0].options().get_lr());
  }

  Nets nets, plain;
  torch::optim::Adam d_opt, g_opt, d_plain, g_plain;
  torch::optim::StepLR g_decay, g_plain_decay;
};

struct GanCase {
  std::string run_dir;
  int steps = 5;
  int preempt_at = 0;  // rank 0 sends itself SIGTERM before this step
  int throw_at = 0;    // rank 1's generator loss throws in this step
  bool dropout = false;
};

// What a rank's loop saw: rank 0's "step S d_loss X g_loss Y" lines (and
// "preempted at step ..." when the Session was), each failed step's error.
struct GanRun {
  int64_t first_step = 0;
  std::vector<std::string> lines;
  std::vector<std::string> failed;
  bool preempted = false;
  std::string final_line;
};

std::string LossLine(const char* what, int64_t step, const StepReport& r) {
  return absl::StrFormat("%s %d d_loss %.9g g_loss %.9g", what, step, r.part_losses[0],
                         r.part_losses[1]);
}

// The GAN's loop through a Session. Without dropout (whose masks the plain
// loop cannot repeat) and run from step 1 without a throw, EXPECTs every
// step's sums and both parts' final parameters to match the plain loop.
GanRun TrainGan(DistContext& dist, const GanCase& c) {
  SetSessionFlags();
  Gan gan(c.dropout);
  GanRun run;
  auto es = Session::Create(dist, gan.Parts(), std::vector<int64_t>(60, 1), c.run_dir);
  EXPECT_TRUE(es.ok()) << es.status();
  if (!es.ok()) return run;
  Session& session = **es;
  session.DeclareSum("samples");
  session.DeclareSum("real_called_real");
  session.ScheduleLearningRate(DLr, "discriminator");
  session.Schedule(gan.g_decay, Session::Every::kStep);
  double running = 0;  // the loop's own state: the sum of the generator's losses so far
  if (session.resumed_user_state() != "{}") running = std::stod(session.resumed_user_state());
  session.set_user_state([&running](const StepReport& r) { running += r.part_losses[1]; },
                         [&running] { return absl::StrFormat("%.17g", running); });
  run.first_step = session.first_step();
  const bool compare = !c.dropout && session.first_step() == 1 && c.throw_at == 0;
  const int rank = dist.rank();
  for (int64_t s = session.first_step(); s <= c.steps; ++s) {
    if (s == c.preempt_at && rank == 0) std::raise(SIGTERM);
    const int64_t epoch = session.epoch();
    auto report = session.Step({
        [&](const MicroBatch& mb) {
          session.AddToSum("samples", static_cast<double>(mb.samples.size()));
          session.AddToSum("real_called_real", (gan.nets.d->forward(Real(mb.samples)) > 0).sum());
          return DLoss(gan.nets, mb.samples, epoch);
        },
        [&](const MicroBatch& mb) {
          if (s == c.throw_at && rank == 1) throw std::runtime_error("the generator's loss failed");
          return GLoss(gan.nets, mb.samples, epoch);
        },
    });
    if (!report.ok() && session.preempted()) {
      // The preempted step returned its report; this Step saved it.
      run.preempted = true;
      run.lines.push_back(absl::StrCat("preempted after step ", session.last_report().step));
      return run;
    }
    if (!report.ok()) {
      run.failed.push_back(absl::StrCat("step ", s, ": ", report.status().ToString()));
      continue;  // the caller goes on with the next step
    }
    run.lines.push_back(LossLine("step", s, *report));
    if (!compare) continue;
    const std::vector<int64_t>& batch = session.balanced_step().global_batch().samples;
    const double called_real = (gan.plain.d->forward(Real(batch)) > 0).sum().item<double>();
    EXPECT_EQ(report->sums.at("samples"), batch.size()) << "step " << s;
    EXPECT_EQ(report->sums.at("real_called_real"), called_real) << "step " << s;
    gan.PlainStep(batch, s, epoch);
  }
  EXPECT_TRUE(session.Finish().ok());
  if (compare) gan.ExpectEqualToPlain("after the last step");
  run.final_line = gan.FinalLine(running);
  return run;
}

class PartsWorldTest : public ::testing::TestWithParam<int> {};

TEST_P(PartsWorldTest, BothPartsEqualThePlainLoopOnTheWholeBatch) {
  RunOnRanks(GetParam(), [](DistContext& dist) {
    GanCase c;
    c.run_dir = RanksDir() + "/run";
    const GanRun run = TrainGan(dist, c);
    EXPECT_EQ(run.lines.size(), 5u);
    EXPECT_TRUE(run.failed.empty()) << run.failed[0];
  });
}

INSTANTIATE_TEST_SUITE_P(Worlds, PartsWorldTest, ::testing::Values(1, 2, 3),
                         [](const auto& info) { return absl::StrCat("world", info.param); });

// The loop-shaped form with both parts (Session::Batches): the loop's body
// as a plain GAN loop writes it, the fakes made once (detached for the
// discriminator's loss, through the stepped discriminator for the
// generator's) and each model's zero_grad kept. The first Backward steps
// the discriminator on every rank before the body goes on, so every step
// equals the plain loop on the whole global batch; 2 epochs of 4 steps,
// uneven shares on 3 ranks (6, 6 and 5 of 17).
TEST_P(PartsWorldTest, TheLoopsBodyStepsEachPartAsThePlainLoopDoes) {
  RunOnRanks(GetParam(), [](DistContext& dist) {
    SetSessionFlags();
    absl::SetFlag(&FLAGS_evenstep_micro_batch_samples, 0);  // one micro-batch per rank and step
    Gan gan(false);
    auto es = Session::Create(dist, gan.Parts(), std::vector<int64_t>(68, 1), RanksDir() + "/run");
    ASSERT_TRUE(es.ok()) << es.status();
    Session& session = **es;
    session.ScheduleLearningRate(DLr, "discriminator");
    session.Schedule(gan.g_decay, Session::Every::kStep);
    Loader<std::vector<int64_t>> loader([](const MicroBatch& mb) { return mb.samples; });
    int bodies = 0;
    for (int64_t epoch = session.first_epoch(); epoch < 2; ++epoch) {
      for (auto& samples : session.Batches(loader)) {
        gan.nets.d->zero_grad();
        const torch::Tensor fake = gan.nets.g->forward(Noise(samples, epoch));
        session.Backward(Bce(gan.nets.d->forward(Real(samples)), 1) +
                         Bce(gan.nets.d->forward(fake.detach()), 0));
        gan.nets.g->zero_grad();
        session.Backward(Bce(gan.nets.d->forward(fake), 1));
        ++bodies;
        ASSERT_TRUE(session.step_ended()) << "one micro-batch per rank and step";
        const int64_t step = session.last_report().step;
        gan.PlainStep(session.balanced_step().global_batch().samples, step, epoch);
        gan.ExpectEqualToPlain(absl::StrCat("step ", step));
      }
      ASSERT_FALSE(session.stopped());
    }
    EXPECT_EQ(bodies, 8);
    EXPECT_TRUE(session.Finish().ok());
  });
}

// A loop over Batches of the GAN's two parts, micro-batches capped at `cap`
// samples, whose body passes the first `backwards` of its two losses: the
// bodies that ran, and Finish's status.
std::pair<int, absl::Status> LoopGan(DistContext& dist, int64_t cap, int backwards) {
  SetSessionFlags();
  absl::SetFlag(&FLAGS_evenstep_micro_batch_samples, cap);
  Gan gan(false);
  auto es = Session::Create(dist, gan.Parts(), std::vector<int64_t>(68, 1), RanksDir() + "/run");
  if (!es.ok()) return {0, es.status()};
  Session& session = **es;
  Loader<std::vector<int64_t>> loader([](const MicroBatch& mb) { return mb.samples; });
  int bodies = 0;
  for (auto& samples : session.Batches(loader)) {
    ++bodies;
    session.Backward(DLoss(gan.nets, samples, 0));
    if (backwards > 1) session.Backward(GLoss(gan.nets, samples, 0));
  }
  EXPECT_TRUE(session.stopped());
  EXPECT_EQ(session.last_report().step, 0) << "no step completed";
  return {bodies, session.Finish()};
}

// A body that passes one loss for two parts, and a micro-batch cap the
// loop-shaped form cannot keep: named, on every rank, and no rank hangs.
TEST(PartsLoopTest, ABodyWithOneBackwardForTwoPartsIsNamedOnEveryRank) {
  RunOnRanks(2, [](DistContext& dist) {
    const auto [bodies, status] = LoopGan(dist, /*cap=*/0, /*backwards=*/1);
    EXPECT_EQ(bodies, 1);
    EXPECT_THAT(status.ToString(),
                HasSubstr(absl::StrCat("rank ", dist.rank(), ", step 1, part 'generator'")));
    EXPECT_THAT(status.ToString(),
                HasSubstr("the loop's body called Session::Backward 1 time(s) for micro-batch 1 "
                          "of this run, but the Session has 2 model parts"));
  });
}

TEST(PartsLoopTest, AMicroBatchCapIsRefusedByNameBeforeAnyStep) {
  RunOnRanks(2, [](DistContext& dist) {
    const auto [bodies, status] = LoopGan(dist, /*cap=*/2, /*backwards=*/2);
    EXPECT_EQ(bodies, 0);
    EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition) << status;
    EXPECT_THAT(status.message(),
                HasSubstr("runs each rank's share of a step as one micro-batch (its body runs "
                          "part 2's loss after part 1 has stepped), but "
                          "--evenstep_micro_batch_samples=2 would cut it into several"));
  });
}

// Rank 0's lines of the run named `name` (written by the ranks into RanksDir()).
std::vector<std::string> LinesOf(const std::string& name) {
  std::vector<std::string> lines =
      absl::StrSplit(evenstep::testing::ReadRanksFile(name + ".txt"), '\n');
  if (lines.back().empty()) lines.pop_back();  // after the last line's newline
  return lines;
}

TEST(PartsTest, APreemptedRunResumesBothPartsSchedulesRandomStreamsAndLoopState) {
  // Dropout in the discriminator: its masks come from the per-micro-batch
  // reseeding, so the resumed steps repeat them. Three runs of two ranks:
  // "whole" uninterrupted, "preempted" at step 4, "resumed" from it.
  OnRanksOptions whole;
  whole.env = {{"GAN_RUN", "whole"}};
  RunOnRanks(
      2,
      [](DistContext& dist) {
        absl::SetFlag(&FLAGS_evenstep_ckpt_every, 0);
        const std::string name = std::getenv("GAN_RUN");
        GanCase c;
        c.run_dir = RanksDir() + (name == "whole" ? "/whole" : "/split");
        c.steps = 7;
        c.dropout = true;
        c.preempt_at = name == "preempted" ? 4 : 0;
        const GanRun run = TrainGan(dist, c);
        EXPECT_EQ(run.preempted, name == "preempted");
        EXPECT_EQ(run.first_step, name == "resumed" ? 5 : 1);
        if (dist.rank() != 0) return;
        std::string text;
        for (const std::string& line : run.lines) absl::StrAppend(&text, line, "\n");
        evenstep::testing::WriteRanksFile(name + ".txt", absl::StrCat(text, run.final_line, "\n"));
      },
      whole);
  OnRanksOptions preempted, resumed;
  preempted.env = {{"GAN_RUN", "preempted"}};
  resumed.env = {{"GAN_RUN", "resumed"}};
  evenstep::testing::RunOnRanksAgain(2, preempted);
  evenstep::testing::RunOnRanksAgain(2, resumed);
  const std::vector<std::string> want = LinesOf("whole"), first = LinesOf("preempted"),
                                 second = LinesOf("resumed");
  ASSERT_EQ(want.size(), 8u);    // steps 1-7 and the final line
  ASSERT_EQ(first.size(), 6u);   // steps 1-4, the stop, the (empty) final line
  ASSERT_EQ(second.size(), 4u);  // steps 5-7 and the final line
  // The preempted step's report reached the loop: the uninterrupted run's step 4.
  for (int s = 0; s < 4; ++s) EXPECT_EQ(first[s], want[s]);
  EXPECT_EQ(first[4], "preempted after step 4");
  for (int s = 0; s < 3; ++s) EXPECT_EQ(second[s], want[4 + s]);
  EXPECT_EQ(second[3], want[7]) << "the parameters, running state and rates after step 7";
}

TEST(PartsTest, AThrowInTheSecondPartAbandonsItOnEveryRankAndTheRanksGoOnAlike) {
  // Rank 1's generator loss throws in step 3: every rank's Step returns
  // ABORTED naming rank 1, the part and the micro-batch; the discriminator
  // has stepped (as in the plain loop), the generator has not, on every rank
  // alike; steps 4 and 5 run, and both ranks end with the same parameters.
  RunOnRanks(2, [](DistContext& dist) {
    GanCase c;
    c.run_dir = RanksDir() + "/run";
    c.throw_at = 3;
    const GanRun run = TrainGan(dist, c);
    ASSERT_EQ(run.failed.size(), 1u);
    EXPECT_THAT(run.failed[0], HasSubstr("step 3: ABORTED"));
    EXPECT_THAT(run.failed[0], HasSubstr("step 3, part 'generator', micro-batch "));
    EXPECT_THAT(run.failed[0], HasSubstr("abandoned on every rank: rank(s) 1 failed"));
    if (dist.rank() == 1) {
      EXPECT_THAT(run.failed[0], HasSubstr("rank 1, step 3, part 'generator', micro-batch 1 of "
                                           "4: the generator's loss failed"));
    }
    ASSERT_EQ(run.lines.size(), 4u);
    EXPECT_THAT(run.lines.back(), HasSubstr("step 5 d_loss"));
    // Both ranks end alike: their final lines (both parts' parameter
    // checksums, the running state, the rates), gathered.
    at::Tensor line = torch::zeros({256}, torch::kUInt8);
    for (size_t i = 0; i < run.final_line.size() && i < 256; ++i) line[i] = run.final_line[i];
    std::vector<at::Tensor> finals;
    ASSERT_TRUE(dist.AllGather(line, &finals).ok());
    EXPECT_TRUE(torch::equal(finals[0], finals[1]))
        << "rank " << dist.rank() << ": " << run.final_line;
  });
}

// The sync-safety program classes through a Session's parts: an encoder
// with a sparse embedding (SGD) and a decoder on its detached features
// (Adam); a rank with no sample in a step (a global batch smaller than the
// world) or 1 to 3 micro-batches per rank; after every step rank 0 runs a
// probe backward through both parts outside the Step and zeroes the
// gradients (the encoder's in place: libtorch 1.13 leaves its sparse
// gradient with every dimension sparse; the decoder's to none); in step 3
// the decoder loss throws on the rank holding the global batch's first
// sample. Every step's parameters equal one process running the plain loop
// on the step's whole global batch (skipping the decoder's update in step
// 3), and step 3 fails alike on every rank. (The idle rank of world 3 once
// waited out the collective timeout here: outside its part's loop it did
// not join the vote on an out-of-memory retry that its peers held.)
struct ProgramCase {
  int world;
  const char* shape;  // "idle", "micro1", "micro3"
  friend void PrintTo(const ProgramCase& c, std::ostream* os) {
    *os << "world " << c.world << " " << c.shape;
  }
};

struct Coder {
  Coder() {
    torch::manual_seed(11);
    encoder = std::make_shared<torch::nn::Module>();
    emb = encoder->register_module(
        "emb", torch::nn::Embedding(torch::nn::EmbeddingOptions(11, 4).sparse(true)));
    lin = encoder->register_module("lin", torch::nn::Linear(4, 4));
    decoder = torch::nn::Linear(4, 1);
  }
  torch::Tensor Features(const std::vector<int64_t>& samples) {
    std::vector<int64_t> ids;
    for (int64_t s : samples) ids.push_back(s % 11);
    return torch::tanh(lin->forward(emb->forward(torch::tensor(ids, torch::kLong))));
  }
  // Sums over `samples` of each part's loss.
  torch::Tensor EncoderLoss(const std::vector<int64_t>& samples) {
    return (Features(samples) - Real(samples)).pow(2).sum();
  }
  torch::Tensor DecoderLoss(const std::vector<int64_t>& samples, bool detach = true) {
    torch::Tensor f = Features(samples);
    return decoder->forward(detach ? f.detach() : f).pow(2).sum();
  }
  std::shared_ptr<torch::nn::Module> encoder;
  torch::nn::Embedding emb{nullptr};
  torch::nn::Linear lin{nullptr}, decoder{nullptr};
};

class PartsProgramTest : public ::testing::TestWithParam<ProgramCase> {};

TEST_P(PartsProgramTest, EveryStepEqualsOneProcessOrFailsAlike) {
  const ProgramCase c = GetParam();
  RunOnRanks(c.world, [c](DistContext& dist) {
    const int rank = dist.rank();
    const std::string shape = c.shape;
    SetSessionFlags();
    absl::SetFlag(&FLAGS_evenstep_global_batch, shape == "idle" ? c.world - 1 : 17);
    // micro3: at most 3 micro-batches per rank (17 samples, 2 or 3 ranks).
    absl::SetFlag(&FLAGS_evenstep_micro_batch_samples, shape == "micro3" ? 3 : 0);
    Coder mine, ref;
    torch::optim::SGD enc_opt(mine.encoder->parameters(), torch::optim::SGDOptions(0.1));
    torch::optim::Adam dec_opt(mine.decoder->parameters(), torch::optim::AdamOptions(0.01));
    torch::optim::SGD enc_ref(ref.encoder->parameters(), torch::optim::SGDOptions(0.1));
    torch::optim::Adam dec_ref(ref.decoder->parameters(), torch::optim::AdamOptions(0.01));
    auto es = Session::Create(
        dist, {{"encoder", *mine.encoder, enc_opt}, {"decoder", *mine.decoder, dec_opt}},
        std::vector<int64_t>(60, 1), RanksDir() + "/run");
    ASSERT_TRUE(es.ok()) << es.status();
    Session& session = **es;
    for (int64_t s = 1; s <= 5; ++s) {
      int micro_batches = 0;
      auto report = session.Step({
          [&](const MicroBatch& mb) {
            ++micro_batches;
            return mine.EncoderLoss(mb.samples);
          },
          [&](const MicroBatch& mb) {
            const int64_t first = session.balanced_step().global_batch().samples.front();
            if (s == 3 && absl::c_linear_search(mb.samples, first)) {
              throw std::runtime_error("the decoder's loss failed");
            }
            return mine.DecoderLoss(mb.samples);
          },
      });
      const std::vector<int64_t>& batch = session.balanced_step().global_batch().samples;
      const double n = static_cast<double>(batch.size());
      enc_ref.zero_grad();
      (ref.EncoderLoss(batch) / n).backward();
      enc_ref.step();
      if (s == 3) {
        ASSERT_FALSE(report.ok()) << "rank " << rank;
        EXPECT_THAT(std::string(report.status().message()),
                    HasSubstr("abandoned on every rank: rank(s) "))
            << "rank " << rank;
      } else {
        ASSERT_TRUE(report.ok()) << "rank " << rank << " step " << s << ": " << report.status();
        dec_ref.zero_grad();
        (ref.DecoderLoss(batch) / n).backward();
        dec_ref.step();
      }
      if (shape == "idle") {
        EXPECT_LE(micro_batches, 1) << "rank " << rank << " step " << s;
      } else if (shape == "micro3") {
        EXPECT_LE(micro_batches, 3) << "rank " << rank << " step " << s;
      }
      auto expect_near = [&](torch::nn::Module& a, torch::nn::Module& b, const char* part) {
        auto want = b.named_parameters();
        for (const auto& p : a.named_parameters()) {
          const torch::Tensor w = want[p.key()];
          EXPECT_LE(((p.value() - w).abs().max() / (w.abs().max() + 1e-12)).item<double>(), 1e-5)
              << "rank " << rank << " step " << s << " " << part << "." << p.key();
        }
      };
      expect_near(*mine.encoder, *ref.encoder, "encoder");
      expect_near(*mine.decoder, *ref.decoder, "decoder");
      if (rank == 0) {  // the probe: a backward through both parts outside the Step
        mine.DecoderLoss({1, 2, 3}, /*detach=*/false).backward();
        enc_opt.zero_grad();  // in place in libtorch 1.13 (sparse: every dimension sparse)
        for (auto& p : mine.decoder->parameters()) p.mutable_grad() = torch::Tensor();
      }
    }
    EXPECT_TRUE(session.Finish().ok());
  });
}

INSTANTIATE_TEST_SUITE_P(Shapes, PartsProgramTest,
                         ::testing::Values(ProgramCase{2, "idle"}, ProgramCase{3, "idle"},
                                           ProgramCase{2, "micro1"}, ProgramCase{3, "micro1"},
                                           ProgramCase{2, "micro3"}, ProgramCase{3, "micro3"}),
                         [](const auto& info) {
                           return absl::StrCat("world", info.param.world, "_", info.param.shape);
                         });

// A misuse of the Session's parts and sums: refused by name on every rank,
// before any loss function runs (setup misuse fails the next Step).
struct Misuse {
  const char* name;
  const char* message;
  friend void PrintTo(const Misuse& m, std::ostream* os) { *os << m.name; }
};

class PartsMisuseTest : public ::testing::TestWithParam<Misuse> {};

TEST_P(PartsMisuseTest, IsRefusedByName) {
  const Misuse m = GetParam();
  RunOnRanks(2, [m](DistContext& dist) {
    SetSessionFlags();
    const std::string bad = m.name;
    Gan gan(false);
    std::vector<ModelPart> parts = gan.Parts();
    if (bad == "dup_name") parts[1].name = "discriminator";
    if (bad == "shared_param") parts[1] = {"generator", *gan.nets.d, gan.g_opt};
    if (bad == "no_part") parts.clear();
    auto es = Session::Create(dist, parts, std::vector<int64_t>(60, 1), RanksDir() + "/run");
    absl::Status status = es.status();
    bool ran = false;
    auto d_loss = [&](const MicroBatch& mb) {
      ran = true;
      if (bad == "undeclared_sum") (*es)->AddToSum("typo", 1.0);
      return DLoss(gan.nets, mb.samples, 0);
    };
    auto g_loss = [&](const MicroBatch& mb) { return GLoss(gan.nets, mb.samples, 0); };
    if (es.ok()) {
      (*es)->DeclareSum("samples");
      if (bad == "sum_twice") (*es)->DeclareSum("samples");
      if (bad == "schedule_unknown_part") (*es)->ScheduleLearningRate(DLr, "critic");
      if (bad == "one_loss") {
        status = (*es)
                     ->Step([&](const std::vector<int64_t>& s) { return DLoss(gan.nets, s, 0); })
                     .status();
      } else {
        status = (*es)->Step({d_loss, g_loss}).status();
      }
    }
    EXPECT_FALSE(status.ok());
    EXPECT_THAT(status.ToString(), HasSubstr(m.message));
    if (bad != "undeclared_sum") EXPECT_FALSE(ran) << "a loss function ran";
  });
}

INSTANTIATE_TEST_SUITE_P(
    Cases, PartsMisuseTest,
    ::testing::Values(
        Misuse{"dup_name", "model part name 'discriminator': given twice"},
        Misuse{"shared_param",
               "a parameter is in two model parts, part 'discriminator' (0.weight) and part "
               "'generator' (0.weight)"},
        Misuse{"no_part", "no model part"},
        Misuse{"one_loss", "this step has 2 model parts: Step takes one loss function per part"},
        Misuse{"undeclared_sum",
               "AddToSum('typo'): not declared (DeclareSum before the first step)"},
        Misuse{"sum_twice", "DeclareSum('samples'), rank"},
        Misuse{"schedule_unknown_part", "Session::ScheduleLearningRate"}),
    [](const auto& info) { return std::string(info.param.name); });

}  // namespace
}  // namespace evenstep

#include "tests/testing/ckpt_model.h"

#include <xxhash.h>

#include <algorithm>
#include <cstdlib>
#include <fstream>

#include "absl/flags/flag.h"
#include "absl/strings/str_format.h"
#include "evenstep/balanced_step.h"
#include "evenstep/flags.h"
#include "evenstep/train_checkpointer.h"
#include "gtest/gtest.h"
#include "tests/testing/on_ranks.h"

namespace evenstep::testing {

namespace {
// Scales by a buffer (the same on every rank, as DDP keeps buffers).
struct ScaleImpl : torch::nn::Module {
  explicit ScaleImpl(int64_t n) { scale = register_buffer("scale", torch::rand({n}) + 0.5); }
  torch::Tensor forward(torch::Tensor x) { return x * scale; }
  torch::Tensor scale;
};
TORCH_MODULE(Scale);

// The checkpointer and BalancedStep of `run`, through the flags a trainer sets.
void SetCkptFlags(const CkptRun& run) {
  absl::SetFlag(&FLAGS_evenstep_ckpt_dir, run.dir);
  if (run.slice_mb > 0) absl::SetFlag(&FLAGS_evenstep_ckpt_slice_mb, run.slice_mb);
  absl::SetFlag(&FLAGS_evenstep_global_batch, 24);
  absl::SetFlag(&FLAGS_evenstep_micro_batch_samples, 5);
}

// The model, optimizer, BalancedStep and checkpointer of `run` on `dist`.
struct Trainer {
  Trainer(DistContext& dist, const CkptRun& run, int seed)
      : model(MakeCkptModel(run.width, run.noncontiguous, run.device, seed)),
        optimizer(MakeCkptOptimizer(*model, run.optimizer)) {
    SetCkptFlags(run);
    auto config = BalanceConfigFromFlags();
    auto options = CheckpointOptionsFromFlags();
    EXPECT_TRUE(config.ok() && options.ok());
    if (!config.ok() || !options.ok()) return;
    auto s = BalancedStep::Create(dist, *model, *optimizer, CkptLengths(), *config);
    auto c = TrainCheckpointer::Create(dist, *options);
    EXPECT_TRUE(s.ok()) << s.status();
    EXPECT_TRUE(c.ok()) << c.status();
    if (s.ok()) step = std::move(*s);
    if (c.ok()) ckpt = std::move(*c);
  }
  bool ok() const { return step != nullptr && ckpt != nullptr; }
  TrainState State() {
    return TrainState{model.ptr().get(), optimizer.get(), step.get(), "{\"note\": \"hello\"}"};
  }
  bool Train(int steps) {
    for (int s = 1; s <= steps; ++s) {
      auto report = step->Step(
          [](const MicroBatch& mb) { return mb.samples; },
          [&](const std::vector<int64_t>& samples) { return CkptLossSum(*model, samples); });
      EXPECT_TRUE(report.ok()) << report.status();
      if (!report.ok()) return false;
    }
    return true;
  }

  torch::nn::Sequential model;
  std::unique_ptr<torch::optim::Optimizer> optimizer;
  std::unique_ptr<BalancedStep> step;
  std::unique_ptr<TrainCheckpointer> ckpt;
};
}  // namespace

torch::nn::Sequential MakeCkptModel(int64_t width, bool noncontiguous, torch::Device device,
                                    int seed) {
  torch::manual_seed(seed);
  torch::nn::Sequential model(torch::nn::Linear(4, width), torch::nn::Tanh(), Scale(width),
                              torch::nn::Linear(width, 1));
  if (noncontiguous) model->register_parameter("skew", torch::rand({4, width}).t());
  model->to(device);
  return model;
}

std::unique_ptr<torch::optim::Optimizer> MakeCkptOptimizer(torch::nn::Module& model,
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

torch::Tensor CkptLossSum(torch::nn::Module& model, const std::vector<int64_t>& samples) {
  torch::Tensor x = torch::zeros({static_cast<int64_t>(samples.size()), 4});
  for (size_t k = 0; k < samples.size(); ++k) x[k].fill_(samples[k] * 0.01);
  const torch::Device device = model.parameters().front().device();
  torch::Tensor loss = model.as<torch::nn::Sequential>()->forward(x.to(device)).pow(2).sum();
  const auto own = model.named_parameters(/*recurse=*/false);
  if (const torch::Tensor* skew = own.find("skew")) loss = loss + 1e-3 * skew->pow(2).sum();
  return loss;
}

std::vector<int64_t> CkptLengths() {
  std::vector<int64_t> lengths(200);
  for (size_t i = 0; i < lengths.size(); ++i) lengths[i] = 1 + static_cast<int64_t>(i % 13);
  return lengths;
}

std::string StateDigest(torch::nn::Module& model, torch::optim::Optimizer& optimizer) {
  auto tensors = CaptureTensors(&model, &optimizer);
  std::sort(tensors->begin(), tensors->end(),
            [](const auto& a, const auto& b) { return a.first < b.first; });
  XXH64_state_t* state = XXH64_createState();
  XXH64_reset(state, 0);
  for (const auto& [name, t] : *tensors) {
    const at::Tensor c = t.contiguous().cpu();
    XXH64_update(state, name.data(), name.size());
    XXH64_update(state, c.data_ptr(), c.numel() * c.element_size());
  }
  const uint64_t h = XXH64_digest(state);
  XXH64_freeState(state);
  return absl::StrFormat("%016x (%d tensors)", h, tensors->size());
}

SavedState SaveCheckpoint(DistContext& dist, const CkptRun& run) {
  Trainer t(dist, run, /*seed=*/0);
  SavedState saved;
  if (!t.ok() || !t.Train(run.steps)) return saved;
  saved.at_save = StateDigest(*t.model, *t.optimizer);
  auto ticket = t.ckpt->Save(run.steps, t.State());
  EXPECT_TRUE(ticket.ok()) << ticket.status();
  if (!ticket.ok()) return saved;
  // The next steps write the parameters and the optimizer state while the
  // checkpoint is written.
  t.Train(run.steps_after_save);
  const absl::Status done = ticket->done.get();
  EXPECT_TRUE(done.ok()) << done;
  EXPECT_TRUE(dist.Barrier().ok());  // every rank's part is durable and the commit visible
  saved.after = StateDigest(*t.model, *t.optimizer);
  return saved;
}

LoadedState LoadCheckpoint(DistContext& dist, const CkptRun& run) {
  Trainer t(dist, run, /*seed=*/99);
  LoadedState loaded;
  if (!t.ok()) return loaded;
  auto result = t.ckpt->Load(t.State());
  EXPECT_TRUE(result.ok()) << result.status();
  if (!result.ok()) return loaded;
  loaded.digest = StateDigest(*t.model, *t.optimizer);
  loaded.step = result->step;
  loaded.user_json = result->user_json;
  loaded.bytes_read = result->bytes_read;
  loaded.sampler_epoch = t.step->state().sampler.epoch;
  loaded.sampler_step = t.step->state().sampler.step;
  return loaded;
}

void SaveOrLoadOnRank(DistContext& dist, CkptRun run) {
  const char* mode = std::getenv("CKPT_MODE");
  const std::string digest_file = RanksDir() + "/saved_digest";
  run.dir = RanksDir() + "/ckpt";
  if (mode != nullptr && std::string(mode) == "save") {
    const SavedState saved = SaveCheckpoint(dist, run);
    if (run.steps_after_save > 0) {
      EXPECT_NE(saved.after, saved.at_save) << "the steps after the save changed nothing";
    }
    if (dist.rank() == 0) std::ofstream(digest_file) << saved.at_save;
    return;
  }
  std::string want;
  std::getline(std::ifstream(digest_file), want);
  const LoadedState loaded = LoadCheckpoint(dist, run);
  EXPECT_FALSE(want.empty()) << "no digest from the save run";
  EXPECT_EQ(loaded.digest, want) << "the state loaded on rank " << dist.rank();
  EXPECT_EQ(loaded.step, run.steps);
  EXPECT_EQ(loaded.user_json, "{\"note\":\"hello\"}");
  EXPECT_EQ(loaded.sampler_epoch, 0);
  EXPECT_EQ(loaded.sampler_step, run.steps);
  if (dist.world_size() > 1 && dist.rank() == 0) {
    EXPECT_GT(loaded.bytes_read, 0) << "each rank reads its part of the bytes";
  }
}

}  // namespace evenstep::testing

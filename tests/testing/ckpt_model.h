// The checkpoint tests' model and their save and load scenarios
// (train_checkpointer_test, cuda_test; ckpt_helper's Session trainer uses the
// model): Linear(4, width), Tanh, a per-feature scale held in a buffer
// (model state that is not a parameter), Linear(width, 1), optionally a
// transposed (non-contiguous) [width, 4] parameter in the loss, so it and its
// optimizer state are saved from strided memory.
#pragma once

#include <torch/torch.h>

#include <memory>
#include <string>
#include <vector>

#include "evenstep/dist_context.h"

namespace evenstep::testing {

// The model from `seed`, on `device`.
torch::nn::Sequential MakeCkptModel(int64_t width, bool noncontiguous, torch::Device device,
                                    int seed);
// sgd, adam (amsgrad), adamw, rmsprop (centered, momentum) or adagrad.
std::unique_ptr<torch::optim::Optimizer> MakeCkptOptimizer(torch::nn::Module& model,
                                                           const std::string& name);
// The sum of the squared outputs for `samples` (inputs from their indices).
torch::Tensor CkptLossSum(torch::nn::Module& model, const std::vector<int64_t>& samples);
// 200 samples of lengths 1-13.
std::vector<int64_t> CkptLengths();
// XXH64 over every model and optimizer tensor's name and bytes, sorted by
// name: "<hex> (<n> tensors)".
std::string StateDigest(torch::nn::Module& model, torch::optim::Optimizer& optimizer);

struct CkptRun {
  std::string dir;  // the checkpoint root
  std::string optimizer = "adam";
  int64_t width = 300;  // >= 262144: tensors of over 1 MiB, read and broadcast in place
  bool noncontiguous = false;
  torch::Device device = torch::kCPU;
  double slice_mb = 0;       // --evenstep_ckpt_slice_mb when > 0
  int steps = 3;             // BalancedSteps before the save (global batch 24, micro 5)
  int steps_after_save = 0;  // run while the checkpoint is written
};

// Trains `steps` BalancedSteps, saves, runs `steps_after_save` more while
// the checkpoint is written and waits for the commit (EXPECTed). The
// digests of the state at the save and after the later steps.
struct SavedState {
  std::string at_save, after;
};
SavedState SaveCheckpoint(DistContext& dist, const CkptRun& run);

// Loads the newest checkpoint into the model built from another seed.
struct LoadedState {
  std::string digest;
  int64_t step = 0;
  std::string user_json;
  int64_t bytes_read = 0;
  int64_t sampler_epoch = -1, sampler_step = -1;
};
LoadedState LoadCheckpoint(DistContext& dist, const CkptRun& run);

// The body of a save run and then load runs (RunOnRanks, RunOnRanksAgain):
// with CKPT_MODE=save in the environment it saves (EXPECTing that the steps
// after the save changed the state, when there are any) and leaves rank 0's
// digest at the save in RanksDir(); with CKPT_MODE=load it loads and
// EXPECTs that digest bit for bit, step 3, the user extras and the sampler
// position (epoch 0, step 3). `run.dir` is RanksDir()/ckpt.
void SaveOrLoadOnRank(DistContext& dist, CkptRun run);

}  // namespace evenstep::testing

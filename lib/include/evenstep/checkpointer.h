// Checkpointer: saves and restores a training run — model parameters and
// buffers, optimizer state (SGD, Adam, AdamW, RMSprop, Adagrad), the balancing
// state (sampler position, plan) and user extras — as sharded asynchronous
// checkpoints (io/checkpoint.h), and loads them at any world size.
//
//   auto ckpt = evenstep::Checkpointer::Create(*ctx, *evenstep::CheckpointOptionsFromFlags());
//   auto loaded = (*ckpt)->LoadLatest({model.get(), &optimizer, step.get()});  // resume
//   ...
//   (*ckpt)->Save(s, {model.get(), &optimizer, step.get()});   // blocks for the snapshot only
//
// Tensor names in a checkpoint: "model/<parameter or buffer name>",
// "optimizer/<group>/<index in group>/<field>" (e.g. exp_avg, step) and
// "optimizer/<group>/lr". Extras hold {"balance": {...}, "user": ...}.
//
// Loading: every rank reads the manifest, reads a byte-balanced part of the
// tensors (checksums verified) and broadcasts it; no rank reads every byte.
// Thread-safety: one training thread; Save and Load are collective.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "evenstep/checkpoint.h"

namespace torch {
namespace nn {
class Module;
}
namespace optim {
class Optimizer;
}
}  // namespace torch

namespace evenstep {

class DistContext;
class BalancedStep;

// What a checkpoint covers; null members are skipped.
struct TrainState {
  torch::nn::Module* model = nullptr;
  torch::optim::Optimizer* optimizer = nullptr;
  BalancedStep* balance = nullptr;
  std::string user_json = "{}";
};

struct LoadOptions {
  // Strict: every model tensor must be in the checkpoint with the same shape
  // and dtype and nothing unexpected may be there (errors name the tensor).
  // Non-strict: loads what matches and lists the rest.
  bool strict = true;
  // A checkpoint directory; empty = the latest committed one.
  std::string path;
};

struct LoadResult {
  int64_t step = 0;
  std::string path;
  std::string user_json = "{}";
  std::vector<std::string> missing;     // model tensors not in the checkpoint
  std::vector<std::string> unexpected;  // checkpoint tensors the model lacks
  int64_t bytes_read = 0;               // by this rank
};

// --evenstep_ckpt_* flags: dir, keep, in_flight, when_busy, slice_mb.
absl::StatusOr<CheckpointOptions> CheckpointOptionsFromFlags();

class Checkpointer {
 public:
  static absl::StatusOr<std::unique_ptr<Checkpointer>> Create(DistContext& ctx,
                                                              CheckpointOptions options);
  ~Checkpointer();

  // Snapshot (the only stall) and background write of `state` at `step`.
  absl::StatusOr<SaveTicket> Save(int64_t step, const TrainState& state);
  // NotFound when there is no committed checkpoint (start from scratch).
  absl::StatusOr<LoadResult> Load(const TrainState& state, const LoadOptions& options = {});
  absl::Status WaitAll();
  const CheckpointOptions& options() const { return options_; }

 private:
  Checkpointer(DistContext& ctx, CheckpointOptions options, std::unique_ptr<CommitStore> store,
               std::unique_ptr<CheckpointWriter> writer);
  DistContext& ctx_;
  CheckpointOptions options_;
  std::unique_ptr<CommitStore> store_;
  std::unique_ptr<CheckpointWriter> writer_;
};

// Named tensors of a model and optimizer as a checkpoint holds them (exposed
// for tools and tests). InvalidArgument naming the optimizer type when its
// state cannot be captured.
absl::StatusOr<std::vector<std::pair<std::string, at::Tensor>>> CaptureTensors(
    torch::nn::Module* model, torch::optim::Optimizer* optimizer);

}  // namespace evenstep

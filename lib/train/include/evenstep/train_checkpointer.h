// TrainCheckpointer: saves and restores a training run — model parameters and
// buffers, optimizer state (SGD, Adam, AdamW, RMSprop, Adagrad), the balancing
// state (sampler position, plan) and user extras — as sharded asynchronous
// checkpoints (io/checkpoint_writer.h, checkpoint_reader.h), and loads them at any world size.
//
//   auto ckpt = evenstep::TrainCheckpointer::Create(*ctx, *evenstep::CheckpointOptionsFromFlags());
//   auto loaded = (*ckpt)->Load({model.get(), &optimizer, step.get()});  // resume
//   ...
//   (*ckpt)->Save(s, {model.get(), &optimizer, step.get()});   // blocks for the snapshot only
//
// Tensor names in a checkpoint: "model/<parameter or buffer name>",
// "optimizer/<group>/<index in group>/<field>" (e.g. exp_avg, step) and
// "optimizer/<group>/lr"; a named optimizer's (TrainState::optimizers, a
// Session with several model parts) "optimizer-<name>/...". Extras hold
// {"balance": {...}, "user": ...}.
//
// Loading: every rank reads the manifest, reads a byte-balanced part of the
// tensors (checksums verified) and broadcasts it; no rank reads every byte.
// Thread-safety: one training thread; Save and Load are collective.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "evenstep/checkpoint_reader.h"
#include "evenstep/checkpoint_writer.h"
#include "evenstep/named_tensor.h"
#include "evenstep/torch_fwd.h"

namespace evenstep {

class DistContext;
class BalancedStep;

// What a checkpoint covers; null members are skipped.
struct TrainState {
  torch::nn::Module* model = nullptr;
  torch::optim::Optimizer* optimizer = nullptr;
  BalancedStep* balance = nullptr;
  std::string user_json = "{}";
  // More optimizers, by name (one per model part): saved and loaded like
  // `optimizer`, under "optimizer-<name>".
  std::vector<std::pair<std::string, torch::optim::Optimizer*>> optimizers;
  // More tensors under their own names ("stream/<name>": a Session's
  // stream state), the same on every rank: saved as they are and loaded in
  // place (checked like model tensors).
  NamedTensors tensors;
};

struct LoadOptions {
  // Strict: every model tensor must be in the checkpoint with the same shape
  // and dtype and nothing unexpected may be there (errors name the tensor).
  // Non-strict: loads what matches and lists the rest.
  bool strict = true;
  // A checkpoint directory; empty = the newest committed one in the
  // TrainCheckpointer's directory.
  std::string path;
  // With `path` empty: when the newest committed checkpoint cannot be
  // opened, validated or read (a corrupt or missing file), set it aside
  // (renamed to step-N.unusable-T) and load the next older one, and so on;
  // LoadResult::skipped says what was skipped. A checkpoint that does not
  // fit the live model or optimizer is never skipped: that is an error.
  bool fallback = false;
};

struct LoadResult {
  int64_t step = 0;
  std::string path;
  std::string user_json = "{}";
  std::vector<std::string> missing;     // model tensors not in the checkpoint
  std::vector<std::string> unexpected;  // checkpoint tensors the model lacks
  int64_t bytes_read = 0;               // by this rank
  std::vector<std::string> skipped;     // with fallback: each unusable checkpoint and why
  // Shards (this rank's share: i % world == rank) whose HDF5 structure is
  // damaged although their data's checksums hold: the load read the right
  // bytes by offset, but h5py and evenstep-ckpt cannot read those files.
  // Each was said in one line on this rank.
  std::vector<std::string> structure_problems;
};

// From the --evenstep_ckpt_* flags: CheckpointOptionsFromFlags() (evenstep/flags.h).

class TrainCheckpointer {
 public:
  static absl::StatusOr<std::unique_ptr<TrainCheckpointer>> Create(DistContext& ctx,
                                                                   CheckpointOptions options);
  ~TrainCheckpointer();

  // Snapshot (the only stall) and background write of `state` at `step`.
  absl::StatusOr<SaveTicket> Save(int64_t step, const TrainState& state);
  // Loads the newest committed checkpoint (by manifest.json, whatever
  // `latest` says) or options.path. NotFound only when the directory holds
  // no committed checkpoint at all (start from scratch); any other failure
  // is an error naming the checkpoint, the file and the reason, the same on
  // every rank (the ranks agree after opening and after reading, so none is
  // left waiting). Everything the load will use — model tensor names,
  // dtypes and shapes, the optimizer's kind, groups, state fields, dtypes
  // and shapes, the balancing state — is checked before the model or the
  // optimizer is touched. A FailedPrecondition error means the checkpoint
  // does not fit the live state.
  absl::StatusOr<LoadResult> Load(const TrainState& state, const LoadOptions& options = {});
  absl::Status WaitAll();
  // After DistContext::Regroup, on every survivor: the saves in flight that
  // the lost ranks never reported on are ended with `why` as their outcome
  // (CheckpointWriter::Abandon; their tickets then hold it), the others
  // waited for, and later saves are written by the new world's ranks
  // through a new commit store. The number of saves ended. Collective over
  // the survivors (each makes one commit store).
  absl::StatusOr<int> Regroup(const absl::Status& why);
  const CheckpointOptions& options() const { return options_; }

 private:
  TrainCheckpointer(DistContext& ctx, CheckpointOptions options, std::unique_ptr<CommitStore> store,
                    std::unique_ptr<CheckpointWriter> writer);
  // One attempt at a checkpoint: its result and, on failure, whether the
  // checkpoint does not fit the live state (mismatch: never a reason to fall
  // back) and whether every rank knows of the failure (agreed: only then may
  // the ranks move on to another candidate together).
  struct Attempt {
    absl::StatusOr<LoadResult> result;
    bool mismatch = false;
    bool agreed = false;
  };
  Attempt LoadFrom(Env& env, const std::string& path, const TrainState& state,
                   const LoadOptions& options);
  // After a load from `path` (through `reader`): this rank's share of its
  // shards checked with HDF5 (LoadResult::structure_problems), each problem
  // said in one line.
  std::vector<std::string> StructureProblems(const CheckpointReader& reader,
                                             const std::string& path) const;

  DistContext& ctx_;
  CheckpointOptions options_;
  std::unique_ptr<CommitStore> store_;
  std::unique_ptr<CheckpointWriter> writer_;
};

// What a resume would refuse in a checkpoint's extras, each problem in one
// line (empty: none): extras that are not an object, a balancing state that
// is malformed (shares that are not finite, negative or do not sum to 1) or
// missing from a TrainCheckpointer's checkpoint (with `require_balance`;
// Load requires it when it restores a BalancedStep strictly). The one check
// of the extras that Load, evenstep-ckpt (every command) and
// tools/evenstep_ckpt_reader.py make.
std::vector<std::string> CheckTrainExtras(const Manifest& manifest, bool require_balance = true);

// Named tensors of a model and optimizer as a checkpoint holds them (exposed
// for tools and tests). InvalidArgument naming the optimizer type when its
// state cannot be captured.
absl::StatusOr<NamedTensors> CaptureTensors(torch::nn::Module* model,
                                            torch::optim::Optimizer* optimizer);

}  // namespace evenstep

// Sharded, asynchronous, crash-consistent checkpoints.
//
// Every rank owns a share of the state's bytes (tensors larger than
// `slice_bytes` are split into slices; the shares differ by at most one
// slice) and writes it as its own HDF5 shard; nothing is gathered to rank 0.
// Save() blocks the training thread only for the snapshot into a reusable
// staging buffer (for device tensors, only for queueing asynchronous copies
// into page-locked staging on a side stream); the rest runs on the I/O
// fibers.
//
// Commit protocol (one checkpoint = DIR/step-SSSSSSSSSS/):
//   1. every rank: create the checkpoint directory, fsync DIR.
//   2. every rank: write its shard to shard-RRRRR-of-WWWWW.h5.tmp (HDF5
//      container + tensor bytes, XXH3-64 of every dataset computed from the
//      staging buffer), fsync it, rename it to shard-RRRRR-of-WWWWW.h5,
//      fsync the checkpoint directory.
//   3. every rank: publish its shard's checksums under the commit key of this
//      step and increment the step's arrival counter (CommitStore: the c10d
//      store, not a collective on the training process group).
//   4. the rank that brings the counter to the world size writes
//      manifest.json (tmp, fsync, rename, fsync directory) — the checkpoint
//      exists from this moment — then DIR/latest the same way, then applies
//      retention (keeps the newest `keep` committed checkpoints, never the
//      newest, and removes uncommitted ones older than it).
// A directory without manifest.json is never loaded. A crash at any point
// leaves the previous checkpoint loadable and this one complete or invisible.
//
// Thread-safety: one training thread calls Save/Wait; the I/O runs on the
// writer's own runtime.
#pragma once

#include <cstdint>
#include <future>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "evenstep/env.h"

namespace at {
class Tensor;
}

namespace evenstep {

class IoRuntime;

// The small shared key-value store ranks commit through (lib/ implements it
// over the c10d store; tests may use an in-process one).
class CommitStore {
 public:
  virtual ~CommitStore() = default;
  virtual absl::Status Set(const std::string& key, const std::string& value) = 0;
  // Waits until `key` is set (bounded by the store's timeout).
  virtual absl::StatusOr<std::string> Get(const std::string& key) = 0;
  virtual absl::StatusOr<int64_t> Add(const std::string& key, int64_t delta) = 0;
};

// An in-process CommitStore (ranks as threads in one process, tests).
std::unique_ptr<CommitStore> NewInProcessCommitStore();

enum class WhenBusy { kWait, kSkip };

struct CheckpointOptions {
  std::string dir;  // root: holds step-*/ and latest
  int keep = 3;     // committed checkpoints kept (the newest is never removed)
  int max_in_flight = 1;
  WhenBusy when_busy = WhenBusy::kWait;
  int64_t slice_bytes = 64 << 20;
  int io_threads = 2;
  Env* env = nullptr;  // null: Env::Default()
};

struct CheckpointState {
  int64_t step = 0;
  // Names are '/'-separated segments ("model/fc.weight", "optimizer/3/exp_avg");
  // every rank passes the same names, shapes and dtypes in the same order.
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  std::string extras_json = "{}";  // user state (sampler position, RNG, ...)
};

struct SaveTicket {
  int64_t step = 0;
  bool skipped = false;  // WhenBusy::kSkip and K saves were in flight
  // OK once this rank's shard is durable and, on the committing rank, the
  // manifest is committed; the error otherwise.
  std::shared_future<absl::Status> done;
  double snapshot_seconds = 0;  // the training stall
};

class CheckpointWriter {
 public:
  static absl::StatusOr<std::unique_ptr<CheckpointWriter>> Create(CheckpointOptions options,
                                                                  CommitStore* store, int rank,
                                                                  int world_size);
  ~CheckpointWriter();  // waits for saves in flight

  // Snapshots `state` and writes it in the background. InvalidArgument naming
  // the tensor for a bad name or dtype; the I/O outcome comes in the ticket.
  absl::StatusOr<SaveTicket> Save(const CheckpointState& state);
  // Waits for every save in flight; the first error, if any.
  absl::Status WaitAll();

 private:
  struct Impl;
  explicit CheckpointWriter(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// --- Reading -------------------------------------------------------------

struct SliceInfo {
  int shard = 0;
  std::string dataset;
  int64_t begin = 0, end = 0;  // flattened element range
  int64_t offset = -1, bytes = 0;
  uint64_t xxh3 = 0;
};

struct TensorInfo {
  std::string name;
  std::string dtype;
  std::vector<int64_t> shape;
  std::vector<SliceInfo> slices;
};

struct Manifest {
  int version = 1;
  int64_t step = 0;
  int world_size = 0;
  std::vector<std::string> shards;  // file names, index = writing rank
  std::vector<int64_t> shard_bytes;
  std::vector<TensorInfo> tensors;
  std::string extras_json = "{}";
};

// DIR/step-SSSSSSSSSS for `step`.
std::string CheckpointPath(const std::string& dir, int64_t step);
// The committed checkpoint `latest` names, or the newest committed one if
// `latest` is missing; NotFound when there is none.
absl::StatusOr<std::string> LatestCheckpoint(Env& env, const std::string& dir);
// Committed checkpoints (those with a manifest), oldest first.
absl::StatusOr<std::vector<std::string>> CommittedCheckpoints(Env& env, const std::string& dir);

class CheckpointReader {
 public:
  // Parses and validates the manifest of the checkpoint at `path`: names
  // (no absolute paths, no ".."), dtypes, shapes, slice ranges and offsets
  // against the shard files' sizes — before anything is allocated.
  // DataLoss / InvalidArgument naming the file and the entry.
  static absl::StatusOr<std::unique_ptr<CheckpointReader>> Open(Env& env, const std::string& path);
  const Manifest& manifest() const { return manifest_; }
  const std::string& path() const { return path_; }
  const TensorInfo* Find(const std::string& name) const;
  // Reads one tensor (all its slices), verifying checksums: DataLoss naming
  // the shard file and dataset on a mismatch.
  absl::StatusOr<at::Tensor> Read(const std::string& name) const;
  // The same into `dst` (the tensor's bytes, row-major; `size` must match).
  absl::Status ReadInto(const std::string& name, void* dst, int64_t size) const;
  // Verifies every checksum; the list of problems (empty when intact).
  std::vector<std::string> Verify() const;

 private:
  CheckpointReader(Env& env, std::string path, Manifest manifest)
      : env_(env), path_(std::move(path)), manifest_(std::move(manifest)) {}
  Env& env_;
  std::string path_;
  Manifest manifest_;
};

// Manifest <-> JSON (exposed for tools and tests).
std::string ManifestToJson(const Manifest& manifest);
absl::StatusOr<Manifest> ManifestFromJson(const std::string& json, const std::string& origin);

}  // namespace evenstep

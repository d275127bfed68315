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
// Commit protocol (one checkpoint = DIR/step-SSSSSSSSSS/), written down once
// with what a crash at each write leaves: docs/design.md, "Checkpoints:
// commit protocol and crash states". In short: every rank writes its shard
// (tmp, fsync, rename, fsync), reports through the CommitStore, and the last
// to report writes manifest.json the same way (or, when a rank failed,
// removes the directory): a checkpoint is committed if and only if its
// manifest exists, and every rank's save returns the same outcome.
//
// Thread-safety: one training thread calls Save/Wait; the I/O runs on the
// writer's own runtime.
#pragma once

#include <cstdint>
#include <future>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "evenstep/env.h"
#include "evenstep/named_tensor.h"

namespace at {
class Tensor;
}

namespace evenstep {

class IoRuntime;

// The small shared key-value store ranks commit through (lib/ implements it
// over the c10d store; tests/testing/in_process_commit_store.h holds one for
// ranks as threads of one process).
class CommitStore {
 public:
  virtual ~CommitStore() = default;
  virtual absl::Status Set(const std::string& key, const std::string& value) = 0;
  // Waits until `key` is set (bounded by the store's timeout).
  virtual absl::StatusOr<std::string> Get(const std::string& key) = 0;
  virtual absl::StatusOr<int64_t> Add(const std::string& key, int64_t delta) = 0;
};

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

struct CheckpointContents {
  int64_t step = 0;
  // Names are '/'-separated segments ("model/fc.weight", "optimizer/3/exp_avg");
  // every rank passes the same names, shapes and dtypes in the same order.
  NamedTensors tensors;
  std::string extras_json = "{}";  // user state (sampler position, RNG, ...)
};

struct SaveTicket {
  int64_t step = 0;
  bool skipped = false;  // WhenBusy::kSkip and K saves were in flight
  // The save's outcome, the same on every rank: OK once the manifest is
  // committed; otherwise the first failing rank's error (naming the step,
  // the rank and the file), and no file of this save is left behind.
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
  absl::StatusOr<SaveTicket> Save(const CheckpointContents& state);
  // Waits for every save in flight; the first error of any save since the
  // last WaitAll (none is dropped unread), OK otherwise.
  absl::Status WaitAll();

 private:
  struct Impl;
  explicit CheckpointWriter(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// --- Reading -------------------------------------------------------------
// Everything read from disk is untrusted input: sizes are capped before
// anything is allocated, JSON nesting is bounded, only regular files are
// opened (never a symbolic link, FIFO or device; see Env::OpenForRead), and
// every field is checked against the others and the files.

inline constexpr int64_t kMaxManifestBytes = int64_t{256} << 20;
inline constexpr int64_t kMaxLatestBytes = 4096;
inline constexpr int kMaxJsonDepth = 64;

struct SliceInfo {
  int shard = 0;                   // index into Manifest::shards (the writing rank)
  std::string dataset;             // HDF5 path: "/" + name, or "/" + name + "@" + begin for a slice
  int64_t begin = 0, end = 0;      // flattened element range [begin, end)
  int64_t offset = -1, bytes = 0;  // absolute byte offset in the shard file; -1 when empty
  uint64_t xxh3 = 0;               // XXH3-64 (seed 0) of the slice's bytes
};

struct TensorInfo {
  std::string name;
  std::string dtype;
  std::vector<int64_t> shape;
  std::vector<SliceInfo> slices;  // tile [0, numel) in order
};

// The bytes a tensor occupies in its shards (all slices).
int64_t StoredBytes(const TensorInfo& tensor);
// The dtype name a checkpoint stores for `tensor` ("float32", "int64", ...),
// or "unsupported" for a dtype checkpoints cannot hold (complex, quantized);
// compare it with TensorInfo::dtype to check a live tensor against the file.
std::string StoredDtypeOf(const at::Tensor& tensor);

struct Manifest {
  // 2: carries index_xxh3; 1 (written by earlier builds): read without it.
  int version = 2;
  int64_t step = 0;
  int world_size = 0;
  std::vector<std::string> shards;  // file names, index = writing rank
  std::vector<int64_t> shard_bytes;
  std::vector<TensorInfo> tensors;
  std::string extras_json = "{}";
  uint64_t index_xxh3 = 0;  // ManifestIndexChecksum() of the fields above
};

// DIR/step-SSSSSSSSSS for `step`.
std::string CheckpointPath(const std::string& dir, int64_t step);

// What a checkpoint root holds. Only directories named exactly as
// CheckpointPath names them count; quarantined ones (step-N.unusable-T) and
// other entries are ignored.
struct CheckpointListing {
  std::vector<int64_t> committed;    // steps whose directory holds manifest.json, oldest first
  std::vector<int64_t> uncommitted;  // step directories without one (saves that never committed)
  bool has_latest = false;           // DIR/latest exists
  std::optional<int64_t> latest;     // the step `latest` names, when it is a valid name
  std::string latest_problem;        // why `latest` is unusable (empty when fine or absent)
};
absl::StatusOr<CheckpointListing> ListCheckpoints(Env& env, const std::string& dir);
// The newest committed checkpoint, by manifest.json (`latest` is written
// after the manifest and may lag it; it is a hint for people). NotFound when
// there is none.
absl::StatusOr<std::string> LatestCheckpoint(Env& env, const std::string& dir);
// Committed checkpoints (those with a manifest), oldest first.
absl::StatusOr<std::vector<std::string>> CommittedCheckpoints(Env& env, const std::string& dir);

// XXH3-64 (seed 0) of the manifest's canonical index text: step, world size,
// shard names and sizes, and every tensor's name, dtype, shape and slices
// (one tab-separated line each; the README's format section spells it out).
uint64_t ManifestIndexChecksum(const Manifest& manifest);

class CheckpointReader {
 public:
  // Parses and validates the manifest of the checkpoint at `path` (see
  // ManifestFromJson), checks that its step matches the directory's name and
  // that every shard is a regular file of the size the manifest says —
  // before anything is allocated. DataLoss / FailedPrecondition naming the
  // file and the entry.
  static absl::StatusOr<std::unique_ptr<CheckpointReader>> Open(Env& env, const std::string& path);
  const Manifest& manifest() const { return manifest_; }
  const std::string& path() const { return path_; }
  const TensorInfo* Find(const std::string& name) const;
  // Reads one tensor (all its slices), verifying checksums: DataLoss naming
  // the shard file and dataset on a mismatch.
  absl::StatusOr<at::Tensor> Read(const std::string& name) const;
  // The same into `dst` (the tensor's bytes, row-major; `size` must match).
  absl::Status ReadInto(const std::string& name, void* dst, int64_t size) const;
  // Opens every shard with HDF5 and compares each dataset's type, shape,
  // contiguous storage, offset and size with the manifest, so that readers
  // by dataset (h5py) and by offset (evenstep) read the same bytes; the
  // list of problems (empty when they agree).
  std::vector<std::string> CheckStructure() const;
  // The same for shards i with i % world == rank (each rank of a resume
  // checks its share).
  std::vector<std::string> CheckStructure(int rank, int world) const;
  // CheckStructure() and every checksum (read in bounded chunks); the list
  // of problems (empty when intact).
  std::vector<std::string> Verify() const;

  // --- For a distributed load (the TrainCheckpointer) ---
  // Which whole tensors each of `world` ranks reads: indices into
  // manifest().tensors, planned as shards are (largest first to the rank
  // with the fewest bytes so far, ties to the lower rank), so that every
  // rank computes the same plan and the bytes per rank differ by at most the
  // largest tensor.
  std::vector<std::vector<int>> PlanReads(int world) const;
  // The tensor `name` from its stored bytes (`bytes`: kByte, StoredBytes
  // long, e.g. filled by ReadInto and a broadcast): a new CPU tensor of the
  // stored dtype and shape. NotFound / InvalidArgument naming the tensor.
  absl::StatusOr<at::Tensor> FromBytes(const std::string& name, const at::Tensor& bytes) const;

 private:
  CheckpointReader(Env& env, std::string path, Manifest manifest)
      : env_(env), path_(std::move(path)), manifest_(std::move(manifest)) {}
  Env& env_;
  std::string path_;
  Manifest manifest_;
};

// Manifest <-> JSON (exposed for tools and tests). ManifestToJson fills in
// index_xxh3. ManifestFromJson checks every invariant the format states
// (types, ranges, canonical shard and dataset names, slices tiling each
// tensor, byte ranges inside their shard and not overlapping, the index
// checksum); DataLoss naming `origin` and the entry otherwise.
std::string ManifestToJson(const Manifest& manifest);
absl::StatusOr<Manifest> ManifestFromJson(const std::string& json, const std::string& origin);
// The deepest nesting of arrays and objects in a JSON text (a linear scan,
// no recursion): callers reject texts deeper than kMaxJsonDepth before
// parsing, since nlohmann::json's dump recurses.
int JsonNestingDepth(const std::string& text);

}  // namespace evenstep

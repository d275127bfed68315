// The checkpoint format's index, shared by the writer (checkpoint_writer.h)
// and the reader (checkpoint_reader.h): a checkpoint DIR/step-SSSSSSSSSS/
// holds one HDF5 shard per writing rank and manifest.json, which places every
// tensor's slices (shard, dataset, element range, byte range, XXH3-64); what
// a checkpoint root holds; the manifest to and from JSON. The format is
// spelled out in README.md.
//
// Everything read from disk is untrusted input: sizes are capped before
// anything is allocated, JSON nesting is bounded, only regular files are
// opened (never a symbolic link, FIFO or device; see Env::OpenForRead), and
// every field is checked against the others and the files.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "evenstep/env.h"

namespace evenstep {

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

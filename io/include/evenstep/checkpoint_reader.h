// Reading a checkpoint (checkpoint_manifest.h's format): its manifest
// validated before anything is allocated, tensors read and checked against
// their checksums, the shards' HDF5 structure checked against the manifest,
// and the plan of a distributed load.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "evenstep/checkpoint_manifest.h"
#include "evenstep/env.h"

namespace at {
class Tensor;
}

namespace evenstep {

// The dtype name a checkpoint stores for `tensor` ("float32", "int64", ...),
// or "unsupported" for a dtype checkpoints cannot hold (complex, quantized);
// compare it with TensorInfo::dtype to check a live tensor against the file.
std::string StoredDtypeOf(const at::Tensor& tensor);

// PlanReads over any tensor list: per part, the indices of the whole
// tensors it takes (largest first to the part with the fewest bytes so far,
// ties to the lower part). The survivors' shares of a HandOver too.
std::vector<std::vector<int>> PlanWholeReads(const std::vector<TensorInfo>& tensors, int parts);

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

}  // namespace evenstep

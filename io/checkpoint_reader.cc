// The byte-level CheckpointReader: a checkpoint opened after its manifest
// and shard files are checked, tensors read into caller memory against their
// checksums, the shards' HDF5 structure compared with the manifest. Free of
// ATen, so the fuzz harness builds it with sanitizers; the at::Tensor side is
// checkpoint_reader_tensors.cc.
#include "evenstep/checkpoint_reader.h"

#include <xxhash.h>

#include <algorithm>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "evenstep/internal/h5_shard.h"
#include "evenstep/internal/names.h"
#include "evenstep/status_macros.h"

namespace evenstep {

absl::StatusOr<std::unique_ptr<CheckpointReader>> CheckpointReader::Open(Env& env,
                                                                         const std::string& path) {
  const std::string manifest_path = path + "/manifest.json";
  EVENSTEP_ASSIGN_OR_RETURN(const std::string text,
                            ReadFileToString(env, manifest_path, kMaxManifestBytes));
  absl::StatusOr<Manifest> manifest = ManifestFromJson(text, manifest_path);
  if (!manifest.ok()) return manifest.status();
  const std::string base = path.substr(path.find_last_of('/') + 1);
  if (const std::optional<int64_t> step = internal::StepOfDirName(base);
      step && *step != manifest->step) {
    return absl::DataLossError(absl::StrCat(manifest_path, ": step ", manifest->step,
                                            " in the directory of step ", *step));
  }
  // The shard files must be regular files as large as the manifest says.
  for (size_t i = 0; i < manifest->shards.size(); ++i) {
    const std::string shard = path + "/" + manifest->shards[i];
    EVENSTEP_ASSIGN_OR_RETURN(const std::unique_ptr<File> file, env.OpenForRead(shard));
    EVENSTEP_ASSIGN_OR_RETURN(const int64_t size, file->Size());
    if (size != manifest->shard_bytes[i]) {
      return absl::DataLossError(
          absl::StrCat(shard, ": ", size, " bytes, the manifest says ", manifest->shard_bytes[i]));
    }
  }
  return std::unique_ptr<CheckpointReader>(new CheckpointReader(env, path, *std::move(manifest)));
}

const TensorInfo* CheckpointReader::Find(const std::string& name) const {
  for (const TensorInfo& t : manifest_.tensors) {
    if (t.name == name) return &t;
  }
  return nullptr;
}

absl::Status CheckpointReader::ReadInto(const std::string& name, void* dst, int64_t size) const {
  const TensorInfo* t = Find(name);
  if (t == nullptr) return absl::NotFoundError(absl::StrCat(path_, ": no tensor ", name));
  const int64_t element = internal::DtypeSize(t->dtype);
  int64_t total = 0;
  for (const SliceInfo& s : t->slices) total += s.bytes;
  if (total != size) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor ", name, " holds ", total, " bytes, the destination ", size));
  }
  char* base = static_cast<char*>(dst);
  for (const SliceInfo& s : t->slices) {
    if (s.bytes == 0) continue;
    const std::string shard = path_ + "/" + manifest_.shards[s.shard];
    EVENSTEP_ASSIGN_OR_RETURN(const std::unique_ptr<File> file, env_.OpenForRead(shard));
    char* out = base + s.begin * element;
    if (absl::Status st = file->PRead(s.offset, out, static_cast<size_t>(s.bytes)); !st.ok()) {
      return st;
    }
    if (XXH3_64bits(out, static_cast<size_t>(s.bytes)) != s.xxh3) {
      return absl::DataLossError(
          absl::StrCat(shard, ", dataset ", s.dataset, ": checksum mismatch (tensor ", name, ")"));
    }
  }
  return absl::OkStatus();
}

std::vector<std::string> CheckpointReader::CheckStructure() const { return CheckStructure(0, 1); }

std::vector<std::string> CheckpointReader::CheckStructure(int rank, int world) const {
  std::vector<std::vector<internal::ShardDataset>> expected(manifest_.shards.size());
  for (const TensorInfo& t : manifest_.tensors) {
    for (const SliceInfo& s : t.slices) {
      internal::ShardDataset d;
      d.path = s.dataset;
      d.dtype = t.dtype;
      d.shape = t.slices.size() == 1 ? t.shape : std::vector<int64_t>{s.end - s.begin};
      d.tensor = t.name;
      d.begin = s.begin;
      d.end = s.end;
      d.offset = s.offset;
      d.bytes = s.bytes;
      expected[s.shard].push_back(std::move(d));
    }
  }
  std::vector<std::string> problems;
  for (size_t i = 0; i < expected.size(); ++i) {
    if (world > 1 && static_cast<int>(i % world) != rank) continue;
    for (std::string& p :
         internal::CheckShardFile(path_ + "/" + manifest_.shards[i], expected[i])) {
      problems.push_back(std::move(p));
    }
  }
  return problems;
}

std::vector<std::string> CheckpointReader::Verify() const {
  std::vector<std::string> problems = CheckStructure();
  constexpr size_t kChunk = 4 << 20;
  std::string buffer(kChunk, '\0');
  for (const TensorInfo& t : manifest_.tensors) {
    for (const SliceInfo& s : t.slices) {
      if (s.bytes == 0) continue;
      const std::string shard = path_ + "/" + manifest_.shards[s.shard];
      auto file = env_.OpenForRead(shard);
      if (!file.ok()) {
        problems.push_back(std::string(file.status().message()));
        continue;
      }
      XXH3_state_t* state = XXH3_createState();
      XXH3_64bits_reset(state);
      absl::Status read;
      for (int64_t done = 0; read.ok() && done < s.bytes;) {
        const size_t n = static_cast<size_t>(std::min<int64_t>(kChunk, s.bytes - done));
        read = (*file)->PRead(s.offset + done, buffer.data(), n);
        if (read.ok()) XXH3_64bits_update(state, buffer.data(), n);
        done += static_cast<int64_t>(n);
      }
      const uint64_t h = XXH3_64bits_digest(state);
      XXH3_freeState(state);
      if (!read.ok()) {
        problems.push_back(std::string(read.message()));
      } else if (h != s.xxh3) {
        problems.push_back(absl::StrCat(shard, ", dataset ", s.dataset,
                                        ": checksum mismatch (tensor ", t.name, ")"));
      }
    }
  }
  return problems;
}

}  // namespace evenstep

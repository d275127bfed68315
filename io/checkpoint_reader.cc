// Manifest JSON, checkpoint discovery and CheckpointReader. Manifests are
// treated as untrusted input: every name, dtype, shape, range and offset is
// checked against the shard files before a byte is allocated or read.
#include <ATen/ATen.h>
#include <xxhash.h>

#include <algorithm>
#include <limits>
#include <nlohmann/json.hpp>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/strip.h"
#include "evenstep/checkpoint.h"
#include "evenstep/internal/dtypes.h"
#include "evenstep/internal/h5_shard.h"
#include "evenstep/internal/names.h"

namespace evenstep {

std::string ManifestToJson(const Manifest& m) {
  nlohmann::json tensors = nlohmann::json::array();
  for (const TensorInfo& t : m.tensors) {
    nlohmann::json slices = nlohmann::json::array();
    for (const SliceInfo& s : t.slices) {
      slices.push_back({{"shard", s.shard},
                        {"dataset", s.dataset},
                        {"begin", s.begin},
                        {"end", s.end},
                        {"offset", s.offset},
                        {"bytes", s.bytes},
                        {"xxh3", absl::StrFormat("%016x", s.xxh3)}});
    }
    tensors.push_back(
        {{"name", t.name}, {"dtype", t.dtype}, {"shape", t.shape}, {"slices", std::move(slices)}});
  }
  nlohmann::json extras = nlohmann::json::parse(m.extras_json, nullptr, false);
  if (extras.is_discarded()) extras = m.extras_json;  // kept as a string
  nlohmann::json j = {{"format", "evenstep-checkpoint"},
                      {"version", m.version},
                      {"step", m.step},
                      {"world_size", m.world_size},
                      {"shards", m.shards},
                      {"shard_bytes", m.shard_bytes},
                      {"tensors", std::move(tensors)},
                      {"extras", std::move(extras)}};
  return j.dump(1);
}

absl::StatusOr<Manifest> ManifestFromJson(const std::string& json, const std::string& origin) {
  auto bad = [&](const std::string& why) {
    return absl::DataLossError(absl::StrCat(origin, ": ", why));
  };
  const nlohmann::json j = nlohmann::json::parse(json, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) return bad("not a JSON object");
  Manifest m;
  try {
    if (j.at("format").get<std::string>() != "evenstep-checkpoint")
      return bad("not an evenstep manifest");
    m.version = j.at("version").get<int>();
    if (m.version != 1)
      return bad(absl::StrCat("format version ", m.version, " (this build reads 1)"));
    m.step = j.at("step").get<int64_t>();
    m.world_size = j.at("world_size").get<int>();
    m.shards = j.at("shards").get<std::vector<std::string>>();
    m.shard_bytes = j.at("shard_bytes").get<std::vector<int64_t>>();
    const auto& extras = j.at("extras");
    m.extras_json = extras.is_string() ? extras.get<std::string>() : extras.dump();
    for (const auto& t : j.at("tensors")) {
      TensorInfo info;
      info.name = t.at("name").get<std::string>();
      info.dtype = t.at("dtype").get<std::string>();
      info.shape = t.at("shape").get<std::vector<int64_t>>();
      for (const auto& s : t.at("slices")) {
        SliceInfo slice;
        slice.shard = s.at("shard").get<int>();
        slice.dataset = s.at("dataset").get<std::string>();
        slice.begin = s.at("begin").get<int64_t>();
        slice.end = s.at("end").get<int64_t>();
        slice.offset = s.at("offset").get<int64_t>();
        slice.bytes = s.at("bytes").get<int64_t>();
        slice.xxh3 = std::stoull(s.at("xxh3").get<std::string>(), nullptr, 16);
        info.slices.push_back(std::move(slice));
      }
      m.tensors.push_back(std::move(info));
    }
  } catch (const std::exception& e) {
    return bad(absl::StrCat("malformed: ", e.what()));
  }
  // Structure.
  if (m.world_size < 1 || static_cast<int>(m.shards.size()) != m.world_size ||
      m.shard_bytes.size() != m.shards.size()) {
    return bad(absl::StrCat("world_size ", m.world_size, " with ", m.shards.size(), " shards"));
  }
  for (const std::string& shard : m.shards) {
    if (absl::Status s = internal::ValidateFileName(shard); !s.ok())
      return bad(std::string(s.message()));
  }
  for (const TensorInfo& t : m.tensors) {
    if (absl::Status s = internal::ValidateTensorName(t.name); !s.ok()) {
      return bad(std::string(s.message()));
    }
    const int64_t element = internal::DtypeSize(t.dtype);
    if (element == 0) return bad(absl::StrCat("tensor ", t.name, ": unknown dtype ", t.dtype));
    int64_t numel = 1;
    for (int64_t d : t.shape) {
      if (d < 0 || (d > 0 && numel > (std::numeric_limits<int64_t>::max() / 16) / d)) {
        return bad(absl::StrCat("tensor ", t.name, ": impossible shape"));
      }
      numel *= d;
    }
    int64_t covered = 0;
    for (const SliceInfo& s : t.slices) {
      if (s.shard < 0 || s.shard >= m.world_size) {
        return bad(absl::StrCat("tensor ", t.name, ": slice in shard ", s.shard));
      }
      if (s.begin != covered || s.end < s.begin || s.end > numel ||
          s.bytes != (s.end - s.begin) * element) {
        return bad(absl::StrCat("tensor ", t.name, ": slice [", s.begin, ", ", s.end,
                                ") does not continue the element range at ", covered, " of ",
                                numel));
      }
      if (s.bytes > 0 && (s.offset < 0 || s.offset > m.shard_bytes[s.shard] - s.bytes)) {
        return bad(absl::StrCat("tensor ", t.name, ": bytes [", s.offset, ", ", s.offset + s.bytes,
                                ") outside shard ", m.shards[s.shard], " (", m.shard_bytes[s.shard],
                                " bytes)"));
      }
      covered = s.end;
    }
    if (covered != numel) {
      return bad(
          absl::StrCat("tensor ", t.name, ": slices cover ", covered, " of ", numel, " elements"));
    }
  }
  return m;
}

absl::StatusOr<std::vector<std::string>> CommittedCheckpoints(Env& env, const std::string& dir) {
  absl::StatusOr<std::vector<std::string>> names = env.List(dir);
  if (!names.ok()) return names.status();
  std::vector<std::string> out;
  for (const std::string& name : *names) {
    const std::string path = dir + "/" + name;
    if (absl::StartsWith(name, "step-") && env.Exists(path + "/manifest.json")) {
      out.push_back(path);
    }
  }
  return out;
}

absl::StatusOr<std::string> LatestCheckpoint(Env& env, const std::string& dir) {
  absl::StatusOr<std::string> latest = ReadFileToString(env, dir + "/latest");
  if (latest.ok()) {
    const std::string name(absl::StripAsciiWhitespace(*latest));
    if (internal::ValidateFileName(name).ok() && absl::StartsWith(name, "step-") &&
        env.Exists(dir + "/" + name + "/manifest.json")) {
      return dir + "/" + name;
    }
  }
  absl::StatusOr<std::vector<std::string>> committed = CommittedCheckpoints(env, dir);
  if (!committed.ok()) return committed.status();
  if (committed->empty()) {
    return absl::NotFoundError(absl::StrCat("no committed checkpoint in ", dir));
  }
  return committed->back();
}

absl::StatusOr<std::unique_ptr<CheckpointReader>> CheckpointReader::Open(Env& env,
                                                                         const std::string& path) {
  const std::string manifest_path = path + "/manifest.json";
  absl::StatusOr<std::string> json = ReadFileToString(env, manifest_path);
  if (!json.ok()) return json.status();
  absl::StatusOr<Manifest> manifest = ManifestFromJson(*json, manifest_path);
  if (!manifest.ok()) return manifest.status();
  // The shard files must be as large as the manifest says.
  for (size_t i = 0; i < manifest->shards.size(); ++i) {
    const std::string shard = path + "/" + manifest->shards[i];
    auto file = env.OpenForRead(shard);
    if (!file.ok()) return file.status();
    auto size = (*file)->Size();
    if (!size.ok()) return size.status();
    if (*size != manifest->shard_bytes[i]) {
      return absl::DataLossError(
          absl::StrCat(shard, ": ", *size, " bytes, the manifest says ", manifest->shard_bytes[i]));
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

absl::StatusOr<at::Tensor> CheckpointReader::Read(const std::string& name) const {
  const TensorInfo* t = Find(name);
  if (t == nullptr) return absl::NotFoundError(absl::StrCat(path_, ": no tensor ", name));
  at::Tensor out =
      at::empty(t->shape, at::TensorOptions().dtype(*internal::DtypeFromName(t->dtype)));
  absl::Status s = ReadInto(name, out.data_ptr(), out.numel() * out.element_size());
  if (!s.ok()) return s;
  return out;
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
    auto file = env_.OpenForRead(shard);
    if (!file.ok()) return file.status();
    char* out = base + s.begin * element;
    if (absl::Status st = (*file)->PRead(s.offset, out, static_cast<size_t>(s.bytes)); !st.ok()) {
      return st;
    }
    if (XXH3_64bits(out, static_cast<size_t>(s.bytes)) != s.xxh3) {
      return absl::DataLossError(
          absl::StrCat(shard, ", dataset ", s.dataset, ": checksum mismatch (tensor ", name, ")"));
    }
  }
  return absl::OkStatus();
}

std::vector<std::string> CheckpointReader::Verify() const {
  std::vector<std::string> problems;
  for (const TensorInfo& t : manifest_.tensors) {
    absl::StatusOr<at::Tensor> read = Read(t.name);
    if (!read.ok()) problems.push_back(std::string(read.status().message()));
  }
  return problems;
}

}  // namespace evenstep

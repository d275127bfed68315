// Manifest JSON and checkpoint discovery (checkpoint_manifest.h; free of
// ATen, like checkpoint_reader.cc, so the fuzz harness builds both with
// sanitizers). Manifests are untrusted input: sizes are capped before reading,
// nesting is bounded before parsing, every field is type- and range-checked,
// and names, ranges and offsets are checked against each other and against
// the shard files before a byte is allocated or read.
#include <xxhash.h>

#include <algorithm>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"
#include "evenstep/checkpoint_manifest.h"
#include "evenstep/internal/h5_shard.h"
#include "evenstep/internal/names.h"
#include "evenstep/status_macros.h"

namespace evenstep {
namespace {

using json = nlohmann::json;

// A field that breaks the format; caught in ManifestFromJson.
struct Malformed {
  std::string why;
};

const json& Field(const json& j, const char* key) {
  if (!j.is_object()) throw Malformed{absl::StrCat("expected an object holding \"", key, "\"")};
  auto it = j.find(key);
  if (it == j.end()) throw Malformed{absl::StrCat("no \"", key, "\"")};
  return *it;
}

// A JSON integer (never a float) in [lo, hi]; `what` names it in the error.
int64_t IntOf(const json& v, const std::string& what, int64_t lo, int64_t hi) {
  if (!v.is_number_integer()) {
    throw Malformed{absl::StrCat(what, " is ", v.dump().substr(0, 40), ", not an integer")};
  }
  int64_t out = 0;
  if (v.is_number_unsigned()) {
    const uint64_t u = v.get<uint64_t>();
    if (u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      throw Malformed{absl::StrCat(what, " = ", u, " is out of range")};
    }
    out = static_cast<int64_t>(u);
  } else {
    out = v.get<int64_t>();
  }
  if (out < lo || out > hi) {
    throw Malformed{absl::StrCat(what, " = ", out, " is outside [", lo, ", ", hi, "]")};
  }
  return out;
}

int64_t Int(const json& j, const char* key, int64_t lo, int64_t hi) {
  return IntOf(Field(j, key), absl::StrCat("\"", key, "\""), lo, hi);
}

std::string Str(const json& j, const char* key) {
  const json& v = Field(j, key);
  if (!v.is_string()) throw Malformed{absl::StrCat("\"", key, "\" is not a string")};
  return v.get<std::string>();
}

const json& Array(const json& j, const char* key) {
  const json& v = Field(j, key);
  if (!v.is_array()) throw Malformed{absl::StrCat("\"", key, "\" is not an array")};
  return v;
}

// Exactly 16 lowercase hex digits.
uint64_t Hex64(const json& j, const char* key) {
  const std::string s = Str(j, key);
  uint64_t out = 0;
  if (s.size() != 16)
    throw Malformed{absl::StrCat("\"", key, "\" = \"", s, "\" is not 16 hex digits")};
  for (char c : s) {
    int d = -1;
    if (c >= '0' && c <= '9') d = c - '0';
    if (c >= 'a' && c <= 'f') d = c - 'a' + 10;
    if (d < 0) throw Malformed{absl::StrCat("\"", key, "\" = \"", s, "\" is not 16 hex digits")};
    out = out << 4 | static_cast<uint64_t>(d);
  }
  return out;
}

std::string HexOf(uint64_t v) { return absl::StrFormat("%016x", v); }

constexpr int64_t kMaxDims = 64;
constexpr int64_t kMaxWorld = 1 << 20;

}  // namespace

int JsonNestingDepth(const std::string& text) {
  int depth = 0, deepest = 0;
  bool in_string = false, escaped = false;
  for (char c : text) {
    if (in_string) {
      if (escaped) {
        escaped = false;
      } else if (c == '\\') {
        escaped = true;
      } else if (c == '"') {
        in_string = false;
      }
    } else if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      deepest = std::max(deepest, ++depth);
    } else if (c == ']' || c == '}') {
      --depth;
    }
  }
  return deepest;
}

uint64_t ManifestIndexChecksum(const Manifest& m) {
  std::string text = absl::StrCat("evenstep-checkpoint-index\t", m.version, "\nstep\t", m.step,
                                  "\nworld_size\t", m.world_size, "\n");
  for (size_t i = 0; i < m.shards.size(); ++i) {
    absl::StrAppend(&text, "shard\t", i, "\t", m.shards[i], "\t",
                    i < m.shard_bytes.size() ? m.shard_bytes[i] : -1, "\n");
  }
  for (const TensorInfo& t : m.tensors) {
    absl::StrAppend(&text, "tensor\t", t.name, "\t", t.dtype, "\t", absl::StrJoin(t.shape, ","),
                    "\n");
    for (const SliceInfo& s : t.slices) {
      absl::StrAppend(&text, "slice\t", s.shard, "\t", s.dataset, "\t", s.begin, "\t", s.end, "\t",
                      s.offset, "\t", s.bytes, "\t", HexOf(s.xxh3), "\n");
    }
  }
  return XXH3_64bits(text.data(), text.size());
}

std::string ManifestToJson(const Manifest& m) {
  json tensors = json::array();
  for (const TensorInfo& t : m.tensors) {
    json slices = json::array();
    for (const SliceInfo& s : t.slices) {
      slices.push_back({{"shard", s.shard},
                        {"dataset", s.dataset},
                        {"begin", s.begin},
                        {"end", s.end},
                        {"offset", s.offset},
                        {"bytes", s.bytes},
                        {"xxh3", HexOf(s.xxh3)}});
    }
    tensors.push_back(
        {{"name", t.name}, {"dtype", t.dtype}, {"shape", t.shape}, {"slices", std::move(slices)}});
  }
  json extras = json::parse(m.extras_json, nullptr, false);
  if (extras.is_discarded()) extras = m.extras_json;  // kept as a string
  json j = {{"format", "evenstep-checkpoint"},
            {"version", m.version},
            {"step", m.step},
            {"world_size", m.world_size},
            {"shards", m.shards},
            {"shard_bytes", m.shard_bytes},
            {"tensors", std::move(tensors)},
            {"extras", std::move(extras)}};
  if (m.version >= 2) j["index_xxh3"] = HexOf(ManifestIndexChecksum(m));
  return j.dump(1);
}

namespace {

// One tensor's entry of a manifest (throws Malformed or json's exceptions).
TensorInfo ParseTensor(const json& t) {
  TensorInfo info;
  info.name = Str(t, "name");
  info.dtype = Str(t, "dtype");
  const json& shape = Array(t, "shape");
  if (static_cast<int64_t>(shape.size()) > kMaxDims) {
    throw Malformed{absl::StrCat("tensor ", info.name, ": more than ", kMaxDims, " dimensions")};
  }
  for (const json& d : shape) {
    // Negative dimensions are refused below, with the whole shape.
    info.shape.push_back(IntOf(d, absl::StrCat("tensor ", info.name, ": a dimension"),
                               std::numeric_limits<int64_t>::min(),
                               std::numeric_limits<int64_t>::max()));
  }
  for (const json& s : Array(t, "slices")) {
    SliceInfo slice;
    slice.shard = static_cast<int>(Int(s, "shard", 0, kMaxWorld));
    slice.dataset = Str(s, "dataset");
    slice.begin = Int(s, "begin", 0, std::numeric_limits<int64_t>::max());
    slice.end = Int(s, "end", 0, std::numeric_limits<int64_t>::max());
    slice.offset = Int(s, "offset", -1, std::numeric_limits<int64_t>::max());
    slice.bytes = Int(s, "bytes", 0, std::numeric_limits<int64_t>::max());
    slice.xxh3 = Hex64(s, "xxh3");
    info.slices.push_back(std::move(slice));
  }
  return info;
}

// The manifest's fields from `j` (throws Malformed or json's exceptions);
// the reason when it is not a manifest this build reads, else "".
std::string ParseFields(const json& j, Manifest* out) {
  Manifest& m = *out;
  if (Str(j, "format") != "evenstep-checkpoint") return "not an evenstep manifest";
  m.version = static_cast<int>(Int(j, "version", 0, std::numeric_limits<int>::max()));
  if (m.version != 1 && m.version != 2) {
    return absl::StrCat("format version ", m.version, " (this build reads 1 and 2)");
  }
  m.step = Int(j, "step", 0, std::numeric_limits<int64_t>::max());
  m.world_size = static_cast<int>(Int(j, "world_size", 1, kMaxWorld));
  for (const json& s : Array(j, "shards")) {
    if (!s.is_string()) throw Malformed{"a shard name is not a string"};
    m.shards.push_back(s.get<std::string>());
  }
  for (const json& b : Array(j, "shard_bytes")) {
    m.shard_bytes.push_back(
        IntOf(b, "a shard_bytes entry", 0, std::numeric_limits<int64_t>::max()));
  }
  const json& extras = Field(j, "extras");
  m.extras_json = extras.is_string() ? extras.get<std::string>() : extras.dump();
  for (const json& t : Array(j, "tensors")) m.tensors.push_back(ParseTensor(t));
  if (m.version >= 2) m.index_xxh3 = Hex64(j, "index_xxh3");
  return "";
}

// Byte ranges per shard, to find overlaps: (offset, end, tensor).
using ShardRanges = std::vector<std::vector<std::pair<std::pair<int64_t, int64_t>, std::string>>>;

// Tensor `t`'s entry against the format: a valid, unique name, a known dtype,
// a possible shape, slices that cover its elements in order inside their
// shards (their byte ranges added to `ranges`). The problem, or "".
std::string CheckTensor(const Manifest& m, const TensorInfo& t, std::set<std::string>* names,
                        ShardRanges* ranges) {
  if (absl::Status s = internal::ValidateTensorName(t.name); !s.ok()) {
    return std::string(s.message());
  }
  if (!names->insert(t.name).second) return absl::StrCat("tensor ", t.name, " appears twice");
  const int64_t element = internal::DtypeSize(t.dtype);
  if (element == 0) return absl::StrCat("tensor ", t.name, ": unknown dtype ", t.dtype);
  int64_t numel = 1;
  for (int64_t d : t.shape) {
    if (d < 0 || (d > 0 && numel > (std::numeric_limits<int64_t>::max() / 16) / d)) {
      return absl::StrCat("tensor ", t.name, ": impossible shape [", absl::StrJoin(t.shape, ","),
                          "]");
    }
    numel *= d;
  }
  if (t.slices.empty()) return absl::StrCat("tensor ", t.name, ": no slices");
  int64_t covered = 0;
  for (const SliceInfo& s : t.slices) {
    if (s.shard < 0 || s.shard >= m.world_size) {
      return absl::StrCat("tensor ", t.name, ": slice in shard ", s.shard, " of ", m.world_size);
    }
    const bool progresses = s.end > s.begin || (numel == 0 && t.slices.size() == 1);
    if (s.begin != covered || !progresses || s.end > numel ||
        s.bytes != (s.end - s.begin) * element) {
      return absl::StrCat("tensor ", t.name, ": slice [", s.begin, ", ", s.end, ") of ", s.bytes,
                          " bytes does not continue the element range at ", covered, " of ", numel);
    }
    const std::string dataset =
        t.slices.size() == 1 ? absl::StrCat("/", t.name) : absl::StrCat("/", t.name, "@", s.begin);
    if (s.dataset != dataset) {
      return absl::StrCat("tensor ", t.name, ": dataset \"", s.dataset.substr(0, 200),
                          "\"; the format names it \"", dataset, "\"");
    }
    if ((s.bytes == 0) != (s.offset == -1)) {
      return absl::StrCat("tensor ", t.name, ": offset ", s.offset, " with ", s.bytes,
                          " bytes (-1 exactly when empty)");
    }
    if (s.bytes > 0) {
      if (s.offset > m.shard_bytes[s.shard] - s.bytes) {
        return absl::StrCat("tensor ", t.name, ": bytes [", s.offset, ", ",
                            static_cast<uint64_t>(s.offset) + s.bytes, ") outside shard ",
                            m.shards[s.shard], " (", m.shard_bytes[s.shard], " bytes)");
      }
      (*ranges)[s.shard].push_back({{s.offset, s.offset + s.bytes}, t.name});
    }
    covered = s.end;
  }
  if (covered != numel) {
    return absl::StrCat("tensor ", t.name, ": slices cover ", covered, " of ", numel, " elements");
  }
  return "";
}

// Tensors whose bytes overlap in a shard: the problem, or "".
std::string CheckOverlaps(const Manifest& m, ShardRanges& ranges) {
  for (int r = 0; r < m.world_size; ++r) {
    auto& list = ranges[r];
    std::sort(list.begin(), list.end());
    for (size_t i = 1; i < list.size(); ++i) {
      if (list[i].first.first < list[i - 1].first.second) {
        return absl::StrCat("tensors ", list[i - 1].second, " and ", list[i].second, " overlap in ",
                            m.shards[r]);
      }
    }
  }
  return "";
}

}  // namespace

absl::StatusOr<Manifest> ManifestFromJson(const std::string& text, const std::string& origin) {
  auto bad = [&](const std::string& why) {
    return absl::DataLossError(absl::StrCat(origin, ": ", why));
  };
  if (const int depth = JsonNestingDepth(text); depth > kMaxJsonDepth) {
    return bad(absl::StrCat("JSON nested ", depth, " deep (at most ", kMaxJsonDepth, ")"));
  }
  const json j = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) return bad("not a JSON object");
  Manifest m;
  try {
    if (const std::string why = ParseFields(j, &m); !why.empty()) return bad(why);
  } catch (const Malformed& e) {
    return bad(absl::StrCat("malformed: ", e.why));
  } catch (const std::exception& e) {
    return bad(absl::StrCat("malformed: ", e.what()));
  }
  // Structure.
  if (static_cast<int>(m.shards.size()) != m.world_size ||
      m.shard_bytes.size() != m.shards.size()) {
    return bad(absl::StrCat("world_size ", m.world_size, " with ", m.shards.size(), " shards and ",
                            m.shard_bytes.size(), " shard sizes"));
  }
  for (int i = 0; i < m.world_size; ++i) {
    if (m.shards[i] != internal::ShardFileName(i, m.world_size)) {
      return bad(absl::StrCat("shard ", i, " is named \"", m.shards[i].substr(0, 200),
                              "\"; the format names it ",
                              internal::ShardFileName(i, m.world_size)));
    }
  }
  std::set<std::string> names;
  ShardRanges ranges(m.world_size);
  for (const TensorInfo& t : m.tensors) {
    if (const std::string why = CheckTensor(m, t, &names, &ranges); !why.empty()) return bad(why);
  }
  if (const std::string why = CheckOverlaps(m, ranges); !why.empty()) return bad(why);
  if (m.version >= 2) {
    const uint64_t computed = ManifestIndexChecksum(m);
    if (computed != m.index_xxh3) {
      return bad(absl::StrCat("index checksum ", HexOf(m.index_xxh3),
                              " does not match its tensor index (", HexOf(computed),
                              "): names, dtypes, shapes or slices were changed"));
    }
  }
  return m;
}

absl::StatusOr<CheckpointListing> ListCheckpoints(Env& env, const std::string& dir) {
  EVENSTEP_ASSIGN_OR_RETURN(const std::vector<std::string> names, env.List(dir),
                            "listing checkpoints");
  CheckpointListing out;
  for (const std::string& name : names) {
    if (name == "latest") out.has_latest = true;
    const std::optional<int64_t> step = internal::StepOfDirName(name);
    if (!step) continue;
    (env.Exists(absl::StrCat(dir, "/", name, "/manifest.json")) ? out.committed : out.uncommitted)
        .push_back(*step);
  }
  std::sort(out.committed.begin(), out.committed.end());
  std::sort(out.uncommitted.begin(), out.uncommitted.end());
  if (out.has_latest) {
    absl::StatusOr<std::string> latest = ReadFileToString(env, dir + "/latest", kMaxLatestBytes);
    if (!latest.ok()) {
      out.latest_problem = std::string(latest.status().message());
    } else {
      const std::string name(absl::StripAsciiWhitespace(*latest));
      out.latest = internal::StepOfDirName(name);
      if (!out.latest) {
        out.latest_problem = absl::StrCat(dir, "/latest holds \"", name.substr(0, 100),
                                          "\", not a checkpoint name (step-SSSSSSSSSS)");
      }
    }
  }
  return out;
}

absl::StatusOr<std::vector<std::string>> CommittedCheckpoints(Env& env, const std::string& dir) {
  EVENSTEP_ASSIGN_OR_RETURN(const CheckpointListing listing, ListCheckpoints(env, dir));
  std::vector<std::string> out;
  for (int64_t step : listing.committed) out.push_back(CheckpointPath(dir, step));
  return out;
}

absl::StatusOr<std::string> LatestCheckpoint(Env& env, const std::string& dir) {
  EVENSTEP_ASSIGN_OR_RETURN(const CheckpointListing listing, ListCheckpoints(env, dir));
  if (listing.committed.empty()) {
    return absl::NotFoundError(absl::StrCat("no committed checkpoint in ", dir));
  }
  return CheckpointPath(dir, listing.committed.back());
}

int64_t StoredBytes(const TensorInfo& tensor) {
  int64_t bytes = 0;
  for (const SliceInfo& s : tensor.slices) bytes += s.bytes;
  return bytes;
}

std::string CheckpointPath(const std::string& dir, int64_t step) {
  return absl::StrCat(dir, "/", internal::StepDirName(step));
}

}  // namespace evenstep

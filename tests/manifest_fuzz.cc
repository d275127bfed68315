// A bounded mutation fuzzer for the checkpoint reader's untrusted input: the
// manifest parser and validator (ManifestFromJson, CheckpointReader::Open)
// and the shard checks (CheckStructure through HDF5, ReadInto / Verify with
// checksums). Built with AddressSanitizer and UndefinedBehaviorSanitizer
// (tests/CMakeLists.txt) from the ATen-free io/ sources, and run by ctest for
// a bounded time:
//   manifest_fuzz [--seconds S] [--seed N] [--work DIR]
// It writes a small real checkpoint (2 shards: whole, sliced, empty and 0-d
// tensors of several dtypes), checks that it reads back intact, then
// mutates copies of it — bytes, numbers, strings, nesting, sizes of the
// manifest; bytes and sizes of the shards — and reads each one the way a
// resume does. A crash, sanitizer report, hang (ctest's timeout) or
// oversized allocation (ASAN_OPTIONS=max_allocation_size_mb) fails the test;
// so does a mutated checkpoint that reads back different bytes without an
// error. Exit status 0 with a summary line otherwise.
#include <unistd.h>
#include <xxhash.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "evenstep/checkpoint_reader.h"
#include "evenstep/env.h"
#include "evenstep/internal/h5_shard.h"
#include "evenstep/internal/names.h"

namespace {

namespace fs = std::filesystem;
using evenstep::Env;

std::string ReadAll(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

void WriteAll(const std::string& path, const std::string& data) {
  std::ofstream(path, std::ios::binary | std::ios::trunc) << data;
}

struct Seed {
  std::string manifest;
  std::vector<std::string> shards;
  std::map<std::string, std::string> bytes;  // tensor -> its bytes
};

// A real two-shard checkpoint, built with the writer's own layout code.
Seed MakeSeed() {
  struct Tensor {
    std::string name, dtype;
    std::vector<int64_t> shape;
    int64_t element;
  };
  const std::vector<Tensor> tensors = {{"model/w", "float32", {8, 5}, 4},
                                       {"model/big", "int64", {40}, 8},
                                       {"model/empty", "float16", {0, 3}, 2},
                                       {"optimizer/0/lr", "float64", {}, 8},
                                       {"model/mask", "bool", {6}, 1}};
  Seed seed;
  evenstep::Manifest m;
  m.step = 7;
  m.world_size = 2;
  m.extras_json = R"({"user": {"note": "seed"}, "balance": {"epoch": 0}})";
  std::vector<std::vector<evenstep::internal::ShardDataset>> per_shard(2);
  std::mt19937_64 rng(1);
  for (size_t i = 0; i < tensors.size(); ++i) {
    const Tensor& t = tensors[i];
    int64_t numel = 1;
    for (int64_t d : t.shape) numel *= d;
    std::string bytes(static_cast<size_t>(numel * t.element), '\0');
    for (char& c : bytes) c = static_cast<char>(rng() & (t.dtype == "bool" ? 1 : 0xff));
    seed.bytes[t.name] = bytes;
    m.tensors.push_back({t.name, t.dtype, t.shape, {}});
    // "model/big" is cut in two slices, one per shard; the rest are whole.
    std::vector<std::pair<int64_t, int64_t>> pieces = {{0, numel}};
    if (t.name == "model/big") pieces = {{0, 25}, {25, 40}};
    for (size_t p = 0; p < pieces.size(); ++p) {
      evenstep::internal::ShardDataset d;
      const bool whole = pieces.size() == 1;
      d.path = whole ? "/" + t.name : absl::StrCat("/", t.name, "@", pieces[p].first);
      d.dtype = t.dtype;
      d.shape = whole ? t.shape : std::vector<int64_t>{pieces[p].second - pieces[p].first};
      d.tensor = t.name;
      d.begin = pieces[p].first;
      d.end = pieces[p].second;
      per_shard[whole ? i % 2 : p].push_back(d);
    }
  }
  for (int r = 0; r < 2; ++r) {
    auto image = evenstep::internal::BuildShardImage(&per_shard[r]);
    if (!image.ok()) {
      std::cerr << "seed: " << image.status() << "\n";
      std::exit(1);
    }
    for (const auto& d : per_shard[r]) {
      const int64_t element = evenstep::internal::DtypeSize(d.dtype);
      const std::string& src = seed.bytes[d.tensor];
      if (d.bytes > 0)
        std::memcpy(image->data() + d.offset, src.data() + d.begin * element, d.bytes);
      evenstep::SliceInfo s;
      s.shard = r;
      s.dataset = d.path;
      s.begin = d.begin;
      s.end = d.end;
      s.offset = d.offset;
      s.bytes = d.bytes;
      s.xxh3 =
          d.bytes > 0 ? XXH3_64bits(image->data() + d.offset, d.bytes) : XXH3_64bits(nullptr, 0);
      for (auto& t : m.tensors) {
        if (t.name == d.tensor) t.slices.push_back(s);
      }
    }
    m.shards.push_back(evenstep::internal::ShardFileName(r, 2));
    m.shard_bytes.push_back(static_cast<int64_t>(image->size()));
    seed.shards.push_back(*image);
  }
  for (auto& t : m.tensors) {
    std::sort(t.slices.begin(), t.slices.end(),
              [](const auto& a, const auto& b) { return a.begin < b.begin; });
  }
  seed.manifest = evenstep::ManifestToJson(m);
  return seed;
}

class Mutator {
 public:
  explicit Mutator(uint64_t seed) : rng_(seed) {}
  size_t Below(size_t n) { return n == 0 ? 0 : static_cast<size_t>(rng_() % n); }

  void MutateText(std::string* s) {
    static const std::vector<std::string> numbers = {"-1",
                                                     "0",
                                                     "1",
                                                     "2",
                                                     "1e400",
                                                     "-1e400",
                                                     "9223372036854775807",
                                                     "9223372036854775808",
                                                     "18446744073709551615",
                                                     "-9223372036854775808",
                                                     "1.5",
                                                     "\"x\"",
                                                     "null",
                                                     "[]",
                                                     "{}",
                                                     "true",
                                                     "4096",
                                                     "1099511627776",
                                                     "-0"};
    static const std::vector<std::string> strings = {"\"../../etc/passwd\"",
                                                     "\"/abs\"",
                                                     "\"\"",
                                                     "\"a@b\"",
                                                     "\"model/w\"",
                                                     "\"step-0000000007\"",
                                                     "\"shard-00000-of-00002.h5\"",
                                                     "\"bfloat16\"",
                                                     "\"ffffffffffffffff\"",
                                                     "\"\\u0000\""};
    switch (Below(8)) {
      case 0:  // flip a byte
        if (!s->empty()) (*s)[Below(s->size())] ^= static_cast<char>(1 << Below(8));
        break;
      case 1:  // insert a byte
        s->insert(s->begin() + static_cast<long>(Below(s->size() + 1)),
                  static_cast<char>("{}[],:\"0-e\\"[Below(11)]));
        break;
      case 2: {  // delete a range
        const size_t at = Below(s->size());
        s->erase(at, Below(64) + 1);
        break;
      }
      case 3:
      case 4: {  // replace a number
        std::vector<size_t> starts;
        for (size_t i = 0; i < s->size(); ++i) {
          if (((*s)[i] >= '0' && (*s)[i] <= '9') && (i == 0 || (*s)[i - 1] == ' ')) {
            starts.push_back(i);
          }
        }
        if (starts.empty()) break;
        const size_t at = starts[Below(starts.size())];
        size_t end = at;
        while (end < s->size() && (((*s)[end] >= '0' && (*s)[end] <= '9') || (*s)[end] == '.')) {
          ++end;
        }
        s->replace(at, end - at, numbers[Below(numbers.size())]);
        break;
      }
      case 5: {  // replace a string
        std::vector<size_t> quotes;
        for (size_t i = 0; i < s->size(); ++i) {
          if ((*s)[i] == '"' && i + 1 < s->size() && (*s)[i + 1] != ':') quotes.push_back(i);
        }
        if (quotes.size() < 2) break;
        const size_t i = Below(quotes.size() - 1);
        s->replace(quotes[i], quotes[i + 1] - quotes[i] + 1, strings[Below(strings.size())]);
        break;
      }
      case 6: {  // deep nesting
        const size_t at = Below(s->size());
        const size_t depth = Below(3) == 0 ? 100000 : Below(100);
        s->insert(at, std::string(depth, Below(2) ? '[' : '{'));
        break;
      }
      case 7: {  // duplicate a range
        const size_t at = Below(s->size());
        const std::string piece = s->substr(at, Below(200));
        s->insert(Below(s->size()), piece);
        break;
      }
    }
  }

  void MutateShard(std::string* s) {
    switch (Below(4)) {
      case 0:
        if (!s->empty()) (*s)[Below(s->size())] ^= static_cast<char>(1 << Below(8));
        break;
      case 1:
        s->resize(Below(s->size() + 1));
        break;
      case 2:
        s->append(Below(64) + 1, '\0');
        break;
      case 3:  // the superblock and object headers live in the first KiB
        if (!s->empty()) (*s)[Below(std::min<size_t>(s->size(), 1024))] = static_cast<char>(rng_());
        break;
    }
  }

 private:
  std::mt19937_64 rng_;
};

}  // namespace

int main(int argc, char** argv) {
  double seconds = 20;
  uint64_t rng_seed = 12345;
  std::string work;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i];
    if (a == "--seconds") seconds = std::stod(argv[i + 1]);
    if (a == "--seed") rng_seed = std::stoull(argv[i + 1]);
    if (a == "--work") work = argv[i + 1];
  }
  if (work.empty()) {
    char tmpl[] = "/tmp/evenstep_fuzz_XXXXXX";
    work = mkdtemp(tmpl);
  }
  const std::string dir = work + "/step-0000000007";
  Env& env = *Env::Default();
  const Seed seed = MakeSeed();
  auto write = [&](const std::string& manifest, const std::vector<std::string>& shards) {
    evenstep::internal::RemoveTree(dir).IgnoreError();
    fs::create_directories(dir);
    WriteAll(dir + "/manifest.json", manifest);
    for (size_t r = 0; r < shards.size(); ++r) {
      WriteAll(dir + "/" + evenstep::internal::ShardFileName(static_cast<int>(r), 2), shards[r]);
    }
  };
  // Reads everything a resume reads; "ok" only when it all reads back.
  auto read_back = [&](std::map<std::string, std::string>* out) -> std::string {
    auto reader = evenstep::CheckpointReader::Open(env, dir);
    if (!reader.ok()) return "open: " + std::string(reader.status().message());
    std::vector<std::string> problems = (*reader)->Verify();
    for (const auto& t : (*reader)->manifest().tensors) {
      int64_t bytes = 0;
      for (const auto& s : t.slices) bytes += s.bytes;
      std::string buffer(static_cast<size_t>(bytes), '\0');
      absl::Status s = (*reader)->ReadInto(t.name, buffer.data(), bytes);
      if (!s.ok()) problems.push_back(std::string(s.message()));
      (*out)[t.name] = buffer;
    }
    return problems.empty() ? "ok" : "verify: " + problems.front();
  };
  write(seed.manifest, seed.shards);
  std::map<std::string, std::string> intact;
  if (const std::string r = read_back(&intact); r != "ok" || intact != seed.bytes) {
    std::cerr << "manifest_fuzz: the seed checkpoint does not read back: " << r << "\n";
    return 1;
  }
  Mutator mutate(rng_seed);
  const auto deadline = std::chrono::steady_clock::now() +
                        std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000));
  int64_t runs = 0, accepted = 0;
  std::map<std::string, int64_t> first_words;
  while (std::chrono::steady_clock::now() < deadline) {
    std::string manifest = seed.manifest;
    std::vector<std::string> shards = seed.shards;
    const size_t what = mutate.Below(3);
    const size_t rounds = mutate.Below(4) + 1;
    for (size_t k = 0; k < rounds; ++k) {
      if (what != 1) mutate.MutateText(&manifest);
      if (what != 0) mutate.MutateShard(&shards[mutate.Below(2)]);
    }
    // The parser alone, then the whole read.
    (void)evenstep::ManifestFromJson(manifest, "fuzz");
    write(manifest, shards);
    std::map<std::string, std::string> got;
    const std::string result = read_back(&got);
    ++runs;
    first_words[result.substr(0, result.find(':'))]++;
    if (result == "ok") {
      ++accepted;
      // Accepted: every tensor the manifest still names must read its own
      // bytes (a mutation that only touched unused bytes or whitespace).
      for (const auto& [name, bytes] : got) {
        auto it = seed.bytes.find(name);
        if (it != seed.bytes.end() && it->second != bytes) {
          std::cerr << "manifest_fuzz: a mutated checkpoint read back other bytes for " << name
                    << " without an error (run " << runs << ")\n";
          WriteAll(work + "/failing-manifest.json", manifest);
          return 1;
        }
      }
    }
  }
  evenstep::internal::RemoveTree(work).IgnoreError();
  std::cout << "manifest_fuzz: " << runs << " mutated checkpoints in " << seconds << " s, "
            << accepted << " accepted and read back intact, the rest refused (";
  for (const auto& [word, n] : first_words) std::cout << word << " " << n << "; ";
  std::cout << "); no crash, no sanitizer report\n";
  return 0;
}

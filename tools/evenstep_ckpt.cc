// evenstep-ckpt: inspect and convert evenstep checkpoints.
//
//   evenstep-ckpt ls DIR                 checkpoints under DIR: step, size, committed, latest
//   evenstep-ckpt show CKPT              tensor index: name, dtype, shape, slices
//   evenstep-ckpt verify CKPT            every checksum; exit 1 naming what is corrupt
//   evenstep-ckpt consolidate CKPT OUT   one HDF5 file with every tensor at its full shape
//   evenstep-ckpt export CKPT OUT        a torch.save archive (a dict name -> tensor;
//                                        torch.load(OUT) in Python)
//
// CKPT is a checkpoint directory (DIR/step-*) or DIR itself (its latest).
// show, consolidate and export first run verify's structure checks (each
// shard's HDF5 types, shapes and layout against the manifest; Read checks
// every checksum): a checkpoint verify refuses is never shown as intact nor
// written out (exit 1, the problems named). Every command also checks the
// extras as a resume does (evenstep::CheckTrainExtras: the balancing state).
#include <sys/stat.h>
#include <torch/serialize.h>
#include <torch/torch.h>

#include <cstring>
#include <fstream>
#include <iostream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "evenstep/checkpoint_reader.h"
#include "evenstep/internal/h5_shard.h"
#include "evenstep/internal/names.h"
#include "evenstep/train_checkpointer.h"

namespace {

using evenstep::Env;

int Usage() {
  std::cerr << "usage: evenstep-ckpt ls DIR | show CKPT | verify CKPT | consolidate CKPT OUT.h5 "
               "| export CKPT OUT.pt\n";
  return 2;
}

absl::StatusOr<std::unique_ptr<evenstep::CheckpointReader>> OpenCheckpoint(const std::string& arg) {
  Env& env = *Env::Default();
  std::string path = arg;
  if (!env.Exists(arg + "/manifest.json")) {
    absl::StatusOr<std::string> latest = evenstep::LatestCheckpoint(env, arg);
    if (!latest.ok()) return latest.status();
    path = *latest;
  }
  return evenstep::CheckpointReader::Open(env, path);
}

int64_t DirBytes(const std::string& dir) {
  int64_t total = 0;
  auto names = evenstep::internal::ListDir(dir);
  for (const std::string& name : names.ok() ? *names : std::vector<std::string>{}) {
    struct stat st;
    const std::string path = dir + "/" + name;
    if (::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode)) total += st.st_size;
  }
  return total;
}

int List(const std::string& dir) {
  Env& env = *Env::Default();
  auto names = env.List(dir);
  auto listing = evenstep::ListCheckpoints(env, dir);
  if (!names.ok() || !listing.ok()) {
    std::cerr << (names.ok() ? listing.status() : names.status()) << "\n";
    return 1;
  }
  const int64_t newest = listing->committed.empty() ? -1 : listing->committed.back();
  std::cout << absl::StrFormat("%-32s %12s %10s %s\n", "checkpoint", "bytes", "committed", "");
  for (const std::string& name : *names) {
    if (name.rfind("step-", 0) != 0) continue;
    const std::string path = dir + "/" + name;
    const std::optional<int64_t> step = evenstep::internal::StepOfDirName(name);
    const bool committed = step && env.Exists(path + "/manifest.json");
    std::string note;
    if (!step) note = "(set aside: not a checkpoint name)";
    if (step && *step == newest) note = "<- resume loads this";
    if (step && listing->latest && *listing->latest == *step) note += " <- latest";
    std::cout << absl::StrFormat("%-32s %12d %10s %s\n", name, DirBytes(path),
                                 committed ? "yes" : "no", note);
  }
  if (!listing->latest_problem.empty()) std::cout << "latest: " << listing->latest_problem << "\n";
  return 0;
}

int Show(const evenstep::CheckpointReader& reader) {
  const evenstep::Manifest& m = reader.manifest();
  std::cout << absl::StrFormat("%s: step %d, written by %d ranks, %d tensors\n", reader.path(),
                               m.step, m.world_size, m.tensors.size());
  for (const evenstep::TensorInfo& t : m.tensors) {
    std::vector<std::string> where;
    for (const evenstep::SliceInfo& s : t.slices) {
      where.push_back(
          absl::StrFormat("%s:%s[%d,%d)", m.shards[s.shard], s.dataset, s.begin, s.end));
    }
    std::cout << absl::StrFormat("  %-40s %-8s [%s]  %s\n", t.name, t.dtype,
                                 absl::StrJoin(t.shape, ","), absl::StrJoin(where, " "));
  }
  std::cout << "  extras: " << m.extras_json << "\n";
  return 0;
}

// What a resume would refuse in the extras, then `more` (the tensors' checks).
std::vector<std::string> Problems(const evenstep::CheckpointReader& reader,
                                  std::vector<std::string> more) {
  std::vector<std::string> problems;
  for (const std::string& p : evenstep::CheckTrainExtras(reader.manifest())) {
    problems.push_back(absl::StrCat(reader.path(), "/manifest.json: ", p));
  }
  problems.insert(problems.end(), more.begin(), more.end());
  return problems;
}

int Verify(const evenstep::CheckpointReader& reader) {
  const std::vector<std::string> problems = Problems(reader, reader.Verify());
  for (const std::string& p : problems) std::cout << "CORRUPT " << p << "\n";
  if (problems.empty()) {
    std::cout << reader.path() << ": all " << reader.manifest().tensors.size()
              << " tensors verified\n";
  }
  return problems.empty() ? 0 : 1;
}

int Consolidate(const evenstep::CheckpointReader& reader, const std::string& out) {
  std::vector<evenstep::internal::ShardDataset> datasets;
  std::vector<at::Tensor> values;
  for (const evenstep::TensorInfo& t : reader.manifest().tensors) {
    auto value = reader.Read(t.name);
    if (!value.ok()) {
      std::cerr << value.status() << "\n";
      return 1;
    }
    evenstep::internal::ShardDataset d;
    d.path = "/" + t.name;
    d.dtype = t.dtype;
    d.shape = t.shape;
    d.tensor = t.name;
    d.end = value->numel();
    datasets.push_back(d);
    values.push_back(*value);
  }
  auto image = evenstep::internal::BuildShardImage(&datasets);
  if (!image.ok()) {
    std::cerr << image.status() << "\n";
    return 1;
  }
  for (size_t i = 0; i < datasets.size(); ++i) {
    if (datasets[i].bytes > 0) {
      std::memcpy(image->data() + datasets[i].offset, values[i].data_ptr(), datasets[i].bytes);
    }
  }
  if (absl::Status s = evenstep::WriteFileAtomically(*Env::Default(), out, *image); !s.ok()) {
    std::cerr << s << "\n";
    return 1;
  }
  std::cout << "wrote " << out << " (" << image->size() << " bytes, " << datasets.size()
            << " datasets)\n";
  return 0;
}

int Export(const evenstep::CheckpointReader& reader, const std::string& out) {
  c10::Dict<std::string, at::Tensor> dict;
  for (const evenstep::TensorInfo& t : reader.manifest().tensors) {
    auto value = reader.Read(t.name);
    if (!value.ok()) {
      std::cerr << value.status() << "\n";
      return 1;
    }
    dict.insert(t.name, *value);
  }
  const std::vector<char> bytes = torch::pickle_save(dict);
  if (absl::Status s = evenstep::WriteFileAtomically(*Env::Default(), out,
                                                     std::string(bytes.begin(), bytes.end()));
      !s.ok()) {
    std::cerr << s << "\n";
    return 1;
  }
  std::cout << "wrote " << out << " (" << bytes.size() << " bytes, " << dict.size()
            << " tensors; torch.load() it in Python)\n";
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3) return Usage();
  const std::string command = argv[1];
  if (command == "ls") return List(argv[2]);
  auto reader = OpenCheckpoint(argv[2]);
  if (!reader.ok()) {
    std::cerr << reader.status() << "\n";
    return 1;
  }
  if (command == "verify") return Verify(**reader);
  if (const std::vector<std::string> problems = Problems(**reader, (*reader)->CheckStructure());
      !problems.empty()) {
    for (const std::string& p : problems) std::cerr << "CORRUPT " << p << "\n";
    std::cerr << "evenstep-ckpt " << command << ": " << (*reader)->path()
              << " fails verify's checks; nothing written\n";
    return 1;
  }
  if (command == "show") return Show(**reader);
  if (command == "consolidate" && argc == 4) return Consolidate(**reader, argv[3]);
  if (command == "export" && argc == 4) return Export(**reader, argv[3]);
  return Usage();
}

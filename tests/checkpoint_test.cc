// Checkpoints: round trips of every dtype across world sizes (ranks as
// writers in one process, committing through an in-process store), byte
// balance, crash at every write point, ENOSPC/EIO at every write point,
// corruption, hostile manifests, the in-flight bound, retention, and
// h5py / h5dump reading a shard.
#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <filesystem>
#include <fstream>
#include <future>
#include <iterator>
#include <map>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "evenstep/checkpoint_reader.h"
#include "evenstep/checkpoint_writer.h"
#include "tests/testing/fault_env.h"
#include "tests/testing/in_process_commit_store.h"
#include "tests/testing/subprocess.h"
#include "tests/testing/temp_dir.h"

namespace evenstep {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

// On /dev/shm when there is one: these tests exercise the protocol through
// the Env (crashes and faults are injected), not the disk, and fsync is free
// there.
class TempDir : public evenstep::testing::TempDir {
 public:
  TempDir() : evenstep::testing::TempDir("evenstep_ckpt", Where::kMemory) {}
};

CheckpointContents MakeState(int64_t step, int seed) {
  at::manual_seed(seed);
  CheckpointContents state;
  state.step = step;
  auto add = [&](const std::string& name, at::Tensor t) { state.tensors.push_back({name, t}); };
  add("model/embed.weight", at::randn({64, 33}));
  add("model/big", at::randn({1000}, at::kDouble));  // sliced when slice_bytes is small
  add("model/half", at::randn({7, 5}).to(at::kHalf));
  add("model/bf16", at::randn({9}).to(at::kBFloat16));
  add("model/ints", at::randint(-100, 100, {4, 4}, at::kLong));
  add("model/i32", at::randint(-100, 100, {6}, at::kInt));
  add("model/i16", at::randint(-100, 100, {6}, at::kShort));
  add("model/i8", at::randint(-100, 100, {6}, at::kChar));
  add("model/u8", at::randint(0, 255, {6}, at::kByte));
  add("model/mask", at::rand({5}) > 0.5);
  add("optimizer/0/step", at::scalar_tensor(step, at::kLong));
  add("optimizer/0/empty", at::empty({0, 3}));
  state.extras_json = absl::StrCat("{\"sampler\": {\"epoch\": 1, \"step\": ", step, "}}");
  return state;
}

using ::evenstep::testing::RunShell;

bool BitEqual(const at::Tensor& a, const at::Tensor& b) {
  if (a.scalar_type() != b.scalar_type() || a.sizes() != b.sizes()) return false;
  const at::Tensor ca = a.contiguous(), cb = b.contiguous();
  return std::memcmp(ca.data_ptr(), cb.data_ptr(), ca.numel() * ca.element_size()) == 0;
}

// Saves `state` as `world` ranks (writers in this process) and waits.
absl::Status SaveAsRanks(const std::string& dir, const CheckpointContents& state, int world,
                         Env* env = nullptr, int64_t slice_bytes = 1024) {
  auto store = std::make_unique<evenstep::testing::InProcessCommitStore>();
  // Every rank saves, then every rank waits: a save's outcome needs all ranks.
  // (All writers exist before the first save: a rank that fails to start
  // never joins, and the others would wait for it.)
  std::vector<std::unique_ptr<CheckpointWriter>> writers;
  std::vector<std::shared_future<absl::Status>> outcomes;
  for (int r = 0; r < world; ++r) {
    CheckpointOptions options;
    options.dir = dir;
    options.env = env;
    options.slice_bytes = slice_bytes;
    auto writer = CheckpointWriter::Create(options, store.get(), r, world);
    if (!writer.ok()) return writer.status();
    writers.push_back(*std::move(writer));
  }
  for (int r = 0; r < world; ++r) {
    auto ticket = writers[r]->Save(state);
    if (!ticket.ok()) return ticket.status();
    outcomes.push_back(ticket->done);
  }
  absl::Status first;
  for (int r = 0; r < world; ++r) {
    absl::Status s = outcomes[r].get();
    if (r > 0 && s.ToString() != first.ToString()) {
      return absl::InternalError(absl::StrCat("rank ", r, " got another outcome: ", s.ToString(),
                                              " vs ", first.ToString()));
    }
    first = s;
  }
  return first;
}

void ExpectMatches(const std::string& path, const CheckpointContents& state) {
  auto reader = CheckpointReader::Open(*Env::Default(), path);
  ASSERT_TRUE(reader.ok()) << reader.status();
  EXPECT_EQ((*reader)->manifest().step, state.step);
  for (const auto& [name, tensor] : state.tensors) {
    auto read = (*reader)->Read(name);
    ASSERT_TRUE(read.ok()) << read.status();
    EXPECT_TRUE(BitEqual(*read, tensor)) << name;
  }
  EXPECT_THAT((*reader)->manifest().extras_json, HasSubstr("\"sampler\""));
}

class CheckpointWorldTest : public ::testing::TestWithParam<int> {};

TEST_P(CheckpointWorldTest, RoundTripEveryDtypeBitExact) {
  TempDir dir;
  const CheckpointContents state = MakeState(7, 1);
  ASSERT_TRUE(SaveAsRanks(dir.path(), state, GetParam()).ok());
  auto latest = LatestCheckpoint(*Env::Default(), dir.path());
  ASSERT_TRUE(latest.ok()) << latest.status();
  EXPECT_EQ(*latest, CheckpointPath(dir.path(), 7));
  ExpectMatches(*latest, state);
  auto reader = CheckpointReader::Open(*Env::Default(), *latest);
  EXPECT_TRUE((*reader)->Verify().empty());
  // Bytes per shard: within 5 % of each other plus one slice (SaveAsRanks's
  // slice_bytes, 1 KiB).
  const auto& bytes = (*reader)->manifest().shard_bytes;
  EXPECT_EQ(static_cast<int>(bytes.size()), GetParam());
  std::vector<int64_t> data(bytes.size(), 0);
  for (const TensorInfo& t : (*reader)->manifest().tensors) {
    for (const SliceInfo& s : t.slices) data[s.shard] += s.bytes;
  }
  const auto [lo, hi] = std::minmax_element(data.begin(), data.end());
  EXPECT_LE(*hi - *lo, 0.05 * *hi + 1024) << "per-rank bytes";
}

INSTANTIATE_TEST_SUITE_P(Worlds, CheckpointWorldTest, ::testing::Values(1, 2, 3, 4));

// The reader's part of a distributed load: every tensor is read by exactly
// one rank, ranks' bytes differ by at most the largest tensor, and the bytes
// a rank reads become the stored tensor again (wrong sizes refused, naming it).
TEST_P(CheckpointWorldTest, ReadPlanCoversEveryTensorOnceAndBytesBecomeTheTensor) {
  TempDir dir;
  const CheckpointContents state = MakeState(3, 1);
  ASSERT_TRUE(SaveAsRanks(dir.path(), state, 2).ok());
  auto reader = CheckpointReader::Open(*Env::Default(), CheckpointPath(dir.path(), 3));
  ASSERT_TRUE(reader.ok()) << reader.status();
  const Manifest& manifest = (*reader)->manifest();
  const int world = GetParam();
  const std::vector<std::vector<int>> plan = (*reader)->PlanReads(world);
  ASSERT_EQ(static_cast<int>(plan.size()), world);
  std::vector<int> readers(manifest.tensors.size(), 0);
  std::vector<int64_t> bytes(world, 0);
  int64_t largest = 0;
  for (int r = 0; r < world; ++r) {
    for (int t : plan[r]) {
      ASSERT_GE(t, 0);
      ASSERT_LT(t, static_cast<int>(manifest.tensors.size()));
      ++readers[t];
      bytes[r] += StoredBytes(manifest.tensors[t]);
      largest = std::max(largest, StoredBytes(manifest.tensors[t]));
    }
  }
  for (size_t t = 0; t < readers.size(); ++t) {
    EXPECT_EQ(readers[t], 1) << manifest.tensors[t].name;
  }
  const auto [lo, hi] = std::minmax_element(bytes.begin(), bytes.end());
  EXPECT_LE(*hi - *lo, largest);
  std::map<std::string, at::Tensor> saved(state.tensors.begin(), state.tensors.end());
  for (const TensorInfo& t : manifest.tensors) {
    at::Tensor raw = at::empty({StoredBytes(t)}, at::kByte);
    ASSERT_TRUE((*reader)->ReadInto(t.name, raw.data_ptr(), raw.numel()).ok()) << t.name;
    auto typed = (*reader)->FromBytes(t.name, raw);
    ASSERT_TRUE(typed.ok()) << typed.status();
    EXPECT_TRUE(BitEqual(*typed, saved.at(t.name))) << t.name;
    EXPECT_EQ(StoredDtypeOf(*typed), t.dtype);
  }
  const TensorInfo& first = manifest.tensors.front();
  auto short_bytes =
      (*reader)->FromBytes(first.name, at::empty({StoredBytes(first) + 1}, at::kByte));
  EXPECT_EQ(short_bytes.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(short_bytes.status().message(), HasSubstr(first.name));
  EXPECT_TRUE(
      absl::IsNotFound((*reader)->FromBytes("model/none", at::empty({0}, at::kByte)).status()));
  EXPECT_EQ(StoredDtypeOf(at::zeros({2}, at::kComplexFloat)), "unsupported");
}

TEST(CheckpointTest, CrashAtEveryWritePointLeavesPreviousOrNewComplete) {
  TempDir counting;
  FaultEnv probe(Env::Default());
  ASSERT_TRUE(SaveAsRanks(counting.path(), MakeState(1, 1), 2).ok());
  probe.Reset();
  ASSERT_TRUE(SaveAsRanks(counting.path(), MakeState(2, 2), 2, &probe).ok());
  const int64_t points = probe.write_points();
  ASSERT_GT(points, 10);
  for (int64_t n = 1; n <= points; ++n) {
    TempDir dir;
    const CheckpointContents before = MakeState(1, 1), after = MakeState(2, 2);
    ASSERT_TRUE(SaveAsRanks(dir.path(), before, 2).ok());
    FaultEnv env(Env::Default());
    env.CrashAt(n);
    const absl::Status s = SaveAsRanks(dir.path(), after, 2, &env);
    EXPECT_FALSE(s.ok()) << "crash at write point " << n << " went unnoticed";
    env.RecoverFromCrash();
    auto latest = LatestCheckpoint(*Env::Default(), dir.path());
    ASSERT_TRUE(latest.ok()) << "crash at " << n << ": " << latest.status();
    if (*latest == CheckpointPath(dir.path(), 2)) {
      ExpectMatches(*latest, after);
    } else {
      ExpectMatches(*latest, before);
    }
    // The `latest` hint survives too: a crash leaves its old entry or its
    // new one, naming a committed checkpoint, never no file at all.
    auto listing = ListCheckpoints(*Env::Default(), dir.path());
    ASSERT_TRUE(listing.ok()) << listing.status();
    EXPECT_TRUE(listing->has_latest) << "no latest after a crash at " << n;
    ASSERT_TRUE(listing->latest.has_value()) << listing->latest_problem << ", crash at " << n;
    EXPECT_TRUE(*listing->latest == 1 ||
                (*listing->latest == 2 && *latest == CheckpointPath(dir.path(), 2)))
        << "latest names step " << *listing->latest << " after a crash at " << n;
  }
}

// A save that returned OK survives a power cut right after it, even into a
// checkpoint root the writer had to create (its entry, and its parents',
// must have been made durable too).
TEST(CheckpointTest, CommittedSaveIntoANewRootSurvivesACrashRightAfter) {
  TempDir dir;
  const std::string root = dir.path() + "/new/nested/root";
  FaultEnv env(Env::Default());
  const CheckpointContents state = MakeState(4, 3);
  ASSERT_TRUE(SaveAsRanks(root, state, 2, &env).ok());
  env.CrashAt(1);
  env.RecoverFromCrash();
  auto latest = LatestCheckpoint(*Env::Default(), root);
  ASSERT_TRUE(latest.ok()) << latest.status();
  ExpectMatches(*latest, state);
}

// FaultEnv models what a crash undoes: a Remove not followed by its
// directory's sync comes back (with its synced bytes), one followed by it
// does not; a directory CreateDirs made vanishes with its contents unless
// its parent was synced.
TEST(FaultEnvTest, CrashUndoesUnsyncedRemovesAndDirectoryCreations) {
  TempDir dir;
  Env& real = *Env::Default();
  const std::string sub = dir.path() + "/sub";
  ASSERT_TRUE(real.CreateDirs(sub).ok());
  ASSERT_TRUE(WriteFileAtomically(real, sub + "/kept", "durable bytes").ok());
  ASSERT_TRUE(WriteFileAtomically(real, dir.path() + "/gone", "removed for good").ok());
  FaultEnv env(&real);
  ASSERT_TRUE(env.Remove(dir.path() + "/gone").ok());
  ASSERT_TRUE(env.CreateDirs(dir.path() + "/made").ok());
  ASSERT_TRUE(env.SyncDir(dir.path()).ok());  // both made durable
  ASSERT_TRUE(env.CreateDirs(dir.path() + "/lost/inner").ok());
  ASSERT_TRUE(WriteFileAtomically(env, dir.path() + "/lost/inner/f", "synced in inner").ok());
  ASSERT_TRUE(env.Remove(sub + "/kept").ok());  // sub is never synced after this
  env.CrashAt(1);
  env.RecoverFromCrash();
  EXPECT_FALSE(real.Exists(dir.path() + "/gone")) << "a removal made durable came back";
  EXPECT_TRUE(real.Exists(dir.path() + "/made")) << "a directory whose parent was synced vanished";
  EXPECT_FALSE(real.Exists(dir.path() + "/lost"))
      << "a directory whose parent was never synced survived";
  auto kept = ReadFileToString(real, sub + "/kept");
  ASSERT_TRUE(kept.ok()) << "an unsynced removal was not undone: " << kept.status();
  EXPECT_EQ(*kept, "durable bytes");
}

TEST(CheckpointTest, NoSpaceOrIoErrorAtEveryWritePointIsReportedAndNothingIsLost) {
  for (int error : {ENOSPC, EIO}) {
    TempDir counting;
    FaultEnv probe(Env::Default());
    ASSERT_TRUE(SaveAsRanks(counting.path(), MakeState(1, 1), 2, &probe).ok());
    const int64_t points = probe.write_points();
    for (int64_t n = 1; n <= points; ++n) {
      TempDir dir;
      const CheckpointContents before = MakeState(1, 1);
      ASSERT_TRUE(SaveAsRanks(dir.path(), before, 2).ok());
      FaultEnv env(Env::Default());
      env.FailAt(n, error);
      const absl::Status s = SaveAsRanks(dir.path(), MakeState(2, 2), 2, &env);
      ASSERT_FALSE(s.ok()) << "failure at write point " << n << " went unnoticed";
      EXPECT_EQ(s.code(), error == ENOSPC ? absl::StatusCode::kResourceExhausted
                                          : absl::StatusCode::kInternal)
          << s;
      EXPECT_THAT(s.message(), HasSubstr("rank "));
      EXPECT_THAT(s.message(), HasSubstr("(injected)"));
      // A failed save leaves no file behind (unless its manifest committed
      // and only `latest` or retention failed).
      const std::string failed = CheckpointPath(dir.path(), 2);
      if (!std::filesystem::exists(failed + "/manifest.json")) {
        EXPECT_FALSE(std::filesystem::exists(failed)) << "partial files left, point " << n;
      }
      for (const auto& e : std::filesystem::recursive_directory_iterator(dir.path())) {
        EXPECT_FALSE(absl::EndsWith(e.path().string(), ".tmp")) << e.path() << ", point " << n;
      }
      // The committed checkpoint is intact whatever failed; the newest is
      // step 1, or step 2 whole when only `latest` or retention failed after
      // its manifest committed. Training can save again.
      ExpectMatches(CheckpointPath(dir.path(), 1), before);
      auto latest = LatestCheckpoint(*Env::Default(), dir.path());
      ASSERT_TRUE(latest.ok());
      if (*latest == CheckpointPath(dir.path(), 2)) {
        ExpectMatches(*latest, MakeState(2, 2));
      } else {
        EXPECT_EQ(*latest, CheckpointPath(dir.path(), 1)) << "point " << n;
      }
      env.Reset();
      const CheckpointContents again = MakeState(3, 3);
      ASSERT_TRUE(SaveAsRanks(dir.path(), again, 2, &env).ok()) << "after a failure at " << n;
      ExpectMatches(CheckpointPath(dir.path(), 3), again);
    }
  }
}

TEST(CheckpointTest, FlippedByteIsReportedWithFileAndDataset) {
  TempDir dir;
  const CheckpointContents state = MakeState(5, 1);
  ASSERT_TRUE(SaveAsRanks(dir.path(), state, 2).ok());
  const std::string path = CheckpointPath(dir.path(), 5);
  auto reader = CheckpointReader::Open(*Env::Default(), path);
  ASSERT_TRUE(reader.ok());
  const TensorInfo* t = (*reader)->Find("model/embed.weight");
  ASSERT_NE(t, nullptr);
  const SliceInfo& slice = t->slices.front();
  const std::string shard = path + "/" + (*reader)->manifest().shards[slice.shard];
  {
    std::fstream f(shard, std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(slice.offset + 17);
    char c;
    f.read(&c, 1);
    c ^= 0x10;
    f.seekp(slice.offset + 17);
    f.write(&c, 1);
  }
  const std::vector<std::string> problems = (*reader)->Verify();
  ASSERT_EQ(problems.size(), 1u);
  EXPECT_THAT(problems[0], HasSubstr(shard));
  EXPECT_THAT(problems[0], HasSubstr(slice.dataset));
  auto read = (*reader)->Read("model/embed.weight");
  EXPECT_EQ(read.status().code(), absl::StatusCode::kDataLoss);
}

TEST(CheckpointTest, HostileManifestsAreRejected) {
  TempDir dir;
  ASSERT_TRUE(SaveAsRanks(dir.path(), MakeState(5, 1), 1).ok());
  const std::string path = CheckpointPath(dir.path(), 5);
  auto original = ReadFileToString(*Env::Default(), path + "/manifest.json");
  ASSERT_TRUE(original.ok());
  auto rejected = [&](const std::string& from, const std::string& to) {
    std::string json = *original;
    const size_t at = json.find(from);
    EXPECT_NE(at, std::string::npos) << from;
    json.replace(at, from.size(), to);
    return ManifestFromJson(json, "manifest.json").status();
  };
  EXPECT_THAT(rejected("\"model/embed.weight\"", "\"../../etc/passwd\"").message(),
              HasSubstr("\"..\""));
  EXPECT_THAT(rejected("\"model/embed.weight\"", "\"/abs\"").message(), HasSubstr("absolute"));
  EXPECT_THAT(rejected("shard-00000-of-00001.h5\"", "../x.h5\"").message(),
              HasSubstr("the format names it shard-00000-of-00001.h5"));
  EXPECT_THAT(
      rejected("\"shape\": [\n    64,\n    33\n   ]", "\"shape\": [1000000000000, 1000000000000]")
          .message(),
      HasSubstr("impossible shape"));
  EXPECT_FALSE(rejected("\"offset\": ", "\"offset\": 99999999").ok());
  EXPECT_FALSE(ManifestFromJson("{not json", "m").ok());
}

TEST(CheckpointTest, RetentionKeepsTheNewest) {
  TempDir dir;
  auto store = std::make_unique<evenstep::testing::InProcessCommitStore>();
  CheckpointOptions options;
  options.dir = dir.path();
  options.keep = 2;
  auto writer = CheckpointWriter::Create(options, store.get(), 0, 1);
  ASSERT_TRUE(writer.ok());
  for (int step = 1; step <= 4; ++step) {
    auto ticket = (*writer)->Save(MakeState(step, step));
    ASSERT_TRUE(ticket.ok());
    ASSERT_TRUE(ticket->done.get().ok());
  }
  auto committed = CommittedCheckpoints(*Env::Default(), dir.path());
  ASSERT_TRUE(committed.ok());
  EXPECT_EQ(*committed, (std::vector<std::string>{CheckpointPath(dir.path(), 3),
                                                  CheckpointPath(dir.path(), 4)}));
}

// An Env whose shard creation waits for a signal: a save stays in flight.
class GateEnv : public FaultEnv {
 public:
  GateEnv() : FaultEnv(Env::Default()), opened_(gate_.get_future().share()) {}
  absl::StatusOr<std::unique_ptr<File>> Create(const std::string& path) override {
    if (path.find("shard-") != std::string::npos) opened_.wait();
    return FaultEnv::Create(path);
  }
  void Open() { gate_.set_value(); }

 private:
  std::promise<void> gate_;
  std::shared_future<void> opened_;
};

TEST(CheckpointTest, InFlightBoundSkipsOrWaits) {
  TempDir dir;
  GateEnv env;
  auto store = std::make_unique<evenstep::testing::InProcessCommitStore>();
  CheckpointOptions options;
  options.dir = dir.path();
  options.env = &env;
  options.max_in_flight = 1;
  options.when_busy = WhenBusy::kSkip;
  auto writer = CheckpointWriter::Create(options, store.get(), 0, 1);
  ASSERT_TRUE(writer.ok());
  auto first = (*writer)->Save(MakeState(1, 1));
  ASSERT_TRUE(first.ok());
  EXPECT_FALSE(first->skipped);
  auto second = (*writer)->Save(MakeState(2, 2));  // the first is held at the gate
  ASSERT_TRUE(second.ok());
  EXPECT_TRUE(second->skipped);
  env.Open();
  EXPECT_TRUE(first->done.get().ok());
  auto third = (*writer)->Save(MakeState(3, 3));
  ASSERT_TRUE(third.ok());
  EXPECT_FALSE(third->skipped);
  EXPECT_TRUE(third->done.get().ok());
}

TEST(CheckpointTest, H5pyAndH5dumpReadAShard) {
  TempDir dir;
  CheckpointContents state;
  state.step = 9;
  state.tensors.push_back({"model/w", at::arange(6, at::kFloat).reshape({2, 3}) * 0.5});
  state.tensors.push_back({"model/h", at::tensor({1.5, -2.0}, at::kFloat).to(at::kHalf)});
  ASSERT_TRUE(SaveAsRanks(dir.path(), state, 1).ok());
  const std::string shard = CheckpointPath(dir.path(), 9) + "/shard-00000-of-00001.h5";
  auto [rc, out] = RunShell(absl::StrCat(
      "/usr/bin/python3 -c \"import h5py; f = h5py.File('", shard,
      "', 'r'); print(f['model/w'][...].tolist(), f['model/h'].dtype, f['model/h'][...].tolist(),"
      " f['model/w'].attrs['dtype'])\""));
  EXPECT_EQ(rc, 0) << out;
  EXPECT_THAT(out, HasSubstr("[[0.0, 0.5, 1.0], [1.5, 2.0, 2.5]] float16 [1.5, -2.0] "));
  EXPECT_THAT(out, HasSubstr("float32"));
  std::tie(rc, out) = RunShell(absl::StrCat("h5dump -d /model/w ", shard));
  EXPECT_EQ(rc, 0) << out;
  EXPECT_THAT(out, HasSubstr("(0,0): 0, 0.5, 1,"));
}

TEST(CheckpointTest, PythonReaderLoadsEveryTensorBitForBit) {
  // tools/evenstep_ckpt_reader.py: h5py + numpy only, no evenstep code.
  TempDir dir;
  const CheckpointContents state = MakeState(6, 3);
  ASSERT_TRUE(SaveAsRanks(dir.path(), state, 3).ok());  // slices across 3 shards
  const std::string dump = dir.path() + "/dump";
  auto [rc, out] = RunShell(
      absl::StrCat("/usr/bin/python3 ", EVENSTEP_CKPT_READER, " ", dir.path(), " --dump ", dump));
  ASSERT_EQ(rc, 0) << out;
  EXPECT_THAT(out, HasSubstr("extras {\"sampler\""));
  for (const auto& [name, tensor] : state.tensors) {
    std::string file = name;
    for (size_t at = file.find('/'); at != std::string::npos; at = file.find('/')) {
      file.replace(at, 1, "__");
    }
    std::ifstream in(dump + "/" + file + ".bin", std::ios::binary);
    const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    const at::Tensor c = tensor.contiguous();
    ASSERT_EQ(bytes.size(), static_cast<size_t>(c.numel() * c.element_size())) << name;
    EXPECT_EQ(std::memcmp(bytes.data(), c.data_ptr(), bytes.size()), 0) << name;
  }
  // The reader checks the XXH3 checksums (python3-xxhash): a flipped byte fails.
  auto reader = CheckpointReader::Open(*Env::Default(), CheckpointPath(dir.path(), 6));
  ASSERT_TRUE(reader.ok());
  const SliceInfo& slice = (*reader)->Find("model/embed.weight")->slices[0];
  {
    std::fstream f(CheckpointPath(dir.path(), 6) + "/" + (*reader)->manifest().shards[slice.shard],
                   std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(slice.offset + 3);
    f.write("\x55", 1);
  }
  std::tie(rc, out) =
      RunShell(absl::StrCat("/usr/bin/python3 ", EVENSTEP_CKPT_READER, " ", dir.path()));
  EXPECT_NE(rc, 0) << out;
  EXPECT_THAT(out, HasSubstr(slice.dataset + ": checksum mismatch"));
}

TEST(CheckpointTest, CkptToolListsShowsVerifiesAndConsolidates) {
  TempDir dir;
  const CheckpointContents state = MakeState(4, 1);
  ASSERT_TRUE(SaveAsRanks(dir.path(), state, 2).ok());
  const std::string tool = EVENSTEP_CKPT_TOOL;
  auto [rc, out] = RunShell(tool + " ls " + dir.path());
  EXPECT_EQ(rc, 0) << out;
  EXPECT_THAT(
      out, ::testing::ContainsRegex("step-0000000004 +[0-9]+ +yes <- resume loads this <- latest"));
  std::tie(rc, out) = RunShell(tool + " show " + dir.path());
  EXPECT_EQ(rc, 0) << out;
  EXPECT_THAT(out, HasSubstr("model/bf16"));
  std::tie(rc, out) = RunShell(tool + " verify " + dir.path());
  EXPECT_EQ(rc, 0) << out;
  const std::string merged = dir.path() + "/merged.h5";
  std::tie(rc, out) = RunShell(tool + " consolidate " + dir.path() + " " + merged);
  EXPECT_EQ(rc, 0) << out;
  std::tie(rc, out) = RunShell("/usr/bin/python3 -c \"import h5py; f = h5py.File('" + merged +
                               "', 'r'); print(f['model/big'].shape, f['model/ints'][0, 0])\"");
  EXPECT_EQ(rc, 0) << out;
  const int64_t first = state.tensors[4].second[0][0].item<int64_t>();
  EXPECT_THAT(out, HasSubstr(absl::StrCat("(1000,) ", first)));
  // A flipped byte makes verify fail and name the shard.
  auto reader = CheckpointReader::Open(*Env::Default(), CheckpointPath(dir.path(), 4));
  const SliceInfo& slice = (*reader)->Find("model/ints")->slices[0];
  const std::string shard =
      CheckpointPath(dir.path(), 4) + "/" + (*reader)->manifest().shards[slice.shard];
  {
    std::fstream f(shard, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(slice.offset);
    f.write("\x7f", 1);
  }
  std::tie(rc, out) = RunShell(tool + " verify " + dir.path());
  EXPECT_EQ(rc, 1) << out;
  EXPECT_THAT(out, HasSubstr("CORRUPT " + shard));
}

TEST(CheckpointTest, ToolsRefuseHostileCheckpointsWithoutCrashingOrHanging) {
  TempDir dir;
  ASSERT_TRUE(SaveAsRanks(dir.path(), MakeState(4, 1), 2).ok());
  const std::string tool = EVENSTEP_CKPT_TOOL;
  const std::string ckpt = CheckpointPath(dir.path(), 4);
  const std::string manifest = ckpt + "/manifest.json";
  const std::string original = *ReadFileToString(*Env::Default(), manifest);
  // `extras` nested 58,000 deep (nlohmann's dump recurses: SIGSEGV before).
  std::string deep = original;
  deep.replace(deep.find("\"extras\": {"), 11,
               "\"extras\": {\"x\": " + std::string(58000, '[') + std::string(58000, ']') + ", ");
  std::ofstream(manifest, std::ios::trunc) << deep;
  for (const std::string command : {"show", "verify", "consolidate", "export"}) {
    auto [rc, out] = RunShell(absl::StrCat(tool, " ", command, " ", ckpt, " ", dir.path(), "/out"));
    EXPECT_EQ(rc, 1) << command << ": " << out;
    EXPECT_THAT(out, HasSubstr("JSON nested 58002 deep (at most 64)")) << command;
  }
  // A manifest that is a FIFO: refused at once (it used to hang).
  std::filesystem::remove(manifest);
  ASSERT_EQ(mkfifo(manifest.c_str(), 0644), 0);
  auto [rc, out] = RunShell(tool + " verify " + ckpt);
  EXPECT_EQ(rc, 1) << out;
  EXPECT_THAT(out, HasSubstr("not a regular file (a FIFO)"));
  std::filesystem::remove(manifest);
  std::ofstream(manifest) << original;
  // A 1 TiB sparse `latest`: never read whole (it used to throw bad_alloc);
  // the checkpoint is still found by its manifest.
  std::filesystem::resize_file(dir.path() + "/latest", int64_t{1} << 40);
  std::tie(rc, out) = RunShell(tool + " ls " + dir.path());
  EXPECT_EQ(rc, 0) << out;
  EXPECT_THAT(out, HasSubstr("step-0000000004"));
  EXPECT_THAT(out, HasSubstr("more than the 4096 such a file may hold"));
  std::tie(rc, out) = RunShell(tool + " verify " + dir.path());
  EXPECT_EQ(rc, 0) << out;
}

TEST(CheckpointTest, EveryToolRefusesADtypeRelabelledWithARecomputedIndexChecksum) {
  // An attacker's edit that keeps the manifest self-consistent: a float32
  // tensor labelled int32 (same element size), index_xxh3 recomputed. The
  // data checksums still match; only the shard's HDF5 type tells. verify
  // refused it while consolidate and export wrote the float bits as int32.
  TempDir dir;
  ASSERT_TRUE(SaveAsRanks(dir.path(), MakeState(4, 1), 2).ok());
  const std::string tool = EVENSTEP_CKPT_TOOL;
  const std::string ckpt = CheckpointPath(dir.path(), 4);
  const std::string path = ckpt + "/manifest.json";
  auto manifest = ManifestFromJson(*ReadFileToString(*Env::Default(), path), path);
  ASSERT_TRUE(manifest.ok()) << manifest.status();
  std::string relabelled;
  for (TensorInfo& t : manifest->tensors) {
    if (t.dtype == "float32") {
      t.dtype = "int32";
      relabelled = t.name;
      break;
    }
  }
  ASSERT_FALSE(relabelled.empty());
  std::ofstream(path, std::ios::trunc) << ManifestToJson(*manifest);
  for (const std::string command : {"show", "verify", "consolidate", "export"}) {
    const std::string out_file = dir.path() + "/out-" + command;
    auto [rc, out] = RunShell(absl::StrCat(tool, " ", command, " ", ckpt, " ", out_file, " 2>&1"));
    EXPECT_EQ(rc, 1) << command << ": " << out;
    EXPECT_THAT(out, HasSubstr("its HDF5 type is not that of int32")) << command << ": " << out;
    EXPECT_FALSE(std::filesystem::exists(out_file)) << command;
  }
  auto [rc, out] =
      RunShell(absl::StrCat("/usr/bin/python3 ", EVENSTEP_CKPT_READER, " ", ckpt, " 2>&1"));
  EXPECT_EQ(rc, 1) << out;
  EXPECT_THAT(out, HasSubstr("is not what the manifest says")) << out;
  EXPECT_THAT(out, HasSubstr("dtype int32)")) << out;
}

TEST(CheckpointTest, PythonReaderRefusesNonJsonNumbersAsVerifyDoes) {
  // Python's json reads Infinity and NaN; JSON and evenstep's reader do not.
  TempDir dir;
  ASSERT_TRUE(SaveAsRanks(dir.path(), MakeState(4, 1), 2).ok());
  const std::string path = CheckpointPath(dir.path(), 4) + "/manifest.json";
  std::string text = *ReadFileToString(*Env::Default(), path);
  const size_t at = text.find("\"step\": 4");
  ASSERT_NE(at, std::string::npos);
  text.replace(at, 9, "\"step\": Infinity");
  std::ofstream(path, std::ios::trunc) << text;
  auto [rc, out] = RunShell(absl::StrCat(EVENSTEP_CKPT_TOOL, " verify ", dir.path(), " 2>&1"));
  EXPECT_EQ(rc, 1) << out;
  std::tie(rc, out) =
      RunShell(absl::StrCat("/usr/bin/python3 ", EVENSTEP_CKPT_READER, " ", dir.path(), " 2>&1"));
  EXPECT_EQ(rc, 1) << out;
  EXPECT_THAT(out, HasSubstr("Infinity is not a JSON value"));
}

TEST(CheckpointTest, VerifyOpensEveryShardWithHdf5) {
  TempDir dir;
  ASSERT_TRUE(SaveAsRanks(dir.path(), MakeState(4, 1), 2).ok());
  const std::string tool = EVENSTEP_CKPT_TOOL;
  const std::string shard = CheckpointPath(dir.path(), 4) + "/shard-00001-of-00002.h5";
  // A broken superblock: the data checksums still match, but no HDF5 reader
  // (h5py, the README's recipe) can open the shard; verify says so.
  {
    std::fstream f(shard, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(1);
    f.write("XYZ", 3);
  }
  auto [rc, out] = RunShell(tool + " verify " + dir.path());
  EXPECT_EQ(rc, 1) << out;
  EXPECT_THAT(out, HasSubstr("CORRUPT " + shard + ": not an HDF5 file"));
  // The Python reader names the file too (h5py's OSError named none).
  std::tie(rc, out) =
      RunShell(absl::StrCat("/usr/bin/python3 ", EVENSTEP_CKPT_READER, " ", dir.path(), " 2>&1"));
  EXPECT_EQ(rc, 1) << out;
  EXPECT_THAT(out, HasSubstr(shard + ": not a readable HDF5 file"));
  EXPECT_THAT(out, Not(HasSubstr("Traceback")));
  // The resume path reads by offset and still gets the right bytes; the
  // manifest-level checks are unaffected.
  auto reader = CheckpointReader::Open(*Env::Default(), CheckpointPath(dir.path(), 4));
  ASSERT_TRUE(reader.ok()) << reader.status();
  const std::vector<std::string> problems = (*reader)->CheckStructure();
  ASSERT_EQ(problems.size(), 1u);
  EXPECT_THAT(problems[0], HasSubstr(shard));
}

// The HDF5 structure check runs in evenstep-h5check, started with
// posix_spawn, never in a fork of the caller (a threaded trainer's fork
// inherits locks another thread held): from a process where another thread
// allocates all the while, every check of a good checkpoint ends without a
// problem. A checker that crashes, fails or is missing is named, and the
// caller survives (one that exits without reading its request raises no
// SIGPIPE here).
TEST(CheckpointTest, TheStructureCheckRunsInAProgramOfItsOwn) {
  TempDir dir;
  ASSERT_TRUE(SaveAsRanks(dir.path(), MakeState(4, 1), 2).ok());
  auto reader = CheckpointReader::Open(*Env::Default(), CheckpointPath(dir.path(), 4));
  ASSERT_TRUE(reader.ok()) << reader.status();
  std::atomic<bool> stop{false};
  std::thread churn([&] {
    while (!stop.load()) std::vector<std::string> strings(64, std::string(100, 'x'));
  });
  for (int i = 0; i < 20; ++i) {
    EXPECT_THAT((*reader)->CheckStructure(), ::testing::IsEmpty()) << "check " << i;
  }
  stop = true;
  churn.join();
  const std::string fake = dir.path() + "/fake_checker";
  for (const auto& [script, says] : std::vector<std::pair<std::string, std::string>>{
           {"kill -SEGV $$", "died of signal 11"}, {"exit 3", "exited with 3"}}) {
    { std::ofstream(fake) << "#!/bin/sh\n" << script << "\n"; }
    ASSERT_EQ(::chmod(fake.c_str(), 0755), 0);
    ::setenv("EVENSTEP_H5CHECK", fake.c_str(), 1);
    const std::vector<std::string> problems = (*reader)->CheckStructure();
    ASSERT_EQ(problems.size(), 2u) << script;  // one per shard
    EXPECT_THAT(problems[0], HasSubstr("HDF5 cannot read it (the library " + says)) << script;
  }
  ::setenv("EVENSTEP_H5CHECK", "/nonexistent/evenstep-h5check", 1);
  const std::vector<std::string> problems = (*reader)->CheckStructure();
  ::unsetenv("EVENSTEP_H5CHECK");
  ASSERT_EQ(problems.size(), 2u);
  EXPECT_THAT(
      problems[0],
      HasSubstr("not checked: cannot start the HDF5 checker /nonexistent/evenstep-h5check"));
}

TEST(CheckpointTest, PythonReaderRefusesWhatTheCppReaderRefuses) {
  TempDir dir;
  ASSERT_TRUE(SaveAsRanks(dir.path(), MakeState(6, 3), 2).ok());
  const std::string ckpt = CheckpointPath(dir.path(), 6);
  const std::string reader = absl::StrCat("/usr/bin/python3 ", EVENSTEP_CKPT_READER, " ");
  // bfloat16 comes back as torch.bfloat16 under Debian's torch 1.13.
  auto [rc, out] = RunShell(
      absl::StrCat("cd ", std::filesystem::path(EVENSTEP_CKPT_READER).parent_path().string(),
                   " && /usr/bin/python3 -c \"import evenstep_ckpt_reader as r; t, _ = r.load('",
                   dir.path(), "'); print(t['model/bf16'].dtype, t['model/bf16'].shape)\""));
  EXPECT_EQ(rc, 0) << out;
  EXPECT_THAT(out, HasSubstr("torch.bfloat16 torch.Size([9])"));
  // `latest` is never followed: a decoy outside the directory is not loaded.
  std::filesystem::rename(ckpt, dir.path() + "/elsewhere");
  { std::ofstream(dir.path() + "/latest") << "../../elsewhere"; }
  std::tie(rc, out) = RunShell(reader + dir.path());
  EXPECT_EQ(rc, 1) << out;
  EXPECT_THAT(out, HasSubstr("no committed checkpoint"));
  std::filesystem::rename(dir.path() + "/elsewhere", ckpt);
  // A slice that no longer tiles its tensor, and a truncated shard.
  const std::string manifest = ckpt + "/manifest.json";
  const std::string original = *ReadFileToString(*Env::Default(), manifest);
  std::string edited = original;
  const size_t at = edited.find("\"begin\": 0");
  ASSERT_NE(at, std::string::npos);
  edited.replace(at, 10, "\"begin\": 1");
  std::ofstream(manifest, std::ios::trunc) << edited;
  std::tie(rc, out) = RunShell(reader + ckpt);
  EXPECT_EQ(rc, 1) << out;
  EXPECT_THAT(out, HasSubstr("does not continue at 0"));
  std::ofstream(manifest, std::ios::trunc) << original;
  const std::string shard = ckpt + "/shard-00000-of-00002.h5";
  std::filesystem::resize_file(shard, std::filesystem::file_size(shard) - 1);
  std::tie(rc, out) = RunShell(reader + ckpt);
  EXPECT_EQ(rc, 1) << out;
  EXPECT_THAT(out, HasSubstr("bytes, the manifest says"));
}

}  // namespace
}  // namespace evenstep

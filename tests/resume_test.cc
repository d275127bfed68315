// What a training run does when its checkpoints are broken or cannot be
// written, over real ranks (tests/ckpt_helper --mode=session: two processes,
// evenstep::Session, real files):
//   - every class of corrupt or hostile newest checkpoint stops the resume
//     with an error naming the checkpoint and the reason, never a restart
//     from step 1; with --evenstep_resume=newest_valid the previous
//     checkpoint loads and the run says so;
//   - a checkpoint that does not fit the model is an error even with the
//     fallback; `latest` lagging the manifest resumes from the newest
//     committed step; a committed directory is never rewritten;
//   - a real full tmpfs and a read-only mount: every rank reports the failed
//     save, partial files are removed, committed checkpoints stay intact, and
//     the run stops after the configured number of failures.
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "evenstep/checkpoint.h"
#include "evenstep/session.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/subprocess.h"

namespace evenstep {
namespace {

namespace fs = std::filesystem;
using ::evenstep::testing::Describe;
using ::evenstep::testing::ProcessResult;
using ::testing::HasSubstr;
using ::testing::Not;

std::string ReadAll(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

void WriteAll(const std::string& path, const std::string& text) {
  std::ofstream(path, std::ios::binary | std::ios::trunc) << text;
}

std::pair<int, std::string> Shell(const std::string& command) {
  return evenstep::testing::RunShell(command, absl::Seconds(60));
}

// Runs ckpt_helper's Session loop on 2 ranks in `run_dir` (checkpoints in
// `ckpt_dir`, default run_dir/ckpt).
std::vector<ProcessResult> Train(const std::string& run_dir, int steps,
                                 std::vector<std::string> extra, std::string ckpt_dir = "") {
  std::vector<std::string> argv = {
      EVENSTEP_CKPT_HELPER,
      "--mode=session",
      "--run_dir=" + run_dir,
      "--evenstep_ckpt_dir=" + (ckpt_dir.empty() ? run_dir + "/ckpt" : ckpt_dir),
      "--steps=" + std::to_string(steps),
      "--evenstep_ckpt_every=2",
      "--evenstep_global_batch=24",
      "--evenstep_micro_batch_samples=5",
      "--evenstep_log_every=1",
      "--evenstep_timeout=60s",
      "--evenstep_rendezvous_timeout=60s"};
  argv.insert(argv.end(), extra.begin(), extra.end());
  return evenstep::testing::RunRanks(2, argv, absl::Seconds(120));
}

// Rewrites a manifest's index_xxh3 for its (edited) index: a crafted
// manifest that passes the checksum, so the checks behind it are reached.
void Rechecksum(const std::string& manifest_path) {
  nlohmann::json j = nlohmann::json::parse(ReadAll(manifest_path));
  Manifest m;
  m.version = j["version"];
  m.step = j["step"];
  m.world_size = j["world_size"];
  m.shards = j["shards"].get<std::vector<std::string>>();
  m.shard_bytes = j["shard_bytes"].get<std::vector<int64_t>>();
  for (const auto& t : j["tensors"]) {
    TensorInfo info{t["name"], t["dtype"], t["shape"].get<std::vector<int64_t>>(), {}};
    for (const auto& s : t["slices"]) {
      info.slices.push_back({s["shard"], s["dataset"], s["begin"], s["end"], s["offset"],
                             s["bytes"], std::stoull(s["xxh3"].get<std::string>(), nullptr, 16)});
    }
    m.tensors.push_back(std::move(info));
  }
  char hex[17];
  snprintf(hex, sizeof(hex), "%016llx",
           static_cast<unsigned long long>(ManifestIndexChecksum(m)));  // NOLINT
  j["index_xxh3"] = hex;
  WriteAll(manifest_path, j.dump(1));
}

// Applies `edit` to the manifest's JSON, then re-checksums it.
void EditManifest(const std::string& ckpt, const std::function<void(nlohmann::json&)>& edit) {
  const std::string path = ckpt + "/manifest.json";
  nlohmann::json j = nlohmann::json::parse(ReadAll(path));
  edit(j);
  WriteAll(path, j.dump(1));
  Rechecksum(path);
}

nlohmann::json* TensorNamed(nlohmann::json& j, const std::string& name) {
  for (auto& t : j["tensors"]) {
    if (t["name"] == name) return &t;
  }
  ADD_FAILURE() << "no tensor " << name;
  return nullptr;
}

void ReplaceInFile(const std::string& path, const std::string& from, const std::string& to) {
  std::string text = ReadAll(path);
  const size_t at = text.find(from);
  ASSERT_NE(at, std::string::npos) << from << " not in " << path;
  text.replace(at, from.size(), to);
  WriteAll(path, text);
}

struct Corruption {
  std::string name;
  // Breaks the newest checkpoint (`ckpt` = its directory).
  std::function<void(const std::string& ckpt)> apply;
  std::string expect;  // in the error
  friend void PrintTo(const Corruption& c, std::ostream* os) { *os << c.name; }
};

const std::string kShard0 = "/shard-00000-of-00002.h5";
const std::string kShard1 = "/shard-00001-of-00002.h5";

std::vector<Corruption> Corruptions() {
  return {
      {"shard_truncated_by_one_byte",
       [](const std::string& c) { fs::resize_file(c + kShard1, fs::file_size(c + kShard1) - 1); },
       "bytes, the manifest says"},
      {"shard_missing", [](const std::string& c) { fs::remove(c + kShard0); },
       "No such file or directory"},
      {"shard_is_a_directory",
       [](const std::string& c) {
         fs::remove(c + kShard0);
         fs::create_directory(c + kShard0);
       },
       "not a regular file (a directory)"},
      {"shard_is_a_fifo",
       [](const std::string& c) {
         fs::remove(c + kShard0);
         ASSERT_EQ(mkfifo((c + kShard0).c_str(), 0644), 0);
       },
       "not a regular file (a FIFO)"},
      {"shard_is_a_symlink",
       [](const std::string& c) {
         fs::rename(c + kShard0, c + "/../elsewhere.h5");
         fs::create_symlink("../elsewhere.h5", c + kShard0);
       },
       "a symbolic link"},
      {"flipped_data_byte",
       [](const std::string& c) {
         const nlohmann::json j = nlohmann::json::parse(ReadAll(c + "/manifest.json"));
         const auto& slice = j["tensors"][0]["slices"][0];
         const std::string shard =
             c + "/" + j["shards"][slice["shard"].get<int>()].get<std::string>();
         std::fstream f(shard, std::ios::in | std::ios::out | std::ios::binary);
         f.seekp(slice["offset"].get<int64_t>() + 1);
         f.write("\x5a", 1);
       },
       "checksum mismatch"},
      {"manifest_not_json", [](const std::string& c) { WriteAll(c + "/manifest.json", "{not"); },
       "not a JSON object"},
      {"manifest_missing_latest_ahead",
       [](const std::string& c) { fs::remove(c + "/manifest.json"); },
       "step-0000000004/manifest.json: No such file or directory"},
      {"manifest_is_a_fifo",
       [](const std::string& c) {
         fs::remove(c + "/manifest.json");
         ASSERT_EQ(mkfifo((c + "/manifest.json").c_str(), 0644), 0);
       },
       "not a regular file (a FIFO)"},
      {"manifest_sparse_1_tib",
       [](const std::string& c) { fs::resize_file(c + "/manifest.json", int64_t{1} << 40); },
       "bytes, more than the"},
      {"name_escapes_with_dotdot",
       [](const std::string& c) {
         ReplaceInFile(c + "/manifest.json", "\"name\": \"model/0.weight\"",
                       "\"name\": \"../../0.weight\"");
       },
       "\"..\""},
      {"world_size_mismatch",
       [](const std::string& c) {
         ReplaceInFile(c + "/manifest.json", "\"world_size\": 2", "\"world_size\": 3");
       },
       "world_size 3 with 2 shards"},
      {"step_1e400",
       [](const std::string& c) {
         ReplaceInFile(c + "/manifest.json", "\"step\": 4,\n \"tensors\"",
                       "\"step\": 1e400,\n \"tensors\"");
       },
       "manifest.json"},
      {"step_of_another_directory",
       [](const std::string& c) { EditManifest(c, [](nlohmann::json& j) { j["step"] = 3; }); },
       "step 3 in the directory of step 4"},
      {"extras_nested_58000_deep",
       [](const std::string& c) {
         ReplaceInFile(
             c + "/manifest.json", "\"extras\": {",
             "\"extras\": {\"deep\": " + std::string(58000, '[') + std::string(58000, ']') + ", ");
       },
       "JSON nested 58002 deep"},
      {"lr_dtype_relabelled",
       [](const std::string& c) {
         ReplaceInFile(c + "/manifest.json", "\"dtype\": \"float64\"", "\"dtype\": \"int64\"");
       },
       "index checksum"},
      {"lr_dtype_relabelled_and_rechecksummed",
       [](const std::string& c) {
         EditManifest(
             c, [](nlohmann::json& j) { (*TensorNamed(j, "optimizer/0/lr"))["dtype"] = "int64"; });
       },
       "a learning rate is a 0-d float64"},
      {"step_tensor_as_float64",
       [](const std::string& c) {
         EditManifest(c, [](nlohmann::json& j) {
           (*TensorNamed(j, "optimizer/0/0/step"))["dtype"] = "float64";
         });
       },
       "step count is a 0-d int64"},
      {"optimizer_state_of_shape_0",
       [](const std::string& c) {
         EditManifest(c, [](nlohmann::json& j) {
           nlohmann::json& t = *TensorNamed(j, "optimizer/0/1/exp_avg");
           t["shape"] = {0};
           t["slices"] = nlohmann::json::array({{{"shard", 0},
                                                 {"dataset", "/optimizer/0/1/exp_avg"},
                                                 {"begin", 0},
                                                 {"end", 0},
                                                 {"offset", -1},
                                                 {"bytes", 0},
                                                 {"xxh3", "2d06800538d394c2"}}});
         });
       },
       "its parameter is"},
      {"optimizer_tensors_all_removed",
       [](const std::string& c) {
         EditManifest(c, [](nlohmann::json& j) {
           nlohmann::json kept = nlohmann::json::array();
           for (const auto& t : j["tensors"]) {
             if (t["name"].get<std::string>().rfind("optimizer/", 0) != 0) kept.push_back(t);
           }
           j["tensors"] = kept;
         });
       },
       "the optimizer state of 4 parameters was saved; 0 are in the checkpoint"},
  };
}

class ResumeTest : public ::testing::TestWithParam<Corruption> {
 protected:
  // One trained run (checkpoints of steps 2 and 4), copied for each test.
  static void SetUpTestSuite() {
    char tmpl[] = "/tmp/evenstep_resume_template_XXXXXX";
    template_ = mkdtemp(tmpl);
    const auto r = Train(template_, 4, {});
    for (const ProcessResult& p : r) ASSERT_EQ(p.exit_code, 0) << Describe(r);
  }
  static void TearDownTestSuite() { fs::remove_all(template_); }
  void SetUp() override {
    char tmpl[] = "/tmp/evenstep_resume_XXXXXX";
    dir_ = mkdtemp(tmpl);
    fs::copy(template_, dir_, fs::copy_options::recursive | fs::copy_options::overwrite_existing);
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string ckpt(int64_t step) const { return CheckpointPath(dir_ + "/ckpt", step); }

  static std::string template_;
  std::string dir_;
};
std::string ResumeTest::template_;

TEST_P(ResumeTest, CorruptNewestCheckpointStopsTheResumeNamingItOrFallsBackWithTheFlag) {
  const Corruption& c = GetParam();
  c.apply(ckpt(4));
  // Default: an error naming the checkpoint and the reason on every rank,
  // and no training (no restart from step 1).
  auto strict = Train(dir_, 6, {});
  for (const ProcessResult& r : strict) {
    EXPECT_EQ(r.exit_code, 2) << Describe(strict);
    EXPECT_EQ(r.signal, 0) << Describe(strict);
    EXPECT_THAT(r.output, HasSubstr("resume from " + ckpt(4))) << Describe(strict);
    EXPECT_THAT(r.output, HasSubstr(c.expect)) << Describe(strict);
    EXPECT_THAT(r.output, HasSubstr("--evenstep_resume=newest_valid")) << Describe(strict);
    EXPECT_THAT(r.output, Not(HasSubstr("first step"))) << Describe(strict);
  }
  EXPECT_TRUE(fs::exists(ckpt(2) + "/manifest.json")) << "the previous checkpoint was removed";
  // With the fallback: the previous checkpoint loads, and rank 0 says why.
  auto fallback = Train(dir_, 6, {"--evenstep_resume=newest_valid"});
  for (const ProcessResult& r : fallback) {
    EXPECT_EQ(r.exit_code, 0) << Describe(fallback);
    EXPECT_THAT(r.output, HasSubstr("first step 3")) << Describe(fallback);
  }
  EXPECT_THAT(fallback[0].output, HasSubstr("resume: skipped unusable step-0000000004: "));
  EXPECT_THAT(fallback[0].output, HasSubstr(c.expect));
  EXPECT_THAT(fallback[0].output, HasSubstr("resuming from " + ckpt(2)));
  // The new run saved step 4 again, in a fresh directory that verifies.
  auto [rc, out] = Shell(absl::StrCat(EVENSTEP_CKPT_TOOL, " verify ", ckpt(6)));
  EXPECT_EQ(rc, 0) << out;
  std::tie(rc, out) = Shell(absl::StrCat(EVENSTEP_CKPT_TOOL, " verify ", ckpt(4)));
  EXPECT_EQ(rc, 0) << out;
}

INSTANTIATE_TEST_SUITE_P(Classes, ResumeTest, ::testing::ValuesIn(Corruptions()),
                         [](const auto& info) { return info.param.name; });

TEST_F(ResumeTest, CheckpointOfAnotherModelIsAnErrorEvenWithTheFallback) {
  for (const std::string& mode : {"newest", "newest_valid"}) {
    auto r = Train(dir_, 6, {"--width=301", "--evenstep_resume=" + mode});
    for (const ProcessResult& p : r) {
      EXPECT_EQ(p.exit_code, 2) << Describe(r);
      EXPECT_THAT(p.output, HasSubstr("tensor model/0.weight has shape [300,4] float32; the "
                                      "model has [301,4] float32"))
          << Describe(r);
      EXPECT_THAT(p.output, Not(HasSubstr("first step"))) << Describe(r);
    }
  }
  EXPECT_TRUE(fs::exists(ckpt(4) + "/manifest.json")) << "a fitting checkpoint was set aside";
}

TEST_F(ResumeTest, LatestLaggingTheManifestResumesFromTheNewestCommittedStep) {
  // A kill after step 4's manifest and before `latest` was rewritten.
  WriteAll(dir_ + "/ckpt/latest", "step-0000000002");
  auto r = Train(dir_, 6, {});
  for (const ProcessResult& p : r) {
    EXPECT_EQ(p.exit_code, 0) << Describe(r);
    EXPECT_THAT(p.output, HasSubstr("first step 5")) << Describe(r);
  }
}

TEST_F(ResumeTest, ACommittedCheckpointIsNeverRewritten) {
  const std::string before = ReadAll(ckpt(4) + kShard0) + ReadAll(ckpt(4) + "/manifest.json");
  // Starting over in the same directory: the saves of steps 2 and 4 fail
  // loudly instead of overwriting the committed ones.
  auto r = Train(dir_, 4, {"--evenstep_resume=off"});
  for (const ProcessResult& p : r) {
    EXPECT_EQ(p.exit_code, 2) << Describe(r);
    EXPECT_THAT(p.output, HasSubstr("first step 1")) << Describe(r);
    EXPECT_THAT(p.output, HasSubstr("the checkpoint of step 2 FAILED")) << Describe(r);
    EXPECT_THAT(p.output, HasSubstr(ckpt(4) + " already holds a committed checkpoint"))
        << Describe(r);
    EXPECT_THAT(p.output, HasSubstr("the last checkpoint (step 4) failed")) << Describe(r);
  }
  EXPECT_THAT(r[0].output, HasSubstr("--evenstep_resume=off: " + dir_ + "/ckpt already holds"));
  EXPECT_EQ(ReadAll(ckpt(4) + kShard0) + ReadAll(ckpt(4) + "/manifest.json"), before);
}

TEST_F(ResumeTest, BadFlagsAndPathsStopWithAMessageNeverACrash) {
  // The values real runs crashed on (SIGSEGV from a half-built Session).
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"--evenstep_balance=foo", "--evenstep_balance=foo: expected"},
      {"--evenstep_ckpt_keep=0", "--evenstep_ckpt_keep=0: must be >= 1"},
      {"--evenstep_global_batch=0", "--evenstep_global_batch=0: must be >= 1"},
      {"--evenstep_plan_damping=0", "--evenstep_plan_damping=0: must be in (0, 1]"},
      {"--evenstep_log_every=0", "--evenstep_log_every=0: must be >= 1"},
      {"--evenstep_bucket_cap_mb=-1", "--evenstep_bucket_cap_mb=-1: must be in (0, 1048576]"},
      {"--evenstep_ckpt_every=-1", "--evenstep_ckpt_every=-1: must be >= 0"},
      {"--evenstep_resume=maybe", "--evenstep_resume=maybe: expected newest, newest_valid or off"},
      {"--evenstep_micro_batch_tokens=10",
       "has 11 tokens, more than the micro-batch cap --evenstep_micro_batch_tokens=10"},
      {"--evenstep_ckpt_dir=" + dir_ + "/ckpt/latest/sub", "/ckpt/latest/sub"},
  };
  for (const auto& [flag, expect] : cases) {
    auto r = Train(dir_ + "/bad", 2, {flag});
    for (const ProcessResult& p : r) {
      EXPECT_EQ(p.signal, 0) << flag << "\n" << Describe(r);
      EXPECT_EQ(p.exit_code, 2) << flag << "\n" << Describe(r);
      EXPECT_THAT(p.output, HasSubstr(expect)) << flag << "\n" << Describe(r);
    }
  }
}

// A tmpfs mounted for one test (skipped where mounting is not permitted).
class MountedTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/evenstep_mount_XXXXXX";
    dir_ = mkdtemp(tmpl);
    mnt_ = dir_ + "/mnt";
    fs::create_directory(mnt_);
  }
  void TearDown() override {
    if (mounted_) Shell("umount " + mnt_);
    fs::remove_all(dir_);
  }
  bool Mount(const std::string& options) {
    auto [rc, out] = Shell(absl::StrCat("mount -t tmpfs -o ", options, " tmpfs ", mnt_));
    mounted_ = rc == 0;
    if (!mounted_) std::cerr << "mount failed: " << out;
    return mounted_;
  }
  std::string dir_, mnt_;
  bool mounted_ = false;
};

// Bytes a checkpoint directory takes on a tmpfs (whole pages).
int64_t PagesOf(const std::string& dir) {
  int64_t total = 0;
  for (const auto& e : fs::recursive_directory_iterator(dir)) {
    if (e.is_regular_file()) total += (static_cast<int64_t>(e.file_size()) + 4095) / 4096 * 4096;
  }
  return total;
}

TEST_F(MountedTest, FullDiskIsReportedOnEveryRankPartialFilesGoCommittedOnesStay) {
  // How much one checkpoint of this run takes.
  const std::string probe = dir_ + "/probe";
  auto first = Train(probe, 2, {});
  for (const ProcessResult& p : first) ASSERT_EQ(p.exit_code, 0) << Describe(first);
  const int64_t one = PagesOf(CheckpointPath(probe + "/ckpt", 2));
  // Room for one checkpoint and a half: step 2 commits, later saves fail.
  if (!Mount(absl::StrCat("size=", one + one / 2 + 16384))) {
    GTEST_SKIP() << "cannot mount a tmpfs here (needs root / CAP_SYS_ADMIN)";
  }
  const std::string ckpt_dir = mnt_ + "/ckpt";
  auto r = Train(dir_ + "/run", 40, {"--evenstep_ckpt_max_failures=2"}, ckpt_dir);
  for (const ProcessResult& p : r) {
    EXPECT_EQ(p.exit_code, 2) << Describe(r);
    EXPECT_THAT(p.output, HasSubstr("the checkpoint of step 4 FAILED")) << Describe(r);
    EXPECT_THAT(p.output, HasSubstr("No space left on device")) << Describe(r);
    EXPECT_THAT(p.output, HasSubstr("2 checkpoint saves failed in a row")) << Describe(r);
    EXPECT_THAT(p.output, Not(HasSubstr("step 40 loss"))) << Describe(r);
  }
  // Nothing but the committed checkpoint (no partial shard, no tmp file).
  std::vector<std::string> left;
  for (const auto& e : fs::recursive_directory_iterator(ckpt_dir)) {
    left.push_back(fs::relative(e.path(), ckpt_dir).string());
  }
  std::sort(left.begin(), left.end());
  EXPECT_EQ(left,
            (std::vector<std::string>{"latest", "step-0000000002", "step-0000000002/manifest.json",
                                      "step-0000000002/shard-00000-of-00002.h5",
                                      "step-0000000002/shard-00001-of-00002.h5"}));
  auto [rc, out] = Shell(absl::StrCat(EVENSTEP_CKPT_TOOL, " verify ", CheckpointPath(ckpt_dir, 2)));
  EXPECT_EQ(rc, 0) << out;
}

TEST_F(MountedTest, ReadOnlyDirectoryStopsTheRunAtTheFirstFailedSaveWithFail) {
  if (!Mount("size=1m")) GTEST_SKIP() << "cannot mount a tmpfs here (needs root / CAP_SYS_ADMIN)";
  fs::create_directory(mnt_ + "/ckpt");
  auto [rc, out] = Shell("mount -o remount,ro " + mnt_);
  ASSERT_EQ(rc, 0) << out;
  auto r = Train(dir_ + "/run", 40, {"--evenstep_ckpt_on_error=fail"}, mnt_ + "/ckpt");
  for (const ProcessResult& p : r) {
    EXPECT_EQ(p.exit_code, 2) << Describe(r);
    EXPECT_THAT(p.output, HasSubstr("the checkpoint of step 2 FAILED")) << Describe(r);
    EXPECT_THAT(p.output, HasSubstr("Read-only file system")) << Describe(r);
    EXPECT_THAT(p.output, HasSubstr("1 checkpoint saves failed in a row")) << Describe(r);
    EXPECT_THAT(p.output, Not(HasSubstr("step 40 loss"))) << Describe(r);
  }
}

// A fresh directory, removed at the end of the test.
class TempDir {
 public:
  TempDir() {
    char tmpl[] = "/tmp/evenstep-preempt-XXXXXX";
    path_ = mkdtemp(tmpl);
  }
  ~TempDir() { evenstep::testing::RunShell("rm -rf " + path_); }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

// "step N loss X" lines of one rank's output.
std::map<int, double> Losses(const std::string& output) {
  std::map<int, double> losses;
  std::istringstream in(output);
  std::string line;
  while (std::getline(in, line)) {
    int step = 0;
    double loss = 0;
    if (std::sscanf(line.c_str(), "step %d loss %lf", &step, &loss) == 2) losses[step] = loss;
  }
  return losses;
}

TEST(PreemptionTest, ASignalToOneRankSavesTheNextStepOnEveryRankAndResumeContinues) {
  // Rank 1 alone gets SIGTERM after step 4; step 5 (not a --evenstep_ckpt_every
  // step) is saved by every rank, both exit with kPreemptedExitCode, and the
  // resumed run's steps 6-8 have the losses of an uninterrupted run.
  TempDir preempted, plain;
  const std::vector<std::string> static_balance = {"--evenstep_balance=static"};
  std::vector<std::string> signal = static_balance;
  signal.push_back("--signal_at_step=4");
  auto first = Train(preempted.path(), 8, signal);
  for (const ProcessResult& r : first) {
    EXPECT_EQ(r.exit_code, kPreemptedExitCode) << Describe(first);
    EXPECT_THAT(r.output, HasSubstr("preempted by signal 15 at step 5; the checkpoint of step 5 "
                                    "is committed"))
        << Describe(first);
    EXPECT_THAT(r.output, Not(HasSubstr("step 6 loss"))) << Describe(first);
  }
  auto listing = ListCheckpoints(*Env::Default(), preempted.path() + "/ckpt");
  ASSERT_TRUE(listing.ok()) << listing.status();
  ASSERT_FALSE(listing->committed.empty());
  EXPECT_EQ(listing->committed.back(), 5);

  auto resumed = Train(preempted.path(), 8, static_balance);
  for (const ProcessResult& r : resumed) ASSERT_EQ(r.exit_code, 0) << Describe(resumed);
  EXPECT_THAT(resumed[0].output, HasSubstr("first step 6"));
  auto uninterrupted = Train(plain.path(), 8, static_balance);
  for (const ProcessResult& r : uninterrupted) ASSERT_EQ(r.exit_code, 0) << Describe(uninterrupted);
  const auto want = Losses(uninterrupted[0].output);
  const auto got = Losses(resumed[0].output);
  for (int step = 6; step <= 8; ++step) {
    ASSERT_TRUE(got.count(step) && want.count(step)) << step;
    EXPECT_NEAR(got.at(step), want.at(step), 1e-9 * std::abs(want.at(step))) << "step " << step;
  }
}

}  // namespace
}  // namespace evenstep

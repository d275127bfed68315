// TrainCheckpointer over real ranks: a run saved at one world size loads at
// another (reshard 2->3, 3->2, 4->1) with model, optimizer state (SGD, Adam,
// AdamW, RMSprop, Adagrad), sampler position and user extras bit-identical.
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/subprocess.h"
#include "tests/testing/temp_dir.h"

namespace evenstep {
namespace {

using ::evenstep::testing::Describe;
using ::evenstep::testing::ProcessResult;
using ::testing::HasSubstr;

std::string DigestLine(const std::string& output) {
  const size_t at = output.find("digest ");
  return at == std::string::npos ? "" : output.substr(at, output.find('\n', at) - at);
}

struct Case {
  int save_world, load_world;
  std::string optimizer;
  int64_t width = 300;  // hidden width of ckpt_helper's model
  friend void PrintTo(const Case& c, std::ostream* os) {
    *os << c.save_world << "->" << c.load_world << " " << c.optimizer;
  }
};

class ReshardTest : public ::testing::TestWithParam<Case> {};

TEST_P(ReshardTest, LoadsBitIdenticalAtAnotherWorldSize) {
  const Case c = GetParam();
  evenstep::testing::TempDir temp("evenstep_reshard");
  const std::string dir = temp.path();
  const std::vector<std::string> common = evenstep::testing::RankArgv(
      EVENSTEP_CKPT_HELPER, {"--evenstep_ckpt_dir=" + dir, "--evenstep_ckpt_slice_mb=0.001",
                             "--evenstep_global_batch=24", "--evenstep_micro_batch_samples=5",
                             "--optimizer=" + c.optimizer, "--width=" + std::to_string(c.width)});
  std::vector<std::string> save = common, load = common;
  save.push_back("--mode=save");
  // Wide tensors: 3 more steps run while the checkpoint is written; it must
  // hold the save step's bytes (the digest is taken before the save).
  if (c.width > 300) {
    save.push_back("--steps_after_save=3");
    // And a transposed parameter: saved from strided memory.
    save.push_back("--noncontiguous");
    load.push_back("--noncontiguous");
  }
  load.push_back("--mode=load");
  auto saved = evenstep::testing::RunRanks(c.save_world, save);
  for (const ProcessResult& r : saved) ASSERT_EQ(r.exit_code, 0) << Describe(saved);
  const std::string expected = DigestLine(saved[0].output);
  ASSERT_FALSE(expected.empty()) << saved[0].output;
  if (c.width > 300) {  // the later steps did change what was saved
    EXPECT_THAT(saved[0].output, HasSubstr("digest after "));
    EXPECT_THAT(saved[0].output, ::testing::Not(HasSubstr("digest after " + expected.substr(7))));
  }
  auto loaded = evenstep::testing::RunRanks(c.load_world, load);
  for (const ProcessResult& r : loaded) {
    ASSERT_EQ(r.exit_code, 0) << Describe(loaded);
    EXPECT_EQ(DigestLine(r.output), expected) << Describe(loaded);
    EXPECT_THAT(r.output, HasSubstr("loaded step 3 user {\"note\":\"hello\"}"));
    EXPECT_THAT(r.output, HasSubstr("sampler at epoch 0 step 3"));
  }
  if (c.load_world > 1) {
    // Each rank read only part of the bytes.
    EXPECT_THAT(loaded[0].output, ::testing::Not(HasSubstr(" read 0 bytes")));
  }
}

INSTANTIATE_TEST_SUITE_P(Worlds, ReshardTest,
                         ::testing::Values(Case{2, 3, "adam"}, Case{3, 2, "sgd"},
                                           Case{4, 1, "adamw"}, Case{1, 2, "rmsprop"},
                                           Case{2, 2, "adagrad"},
                                           // Tensors over 1 MiB: read and broadcast in place.
                                           Case{2, 3, "sgd", 300000}),
                         [](const auto& info) {
                           return absl::StrCat("from", info.param.save_world, "to",
                                               info.param.load_world, "_", info.param.optimizer,
                                               info.param.width > 300 ? "_wide" : "");
                         });

// A shard whose HDF5 superblock is damaged while its data checksums hold
// (evenstep-ckpt verify refuses it): the resume reads the right bytes by
// offset and says, on the rank that checked that shard, that h5py cannot
// read it.
TEST(ResumeTest, AShardWithADamagedHdf5StructureResumesAndIsNamed) {
  evenstep::testing::TempDir temp("evenstep_h5damage");
  const std::string dir = temp.path();
  const std::vector<std::string> common = evenstep::testing::RankArgv(
      EVENSTEP_CKPT_HELPER, {"--evenstep_ckpt_dir=" + dir, "--evenstep_global_batch=24",
                             "--evenstep_micro_batch_samples=5"});
  std::vector<std::string> save = common, load = common;
  save.push_back("--mode=save");
  load.push_back("--mode=load");
  auto saved = evenstep::testing::RunRanks(2, save);
  for (const ProcessResult& r : saved) ASSERT_EQ(r.exit_code, 0) << Describe(saved);
  const std::string shard = dir + "/step-0000000003/shard-00001-of-00002.h5";
  ASSERT_TRUE(std::filesystem::exists(shard)) << Describe(saved);
  {
    std::fstream f(shard, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(1);
    f.write("XYZ", 3);
  }
  auto loaded = evenstep::testing::RunRanks(2, load);
  for (const ProcessResult& r : loaded) {
    ASSERT_EQ(r.exit_code, 0) << Describe(loaded);
    EXPECT_EQ(DigestLine(r.output), DigestLine(saved[0].output)) << Describe(loaded);
  }
  // Shard 1 is rank 1's to check (i % world).
  EXPECT_THAT(loaded[1].output,
              HasSubstr("[evenstep] rank 1: resumed from " + dir +
                        "/step-0000000003, whose data checksums hold, but a shard's HDF5 "
                        "structure is damaged: " +
                        shard))
      << Describe(loaded);
  EXPECT_THAT(loaded[0].output, ::testing::Not(HasSubstr("HDF5 structure is damaged")))
      << Describe(loaded);
}

// tools/evenstep_ckpt_reader.py loads the checkpoint into a torch.nn.Module
// and a torch.optim optimizer (EVENSTEP_TORCH_PYTHON: Debian's python3-torch
// 1.13 in the default build, the wheel's torch 2.x in scripts/build_torch2.sh);
// every tensor read back out of them equals the saved one bit for bit.
class PyTorchLoadTest : public ::testing::TestWithParam<std::string> {};

TEST_P(PyTorchLoadTest, ModelAndOptimizerStateBitForBit) {
  evenstep::testing::TempDir temp("evenstep_pytorch");
  const std::string dir = temp.path();
  auto saved = evenstep::testing::RunProgramOnRanks(
      2, EVENSTEP_CKPT_HELPER,
      {"--evenstep_ckpt_dir=" + dir, "--evenstep_ckpt_slice_mb=0.001", "--evenstep_global_batch=24",
       "--optimizer=" + GetParam(), "--mode=save"});
  for (const ProcessResult& r : saved) ASSERT_EQ(r.exit_code, 0) << Describe(saved);
  const std::string expected = DigestLine(saved[0].output);
  ASSERT_FALSE(expected.empty()) << saved[0].output;
  const auto python = evenstep::testing::RunAll(
      {{{EVENSTEP_TORCH_PYTHON, EVENSTEP_TORCH_LOAD_CHECK, dir, GetParam()}, {}}},
      evenstep::testing::HangBound(2));
  ASSERT_EQ(python[0].exit_code, 0) << python[0].output;
  EXPECT_THAT(python[0].output, HasSubstr("torch "));
  EXPECT_EQ(DigestLine(python[0].output), expected) << python[0].output;
  EXPECT_THAT(python[0].output, HasSubstr("mismatch named: optimizer/0/1/"));
}

INSTANTIATE_TEST_SUITE_P(Optimizers, PyTorchLoadTest, ::testing::Values("adam", "sgd"));

}  // namespace
}  // namespace evenstep

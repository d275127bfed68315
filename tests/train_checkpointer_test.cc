// TrainCheckpointer over real ranks: a run saved at one world size loads at
// another (reshard 2->3, 3->2, 4->1, ...) with model, optimizer state (SGD,
// Adam, AdamW, RMSprop, Adagrad), sampler position and user extras
// bit-identical; a shard whose HDF5 structure is damaged while its data
// holds resumes and is named; PyTorch loads the checkpoint bit for bit. The
// ranks' save and load (tests/testing/ckpt_model.h's SaveOrLoadOnRank) run
// inside each TEST (RunOnRanks, then RunOnRanksAgain).
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/ckpt_model.h"
#include "tests/testing/on_ranks.h"

namespace evenstep {
namespace {

using ::evenstep::testing::CkptRun;
using ::evenstep::testing::OnRanksOptions;
using ::evenstep::testing::RanksDir;
using ::evenstep::testing::RunOnRanks;
using ::evenstep::testing::RunOnRanksAgain;
using ::testing::HasSubstr;

OnRanksOptions Mode(const char* mode) {
  OnRanksOptions options;
  options.env = {{"CKPT_MODE", mode}};
  return options;
}

std::string SavedDigest() {
  std::string digest;
  std::getline(std::ifstream(RanksDir() + "/saved_digest"), digest);
  return digest;
}

struct Case {
  int save_world, load_world;
  std::string optimizer;
  int64_t width = 300;  // the model's hidden width
  friend void PrintTo(const Case& c, std::ostream* os) {
    *os << c.save_world << "->" << c.load_world << " " << c.optimizer;
  }
};

class ReshardTest : public ::testing::TestWithParam<Case> {};

TEST_P(ReshardTest, LoadsBitIdenticalAtAnotherWorldSize) {
  const Case c = GetParam();
  RunOnRanks(
      c.save_world,
      [c](DistContext& dist) {
        CkptRun run;
        run.optimizer = c.optimizer;
        run.width = c.width;
        run.slice_mb = 0.001;  // tensors sliced across the shards
        // Wide tensors: 3 more steps run while the checkpoint is written; it
        // must hold the save step's bytes. And a transposed parameter: saved
        // from strided memory.
        run.steps_after_save = c.width > 300 ? 3 : 0;
        run.noncontiguous = c.width > 300;
        evenstep::testing::SaveOrLoadOnRank(dist, run);
      },
      Mode("save"));
  RunOnRanksAgain(c.load_world, Mode("load"));
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
  RunOnRanks(
      2, [](DistContext& dist) { evenstep::testing::SaveOrLoadOnRank(dist, CkptRun{}); },
      Mode("save"));
  const std::string dir = RanksDir() + "/ckpt";
  const std::string shard = dir + "/step-0000000003/shard-00001-of-00002.h5";
  ASSERT_TRUE(std::filesystem::exists(shard));
  {
    std::fstream f(shard, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(1);
    f.write("XYZ", 3);
  }
  auto loaded = RunOnRanksAgain(2, Mode("load"));
  ASSERT_EQ(loaded.size(), 2u);
  // Shard 1 is rank 1's to check (i % world).
  EXPECT_THAT(loaded[1].output,
              HasSubstr("[evenstep] rank 1: resumed from " + dir +
                        "/step-0000000003, whose data checksums hold, but a shard's HDF5 "
                        "structure is damaged: " +
                        shard));
  EXPECT_THAT(loaded[0].output, ::testing::Not(HasSubstr("HDF5 structure is damaged")));
}

// tools/evenstep_ckpt_reader.py loads the checkpoint into a torch.nn.Module
// and a torch.optim optimizer (EVENSTEP_TORCH_PYTHON: Debian's python3-torch
// 1.13 in the default build, the wheel's torch 2.x in scripts/build_torch2.sh);
// every tensor read back out of them equals the saved one bit for bit.
class PyTorchLoadTest : public ::testing::TestWithParam<std::string> {};

TEST_P(PyTorchLoadTest, ModelAndOptimizerStateBitForBit) {
  const std::string optimizer = GetParam();
  RunOnRanks(
      2,
      [optimizer](DistContext& dist) {
        CkptRun run;
        run.optimizer = optimizer;
        run.slice_mb = 0.001;
        evenstep::testing::SaveOrLoadOnRank(dist, run);
      },
      Mode("save"));
  const std::string expected = SavedDigest();
  ASSERT_FALSE(expected.empty());
  const auto python = evenstep::testing::RunAll(
      {{{EVENSTEP_TORCH_PYTHON, EVENSTEP_TORCH_LOAD_CHECK, RanksDir() + "/ckpt", optimizer}, {}}},
      evenstep::testing::HangBound(2));
  ASSERT_EQ(python[0].exit_code, 0) << python[0].output;
  EXPECT_THAT(python[0].output, HasSubstr("torch "));
  EXPECT_THAT(python[0].output, HasSubstr("digest " + expected + "\n"));
  EXPECT_THAT(python[0].output, HasSubstr("mismatch named: optimizer/0/1/"));
}

INSTANTIATE_TEST_SUITE_P(Optimizers, PyTorchLoadTest, ::testing::Values("adam", "sgd"));

}  // namespace
}  // namespace evenstep

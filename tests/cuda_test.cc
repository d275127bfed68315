// The CUDA path (ctest label `cuda`; scripts/gpu_check.sh runs it on a lent
// GPU). Every test is skipped, with the reason, where this process sees no
// CUDA device, so a CPU-only CI reports them as skipped rather than passed.
//   - GradSync on CUDA tensors: NCCL at world size 1, and two ranks sharing
//     the one GPU over Gloo (NCCL refuses two ranks on one device): the exact
//     mean-loss gradient for random uneven splits with an idle rank, no-sync
//     accumulation, unused parameters (tests/testing/sync_net.h's model on CUDA).
//   - MicroStepClock with events: the data / compute / sync split on a real
//     stream, and no host synchronisation between Begin() and Read(),
//     counted with CUDA's sync debug mode (a positive control shows the
//     counter counts).
//   - DeviceFeeder: pinned staging and side-stream copies into CUDA tensors.
//   - TrainCheckpointer: the snapshot of CUDA parameters and Adam state holds
//     the save step's values while later optimizer steps keep writing them;
//     it loads into a CUDA model at another world size (tests/testing/ckpt_model.h).
//   - BalancedStep end to end on CUDA, its gradient checked against one
//     process's every step (tests/testing/balance_trainer.h), also when the real allocator
//     runs out of memory under a memory limit, and the sample trainer with
//     --device=cuda: it learns, resumes after a SIGKILL and follows the CPU
//     run's losses.
#include <c10/core/Event.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <torch/torch.h>

#include <chrono>
#include <cmath>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "evenstep/device_feed.h"
#include "evenstep/grad_sync.h"
#include "evenstep/internal/micro_step_clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/balance_trainer.h"
#include "tests/testing/ckpt_model.h"
#include "tests/testing/mixed_tensors.h"
#include "tests/testing/on_ranks.h"
#include "tests/testing/subprocess.h"
#include "tests/testing/sync_net.h"
#include "tests/testing/temp_dir.h"
#if EVENSTEP_TEST_C10_CUDA
#include <c10/cuda/CUDAFunctions.h>
#include <c10/util/Exception.h>
#endif
#if EVENSTEP_TEST_SAMPLE
#include "tests/testing/fortunes_run.h"
#endif

namespace evenstep {
namespace {

using ::evenstep::testing::BalanceRun;
using ::evenstep::testing::BalanceScenario;
using ::evenstep::testing::BalanceStepRecord;
using ::evenstep::testing::ExpectAllStepsRan;
using ::evenstep::testing::ProcessResult;
using ::evenstep::testing::RunOnRanks;
using ::evenstep::testing::TrainBalanced;
using ::testing::HasSubstr;

#define EVENSTEP_SKIP_WITHOUT_CUDA()                                                  \
  if (!torch::cuda::is_available())                                                   \
  GTEST_SKIP() << "no CUDA device in this process (or a libtorch without CUDA): the " \
                  "CUDA path is not run here; scripts/gpu_check.sh runs it on a GPU"

// --- GradSync -----------------------------------------------------------

TEST(CudaGradSyncTest, ExactOverNcclAtWorldSizeOne) {
  EVENSTEP_SKIP_WITHOUT_CUDA();
  evenstep::testing::OnRanksOptions nccl;
  nccl.backend = CommBackend::kNccl;
  evenstep::testing::RunOnRanks(
      1,
      [](DistContext& dist) {
        EXPECT_EQ(dist.backend_name(), "nccl");
        evenstep::testing::SyncExactSplit(dist, 11, evenstep::testing::TinyBuckets(), torch::kCUDA);
      },
      nccl);
}

// Two ranks on one GPU: Gloo all-reduces the CUDA buckets. The seed's split
// leaves rank seed % 2 without work: it joins through SyncNow.
class CudaGradSyncSeedTest : public ::testing::TestWithParam<int> {};

TEST_P(CudaGradSyncSeedTest, ExactForTwoRanksSharingTheGpuOverGlooWithAnIdleRank) {
  EVENSTEP_SKIP_WITHOUT_CUDA();
  const int seed = GetParam();
  evenstep::testing::RunOnRanks(2, [seed](DistContext& dist) {
    EXPECT_EQ(dist.backend_name(), "gloo");
    const auto run = evenstep::testing::SyncExactSplit(dist, seed, evenstep::testing::TinyBuckets(),
                                                       torch::kCUDA);
    EXPECT_EQ(run.micro_batches == 0, dist.rank() == seed % 2) << "rank " << dist.rank();
  });
}

INSTANTIATE_TEST_SUITE_P(Seeds, CudaGradSyncSeedTest, ::testing::Values(12, 21));

// No-sync accumulation and an unused parameter's zeros on CUDA tensors: the
// model and batch of ExactForTwoRanks..., the sync held for two micro-steps
// with rank 1 alone using `extra`.
TEST(CudaGradSyncTest, NoSyncAccumulatesLocallyAndUnusedParametersReduceAsZeros) {
  EVENSTEP_SKIP_WITHOUT_CUDA();
  evenstep::testing::RunOnRanks(2, [](DistContext& dist) {
    using namespace evenstep::testing;  // NOLINT: the sync test model's names
    const SyncBatch batch = GlobalSyncBatch(torch::kCUDA);
    auto net = MakeSyncNet(3, torch::kCUDA, kSyncHidden, /*with_extra=*/true);
    auto sync = GradSync::Attach(*net, dist.data_group(), TinyBuckets());
    ASSERT_TRUE(sync.ok()) << sync.status();
    const bool uses_extra = dist.rank() == 1;
    (*sync)->set_sync_enabled(false);
    for (int m = 0; m < 2; ++m) {
      ScaledLoss(*net, batch, torch::arange(dist.rank() + 2 * m, kSyncBatch, 6), uses_extra)
          .backward();
    }
    EXPECT_EQ((*sync)->collectives_started(), 0) << "collectives during no-sync micro-steps";
    (*sync)->set_sync_enabled(true);
    (*sync)->SetStep(0);
    ScaledLoss(*net, batch, torch::arange(dist.rank() + 4, kSyncBatch, 6), uses_extra).backward();
    // One process's gradient of both ranks' micro-batches.
    auto all = MakeSyncNet(3, torch::kCUDA, kSyncHidden, true);
    for (int r = 0; r < 2; ++r) {
      for (int m = 0; m < 3; ++m)
        ScaledLoss(*all, batch, torch::arange(r + 2 * m, kSyncBatch, 6), r == 1).backward();
    }
    ExpectGradsNear(*net, *all, 1e-5, "synced on CUDA");
  });
}

// --- MicroStepClock -----------------------------------------------------

#if EVENSTEP_TEST_C10_CUDA
// Counts the host synchronisations c10's CUDA functions report while it
// lives: CUDA's sync debug mode (torch.cuda.set_sync_debug_mode("warn"))
// warns on each (item(), a synchronising copy, a stream or device
// synchronisation), and this warning handler of the calling thread counts
// them.
class HostSyncCounter : public c10::WarningHandler {
 public:
  HostSyncCounter()
      : previous_mode_(c10::cuda::warning_state().get_sync_debug_mode()), guard_(this) {
    c10::cuda::warning_state().set_sync_debug_mode(c10::cuda::SyncDebugMode::L_WARN);
  }
  ~HostSyncCounter() override { c10::cuda::warning_state().set_sync_debug_mode(previous_mode_); }
  void process(const c10::Warning& warning) override {
    if (warning.msg().find("synchroniz") != std::string::npos) ++count_;
  }
  int count() const { return count_; }

 private:
  const c10::cuda::SyncDebugMode previous_mode_;
  c10::WarningUtils::WarningHandlerGuard guard_;
  int count_ = 0;
};
#endif

TEST(CudaMicroStepClockTest, SplitsDataComputeAndSyncOnTheStreamWithoutAHostSync) {
  EVENSTEP_SKIP_WITHOUT_CUDA();
#if !EVENSTEP_TEST_C10_CUDA
  GTEST_SKIP() << "this build has no c10_cuda library to count host synchronisations with";
#else
  const c10::Device device(c10::kCUDA, 0);
  internal::MicroStepClock clock(device);
  if (!clock.deferred()) {
    GTEST_SKIP() << "this libtorch's c10::Event cannot time (1.x): every mark synchronises, "
                    "as documented";
  }
  const torch::Tensor a = torch::randn({4096, 4096}, torch::TensorOptions().device(device)) * 1e-2;
  auto work = [&](int n) {
    torch::Tensor x = a;
    for (int i = 0; i < n; ++i) x = torch::mm(x, a);
    return x;
  };
  // Warm-up (cuBLAS handle, allocator), then an idle device.
  work(2);
  torch::cuda::synchronize();
  // Waits, without a host synchronisation, until the device has run
  // everything queued so far.
  auto until_idle = [&] {
    c10::impl::VirtualGuardImpl guard(device.type());
    c10::Event idle(device.type());
    idle.record(guard.getStream(device));
    while (!idle.query()) std::this_thread::sleep_for(std::chrono::microseconds(200));
  };
  constexpr auto kLoad = std::chrono::milliseconds(30);
  internal::MicroStepTimes times;
  int syncs = -1;
  {
    HostSyncCounter counter;
    clock.Begin();
    clock.Start();  // micro-step 0: data at once
    work(16);
    clock.End();
    until_idle();
    std::this_thread::sleep_for(kLoad);  // micro-step 1: the device waits for its data
    clock.Start();
    work(16);
    clock.End();
    clock.Start();  // micro-step 2: its data was ready while 1 still ran
    work(16);
    clock.Arrive();
    work(4);  // stands for the wait on the gradient sync
    clock.End();
    syncs = counter.count();
    times = clock.Read();
    // Positive control: the counter does count a synchronising call.
    const int before = counter.count();
    (void)a.sum().item<float>();
    EXPECT_GT(counter.count(), before) << "the sync counter does not count: the test is void";
  }
  EXPECT_EQ(syncs, 0) << "host synchronisations between Begin() and Read()";
  ASSERT_EQ(times.data.size(), 3u);
  ASSERT_EQ(times.compute.size(), 3u);
  // The device sat idle for the whole load (a lower bound: the marks around
  // the sleep complete before and after it).
  EXPECT_GE(times.data[1], absl::FromChrono(kLoad) - absl::Milliseconds(1));
  // A load hidden behind the previous micro-step's kernels costs nothing.
  EXPECT_LT(times.data[2], times.data[1]);
  for (const absl::Duration& c : times.compute) EXPECT_GT(c, absl::ZeroDuration());
  EXPECT_GT(times.sync, absl::ZeroDuration());
  // 16 products against 4: the split follows the kernels.
  EXPECT_GT(times.compute[2], times.sync);
#endif
}

// --- DeviceFeeder -------------------------------------------------------

TEST(CudaDeviceFeedTest, TensorsArriveOnTheDeviceThroughPinnedBuffers) {
  EVENSTEP_SKIP_WITHOUT_CUDA();
  const c10::Device cuda(c10::kCUDA, 0);
  DeviceFeeder feeder(cuda, /*pinned=*/true);
  // One feed: every dtype and layout arrives exactly.
  {
    const std::vector<at::Tensor> loaded = evenstep::testing::Mixed(1);
    std::vector<at::Tensor> data;
    for (const at::Tensor& t : loaded) data.push_back(t.defined() ? t.clone() : t);
    feeder.Feed(TensorsIn(data));
    feeder.Adopt(TensorsIn(data));
    evenstep::testing::ExpectFedCopies(loaded, data, cuda);
  }
  // Two workers feeding at once, as BalancedStep's data workers do.
  std::vector<std::thread> threads;
  std::vector<int> failures(2, 0);
  for (int w = 0; w < 2; ++w) {
    threads.emplace_back([&, w] {
      for (int k = 0; k < 20; ++k) {
        const std::vector<at::Tensor> loaded = evenstep::testing::Mixed(10 * w + k);
        std::vector<at::Tensor> data;
        for (const at::Tensor& t : loaded) data.push_back(t.defined() ? t.clone() : t);
        feeder.Feed(TensorsIn(data));
        feeder.Adopt(TensorsIn(data));
        for (size_t i = 0; i < data.size(); ++i) {
          if (!loaded[i].defined()) continue;
          if (data[i].device() != cuda || !at::equal(data[i].cpu(), loaded[i])) ++failures[w];
        }
      }
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(failures, (std::vector<int>{0, 0}));
  EXPECT_LE(feeder.buffers(), 2);  // one per concurrent feed
}

// --- TrainCheckpointer --------------------------------------------------

struct CkptCase {
  int save_world, load_world;
  std::string optimizer;
  friend void PrintTo(const CkptCase& c, std::ostream* os) {
    *os << c.save_world << "->" << c.load_world << " " << c.optimizer;
  }
};

class CudaCheckpointTest : public ::testing::TestWithParam<CkptCase> {};

// Tensors of over 1 MiB (width 300000: the Adam state triples them), one of
// them transposed (its contiguous copy is queued on the training stream),
// saved while 5 more steps run: the checkpoint holds the save step's bytes.
TEST_P(CudaCheckpointTest, SnapshotHoldsTheSaveStepWhileLaterStepsWriteAndLoadsAtAnotherWorld) {
  EVENSTEP_SKIP_WITHOUT_CUDA();
  const CkptCase c = GetParam();
  evenstep::testing::OnRanksOptions save, load;
  save.env = {{"CKPT_MODE", "save"}};
  load.env = {{"CKPT_MODE", "load"}};
  evenstep::testing::RunOnRanks(
      c.save_world,
      [c](DistContext& dist) {
        evenstep::testing::CkptRun run;
        run.optimizer = c.optimizer;
        run.width = 300000;
        run.noncontiguous = true;
        run.device = torch::kCUDA;
        run.steps_after_save = 5;
        evenstep::testing::SaveOrLoadOnRank(dist, run);
      },
      save);
  evenstep::testing::RunOnRanksAgain(c.load_world, load);
}

INSTANTIATE_TEST_SUITE_P(Worlds, CudaCheckpointTest,
                         ::testing::Values(CkptCase{2, 1, "adam"}, CkptCase{1, 2, "adamw"}),
                         [](const auto& info) {
                           return absl::StrCat("from", info.param.save_world, "to",
                                               info.param.load_world, "_", info.param.optimizer);
                         });

// --- BalancedStep and the sample trainer --------------------------------

// Random shares with an idle rank, dynamic balancing, every step's synced
// gradient against one process's gradient of the whole global batch; the
// data workers load CPU tensors that BalancedStep moves to the GPU through
// pinned buffers (each checked to arrive intact, then used by the loss).
TEST(CudaBalancedStepTest, TwoRanksOnTheGpuGetTheSingleProcessGradientEveryStep) {
  EVENSTEP_SKIP_WITHOUT_CUDA();
  RunOnRanks(2, [](DistContext& ctx) {
    BalanceScenario s;
    s.flags = {"--evenstep_balance=dynamic", "--evenstep_data_workers=2"};
    s.device = "cuda";
    s.steps = 6;
    s.split_seed = 3;
    s.load_tensors = true;
    ExpectAllStepsRan(TrainBalanced(ctx, s), s);
  });
}

// The real allocator runs out of memory: rank 1's loss allocates 32 MiB per
// padded token under a per-process memory limit (the caching allocator's
// memory fraction) of 24 tokens' worth + 160 MiB. Its larger micro-batches
// throw CUDA's own c10::OutOfMemoryError; each is split and retried within
// its step, every step's gradient equals one process's (the trainer checks),
// rank 1 learns a cap, and the step's peak memory comes from the device
// allocator.
TEST(CudaBalancedStepTest, TheRealAllocatorsOutOfMemoryIsSplitAndRetriedWithTheExactGradient) {
  EVENSTEP_SKIP_WITHOUT_CUDA();
  const std::vector<ProcessResult> results = RunOnRanks(2, [](DistContext& ctx) {
    BalanceScenario s;
    s.flags = {"--evenstep_global_batch=37", "--evenstep_micro_batch_samples=4"};
    s.device = "cuda";
    s.steps = 5;
    s.oom.rank = 1;
    s.oom.tokens = 24;
    s.oom.cuda_mb_per_token = 32;
    const BalanceRun run = TrainBalanced(ctx, s);
    ExpectAllStepsRan(run, s);
    ASSERT_EQ(run.steps.size(), 5u);
    int recoveries = 0;
    for (const BalanceStepRecord& r : run.steps) {
      recoveries += static_cast<int>(r.report.oom_recoveries.size());
    }
    EXPECT_GE(recoveries, 1) << "rank 1 never said it split a micro-batch";
    const std::vector<int64_t>& caps = run.steps.back().state.memory_caps;
    ASSERT_EQ(caps.size(), 2u);
    EXPECT_GT(caps[1], 0) << "rank 1 learned no cap";
    if (ctx.rank() == 1) EXPECT_TRUE(run.steps.back().report.memory.device);
  });
  ASSERT_EQ(results.size(), 2u);
  EXPECT_THAT(results[1].output, HasSubstr("cuda memory limit 928 MiB"));
  EXPECT_THAT(results[1].output,
              ::testing::ContainsRegex("\\[evenstep\\] rank 1, step [0-9]+: out of memory in "
                                       "micro-batch [0-9]+ of [0-9]+ .*: split in "));
}

#if EVENSTEP_TEST_SAMPLE
TEST(CudaSampleTest, TrainsOnTheGpuResumesAfterSigkillAndFollowsTheCpuRun) {
  EVENSTEP_SKIP_WITHOUT_CUDA();
  evenstep::testing::TempDir temp("evenstep_cuda_sample");
  auto train = [&](const std::string& run, std::vector<std::string> extra, int* code,
                   std::string* output) {
    return evenstep::testing::TrainFortunes(EVENSTEP_SAMPLE_TRAINER, temp.path(), 2, run, extra,
                                            code, output);
  };
  int code = 0;
  std::string output;
  const std::vector<std::string> cuda = {"--device=cuda", "--evenstep_backend=gloo"};
  const auto gpu = train("gpu", cuda, &code, &output);
  ASSERT_EQ(code, 0) << output;
  ASSERT_EQ(gpu.size(), 12u) << output;
  EXPECT_LT(gpu.at(12), gpu.at(1)) << output;  // it learns
  // Gloo here too: on a machine with a GPU the default backend is NCCL,
  // which refuses two ranks on one GPU.
  const auto cpu = train("cpu", {"--device=cpu", "--evenstep_backend=gloo"}, &code, &output);
  ASSERT_EQ(code, 0) << output;
  ASSERT_EQ(cpu.size(), 12u) << output;
  for (const auto& [step, loss] : cpu) {
    // The same computation; only the kernels' float summation order differs.
    EXPECT_NEAR(gpu.at(step), loss, 1e-3 * std::abs(loss)) << "step " << step;
  }
  std::vector<std::string> killed = cuda;
  killed.push_back("--kill_at_step=10");
  train("cut", killed, &code, &output);
  EXPECT_EQ(code, 128 + 9) << output;
  const auto resumed = train("cut", cuda, &code, &output);
  ASSERT_EQ(code, 0) << output;
  EXPECT_THAT(output, HasSubstr("resuming from"));
  ASSERT_FALSE(resumed.empty());
  for (const auto& [step, loss] : resumed) {
    EXPECT_NEAR(loss, gpu.at(step), 1e-4 * std::abs(loss)) << "step " << step;
  }
}
#endif

}  // namespace
}  // namespace evenstep

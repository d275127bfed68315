// MemoryProbe on the CPU: the resident set's peak within a step, reset at
// each Begin, and the /proc/self/status parsing it rests on; MemoryFit's
// caps from micro-steps' peaks.
#include "evenstep/memory_probe.h"

#include <cstring>
#include <memory>

#include "evenstep/internal/memory_caps.h"
#include "gtest/gtest.h"

namespace evenstep {
namespace {

constexpr int64_t kMiB = 1 << 20;

// Touches `bytes` of fresh memory (every page written), then frees it.
void TouchAndFree(int64_t bytes) {
  std::unique_ptr<char[]> block(new char[bytes]);
  std::memset(block.get(), 1, static_cast<size_t>(bytes));
  asm volatile("" : : "r"(block.get()) : "memory");  // the writes are not elided
}

TEST(MemoryProbeTest, ParsesTheResidentSetAndItsPeakAndMissingFields) {
  const internal::ResidentSet both = internal::ParseProcStatus(
      "\nName:\ttest\nVmHWM:\t  2048 kB\nVmRSS:\t  1024 kB\nThreads:\t1\n");
  EXPECT_EQ(both.current, 1024 * 1024);
  EXPECT_EQ(both.peak, 2048 * 1024);
  const internal::ResidentSet none = internal::ParseProcStatus("\nName:\ttest\nVmRSS:\tkB\n");
  EXPECT_EQ(none.current, -1);
  EXPECT_EQ(none.peak, -1);
}

// A step that touches 256 MiB peaks at least that far above its start; the
// next step, which touches nothing, starts from a reset peak and does not
// show the earlier one (the process's lifetime peak would).
TEST(MemoryProbeTest, TheCpuPeakIsTheStepsOwnAndResetsAtEachBegin) {
  MemoryProbe probe(c10::Device(c10::kCPU));
  probe.Begin();
  TouchAndFree(256 * kMiB);
  const MemoryPeak big = probe.End();
  EXPECT_FALSE(big.device);
  if (!big.since_begin) GTEST_SKIP() << "/proc/self/clear_refs refused here: no per-step peak";
  EXPECT_GE(big.growth_bytes, 250 * kMiB);
  EXPECT_GE(big.peak_bytes, big.growth_bytes);
  probe.Begin();
  const MemoryPeak quiet = probe.End();
  EXPECT_TRUE(quiet.since_begin);
  EXPECT_LT(quiet.growth_bytes, 64 * kMiB);
  EXPECT_LT(quiet.peak_bytes, big.peak_bytes - 128 * kMiB);
}

// The CPU has no per-micro-step figure (freed memory stays resident) and no
// device limit: nothing for a predicted cap.
TEST(MemoryProbeTest, TheCpuHasNoMicroStepPeakAndNoDeviceLimit) {
  MemoryProbe probe(c10::Device(c10::kCPU));
  probe.Begin();
  EXPECT_EQ(probe.Lap(), -1);
  EXPECT_EQ(probe.DeviceLimit(), 0);
}

// Peaks of 100 MiB + 2 MiB per padded token (with +-1 MiB of noise and one
// wild figure) put a budget of 180 MiB at 40 padded tokens.
TEST(MemoryFitTest, PredictsTheLargestMicroBatchWithinABudget) {
  MemoryFit fit;
  const int64_t sizes[] = {12, 48, 20, 64, 36, 80, 28, 56, 16, 72};
  int i = 0;
  for (int64_t tokens : sizes) {
    const double noise = (i++ % 3 - 1) * 1.0;
    fit.Record(tokens, static_cast<int64_t>((100 + 2.0 * tokens + noise) * kMiB));
  }
  fit.Record(40, 900 * kMiB);  // one wild figure (another job's spike)
  const MemoryFit::Line line = fit.line();
  ASSERT_TRUE(line.valid);
  EXPECT_NEAR(line.fixed_bytes / kMiB, 100, 2);
  EXPECT_NEAR(line.per_token_bytes / kMiB, 2, 0.05);
  EXPECT_NEAR(fit.Cap(180.0 * kMiB), 40, 1);
  // A budget below the fixed part: nothing fits by the line, so the cap is
  // the largest size that did peak within it (none: one token).
  EXPECT_EQ(fit.Cap(50.0 * kMiB), 1);
}

// The cap never falls below a size that peaked within the budget, whatever
// the line says of it.
TEST(MemoryFitTest, NeverCapsBelowASizeThatFitted) {
  MemoryFit fit;
  const int64_t sizes[] = {10, 20, 30, 40, 50, 60};
  for (int64_t tokens : sizes) fit.Record(tokens, (100 + 2 * tokens) * kMiB);
  fit.Record(90, 150 * kMiB);  // a large one that happened to peak low
  ASSERT_TRUE(fit.line().valid);
  EXPECT_GE(fit.Cap(170.0 * kMiB), 90);
}

// No prediction from points that cannot identify the fixed part (fewer than
// six, or all of one size) or from memory that does not grow with the size.
TEST(MemoryFitTest, PredictsNothingItCannotIdentify) {
  MemoryFit few;
  for (int64_t tokens : {10, 20, 30, 40, 50}) few.Record(tokens, (100 + 2 * tokens) * kMiB);
  EXPECT_EQ(few.Cap(180.0 * kMiB), 0);
  MemoryFit same;
  for (int k = 0; k < 20; ++k) same.Record(32, (164 + k % 2) * kMiB);
  EXPECT_EQ(same.Cap(180.0 * kMiB), 0);
  MemoryFit flat;
  for (int64_t tokens : {10, 20, 30, 40, 50, 60, 70}) flat.Record(tokens, 100 * kMiB);
  EXPECT_EQ(flat.Cap(180.0 * kMiB), 0);
}

// BalancedStep's cap: the smaller of the learned (the largest piece that
// fitted, below the smallest that failed) and the predicted one (the parts'
// fits within the budget, taken only when it moves by more than 5 %);
// restored per rank from the balance state.
TEST(MemoryCapsTest, TheCapIsTheSmallerOfLearnedAndPredictedAndMovesOnlyByMoreThanFivePercent) {
  internal::MemoryCaps caps(180.0 * kMiB, /*parts=*/2);
  ASSERT_TRUE(caps.predicting());
  EXPECT_EQ(caps.cap(), 0);
  for (int64_t tokens : {10, 20, 30, 40, 50, 60}) {
    caps.Record(0, tokens, (100 + 2 * tokens) * kMiB);  // part 0: 40 tokens fit
  }
  EXPECT_FALSE(caps.Predict().has_value()) << "part 1 has no prediction yet";
  for (int64_t tokens : {10, 20, 30, 40, 50, 60}) {
    caps.Record(1, tokens, (60 + 2 * tokens) * kMiB);  // part 1: 60 tokens fit
  }
  const auto p = caps.Predict();
  ASSERT_TRUE(p.has_value());
  EXPECT_EQ(p->part, 0u) << "the part whose fit bounds the cap";
  EXPECT_NEAR(p->cap, 40, 1);
  EXPECT_EQ(caps.cap(), p->cap);
  EXPECT_FALSE(caps.Predict().has_value()) << "unchanged: no new prediction";
  // A failure at 30 tokens: the learned cap stays below it, and the
  // predicted one is bounded by it at the next prediction.
  caps.BeginStep();
  caps.NoteFailed(30);
  EXPECT_EQ(caps.step_failed_max(), 30);
  caps.Learn(24);
  EXPECT_EQ(caps.cap(), 24);
  const auto bounded = caps.Predict();
  ASSERT_TRUE(bounded.has_value());
  EXPECT_EQ(bounded->cap, 29);
  caps.Learn(64);  // never at or above a size that failed
  EXPECT_EQ(caps.cap(), 29);
  // Restored: this rank's learned cap from every rank's.
  internal::MemoryCaps restored(0, 1);
  EXPECT_FALSE(restored.predicting());
  restored.Restore({12, 34}, /*rank=*/1);
  EXPECT_EQ(restored.cap(), 34);
  EXPECT_EQ(restored.all(), (std::vector<int64_t>{12, 34}));
}

}  // namespace
}  // namespace evenstep

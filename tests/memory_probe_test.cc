// MemoryProbe on the CPU: the resident set's peak within a step, reset at
// each Begin, and the /proc/self/status parsing it rests on.
#include "evenstep/memory_probe.h"

#include <cstring>
#include <memory>

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

}  // namespace
}  // namespace evenstep

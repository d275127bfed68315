// DeviceFeeder and TensorWalk: what BalancedStep's data workers use to move
// a loaded micro-batch to the model's device. On a CPU-only machine the
// feeder stages into ordinary memory and "copies" to the CPU, which checks
// the staging (offsets, dtypes, layouts, buffer reuse, concurrency); the
// CUDA case is in cuda_test.cc.
#include "evenstep/device_feed.h"

#include <ATen/ATen.h>
#include <torch/data/example.h>

#include <optional>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "gtest/gtest.h"
#include "tests/testing/mixed_tensors.h"

namespace {

struct MyBatch {
  at::Tensor ids, mask;
  int64_t tokens = 0;
};

}  // namespace

template <>
struct evenstep::TensorWalk<MyBatch> {
  static constexpr bool kKnown = true;
  static void Visit(MyBatch& b, const evenstep::TensorVisitor& f) {
    f(b.ids);
    f(b.mask);
  }
};

namespace {

using evenstep::DeviceFeeder;
using evenstep::TensorsIn;
using evenstep::TensorWalk;
using evenstep::testing::ExpectFedCopies;
using evenstep::testing::Mixed;

static_assert(TensorWalk<at::Tensor>::kKnown);
static_assert(TensorWalk<torch::data::Example<>>::kKnown);
static_assert(TensorWalk<std::vector<torch::data::Example<>>>::kKnown);
static_assert(TensorWalk<std::pair<at::Tensor, std::vector<at::Tensor>>>::kKnown);
static_assert(TensorWalk<std::tuple<int, at::Tensor, std::optional<at::Tensor>>>::kKnown);
static_assert(TensorWalk<MyBatch>::kKnown);
static_assert(!TensorWalk<int>::kKnown);
static_assert(!TensorWalk<std::vector<std::string>>::kKnown);

TEST(DeviceFeedTest, TensorWalkFindsEveryTensorInOrder) {
  auto t = [](int v) { return at::full({1}, v, at::kLong); };
  std::tuple<int, torch::data::Example<>, std::vector<at::Tensor>, std::optional<at::Tensor>,
             std::optional<at::Tensor>, MyBatch>
      data{7, {t(1), t(2)}, {t(3), t(4)}, t(5), std::nullopt, {t(6), t(7), 3}};
  std::vector<int64_t> seen;
  for (at::Tensor* p : TensorsIn(data)) seen.push_back(p->item<int64_t>());
  EXPECT_EQ(seen, (std::vector<int64_t>{1, 2, 3, 4, 5, 6, 7}));
}

TEST(DeviceFeedTest, EveryCpuTensorArrivesExactlyAndOneBufferServesFeedAfterFeed) {
  DeviceFeeder feeder(c10::Device(c10::kCPU), /*pinned=*/false);
  std::vector<at::Tensor> kept;
  for (int round = 0; round < 5; ++round) {
    const std::vector<at::Tensor> loaded = Mixed(round);
    std::vector<at::Tensor> data;
    for (const at::Tensor& t : loaded) data.push_back(t.defined() ? t.clone() : t);
    feeder.Feed(TensorsIn(data));
    ExpectFedCopies(loaded, data, c10::Device(c10::kCPU));
    kept.insert(kept.end(), data.begin(), data.end());
  }
  // One feed at a time: one buffer, reused.
  EXPECT_EQ(feeder.buffers(), 1);
  // Earlier deliveries are not overwritten by the later feeds.
  for (int round = 0; round < 5; ++round) {
    const std::vector<at::Tensor> loaded = Mixed(round);
    for (size_t i = 0; i < loaded.size(); ++i) {
      if (loaded[i].defined()) {
        EXPECT_TRUE(at::equal(kept[round * loaded.size() + i], loaded[i])) << round << " " << i;
      }
    }
  }
}

TEST(DeviceFeedTest, ConcurrentFeedsEachGetTheirOwnBufferAndLargerBatchesGrowIt) {
  DeviceFeeder feeder(c10::Device(c10::kCPU), /*pinned=*/false);
  constexpr int kThreads = 4;
  std::vector<std::thread> threads;
  std::vector<int> failures(kThreads, 0);
  for (int w = 0; w < kThreads; ++w) {
    threads.emplace_back([&, w] {
      for (int k = 0; k < 40; ++k) {
        // Sizes vary so buffers are replaced by larger ones as it goes.
        const at::Tensor loaded = at::arange(100 * (k + 1) + w, at::kFloat);
        at::Tensor data = loaded.clone();
        std::vector<at::Tensor*> one = {&data};
        feeder.Feed(one);
        if (!at::equal(data, loaded) || data.data_ptr() == loaded.data_ptr()) ++failures[w];
      }
    });
  }
  for (std::thread& t : threads) t.join();
  for (int w = 0; w < kThreads; ++w) EXPECT_EQ(failures[w], 0) << "thread " << w;
  // At most one buffer per concurrent feed, each a power of two >= the
  // largest batch (4000 floats + alignment).
  EXPECT_LE(feeder.buffers(), kThreads);
  EXPECT_GE(feeder.buffers(), 1);
  EXPECT_LE(feeder.buffer_bytes(), kThreads * 16384);
}

TEST(DeviceFeedTest, NothingToMoveMakesNoBuffer) {
  DeviceFeeder feeder(c10::Device(c10::kCPU), /*pinned=*/false);
  std::vector<at::Tensor*> none;
  feeder.Feed(none);
  at::Tensor undefined;
  std::vector<at::Tensor*> only_undefined = {&undefined};
  feeder.Feed(only_undefined);
  EXPECT_EQ(feeder.buffers(), 0);
  EXPECT_FALSE(undefined.defined());
}

}  // namespace

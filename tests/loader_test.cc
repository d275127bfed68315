// evenstep::Loader: a copy of the load function per concurrent caller (as
// torch::data copies a dataset per worker), copies reused and given back
// also when the function throws, one identity for all copies of a Loader.
#include "evenstep/loader.h"

#include <atomic>
#include <chrono>
#include <memory>
#include <stdexcept>
#include <thread>
#include <vector>

#include "gtest/gtest.h"

namespace evenstep {
namespace {

// A load function that counts its copies and notices being called by two
// threads at once (its own `busy` flag: a copy is never shared).
struct Counted {
  std::shared_ptr<std::atomic<int>> copies, overlaps;
  bool busy = false;
  Counted(std::shared_ptr<std::atomic<int>> c, std::shared_ptr<std::atomic<int>> o)
      : copies(std::move(c)), overlaps(std::move(o)) {}
  Counted(const Counted& other) : copies(other.copies), overlaps(other.overlaps) { ++*copies; }
  int64_t operator()(const MicroBatch& mb) {
    if (busy) ++*overlaps;
    busy = true;
    std::this_thread::sleep_for(std::chrono::microseconds(200));
    busy = false;
    if (mb.index < 0) throw std::runtime_error("a bad micro-batch");
    return mb.samples.at(0) * 2;
  }
};

TEST(LoaderTest, EachConcurrentCallGetsACopyOfItsOwn) {
  auto copies = std::make_shared<std::atomic<int>>(0);
  auto overlaps = std::make_shared<std::atomic<int>>(0);
  Loader loader{Counted(copies, overlaps)};
  const int made_by_construction = copies->load();
  constexpr int kThreads = 6;
  std::atomic<int> wrong{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 40; ++i) {
        MicroBatch mb;
        mb.samples = {t * 1000 + i};
        if (loader(mb) != 2 * (t * 1000 + i)) ++wrong;
      }
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(wrong.load(), 0);
  EXPECT_EQ(overlaps->load(), 0);
  // At most one copy per thread that ever called at the same time.
  EXPECT_GE(copies->load() - made_by_construction, 1);
  EXPECT_LE(copies->load() - made_by_construction, kThreads);
}

TEST(LoaderTest, AThrowingCallGivesItsCopyBack) {
  auto copies = std::make_shared<std::atomic<int>>(0);
  auto overlaps = std::make_shared<std::atomic<int>>(0);
  Loader loader{Counted(copies, overlaps)};
  MicroBatch good;
  good.samples = {7};
  EXPECT_EQ(loader(good), 14);
  const int after_first = copies->load();
  MicroBatch bad;
  bad.index = -1;
  for (int i = 0; i < 5; ++i) EXPECT_THROW(loader(bad), std::runtime_error);
  EXPECT_EQ(loader(good), 14);
  EXPECT_EQ(copies->load(), after_first);  // one thread: the one copy, reused
}

TEST(LoaderTest, CopiesShareOneIdentity) {
  auto f = [](const MicroBatch& mb) { return mb.samples.size(); };
  Loader a(f);
  Loader b = a;
  Loader other(f);
  EXPECT_EQ(a.id(), b.id());
  EXPECT_NE(a.id(), other.id());
  static_assert(IsLoader<decltype(a)>::value);
  static_assert(!IsLoader<decltype(f)>::value);
}

}  // namespace
}  // namespace evenstep

// Sampler: determinism across world sizes and plans, exactly-once per epoch,
// resume, budgets, partition by shares and micro-batch caps.
#include "evenstep/sampler.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <numeric>
#include <set>

#include "tests/testing/fixed_random.h"

namespace evenstep {
namespace {

using ::evenstep::testing::FixedRandom;

using ::testing::HasSubstr;

std::vector<int64_t> Lengths(int n, uint32_t seed = 7) {
  FixedRandom rng(seed);
  std::vector<int64_t> lengths(n);
  for (auto& l : lengths) {
    l = std::clamp<int64_t>(static_cast<int64_t>(rng.LogNormal(3.5, 1.0)), 1, 2000);
  }
  return lengths;
}

std::vector<double> RandomShares(int ranks, FixedRandom& rng, bool allow_zero) {
  std::vector<double> shares(ranks);
  for (auto& s : shares) s = rng.Uniform(0.0, 1.0) + 0.05;
  if (allow_zero && ranks > 1) shares[rng.Int(0, ranks - 1)] = 0;
  return shares;
}

TEST(SamplerTest, GlobalBatchesDependOnlyOnSeedAndEpochNotWorldSizeOrPlan) {
  SamplerOptions options;
  options.seed = 42;
  options.global_batch = 32;
  std::vector<std::vector<int64_t>> reference;
  FixedRandom rng(1);
  for (int world : {1, 2, 4}) {
    auto sampler = Sampler::Create(Lengths(1000), options);
    ASSERT_TRUE(sampler.ok()) << sampler.status();
    for (int step = 0; step < 40; ++step) {
      const GlobalBatch batch = sampler->Next();
      if (world == 1) {
        reference.push_back(batch.samples);
      } else {
        ASSERT_EQ(batch.samples, reference[step]) << "world " << world << " step " << step;
      }
      // Any plan: the parts are exactly the global batch.
      for (PartitionBy by : {PartitionBy::kCount, PartitionBy::kCost}) {
        auto parts = sampler->Partition(batch, RandomShares(world, rng, true), by);
        ASSERT_EQ(static_cast<int>(parts.size()), world);
        std::vector<int64_t> joined;
        for (const auto& part : parts) {
          for (const MicroBatch& mb : sampler->Pack(part)) {
            joined.insert(joined.end(), mb.samples.begin(), mb.samples.end());
          }
        }
        std::sort(joined.begin(), joined.end());
        std::vector<int64_t> expected = batch.samples;
        std::sort(expected.begin(), expected.end());
        ASSERT_EQ(joined, expected);
      }
    }
  }
  // Another seed gives another order.
  options.seed = 43;
  auto other = Sampler::Create(Lengths(1000), options);
  EXPECT_NE(other->Next().samples, reference[0]);
}

TEST(SamplerTest, EverySampleExactlyOncePerEpochTailKept) {
  for (BatchUnit unit : {BatchUnit::kSamples, BatchUnit::kTokens}) {
    SamplerOptions options;
    options.budget_unit = unit;
    options.global_batch = unit == BatchUnit::kSamples ? 30 : 2000;
    const int n = 997;  // not a multiple of the batch: a smaller tail
    auto sampler = Sampler::Create(Lengths(n), options);
    ASSERT_TRUE(sampler.ok());
    for (int epoch = 0; epoch < 2; ++epoch) {
      std::vector<int> seen(n, 0);
      int smaller = 0;
      // Epochs of a token budget differ in their number of batches: each
      // epoch's own count, also before its first batch is drawn.
      const int64_t steps = sampler->steps_in_epoch(epoch);
      for (int64_t s = 0; s < steps; ++s) {
        const GlobalBatch batch = sampler->Next();
        EXPECT_EQ(batch.epoch, epoch);
        EXPECT_EQ(batch.step, s);
        for (int64_t i : batch.samples) ++seen[i];
        if (unit == BatchUnit::kTokens && batch.samples.size() > 1) {
          EXPECT_LE(batch.tokens, options.global_batch);
        }
        if (unit == BatchUnit::kSamples && batch.samples.size() != 30u) ++smaller;
      }
      EXPECT_LE(smaller, 1);
      EXPECT_TRUE(std::all_of(seen.begin(), seen.end(), [](int c) { return c == 1; }))
          << "epoch " << epoch;
    }
  }
}

TEST(SamplerTest, AGlobalBatchLargerThanTheDatasetIsRefusedNamingTheFlag) {
  // --evenstep_global_batch=1000000000 used to be accepted: the first step
  // then held every sample many times over and printed nothing for minutes.
  for (BatchUnit unit : {BatchUnit::kSamples, BatchUnit::kTokens}) {
    SamplerOptions options;
    options.budget_unit = unit;
    std::vector<int64_t> lengths = {3, 5, 7};
    options.global_batch = unit == BatchUnit::kSamples ? 3 : 15;  // the whole dataset: fine
    EXPECT_TRUE(Sampler::Create(lengths, options).ok());
    options.global_batch = 1000000000;
    auto sampler = Sampler::Create(lengths, options);
    ASSERT_FALSE(sampler.ok());
    EXPECT_EQ(sampler.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(sampler.status().message(),
                HasSubstr(unit == BatchUnit::kSamples
                              ? "--evenstep_global_batch=1000000000: more than the whole dataset "
                                "(3 samples)"
                              : "--evenstep_global_batch=1000000000: more than the whole dataset "
                                "(15 tokens in 3 samples)"));
  }
}

TEST(SamplerTest, StreamModeStepsEveryStreamInOrderAndKeepsEachOnOneRank) {
  // 5 streams of 4 positions: sample s * 4 + t.
  SamplerOptions options;
  options.streams = 5;
  options.global_batch = 64;  // ignored in stream mode: one position of every stream
  options.micro_batch_samples = 2;
  auto sampler = Sampler::Create(std::vector<int64_t>(20, 3), options);
  ASSERT_TRUE(sampler.ok()) << sampler.status();
  ASSERT_EQ(sampler->steps_per_epoch(), 4);
  const std::vector<double> shares = {0.5, 0.3, 0.2};
  std::map<int64_t, int> owner;  // stream -> rank, over two epochs
  for (int step = 0; step < 8; ++step) {
    const GlobalBatch batch = sampler->Next();
    EXPECT_EQ(batch.epoch, step / 4);
    EXPECT_EQ(batch.samples, (std::vector<int64_t>{step % 4, 4 + step % 4, 8 + step % 4,
                                                   12 + step % 4, 16 + step % 4}));
    const auto parts = sampler->PartitionStreams(batch, shares);
    size_t dealt = 0;
    for (int r = 0; r < 3; ++r) {
      const auto [first, last] = sampler->StreamRange(shares, r);
      for (int64_t i : parts[r]) {
        EXPECT_GE(i / 4, first);
        EXPECT_LT(i / 4, last);
        auto [it, fresh] = owner.emplace(i / 4, r);
        EXPECT_EQ(it->second, r) << "stream " << i / 4 << " moved to rank " << r;
      }
      dealt += parts[r].size();
      // Packing keeps the stream order (equal lengths).
      std::vector<int64_t> packed;
      for (const MicroBatch& mb : sampler->Pack(parts[r])) {
        packed.insert(packed.end(), mb.samples.begin(), mb.samples.end());
      }
      EXPECT_EQ(packed, parts[r]);
    }
    EXPECT_EQ(dealt, 5u);
  }
  // Blocks by the cumulative shares: [0, 3), [3, 4), [4, 5) (2.5 and 4 rounded).
  EXPECT_EQ(sampler->StreamRange(shares, 0), (std::pair<int64_t, int64_t>{0, 3}));
  EXPECT_EQ(sampler->StreamRange(shares, 1), (std::pair<int64_t, int64_t>{3, 4}));
  EXPECT_EQ(sampler->StreamRange(shares, 2), (std::pair<int64_t, int64_t>{4, 5}));
}

TEST(SamplerTest, StreamModeRefusesADatasetThatIsNotWholeStreams) {
  SamplerOptions options;
  options.streams = 3;
  auto sampler = Sampler::Create(std::vector<int64_t>(10, 1), options);
  ASSERT_FALSE(sampler.ok());
  EXPECT_THAT(sampler.status().message(),
              HasSubstr("--evenstep_streams=3: the dataset's 10 samples must be a whole number "
                        "of positions per stream"));
}

TEST(SamplerTest, DropLastDropsOnlyTheSmallerTail) {
  SamplerOptions options;
  options.global_batch = 30;
  options.drop_last = true;
  auto sampler = Sampler::Create(Lengths(997), options);
  EXPECT_EQ(sampler->steps_per_epoch(), 997 / 30);
  int64_t total = 0;
  for (int64_t s = 0; s < sampler->steps_per_epoch(); ++s) {
    const GlobalBatch batch = sampler->Next();
    EXPECT_EQ(batch.samples.size(), 30u);
    total += batch.samples.size();
  }
  EXPECT_EQ(total, 997 / 30 * 30);
}

TEST(SamplerTest, ResumeMidEpochContinuesTheSameSequence) {
  SamplerOptions options;
  options.seed = 5;
  options.global_batch = 50;
  auto first = Sampler::Create(Lengths(700), options);
  std::vector<std::vector<int64_t>> uninterrupted;
  for (int s = 0; s < 30; ++s) uninterrupted.push_back(first->Next().samples);

  auto before = Sampler::Create(Lengths(700), options);
  for (int s = 0; s < 17; ++s) before->Next();  // 700/50 = 14 per epoch: mid epoch 1
  const SamplerState state = before->state();
  EXPECT_EQ(state.epoch, 1);
  auto after = Sampler::Create(Lengths(700), options);
  ASSERT_TRUE(after->Restore(state).ok());
  for (int s = 17; s < 30; ++s) EXPECT_EQ(after->Next().samples, uninterrupted[s]) << s;

  auto wrong = Sampler::Create(Lengths(699), options);
  const absl::Status status = wrong->Restore(state);
  EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(status.message(), HasSubstr("700 samples"));
}

TEST(SamplerTest, LengthSortingReducesPadding) {
  SamplerOptions sorted;
  sorted.global_batch = 64;
  sorted.micro_batch_samples = 8;
  sorted.sort_window = 0;  // 50 global batches
  SamplerOptions plain = sorted;
  plain.sort_window = 1;  // the default
  EXPECT_EQ(SamplerOptions().sort_window, 1);
  auto padding = [](const SamplerOptions& options) {
    auto sampler = Sampler::Create(Lengths(4096), options);
    double padded = 0, real = 0;
    for (int s = 0; s < sampler->steps_per_epoch(); ++s) {
      const GlobalBatch batch = sampler->Next();
      for (const auto& part : sampler->Partition(batch, {1, 1, 1, 1}, PartitionBy::kCount)) {
        for (const MicroBatch& mb : sampler->Pack(part)) {
          padded += mb.max_length * static_cast<double>(mb.samples.size());
          real += mb.tokens;
        }
      }
    }
    return padded / real;
  };
  // Padded tokens / real tokens - 1: the waste. Sorting windows of 50
  // global batches removes most of it.
  const double sorted_waste = padding(sorted) - 1, plain_waste = padding(plain) - 1;
  EXPECT_LT(sorted_waste, 0.25 * plain_waste) << sorted_waste << " vs " << plain_waste;
}

TEST(SamplerTest, CostPartitionMatchesShares) {
  SamplerOptions options;
  options.global_batch = 512;
  auto sampler = Sampler::Create(Lengths(4096), options);
  const std::vector<double> shares = {0.1, 0.4, 0.0, 0.5};
  const GlobalBatch batch = sampler->Next();
  auto parts = sampler->Partition(batch, shares, PartitionBy::kCost);
  EXPECT_TRUE(parts[2].empty());
  double longest = 0;
  for (int64_t i : batch.samples) longest = std::max(longest, sampler->cost(i));
  for (int r = 0; r < 4; ++r) {
    double cost = 0;
    for (int64_t i : parts[r]) cost += sampler->cost(i);
    EXPECT_NEAR(cost, shares[r] * batch.cost, longest) << "rank " << r;
  }
  // Count partition: equal counts, strided.
  auto counted = sampler->Partition(batch, shares, PartitionBy::kCount);
  for (const auto& part : counted) EXPECT_EQ(part.size(), 128u);
}

TEST(SamplerTest, PackRespectsCapsAndMinimum) {
  SamplerOptions options;
  options.micro_batch_samples = 6;
  options.micro_batch_tokens = 400;
  options.min_micro_batches = 3;
  std::vector<int64_t> lengths = Lengths(500);
  for (int64_t& l : lengths) l = std::min<int64_t>(l, 400);
  auto sampler = Sampler::Create(lengths, options);
  ASSERT_TRUE(sampler.ok()) << sampler.status();
  std::vector<int64_t> all(500);
  std::iota(all.begin(), all.end(), 0);
  const auto micro = sampler->Pack(all);
  int64_t total = 0;
  for (const MicroBatch& mb : micro) {
    EXPECT_LE(mb.samples.size(), 6u);
    EXPECT_LE(mb.max_length * static_cast<int64_t>(mb.samples.size()), 400);
    total += mb.samples.size();
  }
  EXPECT_EQ(total, 500);
  // Few samples: split up to the minimum.
  const auto small = sampler->Pack({1, 2, 3, 4});
  EXPECT_EQ(small.size(), 3u);
  EXPECT_EQ(sampler->Pack({}).size(), 0u);
  EXPECT_EQ(sampler->Pack({9}).size(), 1u);
}

TEST(SamplerTest, ASampleLongerThanTheTokenCapIsAnErrorNamingIt) {
  SamplerOptions options;
  options.micro_batch_tokens = 10;
  auto sampler = Sampler::Create({3, 10, 11, 2}, options);
  EXPECT_EQ(sampler.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(sampler.status().message(),
              ::testing::HasSubstr("sample 2 has 11 tokens, more than the micro-batch cap "
                                   "--evenstep_micro_batch_tokens=10"));
}

TEST(SamplerTest, ATokenGlobalBatchSmallerThanTheLongestSampleIsAnErrorNamingTheFlags) {
  // --evenstep_batch_unit=tokens --evenstep_global_batch=1 used to train one
  // sample per step without a word.
  SamplerOptions options;
  options.budget_unit = BatchUnit::kTokens;
  options.global_batch = 10;
  EXPECT_TRUE(Sampler::Create({3, 10, 2}, options).ok());
  auto sampler = Sampler::Create({3, 10, 11, 2}, options);
  EXPECT_EQ(sampler.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(sampler.status().message(),
              HasSubstr("sample 2 has 11 tokens, more than a whole global batch "
                        "(--evenstep_global_batch=10 --evenstep_batch_unit=tokens)"));
}

TEST(SamplerTest, CountsForNormalisation) {
  SamplerOptions options;
  options.normalization = Normalization::kTokens;
  options.global_batch = 4;  // the whole dataset
  auto sampler = Sampler::Create({5, 6, 7, 8}, options);
  ASSERT_TRUE(sampler.ok()) << sampler.status();
  const GlobalBatch batch = sampler->Next();
  EXPECT_EQ(batch.count, 26);
  auto custom = Sampler::Create({5, 6, 7, 8}, options, nullptr, {4, 5, 6, 7});
  ASSERT_TRUE(custom.ok()) << custom.status();
  EXPECT_EQ(custom->Next().count, 22);
  options.global_batch = 1;
  auto quadratic = Sampler::Create({10}, options, [](int64_t l) { return l + 0.5 * l * l; });
  ASSERT_TRUE(quadratic.ok()) << quadratic.status();
  EXPECT_EQ(quadratic->cost(0), 60);
}

TEST(SamplerTest, BadInputNamesTheProblem) {
  SamplerOptions options;
  EXPECT_THAT(Sampler::Create({3, 0, 2}, options).status().message(), HasSubstr("sample 1"));
  EXPECT_THAT(Sampler::Create({}, options).status().message(), HasSubstr("no samples"));
  options.global_batch = 0;
  EXPECT_THAT(Sampler::Create({1}, options).status().message(), HasSubstr("global_batch"));
  options.global_batch = 1;
  EXPECT_THAT(Sampler::Create({1, 2}, options, [](int64_t) { return -1.0; }).status().message(),
              HasSubstr("cost function"));
  EXPECT_THAT(Sampler::Create({1, 2}, options, nullptr, {1}).status().message(),
              HasSubstr("1 counts for 2 samples"));
}

}  // namespace
}  // namespace evenstep

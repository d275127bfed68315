// Random draws keyed by sample in a torch::data dataset, over real ranks.
//
// A dataset whose get(index) draws its augmentation from
// evenstep::SampleGenerator(index) gives every sample of every epoch the
// numbers SampleGenerator(seed, epoch, index) gives, whatever loads it: the
// training thread or several data workers, one rank or two, static or
// dynamic splits, the loop-shaped form or the callback form.
#include "evenstep/sample_random.h"

#include <torch/torch.h>

#include <cstring>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "evenstep/session.h"
#include "evenstep/session_options.h"
#include "evenstep/torch_data.h"
#include "gtest/gtest.h"
#include "tests/testing/on_ranks.h"

namespace evenstep {
namespace {

using ::evenstep::testing::RanksDir;
using ::evenstep::testing::ReadRanksFile;
using ::evenstep::testing::RunOnRanks;
using ::evenstep::testing::WriteRanksFile;

constexpr int64_t kSamples = 24;
constexpr uint64_t kSeed = 5;

// data: two numbers drawn for the sample; target: its index.
class Noisy : public torch::data::datasets::Dataset<Noisy> {
 public:
  torch::data::Example<> get(size_t index) override {
    at::Generator g = SampleGenerator(static_cast<int64_t>(index));
    return {torch::rand({2}, g), torch::tensor(static_cast<int64_t>(index))};
  }
  torch::optional<size_t> size() const override { return kSamples; }
};

struct Case {
  int world;
  int workers;
  BalanceMode mode;
  bool loop_form;
  friend void PrintTo(const Case& c, std::ostream* os) {
    *os << "world " << c.world << " workers " << c.workers << " mode " << static_cast<int>(c.mode)
        << (c.loop_form ? " loop" : " callback");
  }
};

class SampleRandomTest : public ::testing::TestWithParam<Case> {};

// "index bits bits" per sample the rank loaded (a loss function does not
// know its micro-batch's epoch: Session::epoch() is the next step's).
std::string Line(const torch::Tensor& data, const torch::Tensor& target, int64_t i) {
  const torch::Tensor row = data[i].contiguous();
  uint32_t bits[2];
  std::memcpy(bits, row.data_ptr<float>(), sizeof bits);
  return absl::StrCat(target[i].item<int64_t>(), " ", bits[0], " ", bits[1]);
}

// SampleGenerator(seed, epoch, index)'s two numbers as Line writes them.
std::string Expected(int64_t epoch, int64_t index) {
  const torch::Tensor drawn = torch::rand({2}, SampleGenerator(kSeed, epoch, index));
  uint32_t bits[2];
  std::memcpy(bits, drawn.data_ptr<float>(), sizeof bits);
  return absl::StrCat(index, " ", bits[0], " ", bits[1]);
}

TEST_P(SampleRandomTest, EverySampleDrawsItsOwnNumbersWhoeverLoadsIt) {
  const Case c = GetParam();
  RunOnRanks(c.world, [c](DistContext& dist) {
    SessionOptions options;
    options.run_dir = RanksDir() + "/run";
    options.timeline = false;
    options.balance.sampler.seed = kSeed;
    options.balance.sampler.global_batch = 6;
    options.balance.sampler.micro_batch_samples = 2;
    options.balance.data_workers = c.workers;
    options.balance.planner.mode = c.mode;
    torch::manual_seed(1);
    torch::nn::Linear model(2, 1);
    torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(0.1));
    auto es = Session::Create(dist, *model, optimizer, UniformLengths(kSamples), options);
    ASSERT_TRUE(es.ok()) << es.status();
    auto loader = LoaderOf(Noisy().map(torch::data::transforms::Stack<>()));
    std::string seen;
    auto loss_of = [&](const torch::data::Example<>& batch) {
      for (int64_t i = 0; i < batch.target.size(0); ++i) {
        seen += Line(batch.data, batch.target, i) + "\n";
      }
      return model->forward(batch.data).sum();
    };
    while ((*es)->epoch() < 2) {
      if (c.loop_form) {
        for (auto& batch : (*es)->Batches(loader)) (*es)->Backward(loss_of(batch));
        ASSERT_FALSE((*es)->stopped());
      } else {
        auto report = (*es)->Step(loader, loss_of);
        ASSERT_TRUE(report.ok()) << report.status();
      }
    }
    ASSERT_TRUE((*es)->Finish().ok());
    WriteRanksFile(absl::StrCat("seen-", dist.rank()), seen);
  });
  // Every sample of both epochs, once each, with its epoch's numbers.
  std::multiset<std::string> seen, expected;
  for (int r = 0; r < c.world; ++r) {
    for (absl::string_view line :
         absl::StrSplit(ReadRanksFile(absl::StrCat("seen-", r)), '\n', absl::SkipEmpty())) {
      seen.insert(std::string(line));
    }
  }
  for (int64_t epoch = 0; epoch < 2; ++epoch) {
    for (int64_t i = 0; i < kSamples; ++i) expected.insert(Expected(epoch, i));
  }
  EXPECT_EQ(seen, expected);
}

INSTANTIATE_TEST_SUITE_P(Loaders, SampleRandomTest,
                         ::testing::Values(Case{1, 0, BalanceMode::kStatic, false},
                                           Case{1, 3, BalanceMode::kStatic, true},
                                           Case{2, 2, BalanceMode::kDynamic, false},
                                           Case{2, 3, BalanceMode::kWork, true}));

TEST(SampleGeneratorTest, KeyedBySeedEpochSampleAndStream) {
  auto draw = [](uint64_t seed, int64_t epoch, int64_t sample, int64_t stream) {
    return torch::rand({4}, SampleGenerator(seed, epoch, sample, stream));
  };
  EXPECT_TRUE(torch::equal(draw(1, 2, 3, 0), draw(1, 2, 3, 0)));
  EXPECT_FALSE(torch::equal(draw(1, 2, 3, 0), draw(2, 2, 3, 0)));
  EXPECT_FALSE(torch::equal(draw(1, 2, 3, 0), draw(1, 3, 3, 0)));
  EXPECT_FALSE(torch::equal(draw(1, 2, 3, 0), draw(1, 2, 4, 0)));
  EXPECT_FALSE(torch::equal(draw(1, 2, 3, 0), draw(1, 2, 3, 1)));
  {
    internal::SampleDrawScope scope(1, 2);
    EXPECT_TRUE(torch::equal(torch::rand({4}, SampleGenerator(3)), draw(1, 2, 3, 0)));
  }
  EXPECT_TRUE(torch::equal(torch::rand({4}, SampleGenerator(3)), draw(0, 0, 3, 0)));
}

}  // namespace
}  // namespace evenstep

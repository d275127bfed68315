// Loss objectives as people write them, over real ranks (Gloo on
// 127.0.0.1) beside one process running the plain loop on the whole global
// batch:
// - "mean": the default; the loss function returns its micro-batch's sum,
//   evenstep divides by the global batch's count;
// - "sum": Objective::kSum (--evenstep_objective=sum), the gradient of the
//   SUM over the global batch (a VAE's ELBO summed over its batch): no
//   division;
// - "sum_of_means": kSum with LossReduction::kMean, the loss function
//   returning its micro-batch's mean: evenstep multiplies it by the
//   micro-batch's count, so the step is again the global sum;
// - "two_terms": kSum, a loss with two terms over different denominators
//   (a per-sample term over the global batch's samples and a per-token term
//   over its tokens, as a captioning loss with a regulariser has), written
//   with MicroBatch::global_samples and global_tokens.
// Samples have lengths 1-7, ranks get uneven shares (dynamic balance,
// seeded start) in 1-3 micro-batches: every step's parameters equal the
// plain loop's (max relative error <= 1e-5) at worlds 1, 2 and 3.
#include <torch/torch.h>

#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "evenstep/balanced_step.h"
#include "gtest/gtest.h"
#include "tests/testing/on_ranks.h"

namespace evenstep {
namespace {

using ::evenstep::testing::RunOnRanks;

constexpr int kSamples = 40;

int64_t Length(int64_t sample) { return 1 + sample % 7; }

std::vector<int64_t> Lengths() {
  std::vector<int64_t> lengths;
  for (int64_t s = 0; s < kSamples; ++s) lengths.push_back(Length(s));
  return lengths;
}

// Each sample: one input row; each of its tokens: one more row.
torch::Tensor Input(int64_t sample) {
  return torch::tensor({std::sin(0.3 * sample), std::cos(0.7 * sample), 0.1 * sample},
                       torch::kFloat);
}
torch::Tensor Tokens(int64_t sample) {
  std::vector<torch::Tensor> rows;
  for (int64_t t = 0; t < Length(sample); ++t) rows.push_back(Input(sample + 31 * t));
  return torch::stack(rows);
}

// Sums over `samples` of the per-sample and per-token losses.
struct Terms {
  torch::Tensor per_sample, per_token;
};
Terms Sums(torch::nn::Linear& net, const std::vector<int64_t>& samples) {
  std::vector<torch::Tensor> inputs, tokens;
  for (int64_t s : samples) {
    inputs.push_back(Input(s));
    tokens.push_back(Tokens(s));
  }
  return {(net->forward(torch::stack(inputs)) - 1).pow(2).sum(),
          net->forward(torch::cat(tokens)).abs().sum()};
}

// The plain loop's loss on the whole global batch.
torch::Tensor PlainLoss(const std::string& objective, torch::nn::Linear& net,
                        const GlobalBatch& batch) {
  const Terms t = Sums(net, batch.samples);
  const double n = static_cast<double>(batch.samples.size());
  if (objective == "mean") return t.per_sample / n;
  if (objective == "two_terms") {
    return t.per_sample / n + t.per_token / static_cast<double>(batch.tokens);
  }
  return t.per_sample;  // "sum", "sum_of_means"
}

// The loss function evenstep calls for one micro-batch.
torch::Tensor MicroLoss(const std::string& objective, torch::nn::Linear& net,
                        const MicroBatch& mb) {
  const Terms t = Sums(net, mb.samples);
  if (objective == "sum_of_means") return t.per_sample / static_cast<double>(mb.samples.size());
  if (objective == "two_terms") {
    return t.per_sample / static_cast<double>(mb.global_samples) +
           t.per_token / static_cast<double>(mb.global_tokens);
  }
  return t.per_sample;  // "mean", "sum"
}

class ObjectiveTest : public ::testing::TestWithParam<std::tuple<int, std::string>> {};

TEST_P(ObjectiveTest, EveryStepEqualsThePlainLoop) {
  const auto [world, objective] = GetParam();
  RunOnRanks(world, [objective = objective](DistContext& dist) {
    BalanceConfig config;
    config.objective = objective == "mean" ? Objective::kMean : Objective::kSum;
    config.loss_reduction =
        objective == "sum_of_means" ? LossReduction::kMean : LossReduction::kSum;
    config.sampler.global_batch = 11;
    config.sampler.micro_batch_samples = 2;
    config.planner.mode = BalanceMode::kDynamic;
    torch::manual_seed(3);
    torch::nn::Linear net(3, 2), plain(3, 2);
    {
      torch::NoGradGuard no_grad;
      for (size_t i = 0; i < net->parameters().size(); ++i) {
        plain->parameters()[i].copy_(net->parameters()[i]);
      }
    }
    torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.01));
    torch::optim::SGD plain_opt(plain->parameters(), torch::optim::SGDOptions(0.01));
    auto step = BalancedStep::Create(dist, *net, opt, Lengths(), config);
    ASSERT_TRUE(step.ok()) << step.status();
    for (int s = 1; s <= 4; ++s) {
      auto report =
          (*step)->Step({[&](const MicroBatch& mb) { return MicroLoss(objective, net, mb); }});
      ASSERT_TRUE(report.ok()) << "step " << s << ": " << report.status();
      plain_opt.zero_grad();
      PlainLoss(objective, plain, (*step)->global_batch()).backward();
      plain_opt.step();
      for (size_t i = 0; i < net->parameters().size(); ++i) {
        const torch::Tensor want = plain->parameters()[i];
        const double error =
            ((net->parameters()[i] - want).abs().max() / (want.abs().max() + 1e-12)).item<double>();
        EXPECT_LE(error, 1e-5) << "rank " << dist.rank() << " step " << s << " parameter " << i;
      }
    }
  });
}

INSTANTIATE_TEST_SUITE_P(WorldsAndObjectives, ObjectiveTest,
                         ::testing::Combine(::testing::Values(1, 2, 3),
                                            ::testing::Values("mean", "sum", "sum_of_means",
                                                              "two_terms")),
                         [](const auto& info) {
                           return absl::StrCat("world", std::get<0>(info.param), "_",
                                               std::get<1>(info.param));
                         });

}  // namespace
}  // namespace evenstep

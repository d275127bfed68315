#include "tests/testing/sync_net.h"

#include <algorithm>
#include <vector>

#include "gtest/gtest.h"

namespace evenstep::testing {

SyncNet::SyncNet(int first_hidden, bool with_extra) {
  l1 = register_module("l1", torch::nn::Linear(kSyncIn, first_hidden));
  l2 = register_module("l2", torch::nn::Linear(first_hidden, kSyncHidden));
  l3 = register_module("l3", torch::nn::Linear(kSyncHidden, kSyncHidden));
  l4 = register_module("l4", torch::nn::Linear(kSyncHidden, kSyncClasses));
  if (with_extra) extra = register_module("extra", torch::nn::Linear(kSyncIn, kSyncClasses));
}

torch::Tensor SyncNet::forward(const torch::Tensor& x, bool use_extra) {
  auto h = torch::tanh(l1(x));
  h = torch::tanh(l2(h));
  h = torch::tanh(l3(h));
  auto out = l4(h);
  if (use_extra) out = out + extra(x);
  return out;
}

std::shared_ptr<SyncNet> MakeSyncNet(int seed, torch::Device device, int first_hidden,
                                     bool with_extra) {
  torch::manual_seed(seed);
  auto net = std::make_shared<SyncNet>(first_hidden, with_extra);
  net->to(device);
  return net;
}

SyncBatch GlobalSyncBatch(torch::Device device) {
  torch::manual_seed(1234);
  return {torch::randn({kSyncBatch, kSyncIn}).to(device),
          torch::randint(0, kSyncClasses, {kSyncBatch}, torch::kLong).to(device)};
}

torch::Tensor ScaledLoss(SyncNet& net, const SyncBatch& batch, const torch::Tensor& idx,
                         bool use_extra) {
  const torch::Tensor at = idx.to(batch.x.device());
  auto logits = net.forward(batch.x.index_select(0, at), use_extra);
  return torch::nn::functional::cross_entropy(
             logits, batch.y.index_select(0, at),
             torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kSum)) /
         kSyncBatch;
}

double MaxRelError(const torch::Tensor& got, const torch::Tensor& want) {
  if (got.numel() == 0 && want.numel() == 0) return 0;  // e.g. zero output features
  const torch::Tensor g = got.to(torch::kDouble), w = want.to(torch::kDouble);
  const double scale = std::max(w.abs().max().item<double>(), 1e-12);
  return (g - w).abs().max().item<double>() / scale;
}

void ExpectGradsNear(SyncNet& net, SyncNet& ref, double tolerance, const std::string& what,
                     double factor) {
  auto want = ref.named_parameters();
  for (const auto& item : net.named_parameters()) {
    const torch::Tensor& g = item.value().grad();
    const torch::Tensor& w = want[item.key()].grad();
    if (!g.defined() || !w.defined()) {
      ADD_FAILURE() << what << ": " << item.key() << " has no gradient";
      continue;
    }
    EXPECT_LE(MaxRelError(g, w * factor), tolerance)
        << what << ": " << item.key() << "'s max relative error";
  }
}

GradSyncOptions TinyBuckets() {
  GradSyncOptions options;
  options.bucket_cap_bytes = 64;  // every parameter its own bucket
  options.first_bucket_cap_bytes = 64;
  options.timeout = absl::Seconds(30);
  return options;
}

namespace {
// Rank `rank`'s micro-batches of the split drawn from `seed` (the same draws
// on every rank).
std::vector<torch::Tensor> SplitOf(int seed, int world, int rank) {
  torch::manual_seed(seed);
  const int idle = world > 1 ? seed % world : -1;
  std::vector<std::vector<int64_t>> per_rank(world);
  const auto owner = torch::randint(0, world, {kSyncBatch}, torch::kLong);
  for (int i = 0; i < kSyncBatch; ++i) {
    int r = owner[i].item<int>();
    if (r == idle) r = (r + 1) % world;
    per_rank[r].push_back(i);
  }
  std::vector<torch::Tensor> micro;
  const auto& mine = per_rank[rank];
  const auto sizes = torch::randint(1, 6, {kSyncBatch}, torch::kLong);
  for (size_t start = 0, k = 0; start < mine.size(); ++k) {
    const size_t n = std::min<size_t>(sizes[rank * 3 + k % 5].item<int64_t>(), mine.size() - start);
    micro.push_back(
        torch::tensor(std::vector<int64_t>(mine.begin() + start, mine.begin() + start + n)));
    start += n;
  }
  return micro;
}
}  // namespace

ExactSplitRun SyncExactSplit(DistContext& dist, int seed, const GradSyncOptions& options,
                             torch::Device device) {
  const int world = dist.world_size(), rank = dist.rank();
  const SyncBatch batch = GlobalSyncBatch(device);
  // The reference: one process, the whole batch, rank 0's initial weights.
  auto ref = MakeSyncNet(7, device);
  ScaledLoss(*ref, batch, torch::arange(kSyncBatch)).backward();

  auto net = MakeSyncNet(7 + rank, device);
  auto sync = GradSync::Attach(*net, dist.data_group(), options);
  ExactSplitRun run;
  if (!sync.ok()) {
    ADD_FAILURE() << "rank " << rank << ": attach failed: " << sync.status();
    return run;
  }
  run.num_buckets = (*sync)->num_buckets();
  EXPECT_GE(run.num_buckets, 8);
  const std::vector<torch::Tensor> micro = SplitOf(seed, world, rank);
  run.micro_batches = static_cast<int>(micro.size());
  (*sync)->SetStep(0);
  for (size_t m = 0; m < micro.size(); ++m) {
    run.samples += static_cast<int>(micro[m].numel());
    (*sync)->set_sync_enabled(m + 1 == micro.size());
    ScaledLoss(*net, batch, micro[m]).backward();
  }
  if (micro.empty()) {
    EXPECT_TRUE((*sync)->SyncNow().ok()) << "rank " << rank << "'s SyncNow";
  } else {
    run.buckets_launched_during_backward = (*sync)->last_stats().buckets_launched_during_backward;
  }
  ExpectGradsNear(*net, *ref, 1e-5, "rank " + std::to_string(rank) + "'s synced gradient");
  return run;
}

}  // namespace evenstep::testing

// Rank program for the GradSync tests (started by grad_sync_test.cc with the
// torchrun convention). Scenarios:
//   exact SEED      random uneven split of one global batch across ranks and
//                   micro-steps (one rank without work); synced gradient must
//                   equal the single-process gradient of the mean loss
//   nosync          no collective during local micro-steps, local accumulation
//   unused          a parameter only rank 0 uses is reduced as zeros elsewhere
//   mismatch        rank 1's model differs: Attach must fail naming it
//   frozen          every rank builds its model from another seed and freezes
//                   l1: after Attach every parameter, frozen ones included,
//                   equals rank 0's
//   hook NAME       sum | avg | fp16 | bf16 | user, compared with SUM
// Exit codes: 0 passed, 1 check failed (printed), 3 init failed, 4 expected error.
#include <torch/torch.h>

#include <iostream>
#include <string>
#include <vector>

#include "absl/flags/parse.h"
#include "absl/strings/numbers.h"
#include "evenstep/dist_context.h"
#include "evenstep/grad_sync.h"

namespace {

constexpr int kIn = 12, kHidden = 16, kClasses = 3, kBatch = 24;

struct Net : torch::nn::Module {
  Net(int first_hidden, bool with_extra) {
    l1 = register_module("l1", torch::nn::Linear(kIn, first_hidden));
    l2 = register_module("l2", torch::nn::Linear(first_hidden, kHidden));
    l3 = register_module("l3", torch::nn::Linear(kHidden, kHidden));
    l4 = register_module("l4", torch::nn::Linear(kHidden, kClasses));
    if (with_extra) extra = register_module("extra", torch::nn::Linear(kIn, kClasses));
  }
  torch::Tensor forward(const torch::Tensor& x, bool use_extra = false) {
    auto h = torch::tanh(l1(x));
    h = torch::tanh(l2(h));
    h = torch::tanh(l3(h));
    auto out = l4(h);
    if (use_extra) out = out + extra(x);
    return out;
  }
  torch::nn::Linear l1{nullptr}, l2{nullptr}, l3{nullptr}, l4{nullptr}, extra{nullptr};
};

std::shared_ptr<Net> MakeNet(int seed, int first_hidden = kHidden, bool with_extra = false) {
  torch::manual_seed(seed);
  return std::make_shared<Net>(first_hidden, with_extra);
}

struct Batch {
  torch::Tensor x, y;
};

Batch GlobalBatch() {
  torch::manual_seed(1234);
  return {torch::randn({kBatch, kIn}), torch::randint(0, kClasses, {kBatch}, torch::kLong)};
}

// Sum of per-sample losses of `idx`, divided by the global count.
torch::Tensor ScaledLoss(Net& net, const Batch& b, const torch::Tensor& idx,
                         bool use_extra = false) {
  auto logits = net.forward(b.x.index_select(0, idx), use_extra);
  return torch::nn::functional::cross_entropy(
             logits, b.y.index_select(0, idx),
             torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kSum)) /
         kBatch;
}

double MaxRelError(const torch::Tensor& got, const torch::Tensor& want) {
  const double scale = std::max(want.abs().max().item<double>(), 1e-12);
  return (got - want).abs().max().item<double>() / scale;
}

// Compares every parameter gradient of `net` with `ref` (scaled by `factor`).
bool CompareGrads(Net& net, Net& ref, double tolerance, const std::string& what,
                  double factor = 1) {
  bool ok = true;
  auto got = net.named_parameters();
  auto want = ref.named_parameters();
  for (const auto& item : got) {
    const torch::Tensor& g = item.value().grad();
    const torch::Tensor& w = want[item.key()].grad();
    if (!g.defined() || !w.defined()) {
      std::cout << "MISMATCH " << what << ": " << item.key() << " has no gradient" << std::endl;
      ok = false;
      continue;
    }
    const double err = MaxRelError(g, w * factor);
    if (!(err <= tolerance)) {
      std::cout << "MISMATCH " << what << ": " << item.key() << " max relative error " << err
                << " > " << tolerance << std::endl;
      ok = false;
    }
  }
  return ok;
}

void ZeroGrads(Net& net) {
  for (auto& p : net.parameters()) {
    if (p.grad().defined()) p.mutable_grad().zero_();
  }
}

evenstep::GradSyncOptions TinyBuckets() {
  evenstep::GradSyncOptions options;
  options.bucket_cap_bytes = 64;  // every parameter its own bucket
  options.first_bucket_cap_bytes = 64;
  options.timeout = absl::Seconds(30);
  return options;
}

int Exact(evenstep::DistContext& dist, int seed) {
  const int world = dist.world_size(), rank = dist.rank();
  const Batch batch = GlobalBatch();
  // Reference: one process, whole batch, mean loss, rank 0's initial weights.
  auto ref = MakeNet(7);
  ScaledLoss(*ref, batch, torch::arange(kBatch)).backward();

  auto net = MakeNet(7 + rank);  // differs per rank until Attach broadcasts rank 0's
  auto sync = evenstep::GradSync::Attach(*net, dist.data_group(), TinyBuckets());
  if (!sync.ok()) {
    std::cout << "attach failed: " << sync.status() << std::endl;
    return 1;
  }
  if ((*sync)->num_buckets() < 8) {
    std::cout << "MISMATCH expected >= 8 buckets, got " << (*sync)->num_buckets() << std::endl;
    return 1;
  }
  // The split: every rank derives the same assignment from SEED.
  torch::manual_seed(seed);
  const int idle = world > 1 ? seed % world : -1;
  std::vector<std::vector<int64_t>> per_rank(world);
  auto owner = torch::randint(0, world, {kBatch}, torch::kLong);
  for (int i = 0; i < kBatch; ++i) {
    int r = owner[i].item<int>();
    if (r == idle) r = (r + 1) % world;
    per_rank[r].push_back(i);
  }
  std::vector<torch::Tensor> micro;
  const auto& mine = per_rank[rank];
  auto sizes = torch::randint(1, 6, {kBatch}, torch::kLong);  // same draws on every rank
  for (size_t start = 0, k = 0; start < mine.size(); ++k) {
    const size_t n = std::min<size_t>(sizes[rank * 3 + k % 5].item<int64_t>(), mine.size() - start);
    micro.push_back(
        torch::tensor(std::vector<int64_t>(mine.begin() + start, mine.begin() + start + n)));
    start += n;
  }
  std::cout << "rank " << rank << ": " << mine.size() << " samples in " << micro.size()
            << " micro-batches" << std::endl;
  for (size_t m = 0; m < micro.size(); ++m) {
    (*sync)->set_sync_enabled(m + 1 == micro.size());
    ScaledLoss(*net, batch, micro[m]).backward();
  }
  if (micro.empty()) {
    if (auto s = (*sync)->SyncNow(); !s.ok()) {
      std::cout << s << std::endl;
      return 1;
    }
  } else {
    std::cout << "launched during backward: "
              << (*sync)->last_stats().buckets_launched_during_backward << " of "
              << (*sync)->num_buckets() << std::endl;
  }
  if (!CompareGrads(*net, *ref, 1e-5, "exact")) return 1;
  std::cout << "exact ok" << std::endl;
  return 0;
}

int NoSync(evenstep::DistContext& dist) {
  const int world = dist.world_size(), rank = dist.rank();
  const Batch batch = GlobalBatch();
  auto net = MakeNet(3);
  auto ref = MakeNet(3);
  auto sync = evenstep::GradSync::Attach(*net, dist.data_group(), TinyBuckets());
  if (!sync.ok()) {
    std::cout << sync.status() << std::endl;
    return 1;
  }
  // Rank r's micro-batches are samples {r, r + world, ...} in 3 chunks.
  std::vector<torch::Tensor> micro;
  for (int m = 0; m < 3; ++m) micro.push_back(torch::arange(rank + m * world, kBatch, 3 * world));
  (*sync)->set_sync_enabled(false);
  for (int m = 0; m < 2; ++m) {
    ScaledLoss(*net, batch, micro[m]).backward();
    ScaledLoss(*ref, batch, micro[m]).backward();
  }
  if ((*sync)->collectives_started() != 0) {
    std::cout << "MISMATCH collectives during no-sync micro-steps" << std::endl;
    return 1;
  }
  if (!CompareGrads(*net, *ref, 0, "local accumulation")) return 1;
  (*sync)->set_sync_enabled(true);
  ScaledLoss(*net, batch, micro[2]).backward();
  // One per bucket, and once the broadcast of rank 0's ready order.
  if ((*sync)->collectives_started() != (*sync)->num_buckets() + (world > 1 ? 1 : 0)) {
    std::cout << "MISMATCH expected one collective per bucket and the order broadcast, got "
              << (*sync)->collectives_started() << std::endl;
    return 1;
  }
  // Expected: the gradient over every rank's micro-batches.
  auto all = MakeNet(3);
  for (int r = 0; r < world; ++r) {
    for (int m = 0; m < 3; ++m)
      ScaledLoss(*all, batch, torch::arange(r + m * world, kBatch, 3 * world)).backward();
  }
  if (!CompareGrads(*net, *all, 1e-5, "synced")) return 1;
  std::cout << "nosync ok" << std::endl;
  return 0;
}

int Unused(evenstep::DistContext& dist) {
  const int world = dist.world_size(), rank = dist.rank();
  const Batch batch = GlobalBatch();
  auto net = MakeNet(5, kHidden, /*with_extra=*/true);
  auto sync = evenstep::GradSync::Attach(*net, dist.data_group(), TinyBuckets());
  if (!sync.ok()) {
    std::cout << sync.status() << std::endl;
    return 1;
  }
  const auto idx = torch::arange(kBatch);
  // zero_grad() of a libtorch optimizer detach_()es every gradient: it must
  // work on the gradients GradSync wrote back.
  torch::optim::SGD optimizer(net->parameters(), torch::optim::SGDOptions(0.0));
  for (int step = 0; step < 2; ++step) {  // twice: the second step reuses the aliases
    optimizer.zero_grad();
    ScaledLoss(*net, batch, idx, /*use_extra=*/rank == 0).backward();
    auto ref_main = MakeNet(5, kHidden, true);
    ScaledLoss(*ref_main, batch, idx, false).backward();
    auto ref_extra = MakeNet(5, kHidden, true);
    ScaledLoss(*ref_extra, batch, idx, true).backward();
    // Rank 0 adds extra's output to the logits, so its main-layer gradient is
    // ref_extra's; the other ranks contribute ref_main's and zeros for extra.
    for (const auto& item : net->named_parameters()) {
      const bool is_extra = item.key().rfind("extra", 0) == 0;
      torch::Tensor want = is_extra
                               ? ref_extra->named_parameters()[item.key()].grad()
                               : ref_extra->named_parameters()[item.key()].grad() +
                                     (world - 1) * ref_main->named_parameters()[item.key()].grad();
      const double err = MaxRelError(item.value().grad(), want);
      if (!(err <= 1e-5)) {
        std::cout << "MISMATCH step " << step << " " << item.key() << " error " << err << std::endl;
        return 1;
      }
    }
    optimizer.step();  // lr 0: nothing moves, but the parameters were stepped
  }
  std::cout << "unused ok" << std::endl;
  return 0;
}

int Mismatch(evenstep::DistContext& dist) {
  auto net = MakeNet(1, dist.rank() == 1 ? kHidden + 1 : kHidden);
  auto sync = evenstep::GradSync::Attach(*net, dist.data_group(), TinyBuckets());
  if (sync.ok()) {
    std::cout << "UNEXPECTED: attach succeeded" << std::endl;
    return 1;
  }
  std::cout << "attach failed: " << sync.status() << std::endl;
  return 4;
}

int Frozen(evenstep::DistContext& dist) {
  auto net = MakeNet(100 + dist.rank());
  for (auto& p : net->l1->parameters()) p.set_requires_grad(false);
  auto sync = evenstep::GradSync::Attach(*net, dist.data_group(), TinyBuckets());
  if (!sync.ok()) {
    std::cout << sync.status() << std::endl;
    return 1;
  }
  int failures = 0;
  for (const auto& item : net->named_parameters()) {
    torch::Tensor mine = item.value().detach().clone();
    torch::Tensor root = mine.clone();
    if (!dist.Broadcast(root, 0).ok()) return 1;
    if (!torch::equal(mine, root)) {
      std::cout << "parameter " << item.key() << " differs from rank 0's after Attach"
                << (item.value().requires_grad() ? "" : " (frozen)") << std::endl;
      ++failures;
    }
  }
  if (failures == 0) std::cout << "frozen ok" << std::endl;
  return failures == 0 ? 0 : 1;
}

int Hook(evenstep::DistContext& dist, const std::string& name) {
  const int world = dist.world_size(), rank = dist.rank();
  const Batch batch = GlobalBatch();
  auto net = MakeNet(9);
  evenstep::GradSyncOptions options = TinyBuckets();
  options.check_zero_grad = false;  // two synchronisations of one state, on purpose
  auto sync = evenstep::GradSync::Attach(*net, dist.data_group(), options);
  if (!sync.ok()) {
    std::cout << sync.status() << std::endl;
    return 1;
  }
  const auto idx = torch::arange(rank, kBatch, world);
  ScaledLoss(*net, batch, idx).backward();  // SUM (default)
  auto sum = MakeNet(9);
  for (const auto& item : net->named_parameters()) {
    sum->named_parameters()[item.key()].mutable_grad() = item.value().grad().clone();
  }
  ZeroGrads(*net);
  double factor = 1, tolerance = 1e-2;
  if (name == "user") {
    evenstep::CommHook base = evenstep::SumHook();
    (*sync)->set_comm_hook([base](const evenstep::CommHookContext& ctx, at::Tensor& bucket) {
      return evenstep::ReducedBucket::Then(base(ctx, bucket),
                                           [](at::Tensor reduced) { return reduced.mul(2); });
    });
    factor = 2;
    tolerance = 1e-6;
  } else {
    auto hook = evenstep::CommHookByName(name);
    if (!hook.ok()) {
      std::cout << hook.status() << std::endl;
      return 1;
    }
    (*sync)->set_comm_hook(*hook);
    if (name == "avg") {
      factor = 1.0 / world;
      tolerance = 1e-6;
    } else if (name == "sum") {
      tolerance = 0;
    }
  }
  ScaledLoss(*net, batch, idx).backward();
  if (!CompareGrads(*net, *sum, tolerance, "hook " + name, factor)) return 1;
  std::cout << "hook " << name << " ok" << std::endl;
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<char*> args = absl::ParseCommandLine(argc, argv);
  std::cout.setf(std::ios::unitbuf);
  torch::set_num_threads(1);
  if (args.size() < 2) {
    std::cerr << "usage: grad_sync_helper SCENARIO [ARG]" << std::endl;
    return 2;
  }
  const std::string scenario = args[1];
  auto ctx = evenstep::DistContext::CreateFromFlags();
  if (!ctx.ok()) {
    std::cout << "init failed: " << ctx.status() << std::endl;
    return 3;
  }
  evenstep::DistContext& dist = **ctx;
  const std::string arg = args.size() > 2 ? args[2] : "";
  if (scenario == "exact") {
    int seed = 0;
    if (!absl::SimpleAtoi(arg, &seed)) return 2;
    return Exact(dist, seed);
  }
  if (scenario == "nosync") return NoSync(dist);
  if (scenario == "unused") return Unused(dist);
  if (scenario == "mismatch") return Mismatch(dist);
  if (scenario == "frozen") return Frozen(dist);
  if (scenario == "hook") return Hook(dist, arg);
  std::cerr << "unknown scenario " << scenario << std::endl;
  return 2;
}

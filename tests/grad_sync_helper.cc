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
//   hook NAME       sum | avg | fp16 | bf16 | user, compared with one process's
//                   gradient of the whole batch
//   hookinfo        a user hook sees every gradient once, with its offset and
//                   shape, and is_last on the last bucket only
//   powersgd        rank-1 PowerSGD: exact for a rank-1 summed gradient; with
//                   error feedback the mean of many approximations of one
//                   rank-3 gradient converges to it
//   sparse_undeclared  an Embedding(sparse) weight attached from a list
//                   without sparse_parameters: every rank's sync fails naming it
//   forgotten_sync  rank 1 never joins the sync (it forgets SyncNow): rank 0's
//                   sync times out naming rank 1, and rank 0's next GradSync
//                   sync and DistContext collective fail at once with that
//                   error instead of blocking on the timed-out all_reduce
// --evenstep_sync_topology=hierarchical runs exact, unused and hook through
// the hierarchical sync (nodes from GROUP_RANK).
// --device=cuda puts the models and the batch of exact, nosync and unused on
// the GPU (tests/cuda_test.cc: NCCL at world size 1, Gloo with CUDA tensors
// for several ranks sharing one GPU).
// Exit codes: 0 passed, 1 check failed (printed), 3 init failed, 4 expected error,
// 5 sync topology refused.
#include <torch/torch.h>

#include <chrono>
#include <iostream>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/numbers.h"
#include "evenstep/dist_context.h"
#include "evenstep/flags.h"
#include "evenstep/grad_sync.h"
#include "evenstep/sync_topology.h"

ABSL_FLAG(std::string, device, "cpu", "Where the models and the batch live (cpu, cuda).");

namespace {

torch::Device Device() { return torch::Device(absl::GetFlag(FLAGS_device)); }

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
  auto net = std::make_shared<Net>(first_hidden, with_extra);
  net->to(Device());
  return net;
}

struct Batch {
  torch::Tensor x, y;
};

Batch GlobalBatch() {
  torch::manual_seed(1234);
  return {torch::randn({kBatch, kIn}).to(Device()),
          torch::randint(0, kClasses, {kBatch}, torch::kLong).to(Device())};
}

// Sum of per-sample losses of `idx`, divided by the global count.
torch::Tensor ScaledLoss(Net& net, const Batch& b, const torch::Tensor& idx,
                         bool use_extra = false) {
  const torch::Tensor at = idx.to(b.x.device());
  auto logits = net.forward(b.x.index_select(0, at), use_extra);
  return torch::nn::functional::cross_entropy(
             logits, b.y.index_select(0, at),
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

// TinyBuckets() with `hook` under --evenstep_sync_topology (hierarchical
// wraps it over ApplySyncTopology's subgroups); prints the choice's line, or
// the refusal and exits 5.
evenstep::GradSyncOptions TopologyBuckets(evenstep::DistContext& dist,
                                          evenstep::CommHook hook = evenstep::SumHook()) {
  evenstep::GradSyncOptions options = TinyBuckets();
  options.comm_hook = std::move(hook);
  auto topology = evenstep::SyncTopologyByName(absl::GetFlag(FLAGS_evenstep_sync_topology));
  absl::StatusOr<evenstep::TopologyChoice> choice =
      topology.ok() ? evenstep::ApplySyncTopology(dist, *topology, &options)
                    : absl::StatusOr<evenstep::TopologyChoice>(topology.status());
  if (!choice.ok()) {
    std::cout << "topology refused: " << choice.status() << std::endl;
    std::exit(5);
  }
  std::cout << choice->line << std::endl;
  return options;
}

int Exact(evenstep::DistContext& dist, int seed) {
  const int world = dist.world_size(), rank = dist.rank();
  const Batch batch = GlobalBatch();
  // Reference: one process, whole batch, mean loss, rank 0's initial weights.
  auto ref = MakeNet(7);
  ScaledLoss(*ref, batch, torch::arange(kBatch)).backward();

  auto net = MakeNet(7 + rank);  // differs per rank until Attach broadcasts rank 0's
  auto sync = evenstep::GradSync::Attach(*net, dist.data_group(), TopologyBuckets(dist));
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
  auto sync = evenstep::GradSync::Attach(*net, dist.data_group(), TopologyBuckets(dist));
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
  double factor = 1, tolerance = 1e-2;
  evenstep::CommHook hook;
  if (name == "user") {
    evenstep::CommHook base = evenstep::SumHook();
    hook = [base](const evenstep::CommHookContext& ctx, at::Tensor& bucket) {
      return evenstep::BucketFuture::Then(base(ctx, bucket),
                                          [](at::Tensor reduced) { return reduced.mul(2); });
    };
    factor = 2;
    tolerance = 1e-5;
  } else {
    auto named = evenstep::CommHookByName(name);
    if (!named.ok()) {
      std::cout << named.status() << std::endl;
      return 1;
    }
    hook = *named;
    if (name == "avg") {
      factor = 1.0 / world;
      tolerance = 1e-5;
    } else if (name == "sum") {
      tolerance = 1e-5;  // the same sums in another order
    }
  }
  auto sync = evenstep::GradSync::Attach(*net, dist.data_group(), TopologyBuckets(dist, hook));
  if (!sync.ok()) {
    std::cout << sync.status() << std::endl;
    return 1;
  }
  const auto idx = torch::arange(rank, kBatch, world);
  // The reference: one process's gradient of the whole global batch, no
  // sync at all (the ranks' SUM of their strided parts must equal it).
  auto sum = MakeNet(9);
  ScaledLoss(*sum, batch, torch::arange(0, kBatch)).backward();
  ScaledLoss(*net, batch, idx).backward();
  if (!CompareGrads(*net, *sum, tolerance, "hook " + name, factor)) return 1;
  std::cout << "hook " << name << " ok" << std::endl;
  return 0;
}

}  // namespace

int HookInfo(evenstep::DistContext& dist) {
  const Batch batch = GlobalBatch();
  auto net = MakeNet(9);
  auto sync = evenstep::GradSync::Attach(*net, dist.data_group(), TinyBuckets());
  if (!sync.ok()) {
    std::cout << sync.status() << std::endl;
    return 1;
  }
  std::map<std::string, int> seen;
  int failures = 0, lasts = 0;
  evenstep::CommHook base = evenstep::SumHook();
  (*sync)->set_comm_hook([&](const evenstep::CommHookContext& ctx, at::Tensor& bucket) {
    int64_t offset = 0;
    for (const evenstep::BucketParam& p : *ctx.params) {
      ++seen[p.name];
      int64_t numel = 1;
      for (int64_t d : p.sizes) numel *= d;
      if (p.offset != offset || p.numel != numel) ++failures;
      offset += p.numel;
    }
    if (offset != bucket.numel()) ++failures;  // a user hook sees only gradients
    if (ctx.is_last) {
      ++lasts;
      if (ctx.bucket_index != ctx.num_buckets - 1) ++failures;
    }
    return base(ctx, bucket);
  });
  ScaledLoss(*net, batch, torch::arange(dist.rank(), kBatch, dist.world_size())).backward();
  for (const auto& item : net->named_parameters()) {
    if (seen[item.key()] != 1) {
      std::cout << "MISMATCH " << item.key() << " seen " << seen[item.key()] << " times"
                << std::endl;
      ++failures;
    }
  }
  if (lasts != 1 || failures > 0 || !(*sync)->status().ok()) {
    std::cout << "MISMATCH lasts " << lasts << " failures " << failures << " " << (*sync)->status()
              << std::endl;
    return 1;
  }
  std::cout << "hookinfo ok" << std::endl;
  return 0;
}

int PowerSgd(evenstep::DistContext& dist) {
  const int world = dist.world_size();
  torch::manual_seed(3);
  auto lin = torch::nn::Linear(torch::nn::LinearOptions(8, 6).bias(false));
  evenstep::GradSyncOptions options = TinyBuckets();
  options.comm_hook = evenstep::PowerSgdHook({});
  auto sync = evenstep::GradSync::Attach(*lin, dist.data_group(), options);
  if (!sync.ok()) {
    std::cout << sync.status() << std::endl;
    return 1;
  }
  // 1. The same single sample on every rank: a rank-1 gradient; its SUM is
  // rank 1 and PowerSGD reproduces it.
  torch::manual_seed(4);
  const torch::Tensor x1 = torch::randn({1, 8});
  auto grad_of = [&](const torch::Tensor& x) {
    lin->zero_grad();
    lin(x).pow(2).sum().backward();
    return lin->weight.grad().clone();
  };
  torch::Tensor got = grad_of(x1);
  torch::Tensor exact = [&] {
    torch::NoGradGuard no_grad;
    torch::Tensor w = lin->weight.detach();
    return (2 * world) * w.matmul(x1.t()).matmul(x1);  // d/dW sum((Wx)^2) = 2 (Wx) x^T, per rank
  }();
  const double err1 = MaxRelError(got, exact);
  if (!(err1 <= 1e-4)) {
    std::cout << "MISMATCH powersgd rank-1 gradient error " << err1 << std::endl;
    return 1;
  }
  // 2. A rank-3 gradient (three samples, different per rank), the same every
  // step: one approximation misses by about its 2nd singular value; with
  // error feedback, the mean of T approximations misses by O(1/T).
  torch::manual_seed(10 + dist.rank());
  const torch::Tensor x3 = torch::randn({3, 8});
  (*sync)->set_sync_enabled(false);
  torch::Tensor local = grad_of(x3);
  (*sync)->set_sync_enabled(true);
  torch::Tensor sum = local.clone();
  if (!dist.AllReduce(sum).ok()) return 3;
  torch::Tensor total = torch::zeros_like(sum);
  double first = 0;
  constexpr int kSteps = 40;
  for (int t = 1; t <= kSteps; ++t) {
    torch::Tensor g = grad_of(x3);
    total += g;
    if (t == 1) first = MaxRelError(g, sum);
  }
  const double mean_err = MaxRelError(total / kSteps, sum);
  std::cout << "powersgd one step error " << first << ", mean of " << kSteps << " steps error "
            << mean_err << std::endl;
  if (!(first > 1e-3) || !(mean_err < first / 5)) {
    std::cout << "MISMATCH error feedback does not converge" << std::endl;
    return 1;
  }
  std::cout << "powersgd ok" << std::endl;
  return 0;
}

int SparseUndeclared(evenstep::DistContext& dist) {
  auto embed = torch::nn::Embedding(torch::nn::EmbeddingOptions(10, 4).sparse(true));
  std::vector<evenstep::NamedTensor> params = {{"embed.weight", embed->weight}};
  auto sync = evenstep::GradSync::Attach(params, {}, dist.data_group(), TinyBuckets());
  if (!sync.ok()) {
    std::cout << sync.status() << std::endl;
    return 1;
  }
  try {
    embed(torch::tensor({1, 2, 3}, torch::kLong)).sum().backward();
  } catch (const std::exception& e) {
    std::cout << "backward failed: " << e.what() << std::endl;
    return 4;
  }
  std::cout << "UNEXPECTED: backward succeeded" << std::endl;
  return 1;
}

int ForgottenSync(evenstep::DistContext& dist) {
  torch::manual_seed(1);
  Net net(kHidden, false);
  evenstep::GradSyncOptions options = TinyBuckets();
  options.timeout = dist.options().collective_timeout;
  options.diagnosis.arrive = [&dist] { return dist.MarkArrival(); };
  options.diagnosis.diagnose = [&dist](int64_t seq, const std::string& what, absl::Duration elapsed,
                                       const std::string& error) {
    return dist.Diagnose(seq, what, elapsed, error);
  };
  auto sync = evenstep::GradSync::Attach(net, dist.data_group(), options);
  if (!sync.ok()) {
    std::cout << sync.status() << std::endl;
    return 1;
  }
  if (dist.rank() == 1) {
    // Stays alive (the store answers) without joining, past rank 0's checks.
    std::this_thread::sleep_for(std::chrono::seconds(8));
    std::cout << "rank 1 left without syncing" << std::endl;
    return 0;
  }
  try {
    net.forward(torch::randn({4, kIn})).sum().backward();
    std::cout << "UNEXPECTED: the sync succeeded" << std::endl;
    return 1;
  } catch (const std::exception& e) {
    std::cout << "sync failed: " << e.what() << std::endl;
  }
  absl::Status again = (*sync)->SyncNow();
  std::cout << "next sync: " << again << std::endl;
  torch::Tensor t = torch::ones({2});
  absl::Status next = dist.AllReduce(t);
  std::cout << "next all_reduce: " << next << std::endl;
  absl::Status barrier = dist.Barrier();
  std::cout << "next barrier: " << barrier << std::endl;
  return again.ok() || next.ok() || barrier.ok() ? 1 : 4;
}

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
  std::cout << "backend " << dist.backend_name() << " device " << Device() << std::endl;
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
  if (scenario == "hookinfo") return HookInfo(dist);
  if (scenario == "powersgd") return PowerSgd(dist);
  if (scenario == "sparse_undeclared") return SparseUndeclared(dist);
  if (scenario == "forgotten_sync") return ForgottenSync(dist);
  std::cerr << "unknown scenario " << scenario << std::endl;
  return 2;
}

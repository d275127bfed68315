// The small model, batch and checks of the gradient-sync tests
// (grad_sync_test, multihost_test, cuda_test): a 4-layer tanh MLP whose
// every parameter is its own bucket under TinyBuckets(), a fixed global batch
// of kBatch samples, and the loss of a subset scaled by the global count, so
// the ranks' summed gradients equal one process's gradient of the mean loss.
#pragma once

#include <torch/torch.h>

#include <memory>
#include <string>

#include "evenstep/dist_context.h"
#include "evenstep/grad_sync.h"

namespace evenstep::testing {

constexpr int kSyncIn = 12, kSyncHidden = 16, kSyncClasses = 3, kSyncBatch = 24;

struct SyncNet : torch::nn::Module {
  SyncNet(int first_hidden, bool with_extra);
  // `use_extra` adds the `extra` layer's output (a parameter some ranks use).
  torch::Tensor forward(const torch::Tensor& x, bool use_extra = false);
  torch::nn::Linear l1{nullptr}, l2{nullptr}, l3{nullptr}, l4{nullptr}, extra{nullptr};
};

// Weights drawn from `seed`, on `device`.
std::shared_ptr<SyncNet> MakeSyncNet(int seed, torch::Device device = torch::kCPU,
                                     int first_hidden = kSyncHidden, bool with_extra = false);

struct SyncBatch {
  torch::Tensor x, y;
};
// The same kSyncBatch samples on every rank.
SyncBatch GlobalSyncBatch(torch::Device device = torch::kCPU);

// Sum of the per-sample losses of samples `idx`, divided by kSyncBatch.
torch::Tensor ScaledLoss(SyncNet& net, const SyncBatch& batch, const torch::Tensor& idx,
                         bool use_extra = false);

// The largest difference relative to `want`'s largest magnitude, computed
// in double (0 for two empty tensors); also the conformance suite's measure.
double MaxRelError(const torch::Tensor& got, const torch::Tensor& want);

// EXPECTs every parameter gradient of `net` within `tolerance` (relative to
// its largest element) of `factor` x `ref`'s, naming the parameter and `what`.
void ExpectGradsNear(SyncNet& net, SyncNet& ref, double tolerance, const std::string& what,
                     double factor = 1);

// Every parameter its own bucket; a 30 s collective timeout.
GradSyncOptions TinyBuckets();

// What one rank did in SyncExactSplit.
struct ExactSplitRun {
  int samples = 0, micro_batches = 0;
  int64_t buckets_launched_during_backward = 0, num_buckets = 0;
};

// The exactness scenario: every rank derives the same random uneven split of
// the global batch from `seed` (rank seed % world gets no sample and joins
// through SyncNow; the others' micro-batches hold 1-5 samples), attaches
// GradSync with `options` to a model whose weights differ per rank until
// Attach broadcasts rank 0's, and accumulates its micro-batches with the
// sync on the last. EXPECTs the synced gradient within 1e-5 of one process's
// gradient of the whole batch's mean loss, and at least 8 buckets.
ExactSplitRun SyncExactSplit(DistContext& dist, int seed, const GradSyncOptions& options,
                             torch::Device device = torch::kCPU);

}  // namespace evenstep::testing

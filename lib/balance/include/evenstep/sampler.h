// Sampler: the deterministic, work-aware order of a dataset's samples for
// balanced data-parallel training.
//
// For (seed, epoch) the sampler shuffles the sample indices, optionally sorts
// them by length inside windows of `sort_window` samples (so micro-batches
// hold similar lengths and little padding; off by default), cuts global batches under a fixed
// budget (samples or tokens per optimizer step) and shuffles the order of the
// global batches within each window. The sequence of global batches depends
// only on the seed and the epoch — never on the world size or the plan.
// Partition() then splits one global batch across ranks to match a plan's
// shares, and Pack() cuts one rank's part into micro-batches under the
// per-micro-batch cap (the memory limit); their number is that rank's
// accumulation count for the step.
//
//   auto sampler = evenstep::Sampler::Create(lengths, options);
//   evenstep::GlobalBatch batch = sampler->Next();
//   auto parts = sampler->Partition(batch, shares, evenstep::PartitionBy::kCost);
//   std::vector<evenstep::MicroBatch> mine = sampler->Pack(parts[rank]);
//
// Thread-safety: const methods may be called concurrently; Next() and
// Restore() need exclusive access.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "evenstep/cost_model.h"

namespace evenstep {

enum class BatchUnit { kSamples, kTokens };
// What each sample's loss is normalised by: the global batch's total number of
// samples or of tokens (per-sample counts can also be given explicitly).
enum class Normalization { kSamples, kTokens };

// Cost units of a sample from its length (tokens); the default is the length
// itself. E.g. [](int64_t l) { return l + 0.002 * l * l; } for attention.
using CostFunction = std::function<double(int64_t length)>;

struct SamplerOptions {
  uint64_t seed = 0;
  BatchUnit budget_unit = BatchUnit::kSamples;
  // Samples (or tokens) per optimizer step, over all ranks. A sample longer
  // than a token budget forms a global batch of its own.
  int64_t global_batch = 64;
  // Per-micro-batch cap: at most this many samples, and at most this many
  // padded tokens (samples x longest length). 0 = no cap. A sample longer
  // than the token cap is an error at Create (it could not be kept).
  int64_t micro_batch_samples = 0;
  int64_t micro_batch_tokens = 0;
  // Fewest micro-batches a rank with at least this many samples gets.
  int min_micro_batches = 1;
  // Samples per length-sorting window; 1 = no sorting across global batches
  // (the default: every global batch is a plain shuffle's, so sorting costs
  // no model quality; each rank still packs its share longest first); 0 =
  // 50 global batches' worth. Larger windows pad less (up to 1.4x fewer
  // padded tokens on the fortunes) at a measured quality cost: see
  // docs/benchmarks.md#sorting-window.
  int64_t sort_window = 1;
  bool shuffle = true;
  // Drop the last, smaller global batch of an epoch instead of keeping it.
  bool drop_last = false;
  Normalization normalization = Normalization::kSamples;
  // Stream mode (truncated BPTT, online rollouts): the dataset is `streams`
  // streams of T = samples / streams positions each, sample s * T + t being
  // stream s's position t. Global batch t of every epoch is position t of
  // every stream, in stream order (no shuffle; global_batch is `streams`),
  // and each stream stays on one rank, in order, for the whole epoch
  // (BalancedStep assigns contiguous blocks of streams by the shares at the
  // epoch's start): per-stream state can live on that rank. 0 = off.
  int64_t streams = 0;
};

// Lengths for samples that all cost the same (images, fixed-size records):
// `n` ones. With them, work and dynamic balancing split by sample counts.
inline std::vector<int64_t> UniformLengths(int64_t n) {
  return std::vector<int64_t>(n > 0 ? static_cast<size_t>(n) : 0, 1);
}

struct MicroBatch {
  std::vector<int64_t> samples;  // dataset indices, longest first
  int64_t tokens = 0;            // sum of lengths
  int64_t max_length = 0;
  double cost = 0;   // cost units
  double count = 0;  // normalisation count (samples or tokens)
  // Set by BalancedStep: the epoch of its global batch (for random draws
  // keyed by epoch and sample) and its place among this rank's
  // micro-batches of the step (0-based).
  int64_t epoch = 0;
  int index = 0;
  uint64_t seed = 0;  // the sampler's seed (SampleGenerator's key)
  // ... and its global batch's samples and tokens over all ranks: the
  // denominators of a loss with several terms under Objective::kSum
  // (`term_a / mb.global_samples + term_b / mb.global_tokens`).
  int64_t global_samples = 0;
  int64_t global_tokens = 0;
  // Samples x longest length: what its padded activations hold at once, the
  // unit of memory caps (BalanceConfig::oom).
  int64_t padded_tokens() const { return static_cast<int64_t>(samples.size()) * max_length; }
};

struct GlobalBatch {
  int64_t epoch = 0;
  int64_t step = 0;  // index of this global batch within the epoch
  std::vector<int64_t> samples;
  double cost = 0;   // total cost units
  double count = 0;  // total normalisation count: each sample's loss is scaled by 1/count
  int64_t tokens = 0;
};

// Where the sampler stands: the next global batch is `step` of `epoch`.
struct SamplerState {
  int64_t epoch = 0;
  int64_t step = 0;
  uint64_t seed = 0;
  int64_t num_samples = 0;  // checked on restore
  // What a global batch is (checked on restore when known: 0 in checkpoints
  // written before it was saved). A resume with another global batch would
  // change the sample order and what one optimizer step means.
  int64_t global_batch = 0;
  bool tokens = false;  // --evenstep_batch_unit=tokens
};

enum class PartitionBy {
  kCount,  // equal sample counts, strided like DistributedSampler (the usual practice)
  kCost,   // cost units in proportion to the shares, longest first
};

class Sampler {
 public:
  // `lengths[i]` is sample i's length in tokens (>= 1). `counts`, when not
  // empty, overrides each sample's normalisation count (e.g. length - 1
  // targets for a language model). InvalidArgument naming the option or the
  // sample for bad input.
  static absl::StatusOr<Sampler> Create(std::vector<int64_t> lengths, SamplerOptions options,
                                        CostFunction cost = nullptr,
                                        std::vector<double> counts = {});

  // The next global batch; moves to the next epoch after the last one.
  GlobalBatch Next();
  // Global batches of the epoch being drawn (the one the last Next() came
  // from; at an epoch's end, that finished epoch).
  int64_t steps_per_epoch() const { return static_cast<int64_t>(epoch_batches_.size()); }
  // Global batches of any epoch (with a token budget epochs may differ by a
  // batch; another epoch than the current one is computed, O(n log n)).
  int64_t steps_in_epoch(int64_t epoch) const;
  SamplerState state() const;
  // Continues exactly where `state` was taken. FailedPrecondition when the
  // state belongs to another dataset or seed.
  absl::Status Restore(const SamplerState& state);

  // Splits `batch` across shares.size() ranks. kCount: equal counts (shares
  // ignored). kCost: rank r's cost units approach shares[r] * batch.cost
  // (shares >= 0, not all zero; a zero share gets nothing).
  std::vector<std::vector<int64_t>> Partition(const GlobalBatch& batch,
                                              const std::vector<double>& shares,
                                              PartitionBy by) const;
  // Each sample, longest first, goes to the rank furthest below its
  // target time (`target_s[r]`, zero = no work), where a rank's time is
  // predicted from its fit with the micro-batches it would actually pack: a
  // sample that opens a new micro-batch also costs that rank's fixed cost.
  // This keeps the discrete micro-step costs the planner's smooth model
  // cannot see out of the imbalance.
  std::vector<std::vector<int64_t>> PartitionByTime(const GlobalBatch& batch,
                                                    const std::vector<CostFit>& fits,
                                                    const std::vector<double>& target_s) const;
  // Cuts one rank's samples into micro-batches under the caps, longest first;
  // `padded_tokens_cap` > 0 adds this rank's own cap on samples x longest
  // length (its learned memory cap: BalanceConfig::oom).
  std::vector<MicroBatch> Pack(std::vector<int64_t> samples, int64_t padded_tokens_cap = 0) const;
  // One rank's samples as one micro-batch (none for no samples), longest
  // first, whatever the caps: a loop over Session::Batches with several
  // model parts runs every part over the rank's whole share at once.
  std::vector<MicroBatch> PackWhole(std::vector<int64_t> samples) const;
  // Stream mode: the streams [first, last) rank `rank` of shares.size()
  // owns under `shares` (contiguous blocks by the cumulative shares), and
  // `batch` split that way.
  std::pair<int64_t, int64_t> StreamRange(const std::vector<double>& shares, int rank) const;
  std::vector<std::vector<int64_t>> PartitionStreams(const GlobalBatch& batch,
                                                     const std::vector<double>& shares) const;

  int64_t num_samples() const { return static_cast<int64_t>(lengths_.size()); }
  int64_t length(int64_t i) const { return lengths_[i]; }
  double cost(int64_t i) const { return costs_[i]; }
  double count(int64_t i) const { return counts_[i]; }
  const SamplerOptions& options() const { return options_; }
  // Mean cost units of a micro-batch at the cap (for the planner), or the
  // whole mean global batch when uncapped.
  double micro_batch_cost_cap() const { return micro_cost_cap_; }

 private:
  Sampler(std::vector<int64_t> lengths, std::vector<double> costs, std::vector<double> counts,
          SamplerOptions options);
  // Builds epoch_batches_ for `epoch`.
  void BuildEpoch(int64_t epoch);
  // The global batches of `epoch`, in order (a function of the seed, the
  // epoch and the options only).
  std::vector<std::vector<int64_t>> BatchesOfEpoch(int64_t epoch) const;
  // Longest first to the rank with the largest target - charged so far;
  // cost(rank, sample) is what the sample would add to that rank;
  // commit(rank, sample) records that it went there.
  template <typename Cost, typename Commit>
  std::vector<std::vector<int64_t>> Assign(const GlobalBatch& batch,
                                           const std::vector<double>& target, Cost&& cost,
                                           Commit&& commit) const;

  // Adds sample `i` to `mb` (its lengths, cost and count).
  void AddTo(MicroBatch& mb, int64_t i) const;
  // Whether a sample of `length` joins an open micro-batch of `n` samples
  // (0: none open) whose longest is `max_length`, under the caps.
  bool Joins(int64_t n, int64_t max_length, int64_t length, int64_t padded_tokens_cap = 0) const;
  // The number of micro-batches Pack cuts `longest_first` into.
  int64_t MicroSteps(const std::vector<int64_t>& longest_first) const;
  // Evens out the predicted finish times of a greedy split (see sampler.cc);
  // leaves each part ordered longest first.
  void Level(const std::vector<CostFit>& fits, const std::vector<double>& target_s,
             std::vector<std::vector<int64_t>>& parts) const;

  std::vector<int64_t> lengths_;
  std::vector<double> costs_;
  std::vector<double> counts_;
  SamplerOptions options_;
  double micro_cost_cap_ = 0;
  int64_t epoch_ = -1;
  int64_t step_ = 0;
  std::vector<std::vector<int64_t>> epoch_batches_;
};

}  // namespace evenstep

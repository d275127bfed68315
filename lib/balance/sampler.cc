// Sampler: deterministic epoch order, length-aware global batches, work
// partition and micro-batch packing. The random numbers come from a local
// splitmix64 stream and Lemire's bounded draw instead of <random>'s
// distributions, whose results are implementation-defined: the order must be
// identical on every rank and across standard libraries, so checkpoints made
// by one build resume the same sequence in another.
#include "evenstep/sampler.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <queue>
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "evenstep/internal/median.h"

namespace evenstep {
namespace {

class SplitMix64 {
 public:
  explicit SplitMix64(uint64_t seed) : state_(seed) {}
  uint64_t Next() {
    uint64_t z = (state_ += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
  }
  // Uniform in [0, n), n > 0 (Lemire's multiply-shift with rejection).
  uint64_t Below(uint64_t n) {
    unsigned __int128 m = static_cast<unsigned __int128>(Next()) * n;
    uint64_t low = static_cast<uint64_t>(m);
    if (low < n) {
      const uint64_t threshold = -n % n;
      while (low < threshold) {
        m = static_cast<unsigned __int128>(Next()) * n;
        low = static_cast<uint64_t>(m);
      }
    }
    return static_cast<uint64_t>(m >> 64);
  }

 private:
  uint64_t state_;
};

template <typename T>
void Shuffle(std::vector<T>& v, SplitMix64& rng) {
  for (size_t i = v.size(); i > 1; --i) std::swap(v[i - 1], v[rng.Below(i)]);
}

uint64_t EpochSeed(uint64_t seed, int64_t epoch) {
  SplitMix64 mix(seed ^ (0xa0761d6478bd642fULL * static_cast<uint64_t>(epoch + 1)));
  return mix.Next();
}

}  // namespace

absl::StatusOr<Sampler> Sampler::Create(std::vector<int64_t> lengths, SamplerOptions options,
                                        CostFunction cost, std::vector<double> counts) {
  if (lengths.empty()) return absl::InvalidArgumentError("Sampler: the dataset has no samples");
  if (options.global_batch <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("Sampler: global_batch=", options.global_batch, ": must be positive"));
  }
  if (options.micro_batch_samples < 0 || options.micro_batch_tokens < 0) {
    return absl::InvalidArgumentError("Sampler: micro-batch caps must be >= 0 (0 = no cap)");
  }
  if (options.min_micro_batches < 0 || options.sort_window < 0) {
    return absl::InvalidArgumentError("Sampler: min_micro_batches and sort_window must be >= 0");
  }
  if (options.streams < 0 ||
      (options.streams > 0 && static_cast<int64_t>(lengths.size()) % options.streams != 0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--evenstep_streams=", options.streams, ": the dataset's ", lengths.size(),
                     " samples must be a whole number of positions per stream (samples = streams x "
                     "positions, sample s * positions + t)"));
  }
  if (options.streams > 0) {
    // One position of every stream per step, in order.
    options.global_batch = options.streams;
    options.budget_unit = BatchUnit::kSamples;
    options.sort_window = 1;
    options.shuffle = false;
  }
  if (!counts.empty() && counts.size() != lengths.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("Sampler: ", counts.size(), " counts for ", lengths.size(), " samples"));
  }
  std::vector<double> costs(lengths.size());
  for (size_t i = 0; i < lengths.size(); ++i) {
    if (lengths[i] <= 0) {
      return absl::InvalidArgumentError(absl::StrCat("Sampler: sample ", i, " has length ",
                                                     lengths[i], "; lengths must be >= 1"));
    }
    if (options.budget_unit == BatchUnit::kTokens && lengths[i] > options.global_batch) {
      // Each step would be one sample larger than the whole batch.
      return absl::InvalidArgumentError(absl::StrCat(
          "Sampler: sample ", i, " has ", lengths[i], " tokens, more than a whole global batch (",
          "--evenstep_global_batch=", options.global_batch,
          " --evenstep_batch_unit=tokens); raise the global batch to at least the longest "
          "sample's tokens, or count it in samples"));
    }
    if (options.micro_batch_tokens > 0 && lengths[i] > options.micro_batch_tokens) {
      // A micro-batch holds at least one sample: the cap could not be kept.
      return absl::InvalidArgumentError(absl::StrCat(
          "Sampler: sample ", i, " has ", lengths[i],
          " tokens, more than the micro-batch cap "
          "--evenstep_micro_batch_tokens=",
          options.micro_batch_tokens, " allows; raise the cap or truncate the sample"));
    }
    costs[i] = cost ? cost(lengths[i]) : static_cast<double>(lengths[i]);
    if (!(costs[i] > 0) || !std::isfinite(costs[i])) {
      return absl::InvalidArgumentError(absl::StrCat(
          "Sampler: the cost function gives ", costs[i], " for sample ", i, " (length ", lengths[i],
          "); costs must be positive and finite (from flags: --evenstep_cost_quadratic)"));
    }
  }
  // A global batch larger than the whole dataset is a typo, not a plan: each
  // step would be one epoch and more.
  int64_t total = 0;
  for (int64_t l : lengths) total += options.budget_unit == BatchUnit::kTokens ? l : 1;
  if (options.global_batch > total) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--evenstep_global_batch=", options.global_batch, ": more than the whole dataset (",
        options.budget_unit == BatchUnit::kTokens ? absl::StrCat(total, " tokens in ") : "",
        lengths.size(), " samples)"));
  }
  if (counts.empty()) {
    counts.resize(lengths.size());
    for (size_t i = 0; i < lengths.size(); ++i) {
      counts[i] = options.normalization == Normalization::kTokens ? lengths[i] : 1.0;
    }
  }
  for (size_t i = 0; i < counts.size(); ++i) {
    if (!(counts[i] >= 0) || !std::isfinite(counts[i])) {
      return absl::InvalidArgumentError(
          absl::StrCat("Sampler: sample ", i, " has count ", counts[i], "; counts must be >= 0"));
    }
  }
  return Sampler(std::move(lengths), std::move(costs), std::move(counts), options);
}

Sampler::Sampler(std::vector<int64_t> lengths, std::vector<double> costs,
                 std::vector<double> counts, SamplerOptions options)
    : lengths_(std::move(lengths)),
      costs_(std::move(costs)),
      counts_(std::move(counts)),
      options_(options) {
  const double n = static_cast<double>(lengths_.size());
  const double mean_cost = std::accumulate(costs_.begin(), costs_.end(), 0.0) / n;
  const double mean_length = std::accumulate(lengths_.begin(), lengths_.end(), 0.0) / n;
  micro_cost_cap_ = std::numeric_limits<double>::infinity();
  if (options_.micro_batch_samples > 0) {
    micro_cost_cap_ = std::min(micro_cost_cap_, mean_cost * options_.micro_batch_samples);
  }
  if (options_.micro_batch_tokens > 0) {
    micro_cost_cap_ =
        std::min(micro_cost_cap_, mean_cost / mean_length * options_.micro_batch_tokens);
  }
  BuildEpoch(0);
}

void Sampler::BuildEpoch(int64_t epoch) {
  epoch_ = epoch;
  step_ = 0;
  epoch_batches_ = BatchesOfEpoch(epoch);
}

int64_t Sampler::steps_in_epoch(int64_t epoch) const {
  if (epoch == epoch_) return steps_per_epoch();
  return static_cast<int64_t>(BatchesOfEpoch(epoch).size());
}

std::vector<std::vector<int64_t>> Sampler::BatchesOfEpoch(int64_t epoch) const {
  std::vector<std::vector<int64_t>> batches;
  if (options_.streams > 0) {
    const int64_t streams = options_.streams, positions = num_samples() / streams;
    batches.resize(positions);
    for (int64_t t = 0; t < positions; ++t) {
      for (int64_t s = 0; s < streams; ++s) batches[t].push_back(s * positions + t);
    }
    return batches;
  }
  SplitMix64 rng(EpochSeed(options_.seed, epoch));
  std::vector<int64_t> order(lengths_.size());
  std::iota(order.begin(), order.end(), 0);
  if (options_.shuffle) Shuffle(order, rng);

  const int64_t n = static_cast<int64_t>(order.size());
  int64_t window = options_.sort_window;
  if (window == 0) {
    const double mean_length = std::accumulate(lengths_.begin(), lengths_.end(), 0.0) / n;
    const double per_batch = options_.budget_unit == BatchUnit::kSamples
                                 ? options_.global_batch
                                 : std::max(1.0, options_.global_batch / mean_length);
    window = static_cast<int64_t>(50 * per_batch);
  }
  window = std::max<int64_t>(window, 1);
  for (int64_t begin = 0; window > 1 && begin < n; begin += window) {
    const auto first = order.begin() + begin;
    const auto last = order.begin() + std::min(n, begin + window);
    std::stable_sort(first, last, [&](int64_t a, int64_t b) { return lengths_[a] < lengths_[b]; });
  }

  // Cut global batches in the (window-sorted) order.
  std::vector<int64_t> current;
  int64_t tokens = 0;
  for (int64_t i : order) {
    const bool full = options_.budget_unit == BatchUnit::kSamples
                          ? static_cast<int64_t>(current.size()) >= options_.global_batch
                          : !current.empty() && tokens + lengths_[i] > options_.global_batch;
    if (full) {
      batches.push_back(std::move(current));
      current.clear();
      tokens = 0;
    }
    current.push_back(i);
    tokens += lengths_[i];
  }
  const bool tail_full = options_.budget_unit == BatchUnit::kSamples
                             ? static_cast<int64_t>(current.size()) == options_.global_batch
                             : 2 * tokens >= options_.global_batch;
  if (!current.empty() && (tail_full || !options_.drop_last || batches.empty())) {
    batches.push_back(std::move(current));
  }

  // Shuffle the order of the global batches within each window's worth, so
  // lengths do not rise monotonically through a window.
  if (options_.shuffle && window > 1) {
    size_t per_window = 0;
    int64_t seen = 0;
    while (per_window < batches.size() && seen < window) {
      seen += static_cast<int64_t>(batches[per_window++].size());
    }
    per_window = std::max<size_t>(per_window, 1);
    for (size_t begin = 0; begin < batches.size(); begin += per_window) {
      const size_t end = std::min(batches.size(), begin + per_window);
      for (size_t i = end - begin; i > 1; --i) {
        std::swap(batches[begin + i - 1], batches[begin + rng.Below(i)]);
      }
    }
  }
  return batches;
}

GlobalBatch Sampler::Next() {
  if (step_ >= steps_per_epoch()) BuildEpoch(epoch_ + 1);
  GlobalBatch batch;
  batch.epoch = epoch_;
  batch.step = step_;
  batch.samples = epoch_batches_[step_++];
  for (int64_t i : batch.samples) {
    batch.cost += costs_[i];
    batch.count += counts_[i];
    batch.tokens += lengths_[i];
  }
  return batch;
}

SamplerState Sampler::state() const {
  SamplerState state;
  state.epoch = epoch_;
  state.step = step_;
  state.seed = options_.seed;
  state.num_samples = num_samples();
  state.global_batch = options_.global_batch;
  state.tokens = options_.budget_unit == BatchUnit::kTokens;
  return state;
}

absl::Status Sampler::Restore(const SamplerState& state) {
  if (state.seed != options_.seed || state.num_samples != num_samples()) {
    return absl::FailedPreconditionError(
        absl::StrCat("Sampler::Restore: the state is for seed ", state.seed, " and ",
                     state.num_samples, " samples; this sampler has seed ", options_.seed, " and ",
                     num_samples(), " samples (--evenstep_seed, or a changed dataset)"));
  }
  const bool tokens = options_.budget_unit == BatchUnit::kTokens;
  if (state.global_batch > 0 &&
      (state.global_batch != options_.global_batch || state.tokens != tokens)) {
    auto flags = [](int64_t batch, bool in_tokens) {
      return absl::StrCat("--evenstep_global_batch=", batch,
                          " --evenstep_batch_unit=", in_tokens ? "tokens" : "samples");
    };
    return absl::FailedPreconditionError(absl::StrCat(
        "Sampler::Restore: the state was saved with ", flags(state.global_batch, state.tokens),
        "; this run has ", flags(options_.global_batch, tokens),
        ": resuming would change the sample order and what one optimizer step means (the "
        "learning rate's scale); resume with the saved values, or start a new run"));
  }
  if (state.epoch < 0 || state.step < 0) {
    return absl::InvalidArgumentError(absl::StrCat("Sampler::Restore: epoch ", state.epoch,
                                                   " step ", state.step, " is negative"));
  }
  BuildEpoch(state.epoch);
  if (state.step > steps_per_epoch()) {
    return absl::FailedPreconditionError(absl::StrCat("Sampler::Restore: step ", state.step,
                                                      " is past the end of epoch ", state.epoch,
                                                      " (", steps_per_epoch(), " steps)"));
  }
  step_ = state.step;
  return absl::OkStatus();
}

std::vector<std::vector<int64_t>> Sampler::Partition(const GlobalBatch& batch,
                                                     const std::vector<double>& shares,
                                                     PartitionBy by) const {
  const size_t ranks = std::max<size_t>(shares.size(), 1);
  std::vector<std::vector<int64_t>> parts(ranks);
  if (by == PartitionBy::kCount) {
    for (size_t p = 0; p < batch.samples.size(); ++p) {
      parts[p % ranks].push_back(batch.samples[p]);
    }
    return parts;
  }
  const double total_share = std::accumulate(shares.begin(), shares.end(), 0.0);
  std::vector<double> target(ranks, 0);
  for (size_t r = 0; r < ranks; ++r) {
    const double share = total_share > 0 ? shares[r] / total_share : 1.0 / ranks;
    target[r] = std::max(share, 0.0) * batch.cost;
  }
  return Assign(
      batch, target, [&](size_t, int64_t i) { return costs_[i]; }, [](size_t, int64_t) {});
}

std::vector<std::vector<int64_t>> Sampler::PartitionByTime(
    const GlobalBatch& batch, const std::vector<CostFit>& fits,
    const std::vector<double>& target_s) const {
  // The micro-batch each rank is filling, as Pack will cut it (samples
  // arrive longest first, as Pack orders them).
  struct Open {
    int64_t n = 0;
    int64_t max_length = 0;
  };
  std::vector<double> target = target_s;
  std::vector<std::vector<int64_t>> parts;
  for (int pass = 0; pass < 2; ++pass) {
    std::vector<Open> open(target.size());
    auto fits_open = [&](size_t r, int64_t i) {
      return Joins(open[r].n, open[r].max_length, lengths_[i]);
    };
    auto cost = [&](size_t r, int64_t i) {
      return fits[r].per_unit_s * costs_[i] + (fits_open(r, i) ? 0.0 : fits[r].fixed_s);
    };
    double charged = 0;
    parts = Assign(batch, target, cost, [&](size_t r, int64_t i) {
      charged += cost(r, i);
      Open& o = open[r];
      if (fits_open(r, i)) {
        ++o.n;
        o.max_length = std::max(o.max_length, lengths_[i]);
      } else {
        o.n = 1;
        o.max_length = lengths_[i];
      }
    });
    // The targets come from a smooth model of micro-steps; when the real
    // packing costs more in total, every target grows by that ratio and the
    // split is redone once, so the extra is spread in proportion instead of
    // landing on whichever ranks take the last samples.
    const double planned = std::accumulate(target.begin(), target.end(), 0.0);
    if (!(planned > 0) || charged <= planned * 1.001) break;
    for (double& t : target) t *= charged / planned;
  }
  Level(fits, target_s, parts);
  return parts;
}

bool Sampler::Joins(int64_t n, int64_t max_length, int64_t length,
                    int64_t padded_tokens_cap) const {
  return n > 0 && (options_.micro_batch_samples == 0 || n + 1 <= options_.micro_batch_samples) &&
         (padded_tokens_cap <= 0 || (n + 1) * std::max(max_length, length) <= padded_tokens_cap) &&
         (options_.micro_batch_tokens == 0 ||
          (n + 1) * std::max(max_length, length) <= options_.micro_batch_tokens);
}

int64_t Sampler::MicroSteps(const std::vector<int64_t>& longest_first) const {
  int64_t packed = 0, n = 0, max_length = 0;
  for (int64_t i : longest_first) {
    if (Joins(n, max_length, lengths_[i])) {
      ++n;
      max_length = std::max(max_length, lengths_[i]);
    } else {
      ++packed;
      n = 1;
      max_length = lengths_[i];
    }
  }
  // Pack splits micro-batches up to min_micro_batches while one holds two
  // samples or more.
  const int64_t wanted =
      std::min<int64_t>(options_.min_micro_batches, static_cast<int64_t>(longest_first.size()));
  return std::max(packed, wanted);
}

void Sampler::Level(const std::vector<CostFit>& fits, const std::vector<double>& target_s,
                    std::vector<std::vector<int64_t>>& parts) const {
  // The greedy split leaves a few ranks above the rest: the sample that
  // opened a micro-batch late, or the last gap filled by a rank that was
  // only a little below its target. Each round moves the shortest sample of
  // the rank predicted to finish last to the receiver where it ends earliest
  // (among the earliest-finishing ranks, and among those whose last
  // micro-batch still has room), as long as both then finish before the old
  // last. Times count the micro-steps Pack will really cut. A new micro-step
  // on a receiver costs at least the typical ratio of fixed to per-unit cost
  // times its per-unit cost: a fit's fixed cost is its least certain part,
  // and trusting a low one would send work to the ranks that underestimate
  // it. Every rank runs the same rounds on the same inputs, so the split
  // stays identical.
  const size_t ranks = parts.size();
  auto longer = [&](int64_t a, int64_t b) { return lengths_[a] > lengths_[b]; };
  std::vector<double> ratios;
  for (const CostFit& f : fits) {
    if (f.per_unit_s > 0) ratios.push_back(f.fixed_s / f.per_unit_s);
  }
  const double typical_ratio = internal::UpperMedian(std::move(ratios));
  std::vector<double> units(ranks, 0), time(ranks, 0), open_cost(ranks, 0);
  std::vector<int64_t> steps(ranks, 0);
  std::vector<char> room(ranks, 0);
  std::set<std::pair<double, size_t>> by_time, with_room;  // ranks that may work
  std::vector<int64_t> grown, best_grown;
  // Enters rank r, whose part packs into `micro_steps`, into the sets.
  auto add = [&](size_t r, int64_t micro_steps) {
    steps[r] = micro_steps;
    time[r] = fits[r].Predict(static_cast<double>(steps[r]), units[r]);
    by_time.insert({time[r], r});
    room[r] = 0;
    if (!parts[r].empty()) {
      grown = parts[r];
      grown.push_back(parts[r].back());
      room[r] = MicroSteps(grown) == steps[r];
      if (room[r]) with_room.insert({time[r], r});
    }
  };
  auto remove = [&](size_t r) {
    by_time.erase({time[r], r});
    if (room[r]) with_room.erase({time[r], r});
  };
  for (size_t r = 0; r < ranks; ++r) {
    std::stable_sort(parts[r].begin(), parts[r].end(), longer);
    for (int64_t i : parts[r]) units[r] += costs_[i];
    open_cost[r] = std::max(fits[r].fixed_s, typical_ratio * fits[r].per_unit_s);
    if (r < target_s.size() && target_s[r] > 0) add(r, MicroSteps(parts[r]));
  }
  constexpr int kReceivers = 8;
  for (size_t round = 0; round < 4 * ranks + 64 && by_time.size() > 1; ++round) {
    const auto [last_time, from] = *by_time.rbegin();
    if (parts[from].size() <= 1) break;
    const int64_t moved = parts[from].back();
    parts[from].pop_back();
    const int64_t from_steps = MicroSteps(parts[from]);
    const double from_time =
        fits[from].Predict(static_cast<double>(from_steps), units[from] - costs_[moved]);
    size_t best = ranks;
    int64_t best_steps = 0;
    double best_time = last_time * (1 - 1e-9);
    for (const auto* candidates : {&with_room, &by_time}) {
      int tried = 0;
      for (auto it = candidates->begin(); it != candidates->end() && tried < kReceivers; ++it) {
        const size_t to = it->second;
        if (to == from) continue;
        ++tried;
        grown = parts[to];
        grown.insert(std::upper_bound(grown.begin(), grown.end(), moved, longer), moved);
        const int64_t grown_steps = MicroSteps(grown);
        const double to_time =
            fits[to].Predict(static_cast<double>(steps[to]), units[to] + costs_[moved]) +
            (grown_steps > steps[to] ? open_cost[to] : 0.0);
        if (std::max(from_time, to_time) < best_time) {
          best = to;
          best_steps = grown_steps;
          best_time = std::max(from_time, to_time);
          best_grown.swap(grown);
        }
      }
    }
    if (best == ranks) {
      parts[from].push_back(moved);
      break;
    }
    remove(from);
    remove(best);
    units[from] -= costs_[moved];
    units[best] += costs_[moved];
    parts[best].swap(best_grown);
    add(from, from_steps);
    add(best, best_steps);
  }
}

template <typename Cost, typename Commit>
std::vector<std::vector<int64_t>> Sampler::Assign(const GlobalBatch& batch,
                                                  const std::vector<double>& target, Cost&& cost,
                                                  Commit&& commit) const {
  const size_t ranks = std::max<size_t>(target.size(), 1);
  std::vector<std::vector<int64_t>> parts(ranks);
  std::vector<int64_t> by_cost = batch.samples;
  std::stable_sort(by_cost.begin(), by_cost.end(),
                   [&](int64_t a, int64_t b) { return costs_[a] > costs_[b]; });
  // Longest first, each sample to the rank left furthest below its target
  // after taking it (deficit - cost(rank, sample)): for samples of similar
  // size that is the rank that would finish it earliest, which fills the last
  // gaps with the ranks that are fastest for them. The heap holds
  // deficit - cost(rank, reference sample); the reference is renewed (and the
  // heap rebuilt, O(ranks)) whenever the samples have become 10 % cheaper, so
  // a key is never far from the truth for the current sample. Ties go to the
  // lower rank, so every rank computes the same split. Ranks with a zero
  // target get nothing.
  using Entry = std::pair<double, int64_t>;  // (key, -rank)
  std::vector<double> deficit(ranks, 0);
  std::vector<size_t> active;
  for (size_t r = 0; r < target.size(); ++r) {
    if (target[r] > 0) {
      deficit[r] = target[r];
      active.push_back(r);
    }
  }
  if (active.empty()) active.push_back(0);  // nothing planned: rank 0 takes all
  std::vector<Entry> heap;
  double reference_cost = 0;
  auto rebuild = [&](int64_t reference) {
    reference_cost = costs_[reference];
    heap.clear();
    for (size_t r : active) heap.push_back({deficit[r] - cost(r, reference), -int64_t(r)});
    std::make_heap(heap.begin(), heap.end());
  };
  for (int64_t i : by_cost) {
    if (heap.empty() || costs_[i] < 0.9 * reference_cost) rebuild(i);
    std::pop_heap(heap.begin(), heap.end());
    const size_t r = static_cast<size_t>(-heap.back().second);
    deficit[r] -= cost(r, i);
    commit(r, i);
    parts[r].push_back(i);
    heap.back().first = deficit[r] - cost(r, i);  // against a sample like this one
    std::push_heap(heap.begin(), heap.end());
  }
  return parts;
}

std::pair<int64_t, int64_t> Sampler::StreamRange(const std::vector<double>& shares,
                                                 int rank) const {
  double total = 0, before = 0;
  for (size_t r = 0; r < shares.size(); ++r) {
    const double share = std::max(0.0, shares[r]);
    total += share;
    if (static_cast<int>(r) < rank) before += share;
  }
  const double own = rank < static_cast<int>(shares.size()) ? std::max(0.0, shares[rank]) : 0;
  if (!(total > 0)) return {0, rank == 0 ? options_.streams : 0};
  auto at = [&](double cumulative) {
    return static_cast<int64_t>(std::llround(options_.streams * cumulative / total));
  };
  return {at(before), at(before + own)};
}

std::vector<std::vector<int64_t>> Sampler::PartitionStreams(
    const GlobalBatch& batch, const std::vector<double>& shares) const {
  std::vector<std::vector<int64_t>> parts(shares.size());
  const int64_t positions = num_samples() / options_.streams;
  for (size_t r = 0; r < shares.size(); ++r) {
    const auto [first, last] = StreamRange(shares, static_cast<int>(r));
    for (int64_t i : batch.samples) {
      const int64_t stream = i / positions;
      if (stream >= first && stream < last) parts[r].push_back(i);
    }
  }
  return parts;
}

void Sampler::AddTo(MicroBatch& mb, int64_t i) const {
  mb.samples.push_back(i);
  mb.tokens += lengths_[i];
  mb.max_length = std::max(mb.max_length, lengths_[i]);
  mb.cost += costs_[i];
  mb.count += counts_[i];
}

std::vector<MicroBatch> Sampler::PackWhole(std::vector<int64_t> samples) const {
  std::stable_sort(samples.begin(), samples.end(),
                   [&](int64_t a, int64_t b) { return lengths_[a] > lengths_[b]; });
  std::vector<MicroBatch> out;
  if (samples.empty()) return out;
  out.emplace_back();
  for (int64_t i : samples) AddTo(out.back(), i);
  return out;
}

std::vector<MicroBatch> Sampler::Pack(std::vector<int64_t> samples,
                                      int64_t padded_tokens_cap) const {
  std::stable_sort(samples.begin(), samples.end(),
                   [&](int64_t a, int64_t b) { return lengths_[a] > lengths_[b]; });
  std::vector<MicroBatch> out;
  for (int64_t i : samples) {
    if (out.empty() || !Joins(static_cast<int64_t>(out.back().samples.size()),
                              out.back().max_length, lengths_[i], padded_tokens_cap)) {
      out.emplace_back();
    }
    AddTo(out.back(), i);
  }
  // Fewer micro-batches than the minimum: split the costliest one in two
  // (dealing its samples alternately, so the halves hold similar lengths).
  while (static_cast<int>(out.size()) < options_.min_micro_batches) {
    auto largest = std::max_element(out.begin(), out.end(), [](const auto& a, const auto& b) {
      return a.samples.size() < 2 || (b.samples.size() >= 2 && a.cost < b.cost);
    });
    if (largest == out.end() || largest->samples.size() < 2) break;
    MicroBatch whole = std::move(*largest);
    MicroBatch halves[2];
    for (size_t k = 0; k < whole.samples.size(); ++k) AddTo(halves[k % 2], whole.samples[k]);
    *largest = std::move(halves[0]);
    out.insert(largest + 1, std::move(halves[1]));
  }
  return out;
}

}  // namespace evenstep

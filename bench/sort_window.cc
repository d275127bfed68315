// What the length-sorting window costs the model, and what it saves.
//
// --evenstep_sort_window sorts samples by length inside windows of global
// batches, so each global batch holds similar lengths and its micro-batches
// little padding; but a global batch of similar lengths is no longer a random
// sample of the data, which can cost quality when the label or the text
// depends on length. This study trains two tasks at equal steps for each
// window and seed and reports the held-out quality beside the padding
// efficiency (real tokens / padded tokens of the micro-batches that 4 ranks
// with equal shares would compute):
//   fortunes  the sample's byte-level transformer on Debian's fortunes
//             (held-out loss per byte; lower is better)
//   classify  a GRU classifier on synthetic token sequences whose class
//             depends on their content and, as in real data (longer reviews
//             are more often negative), its prior on their length
//             (held-out accuracy; higher is better)
// The global batches come from evenstep's Sampler (they depend only on the
// seed and the window, never on the world size), and each step's gradient is
// the exact mean over its global batch, so one process computes what any
// number of ranks would.
//
// Windows are in global batches: 1 = no sorting across batches (micro-batches
// are still packed by length within each rank's share). Prints one line per
// run, a table of means and standard deviations over the seeds, and
// SUMMARY {json}.
//
//   evenstep_bench_sort_window [--quick] [--seeds 3] [--windows 1,4,50] [--tasks fortunes,classify]
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <iostream>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "evenstep/sampler.h"
#include "samples/byte_lm.h"
#include "samples/fortunes.h"

ABSL_FLAG(bool, quick, false, "One seed, few steps, windows 1 and 50 (the smoke test).");
ABSL_FLAG(int, seeds, 3, "Seeds per window and task.");
ABSL_FLAG(std::string, windows, "1,4,50", "Sorting windows, in global batches (1 = no sorting).");
ABSL_FLAG(std::string, tasks, "fortunes,classify", "Tasks to run.");
ABSL_FLAG(int, fortunes_steps, 150, "Optimizer steps of the fortunes task.");
ABSL_FLAG(int, classify_steps, 300, "Optimizer steps of the classification task.");
ABSL_FLAG(int64_t, max_len, 128, "fortunes: bytes kept per fortune.");
ABSL_FLAG(int64_t, batch, 32, "Samples per global batch.");
ABSL_FLAG(int64_t, micro, 8, "Samples per micro-batch (the cap the padding is measured at).");
ABSL_FLAG(int, ranks, 4, "Ranks the padding efficiency is measured for (equal shares).");

namespace {

using evenstep::GlobalBatch;
using evenstep::MicroBatch;
using evenstep::PartitionBy;
using evenstep::Sampler;
using evenstep::SamplerOptions;
using evenstep::samples::ByteLM;
using evenstep::samples::Lengths;
using evenstep::samples::LoadFortunes;
using evenstep::samples::LossSum;

struct Outcome {
  double quality = 0;  // fortunes: held-out loss per byte; classify: accuracy
  double padding_efficiency = 0;
  double seconds = 0;
};

// The micro-batches `ranks` equal ranks would compute for `batch`.
std::vector<MicroBatch> MicroBatchesOf(const Sampler& sampler, const GlobalBatch& batch,
                                       int ranks) {
  std::vector<MicroBatch> out;
  for (auto& part :
       sampler.Partition(batch, std::vector<double>(ranks, 1.0 / ranks), PartitionBy::kCost)) {
    for (MicroBatch& mb : sampler.Pack(part)) out.push_back(std::move(mb));
  }
  return out;
}

// Trains `steps` steps: each global batch's micro-batches, loss summed and
// scaled by 1 / the batch's sample count, one Adam step. Returns the
// padding efficiency of those micro-batches.
template <typename LossSum>
double Train(Sampler& sampler, torch::optim::Optimizer& opt, int steps, LossSum&& loss_sum) {
  int64_t tokens = 0, padded = 0;
  for (int s = 0; s < steps; ++s) {
    const GlobalBatch batch = sampler.Next();
    for (const MicroBatch& mb : MicroBatchesOf(sampler, batch, absl::GetFlag(FLAGS_ranks))) {
      tokens += mb.tokens;
      padded += mb.max_length * static_cast<int64_t>(mb.samples.size());
      (loss_sum(mb.samples) / batch.count).backward();
    }
    opt.step();
    opt.zero_grad();
  }
  return padded > 0 ? static_cast<double>(tokens) / static_cast<double>(padded) : 1.0;
}

SamplerOptions Options(int64_t window_batches, uint64_t seed) {
  SamplerOptions o;
  o.global_batch = absl::GetFlag(FLAGS_batch);
  o.micro_batch_samples = absl::GetFlag(FLAGS_micro);
  o.sort_window = window_batches <= 1 ? 1 : window_batches * o.global_batch;
  o.seed = seed;
  return o;
}

// --- fortunes ---------------------------------------------------------------

struct Fortunes {
  std::vector<std::string> train, eval;
};

Outcome RunFortunes(const Fortunes& data, int64_t window, uint64_t seed, int steps) {
  const int64_t kMaxLen = absl::GetFlag(FLAGS_max_len);
  torch::manual_seed(seed);
  ByteLM model(64, 2, 4, kMaxLen);
  torch::optim::Adam opt(model->parameters(), torch::optim::AdamOptions(3e-3));
  auto sampler = Sampler::Create(Lengths(data.train), Options(window, seed));
  if (!sampler.ok()) throw std::runtime_error(sampler.status().ToString());
  const absl::Time begin = absl::Now();
  Outcome out;
  out.padding_efficiency = Train(*sampler, opt, steps, [&](const std::vector<int64_t>& ids) {
    return LossSum(model, data.train, ids);
  });
  out.seconds = absl::ToDoubleSeconds(absl::Now() - begin);
  torch::NoGradGuard no_grad;
  double loss = 0, bytes = 0;
  for (size_t b = 0; b < data.eval.size(); b += 32) {
    std::vector<int64_t> ids;
    for (size_t i = b; i < std::min(data.eval.size(), b + 32); ++i) {
      ids.push_back(static_cast<int64_t>(i));
      bytes += static_cast<double>(data.eval[i].size());
    }
    loss += LossSum(model, data.eval, ids).item<double>();
  }
  out.quality = loss / bytes;
  return out;
}

// --- classify ---------------------------------------------------------------

constexpr int64_t kVocab = 16;

struct Sequences {
  std::vector<std::vector<int64_t>> tokens;
  std::vector<int64_t> labels;
  std::vector<int64_t> lengths() const {
    std::vector<int64_t> l;
    for (const auto& t : tokens) l.push_back(static_cast<int64_t>(t.size()));
    return l;
  }
};

// Lengths lognormal (median 24, 4-160 tokens). The class is 1 when token 1
// occurs more often than token 2; the sequence is drawn so that longer ones
// are more often class 1 (a prior of 0.2 at the shortest to 0.8 at the
// longest), and the content then follows the drawn class.
Sequences MakeSequences(int64_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::lognormal_distribution<double> length(std::log(24.0), 0.7);
  std::uniform_int_distribution<int64_t> token(3, kVocab - 1);
  std::uniform_real_distribution<double> u(0, 1);
  Sequences s;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t len = std::clamp<int64_t>(std::lround(length(rng)), 4, 160);
    const double prior = 0.2 + 0.6 * std::log(len / 4.0) / std::log(40.0);
    const int64_t label = u(rng) < prior ? 1 : 0;
    std::vector<int64_t> t(len);
    for (int64_t& x : t) x = token(rng);
    // A few marker tokens, more of the class's own.
    const int64_t k = 1 + len / 8;
    for (int64_t j = 0; j < k; ++j) t[rng() % len] = label == 1 ? 1 : 2;
    for (int64_t j = 0; j < k / 2; ++j) t[rng() % len] = label == 1 ? 2 : 1;
    int64_t ones = 0, twos = 0;
    for (int64_t x : t) ones += x == 1, twos += x == 2;
    s.labels.push_back(ones > twos ? 1 : 0);
    s.tokens.push_back(std::move(t));
  }
  return s;
}

struct ClassifierImpl : torch::nn::Module {
  ClassifierImpl()
      : embed(register_module("embed", torch::nn::Embedding(kVocab, 16))),
        gru(register_module("gru",
                            torch::nn::GRU(torch::nn::GRUOptions(16, 32).batch_first(true)))),
        head(register_module("head", torch::nn::Linear(32, 2))) {}
  // Logits [B, 2] from each sequence's state after its last real token.
  torch::Tensor forward(const torch::Tensor& tokens, const torch::Tensor& last) {
    torch::Tensor out = std::get<0>(gru->forward(embed(tokens)));  // [B, L, 32]
    torch::Tensor at_last =
        out.gather(1, last.view({-1, 1, 1}).expand({-1, 1, out.size(2)})).squeeze(1);
    return head(at_last);
  }
  torch::nn::Embedding embed;
  torch::nn::GRU gru;
  torch::nn::Linear head;
};
TORCH_MODULE(Classifier);

std::pair<torch::Tensor, torch::Tensor> Logits(Classifier& model, const Sequences& data,
                                               const std::vector<int64_t>& ids) {
  int64_t longest = 0;
  for (int64_t i : ids) longest = std::max<int64_t>(longest, data.tokens[i].size());
  const int64_t n = static_cast<int64_t>(ids.size());
  torch::Tensor tokens = torch::zeros({n, longest}, torch::kLong);
  torch::Tensor last = torch::empty({n}, torch::kLong);
  torch::Tensor labels = torch::empty({n}, torch::kLong);
  for (int64_t k = 0; k < n; ++k) {
    const auto& t = data.tokens[ids[k]];
    std::copy(t.begin(), t.end(), tokens[k].data_ptr<int64_t>());
    last[k] = static_cast<int64_t>(t.size()) - 1;
    labels[k] = data.labels[ids[k]];
  }
  return {model->forward(tokens, last), labels};
}

Outcome RunClassify(const Sequences& train, const Sequences& eval, int64_t window, uint64_t seed,
                    int steps) {
  torch::manual_seed(seed);
  Classifier model;
  torch::optim::Adam opt(model->parameters(), torch::optim::AdamOptions(1e-2));
  auto sampler = Sampler::Create(train.lengths(), Options(window, seed));
  if (!sampler.ok()) throw std::runtime_error(sampler.status().ToString());
  const absl::Time begin = absl::Now();
  Outcome out;
  out.padding_efficiency = Train(*sampler, opt, steps, [&](const std::vector<int64_t>& ids) {
    auto [logits, labels] = Logits(model, train, ids);
    return torch::nn::functional::cross_entropy(
        logits, labels, torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kSum));
  });
  out.seconds = absl::ToDoubleSeconds(absl::Now() - begin);
  torch::NoGradGuard no_grad;
  int64_t right = 0;
  const int64_t n = static_cast<int64_t>(eval.labels.size());
  for (int64_t b = 0; b < n; b += 64) {
    std::vector<int64_t> ids;
    for (int64_t i = b; i < std::min(n, b + 64); ++i) ids.push_back(i);
    auto [logits, labels] = Logits(model, eval, ids);
    right += logits.argmax(1).eq(labels).sum().item<int64_t>();
  }
  out.quality = static_cast<double>(right) / static_cast<double>(n);
  return out;
}

struct Stats {
  double mean = 0, sd = 0;
};
Stats Of(const std::vector<double>& v) {
  Stats s;
  for (double x : v) s.mean += x / static_cast<double>(v.size());
  for (double x : v) s.sd += (x - s.mean) * (x - s.mean);
  s.sd = v.size() > 1 ? std::sqrt(s.sd / static_cast<double>(v.size() - 1)) : 0;
  return s;
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  const bool quick = absl::GetFlag(FLAGS_quick);
  const int seeds = quick ? 1 : absl::GetFlag(FLAGS_seeds);
  std::vector<int64_t> windows;
  for (absl::string_view w : absl::StrSplit(quick ? "1,50" : absl::GetFlag(FLAGS_windows), ',')) {
    int64_t v = 0;
    if (!absl::SimpleAtoi(w, &v) || v < 1) {
      std::cerr << "--windows: '" << w << "' is not a number of global batches >= 1\n";
      return 2;
    }
    windows.push_back(v);
  }
  const std::vector<std::string> tasks = absl::StrSplit(absl::GetFlag(FLAGS_tasks), ',');
  for (const std::string& t : tasks) {
    if (t != "fortunes" && t != "classify") {
      std::cerr << "--tasks: unknown task '" << t << "' (fortunes, classify)\n";
      return 2;
    }
  }
  torch::set_num_threads(1);

  Fortunes fortunes;
  Sequences train, eval;
  for (const std::string& task : tasks) {
    if (task == "fortunes") {
      auto all = LoadFortunes();
      if (!all.ok()) {
        std::cerr << all.status() << "\n";
        return 1;
      }
      for (size_t i = 0; i < all->size(); ++i) {
        std::string t = (*all)[i].substr(0, absl::GetFlag(FLAGS_max_len));
        (i % 20 == 0 ? fortunes.eval : fortunes.train).push_back(std::move(t));
      }
    } else {
      train = MakeSequences(20000, 1);
      eval = MakeSequences(2000, 2);
    }
  }

  // (task, window) -> per-seed outcomes.
  std::map<std::pair<std::string, int64_t>, std::vector<Outcome>> runs;
  for (const std::string& task : tasks) {
    const int steps = quick ? (task == "fortunes" ? 3 : 10)
                            : (task == "fortunes" ? absl::GetFlag(FLAGS_fortunes_steps)
                                                  : absl::GetFlag(FLAGS_classify_steps));
    for (int seed = 1; seed <= seeds; ++seed) {
      for (int64_t w : windows) {
        const Outcome o = task == "fortunes" ? RunFortunes(fortunes, w, seed, steps)
                                             : RunClassify(train, eval, w, seed, steps);
        std::cout << absl::StrFormat(
                         "RESULT task=%s window=%d seed=%d steps=%d quality=%.4f "
                         "padding_efficiency=%.3f seconds=%.1f",
                         task, w, seed, steps, o.quality, o.padding_efficiency, o.seconds)
                  << std::endl;
        runs[{task, w}].push_back(o);
      }
    }
  }

  std::cout << "\n| task | window (global batches) | held-out | padding efficiency | train time "
               "vs window 1 |\n|---|---|---|---|---|\n";
  std::vector<std::string> fields = {"\"bench\": \"sort_window\"",
                                     absl::StrCat("\"seeds\": ", seeds)};
  for (const std::string& task : tasks) {
    std::vector<double> base_time;
    for (const Outcome& o : runs[{task, windows.front()}]) base_time.push_back(o.seconds);
    const double base = Of(base_time).mean;
    for (int64_t w : windows) {
      std::vector<double> q, p, t;
      for (const Outcome& o : runs[{task, w}]) {
        q.push_back(o.quality);
        p.push_back(o.padding_efficiency);
        t.push_back(o.seconds);
      }
      const Stats sq = Of(q), sp = Of(p), st = Of(t);
      std::cout << absl::StrFormat("| %s | %d | %s %.4f ± %.4f | %.3f | %.2f |\n", task, w,
                                   task == "fortunes" ? "loss/byte" : "accuracy", sq.mean, sq.sd,
                                   sp.mean, st.mean / base);
      const std::string key = absl::StrCat(task, "_w", w);
      fields.push_back(absl::StrFormat(
          "\"%s\": {\"quality\": %.4f, \"quality_sd\": %.4f, \"padding_efficiency\": %.3f, "
          "\"time_ratio\": %.3f}",
          key, sq.mean, sq.sd, sp.mean, st.mean / base));
    }
  }
  std::cout << "SUMMARY {" << absl::StrJoin(fields, ", ") << "}" << std::endl;
  return 0;
}

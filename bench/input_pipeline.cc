// Input pipeline benchmark: does every rank stay fed? Ranks train a small
// MLP on a dataset whose per-sample preparation time is heavy-tailed
// (lognormal, median --prep_ms, sigma --prep_sigma: decoding and
// augmentation), and one rank's storage path is --slow_factor x slower with
// jitter (0-50 % more per sample). Preparation is a sleep: it stands for work
// done off the training cores (I/O, decode on spare cores), which this
// 2-core machine does not have to give; real CPU-bound decode competes with
// compute and would need cores of its own.
//
// Side by side in one run, each mode's steps in a block (so that a mode
// loading ahead gets no other mode's steps as free time), each with its own
// copy of the model and the same static split and micro-batches:
//   compute    the data ready (no preparation): the floor
//   inline     the load in the training loop (the usual practice)
//   torchdata  libtorch's own torch::data::make_data_loader with --workers
//              workers over the same micro-batches (a batch sampler hands it
//              evenstep's plan), the loader a C++ user would pick
//   evenstep_fn  a plain load function passed to Step on BalancedStep's data
//              workers (--evenstep_data_workers=--workers,
//              --evenstep_prefetch=--prefetch): this step's micro-batches only
//   evenstep   the default row: an evenstep::LoaderOf(dataset) and every
//              --evenstep_* loader flag at its default (data workers per the
//              machine, next step's micro-batches loaded while this one ends)
// Per mode: median step time, its ratio to compute-only, the data-wait share
// of the step (training thread waiting for data, the worst rank), and the
// balance efficiency. Runs 2 and 4 ranks (quick: 2), each under evenstep-run.
// Last line: SUMMARY {json} with the figures of the largest rank count.
//
//   evenstep_bench_input_pipeline [--quick] [--steps N] [--workers W] [--ranks 2,4]
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <iterator>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "bench/relaunch.h"
#include "evenstep/balanced_step.h"
#include "evenstep/dist_context.h"
#include "evenstep/flags.h"
#include "evenstep/status_macros.h"
#include "evenstep/torch_data.h"
#include "samples/sample_file.h"

ABSL_FLAG(bool, quick, false, "A few steps on 2 ranks (the smoke test).");
ABSL_FLAG(bool, worker, false, "(internal) run as one rank of the benchmark.");
ABSL_FLAG(std::string, ranks, "", "Rank counts to run (default 2,4; quick: 2).");
ABSL_FLAG(int, steps, 0, "Measured steps per mode (default 20, quick 3), after 2 warm-up steps.");
ABSL_FLAG(int, workers, 0,
          "Loader threads per rank (torchdata and evenstep_fn modes); 0 = as many as evenstep's "
          "default (DefaultDataWorkers), so that the peers differ only in how they load.");
ABSL_FLAG(int, prefetch, 4, "evenstep_fn: micro-batches loaded ahead.");
ABSL_FLAG(double, prep_ms, 2.0, "Median preparation time per sample.");
ABSL_FLAG(double, prep_sigma, 0.8, "Lognormal sigma of the preparation time.");
ABSL_FLAG(int, slow_rank, 1, "The rank whose storage path is slower.");
ABSL_FLAG(double, slow_factor, 2.0, "How much slower (plus 0-50 % jitter per sample).");
ABSL_FLAG(int64_t, batch, 128, "Global batch (samples per step).");
ABSL_FLAG(int64_t, micro, 16, "Samples per micro-batch.");
ABSL_FLAG(int, hidden, 1024, "MLP width (the compute per micro-batch).");
ABSL_FLAG(std::string, data_dir, ".",
          "Where each rank writes its sample file (removed at the end); 'memory' = no file.");

namespace {

constexpr int kDim = 256;
constexpr const char* kModes[] = {"compute", "inline", "torchdata", "evenstep_fn", "evenstep"};
constexpr int64_t kSamples = 8192;

using evenstep::samples::SampleFile;

// Sample i as bytes: its kDim features (float) then its label (int64).
std::string SampleBytes(const torch::Tensor& x, const torch::Tensor& y, int64_t i) {
  std::string out(kDim * sizeof(float) + sizeof(int64_t), '\0');
  std::memcpy(out.data(), x[i].contiguous().data_ptr<float>(), kDim * sizeof(float));
  const int64_t label = y[i].item<int64_t>();
  std::memcpy(out.data() + kDim * sizeof(float), &label, sizeof(label));
  return out;
}

// A map-style torch::data dataset: sample i's features are fixed, read
// from `file` when there is one (else from memory); get(i) also waits its
// preparation time (when `prepare`).
class PrepDataset : public torch::data::datasets::Dataset<PrepDataset> {
 public:
  PrepDataset(torch::Tensor x, torch::Tensor y, bool prepare, double factor, bool jitter,
              const SampleFile* file = nullptr)
      : x_(std::move(x)),
        y_(std::move(y)),
        prepare_(prepare),
        factor_(factor),
        jitter_(jitter),
        file_(file) {}
  torch::data::Example<> get(size_t index) override {
    if (prepare_) {
      std::mt19937_64 rng(index * 0x9E3779B97F4A7C15ull + 1);
      std::lognormal_distribution<double> prep(std::log(absl::GetFlag(FLAGS_prep_ms)),
                                               absl::GetFlag(FLAGS_prep_sigma));
      double ms = prep(rng) * factor_;
      if (jitter_) ms *= 1 + 0.5 * std::uniform_real_distribution<double>(0, 1)(rng);
      std::this_thread::sleep_for(std::chrono::microseconds(static_cast<int64_t>(ms * 1000)));
    }
    const auto i = static_cast<int64_t>(index);
    if (file_ == nullptr) return {x_[i], y_[i]};
    absl::StatusOr<std::string> bytes = file_->Read(i);
    if (!bytes.ok()) throw std::runtime_error(bytes.status().ToString());
    torch::Tensor x = torch::empty({kDim});
    std::memcpy(x.data_ptr<float>(), bytes->data(), kDim * sizeof(float));
    int64_t label = 0;
    std::memcpy(&label, bytes->data() + kDim * sizeof(float), sizeof(label));
    return {x, torch::tensor(label, torch::kLong)};
  }
  torch::optional<size_t> size() const override { return x_.size(0); }

 private:
  torch::Tensor x_, y_;
  bool prepare_;
  double factor_;
  bool jitter_;
  const SampleFile* file_;
};

// Hands a torch::data loader the micro-batches of the current step, in order.
class PlanSampler : public torch::data::samplers::Sampler<std::vector<size_t>> {
 public:
  explicit PlanSampler(std::shared_ptr<std::vector<std::vector<size_t>>> plan)
      : plan_(std::move(plan)) {}
  void reset(torch::optional<size_t> = {}) override { next_ = 0; }
  torch::optional<std::vector<size_t>> next(size_t) override {
    if (next_ >= plan_->size()) return {};
    return (*plan_)[next_++];
  }
  void save(torch::serialize::OutputArchive&) const override {}
  void load(torch::serialize::InputArchive&) override {}

 private:
  std::shared_ptr<std::vector<std::vector<size_t>>> plan_;
  size_t next_ = 0;
};

torch::nn::Sequential MakeModel() {
  torch::manual_seed(0);
  const int h = absl::GetFlag(FLAGS_hidden);
  return torch::nn::Sequential(torch::nn::Linear(kDim, h), torch::nn::ReLU(),
                               torch::nn::Linear(h, h), torch::nn::ReLU(),
                               torch::nn::Linear(h, 10));
}

int Workers(int local_ranks) {
  const int given = absl::GetFlag(FLAGS_workers);
  return given > 0 ? given : evenstep::DefaultDataWorkers(local_ranks);
}

double Median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

struct Mode {
  std::string name;
  torch::nn::Sequential model;
  std::unique_ptr<torch::optim::SGD> optimizer;
  std::unique_ptr<evenstep::BalancedStep> step;
  std::vector<double> step_s, data_share, efficiency;
};

// This rank's samples written to `path` and opened (null for
// --data_dir=memory).
absl::StatusOr<std::unique_ptr<SampleFile>> WriteSamples(const torch::Tensor& x,
                                                         const torch::Tensor& y,
                                                         const std::string& path) {
  if (absl::GetFlag(FLAGS_data_dir) == "memory") return nullptr;
  std::vector<std::string> samples;
  for (int64_t i = 0; i < kSamples; ++i) samples.push_back(SampleBytes(x, y, i));
  EVENSTEP_RETURN_IF_ERROR(evenstep::samples::WriteSampleFile(path, samples));
  return SampleFile::Open(path);
}

// Each mode's model, optimizer and BalancedStep (static balance, MEAN loss).
absl::StatusOr<std::vector<Mode>> MakeModes(evenstep::DistContext& ctx, int workers) {
  EVENSTEP_ASSIGN_OR_RETURN(evenstep::BalanceConfig base, evenstep::BalanceConfigFromFlags());
  base.planner.mode = evenstep::BalanceMode::kStatic;
  base.sampler.global_batch = absl::GetFlag(FLAGS_batch);
  base.sampler.micro_batch_samples = absl::GetFlag(FLAGS_micro);
  base.sampler.sort_window = 1;
  base.loss_reduction = evenstep::LossReduction::kMean;
  std::vector<Mode> modes;
  for (const char* name : kModes) {
    Mode m;
    m.name = name;
    m.model = MakeModel();
    m.optimizer =
        std::make_unique<torch::optim::SGD>(m.model->parameters(), torch::optim::SGDOptions(0.01));
    evenstep::BalanceConfig config = base;
    if (m.name == "evenstep_fn") {
      config.data_workers = workers;
      config.prefetch = absl::GetFlag(FLAGS_prefetch);
    } else if (m.name != "evenstep") {
      config.data_workers = 0;  // compute, inline: on the training thread
    }
    EVENSTEP_ASSIGN_OR_RETURN(
        m.step, evenstep::BalancedStep::Create(ctx, *m.model, *m.optimizer,
                                               evenstep::UniformLengths(kSamples), config));
    modes.push_back(std::move(m));
  }
  return modes;
}

// One step whose micro-batches libtorch's DataLoader loads on its workers
// (the piece-by-piece API; `plan` is what its sampler hands out).
template <typename Loader, typename Loss>
absl::StatusOr<evenstep::StepReport> TorchDataStep(evenstep::BalancedStep& step,
                                                   std::vector<std::vector<size_t>>* plan,
                                                   Loader& loader, Loss loss) {
  EVENSTEP_RETURN_IF_ERROR(step.BeginStep());
  plan->clear();
  for (const evenstep::MicroBatch& mb : step.micro_batches()) {
    plan->emplace_back(mb.samples.begin(), mb.samples.end());
  }
  for (auto& batch : loader) {
    step.DataReady();
    EVENSTEP_RETURN_IF_ERROR(step.Backward(loss(batch)));
  }
  return step.FinishStep();
}

// The worst rank's data share; rank 0's step time (the ranks end each step
// together, at the sync): one RESULT line per mode on rank 0.
absl::Status PrintResults(evenstep::DistContext& ctx, const std::vector<Mode>& modes) {
  for (const Mode& m : modes) {
    at::Tensor share = torch::tensor({Median(m.data_share)}, torch::kDouble);
    EVENSTEP_RETURN_IF_ERROR(ctx.AllReduce(share, evenstep::ReduceOp::kMax));
    if (ctx.rank() == 0) {
      std::cout << absl::StrFormat("RESULT mode=%s step_s=%.6f data_share=%.6f efficiency=%.6f\n",
                                   m.name, Median(m.step_s), share.item<double>(),
                                   Median(m.efficiency))
                << std::flush;
    }
  }
  return absl::OkStatus();
}

int RunWorker() {
  torch::set_num_threads(1);
  auto ctx = evenstep::DistContextFromFlags();
  if (!ctx.ok()) {
    std::cerr << ctx.status() << "\n";
    return 1;
  }
  const int rank = (*ctx)->rank();
  torch::manual_seed(1);
  const torch::Tensor x = torch::randn({kSamples, kDim});
  const torch::Tensor y = torch::randint(0, 10, {kSamples}, torch::kLong);
  const bool slow = rank == absl::GetFlag(FLAGS_slow_rank);
  const double factor = slow ? absl::GetFlag(FLAGS_slow_factor) : 1.0;
  // This rank's samples on real storage: written once, read with pread.
  const std::string path = absl::StrCat(absl::GetFlag(FLAGS_data_dir),
                                        "/evenstep_input_pipeline.rank", rank, ".samples");
  auto opened = WriteSamples(x, y, path);
  if (!opened.ok()) {
    std::cerr << "--data_dir=" << absl::GetFlag(FLAGS_data_dir) << ": " << opened.status() << "\n";
    return 1;
  }
  std::unique_ptr<SampleFile> file = *std::move(opened);
  struct Remove {
    std::string path;
    ~Remove() { std::remove(path.c_str()); }
  } remove_file{file ? path : ""};
  auto ready = PrepDataset(x, y, false, 1, false).map(torch::data::transforms::Stack<>());
  auto prepared =
      PrepDataset(x, y, true, factor, slow, file.get()).map(torch::data::transforms::Stack<>());
  auto owned = evenstep::LoaderOf(prepared);
  auto plan = std::make_shared<std::vector<std::vector<size_t>>>();
  const int workers = Workers((*ctx)->local_world_size());
  auto loader = torch::data::make_data_loader(
      PrepDataset(x, y, true, factor, slow, file.get()).map(torch::data::transforms::Stack<>()),
      PlanSampler(plan), torch::data::DataLoaderOptions().batch_size(1).workers(workers));

  auto made = MakeModes(**ctx, workers);
  if (!made.ok()) {
    std::cerr << made.status() << "\n";
    return 1;
  }
  std::vector<Mode>& modes = *made;
  auto loss = [](Mode& m) {
    return [&m](const torch::data::Example<>& b) {
      return torch::nn::functional::cross_entropy(m.model->forward(b.data), b.target);
    };
  };
  const int steps = absl::GetFlag(FLAGS_steps) > 0 ? absl::GetFlag(FLAGS_steps)
                                                   : (absl::GetFlag(FLAGS_quick) ? 3 : 20);
  constexpr int kWarmup = 2;
  // Each mode's steps in a block: a mode that loads the next step early
  // must not get the other modes' steps as free loading time.
  for (Mode& m : modes) {
    // Cold reads for every mode: the file's cached pages are dropped.
    if (file != nullptr) {
      absl::Status dropped = file->DropCache();
      if (!dropped.ok()) {
        std::cerr << dropped << "\n";
        return 1;
      }
      if (rank == 0) {
        std::cout << absl::StrFormat("RESIDENT mode=%s fraction=%.3f\n", m.name,
                                     file->ResidentFraction());
      }
    }
    for (int s = 0; s < kWarmup + steps; ++s) {
      absl::StatusOr<evenstep::StepReport> report;
      if (m.name == "compute") {
        report = m.step->Step(evenstep::BatchesOf(ready), loss(m));
      } else if (m.name == "evenstep") {
        report = m.step->Step(owned, loss(m));
      } else if (m.name != "torchdata") {
        report = m.step->Step(evenstep::BatchesOf(prepared), loss(m));
      } else {  // torchdata: the loader's workers load evenstep's micro-batches
        report = TorchDataStep(*m.step, plan.get(), *loader, loss(m));
      }
      if (!report.ok()) {
        std::cerr << m.name << ": " << report.status() << "\n";
        return 1;
      }
      if (s < kWarmup) continue;
      const double step_s = absl::ToDoubleSeconds(report->end - report->begin);
      m.step_s.push_back(step_s);
      m.data_share.push_back(absl::ToDoubleSeconds(report->data) / step_s);
      m.efficiency.push_back(report->balance_efficiency);
    }
  }
  return PrintResults(**ctx, modes).ok() ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  if (absl::GetFlag(FLAGS_worker)) return RunWorker();
  const bool quick = absl::GetFlag(FLAGS_quick);
  std::vector<int> rank_counts;
  for (absl::string_view r : absl::StrSplit(absl::GetFlag(FLAGS_ranks), ',', absl::SkipEmpty())) {
    int n = 0;
    if (absl::SimpleAtoi(r, &n) && n > 0) rank_counts.push_back(n);
  }
  if (rank_counts.empty()) rank_counts = quick ? std::vector<int>{2} : std::vector<int>{2, 4};
  // Pass every flag given on (except the rank counts) to the ranks.
  std::vector<std::string> pass;
  for (int i = 1; i < argc; ++i) {
    if (!absl::StartsWith(argv[i], "--ranks")) pass.push_back(argv[i]);
  }
  const std::string self = evenstep::bench::SelfExecutable();
  std::cout << absl::StrFormat(
      "input_pipeline: prep lognormal median %.1f ms sigma %.1f per sample, rank %d's storage "
      "%.1fx slower (+0-50%% jitter), samples from %s, %d loader workers, global batch %d, "
      "micro-batch %d\n",
      absl::GetFlag(FLAGS_prep_ms), absl::GetFlag(FLAGS_prep_sigma), absl::GetFlag(FLAGS_slow_rank),
      absl::GetFlag(FLAGS_slow_factor),
      absl::GetFlag(FLAGS_data_dir) == "memory" ? "memory" : "files (pread, cold)",
      Workers(rank_counts.front()), absl::GetFlag(FLAGS_batch), absl::GetFlag(FLAGS_micro));
  std::map<std::string, double> summary;
  for (int ranks : rank_counts) {
    std::map<std::string, std::map<std::string, double>> r;
    double resident = -1;  // the file's cached fraction after each drop, the largest
    const std::string command =
        absl::StrCat(EVENSTEP_RUN, " -n ", ranks, " -- ", self, " --worker ",
                     absl::StrJoin(pass, " "), " --evenstep_timeout=10m");
    evenstep::bench::RunLines(command, [&](const std::string& line) {
      if (const auto cached = evenstep::bench::TaggedFields(line, "RESIDENT ")) {
        const auto f = evenstep::bench::NumericFields(*cached);
        if (f.count("fraction")) resident = std::max(resident, f.at("fraction"));
        return;
      }
      const auto fields = evenstep::bench::TaggedFields(line);
      if (!fields) {
        if (line.find("[Gloo]") == std::string::npos) std::cout << "    " << line << "\n";
        return;
      }
      const std::string mode = fields->count("mode") ? fields->at("mode") : "";
      for (const auto& [k, v] : evenstep::bench::NumericFields(*fields)) r[mode][k] = v;
    });
    if (r.size() != std::size(kModes)) {
      std::cout << "  " << ranks << " ranks: failed (see the output above)\n";
      continue;
    }
    const double floor = r["compute"]["step_s"];
    if (absl::GetFlag(FLAGS_data_dir) != "memory") {
      std::cout << absl::StrFormat(
          "  samples read with pread from %s (one file per rank); page cache dropped before "
          "each mode: at most %.1f%% of a file cached after the drop%s\n",
          absl::GetFlag(FLAGS_data_dir), 100 * resident,
          resident > 0.5 ? " (this filesystem keeps files in memory: the reads are not cold)" : "");
    }
    std::cout << absl::StrFormat("\n  %d ranks    %10s %12s %12s %10s\n", ranks, "step",
                                 "vs compute", "data wait", "balance");
    for (const char* mode : kModes) {
      std::cout << absl::StrFormat("  %-13s %9.1fms %12.3f %11.1f%% %10.3f\n", mode,
                                   r[mode]["step_s"] * 1e3, r[mode]["step_s"] / floor,
                                   r[mode]["data_share"] * 100, r[mode]["efficiency"]);
    }
    const double vs_peer = r["evenstep"]["step_s"] / r["torchdata"]["step_s"];
    const double fn_vs_peer = r["evenstep_fn"]["step_s"] / r["torchdata"]["step_s"];
    std::cout << absl::StrFormat(
        "  evenstep (defaults) / torchdata step: %.3f (a plain function on the workers: %.3f); "
        "inline / evenstep: %.2f\n",
        vs_peer, fn_vs_peer, r["inline"]["step_s"] / r["evenstep"]["step_s"]);
    summary = {{"ranks", ranks},
               {"evenstep_vs_compute", r["evenstep"]["step_s"] / floor},
               {"evenstep_data_share", r["evenstep"]["data_share"]},
               {"torchdata_vs_compute", r["torchdata"]["step_s"] / floor},
               {"inline_vs_compute", r["inline"]["step_s"] / floor},
               {"evenstep_vs_torchdata", vs_peer},
               {"evenstep_balance_efficiency", r["evenstep"]["efficiency"]},
               {"evenstep_fn_vs_compute", r["evenstep_fn"]["step_s"] / floor},
               {"evenstep_fn_data_share", r["evenstep_fn"]["data_share"]},
               {"evenstep_fn_vs_torchdata", fn_vs_peer},
               {"resident_after_drop", resident}};
  }
  if (summary.empty()) return 1;
  std::vector<std::string> fields = {"\"bench\": \"input_pipeline\""};
  for (const auto& [k, v] : summary) fields.push_back(absl::StrFormat("\"%s\": %.4f", k, v));
  fields.push_back(absl::StrCat("\"quick\": ", quick ? "true" : "false"));
  std::cout << "SUMMARY {" << absl::StrJoin(fields, ", ") << "}" << std::endl;
  return 0;
}

// Out-of-memory benchmark: what a run does when a micro-batch does not fit.
//
// 2 real ranks (Gloo, evenstep-run) train the byte-level model (memory and
// compute linear in a micro-batch's padded length) on the fortune-cookie
// collection, whose lengths have a long tail (median ~100 bytes, 1 % over
// 1,000, the longest 2,434). Each rank has a memory budget in padded tokens
// (samples x longest length of a micro-batch); rank 1 has half of rank 0's,
// as a smaller GPU or one shared with another job. A micro-batch over its
// rank's budget throws the allocator's own error (c10::OutOfMemoryError) in
// its forward, as a real allocation would; its rows run side by side on the
// same global batches from the same initial model:
//   reference  no budget (what the run should compute)
//   die        --evenstep_oom=fail and the loop stops at the first error,
//              as a plain loop does: the step it dies at
//   skip       fairseq's way: the failed step is dropped on every rank and
//              training goes on: steps and samples lost, its held-out loss
//              against the reference's
//   split      evenstep (--evenstep_oom=split, the default): the micro-batch
//              is split and retried within its step, the rank learns its cap
//              and is never given a larger one: samples lost (0), the
//              recoveries and the out-of-memory errors after the first step
//              that learned the cap, the time against the reference (the
//              recomputed forward passes and the smaller micro-batches), its
//              parameters against the reference's (max relative difference)
//              and its held-out loss
//   predict    split, and caps predicted from each micro-step's peak memory
//              (--evenstep_memory_limit_mb): the peaks are scripted as a
//              device allocator would report them (this CPU has none): the
//              model's state (parameters, gradients, Adam's two moments) +
//              64 KiB per padded token, under a limit that a micro-batch of
//              the rank's budget just reaches; the recoveries left (0 when
//              the cap is predicted before the first long micro-batch)
// The held-out loss is per byte over fortunes kept out of training.
// Last line: SUMMARY {json}.
//
//   evenstep_bench_oom [--quick] [--steps N] [--budget_tokens T]
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <iostream>
#include <map>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "bench/byte_mlp.h"
#include "bench/relaunch.h"
#include "evenstep/balanced_step.h"
#include "evenstep/dist_context.h"
#include "evenstep/flags.h"
#include "samples/fortunes.h"

ABSL_FLAG(bool, quick, false, "Few steps (the smoke test).");
ABSL_FLAG(bool, verbose, false, "Print every failed step's error on every rank.");
ABSL_FLAG(int, steps, 0, "Optimizer steps per row (default 100, quick 6).");
ABSL_FLAG(int64_t, budget_tokens, 0,
          "Rank 0's memory budget in padded tokens (samples x longest length of a micro-batch); "
          "rank 1 has half. Default 8192 (rank 1 fails on micro-batches holding one of the 1.4 %% "
          "of fortunes over 1,024 bytes), quick 4096 (so that 6 steps see a recovery).");
ABSL_FLAG(std::string, rows, "reference,die,skip,split,predict", "Rows to run (reference first).");
ABSL_FLAG(int, held_out, 300, "Fortunes kept out of training for the held-out loss.");

namespace {

using evenstep::bench::ByteModel;
using evenstep::bench::Texts;

struct Row {
  std::string name;
  int steps_done = 0;
  int died_at = 0;  // die: the step whose error stopped the run (0 = none)
  int steps_lost = 0;
  int64_t samples_lost = 0;
  int recoveries = 0;                // micro-batches split and retried (every rank)
  int late_ooms = 0;                 // out-of-memory errors after the step that learned the caps
  double seconds = 0;                // the steps' wall time (rank 0)
  double held_out = 0;               // held-out loss per byte
  double param_diff = 0;             // max relative difference to the reference's parameters
  std::vector<double> curve;         // held-out loss at each half of the steps
  torch::Tensor params;              // the final parameters, flattened
  std::vector<double> step_seconds;  // per step (index s - 1; 0 for a failed one)
  std::vector<int> recovery_steps;   // steps with a recovery on some rank
};

double HeldOutLoss(ByteModel& model, const Texts& eval) {
  torch::NoGradGuard no_grad;
  double loss = 0, bytes = 0;
  for (size_t b = 0; b < eval.texts.size(); b += 16) {  // sorted by length: little padding
    std::vector<int64_t> ids;
    for (size_t i = b; i < std::min(eval.texts.size(), b + 16); ++i) {
      ids.push_back(static_cast<int64_t>(i));
      bytes += static_cast<double>(eval.lengths[i]);
    }
    loss += model->LossSum(eval, ids).item<double>();
  }
  return loss / bytes;
}

torch::Tensor Flat(ByteModel& model) {
  std::vector<torch::Tensor> all;
  for (const auto& p : model->parameters()) all.push_back(p.detach().reshape({-1}).clone());
  return torch::cat(all);
}

// One row. `budget`: this rank's budget in padded tokens (0 = none).
absl::StatusOr<Row> Run(evenstep::DistContext& ctx, const Texts& train, const Texts& eval,
                        const std::string& name, int steps, int64_t budget,
                        const torch::Tensor& reference) {
  EVENSTEP_ASSIGN_OR_RETURN(evenstep::BalanceConfig config, evenstep::BalanceConfigFromFlags());
  const bool splits = name == "split" || name == "predict" || name == "reference";
  config.oom = splits ? evenstep::BalanceConfig::OomPolicy::kSplit
                      : evenstep::BalanceConfig::OomPolicy::kFail;
  torch::manual_seed(0);
  ByteModel model;
  if (name == "predict" && budget > 0) {
    int64_t state = 0;  // bytes: parameters, gradients and Adam's two moments
    for (const auto& p : model->parameters()) state += 4 * p.numel() * p.element_size();
    constexpr int64_t kPerToken = 64 << 10;
    config.memory_limit_bytes = state + kPerToken * budget;
    config.micro_peak_bytes = [state](const evenstep::MicroBatch& mb) {
      return state + kPerToken * mb.padded_tokens();
    };
  }
  torch::optim::Adam optimizer(model->parameters(), torch::optim::AdamOptions(3e-3));
  EVENSTEP_ASSIGN_OR_RETURN(
      std::unique_ptr<evenstep::BalancedStep> step,
      evenstep::BalancedStep::Create(ctx, *model, optimizer, train.lengths, config));
  Row row;
  row.name = name;
  int ooms = 0, ooms_by_then = 0;
  const absl::Time begin = absl::Now();
  row.step_seconds.assign(steps, 0.0);
  for (int s = 1; s <= steps; ++s) {
    const absl::Time step_begin = absl::Now();
    auto report = step->Step(
        [](const evenstep::MicroBatch& mb) { return mb; },
        [&](const evenstep::MicroBatch& mb) -> torch::Tensor {
          const int64_t padded = mb.padded_tokens();
          if (budget > 0 && padded > budget) {
            ++ooms;
            C10_THROW_ERROR(OutOfMemoryError,
                            absl::StrFormat("out of memory: %d padded tokens over this rank's "
                                            "budget of %d (injected by the benchmark)",
                                            padded, budget));
          }
          return model->LossSum(train, mb.samples);
        });
    if (!report.ok()) {
      if (absl::GetFlag(FLAGS_verbose) || (name == "die" && ctx.rank() == 0)) {
        std::cout << "    " << name << ", rank " << ctx.rank() << ", step " << s << ": "
                  << report.status().message().substr(0, 300) << "\n";
      }
      if (name == "die") {
        row.died_at = s;
        break;
      }
      ++row.steps_lost;  // skip: the step is dropped on every rank
      row.samples_lost += static_cast<int64_t>(step->global_batch().samples.size());
      continue;
    }
    ++row.steps_done;
    row.step_seconds[s - 1] = absl::ToDoubleSeconds(absl::Now() - step_begin);
    int recovered = 0;
    for (int n : report->rank_oom_splits) recovered += n;
    row.recoveries += recovered;
    if (recovered > 0) {
      ooms_by_then = ooms;
      row.recovery_steps.push_back(s);
    }
    if (s % std::max(1, steps / 2) == 0) row.curve.push_back(HeldOutLoss(model, eval));
  }
  row.seconds = absl::ToDoubleSeconds(absl::Now() - begin);
  // Errors after the last step that learned a cap: a learned cap that holds
  // leaves none (summed over ranks).
  at::Tensor late = at::tensor({static_cast<double>(ooms - ooms_by_then)}, at::kDouble);
  EVENSTEP_RETURN_IF_ERROR(ctx.AllReduce(late, evenstep::ReduceOp::kSum));
  row.late_ooms = static_cast<int>(late.item<double>());
  row.held_out = HeldOutLoss(model, eval);
  row.params = Flat(model);
  if (reference.defined()) {
    row.param_diff = ((row.params - reference).abs().max() / reference.abs().max().clamp_min(1e-12))
                         .item<double>();
  }
  return row;
}

}  // namespace

int main(int argc, char** argv) {
  // The benchmark's defaults; --evenstep_* on the command line override them.
  absl::SetFlag(&FLAGS_evenstep_global_batch, 32);
  absl::SetFlag(&FLAGS_evenstep_micro_batch_samples, 4);
  absl::SetFlag(&FLAGS_evenstep_timeout, absl::Minutes(2));
  absl::ParseCommandLine(argc, argv);
  if (int rc = evenstep::bench::RelaunchUnlessLaunched(2, argc, argv); rc != 0) return rc;
  torch::set_num_threads(1);
  const bool quick = absl::GetFlag(FLAGS_quick);
  const int steps = absl::GetFlag(FLAGS_steps) > 0 ? absl::GetFlag(FLAGS_steps) : (quick ? 6 : 100);
  auto ctx = evenstep::DistContextFromFlags();
  if (!ctx.ok()) {
    std::cerr << ctx.status() << "\n";
    return 1;
  }
  const int rank = (*ctx)->rank();
  const bool print = rank == 0;
  auto fortunes = evenstep::samples::LoadFortunes();
  if (!fortunes.ok()) {
    std::cerr << fortunes.status() << "\n";
    return 1;
  }
  Texts train, eval;
  const size_t held_out = std::min<size_t>(absl::GetFlag(FLAGS_held_out), fortunes->size() / 2);
  for (size_t i = 0; i < fortunes->size(); ++i) {
    Texts& into = i < held_out ? eval : train;
    into.texts.push_back((*fortunes)[i]);
  }
  std::sort(eval.texts.begin(), eval.texts.end(),
            [](const std::string& a, const std::string& b) { return a.size() < b.size(); });
  train.lengths = evenstep::samples::Lengths(train.texts);
  eval.lengths = evenstep::samples::Lengths(eval.texts);
  const int64_t full = absl::GetFlag(FLAGS_budget_tokens) > 0 ? absl::GetFlag(FLAGS_budget_tokens)
                                                              : (quick ? 4096 : 8192);
  const int64_t budget = rank == 1 ? full / 2 : full;
  if (print) {
    std::vector<int64_t> sorted = train.lengths;
    std::sort(sorted.begin(), sorted.end());
    std::cout << absl::StrFormat(
        "oom: %d ranks, %d fortunes (median %d bytes, 99th percentile %d, longest %d), global "
        "batch %d, micro-batches of %d samples; memory budget (padded tokens): rank 0 %d, rank "
        "1 %d; %d steps per row\n",
        (*ctx)->world_size(), sorted.size(), sorted[sorted.size() / 2],
        sorted[sorted.size() * 99 / 100], sorted.back(), absl::GetFlag(FLAGS_evenstep_global_batch),
        absl::GetFlag(FLAGS_evenstep_micro_batch_samples), full, full / 2, steps);
  }
  std::vector<Row> rows;
  torch::Tensor reference;
  for (const std::string& name :
       std::vector<std::string>(absl::StrSplit(absl::GetFlag(FLAGS_rows), ','))) {
    absl::StatusOr<Row> row =
        Run(**ctx, train, eval, name, steps, name == "reference" ? 0 : budget, reference);
    if (!row.ok()) {
      std::cerr << "rank " << rank << ", row " << name << ": " << row.status() << "\n";
      return 1;
    }
    if (name == "reference") reference = row->params;  // the same on every rank
    rows.push_back(*row);
    if (print) {
      std::cout << absl::StrFormat(
          "  %-9s steps %3d/%d%s, samples lost %5d, recoveries %2d, %6.2f s, held-out %.4f/byte "
          "(curve %s)%s\n",
          name, row->steps_done, steps,
          row->died_at > 0 ? absl::StrFormat(" (died at step %d)", row->died_at) : "",
          row->samples_lost, row->recoveries, row->seconds, row->held_out,
          absl::StrJoin(row->curve, " ",
                        [](std::string* out, double v) { absl::StrAppendFormat(out, "%.3f", v); }),
          name == "reference" ? ""
                              : absl::StrFormat(", params vs reference %.2g", row->param_diff));
    }
  }
  auto row_named = [&rows](const std::string& name) -> const Row& {
    for (const Row& r : rows) {
      if (r.name == name) return r;
    }
    static const Row none;
    return none;
  };
  const Row& ref = rows[0];
  const Row& die = row_named("die");
  const Row& skip = row_named("skip");
  const Row& split = row_named("split");
  const Row& predict = row_named("predict");
  const double split_time = split.seconds / ref.seconds;
  // The recoveries' own cost: the steps that recovered against the same
  // steps of the reference, over the reference's whole run (the run's time
  // ratio also holds the smaller micro-batches' effect on every later step).
  double recovery_extra = 0;
  for (int s : split.recovery_steps) {
    recovery_extra += split.step_seconds[s - 1] - ref.step_seconds[s - 1];
  }
  double ref_steps = 0;
  for (double t : ref.step_seconds) ref_steps += t;
  const double recovery_cost = ref_steps > 0 ? recovery_extra / ref_steps : 0;
  if (print) {
    std::cout << absl::StrFormat(
        "\n| row | steps applied | died at | samples lost | held-out / reference | time / "
        "reference |\n|---|---|---|---|---|---|\n");
    for (const Row& r : rows) {
      std::cout << absl::StrFormat("| %s | %d | %s | %d | %.4f | %.3f |\n", r.name, r.steps_done,
                                   r.died_at > 0 ? absl::StrCat(r.died_at) : "-", r.samples_lost,
                                   r.held_out / ref.held_out, r.seconds / ref.seconds);
    }
    std::cout << absl::StrFormat(
        "split: %d recoveries, %d out-of-memory errors after the last step that learned a cap, "
        "parameters within %.2g (max relative) of the reference's; the steps that recovered took "
        "%.2f %% of the reference's run more than its same steps; the whole run %+.1f %% (the "
        "learned caps' smaller micro-batches pad less)\n",
        split.recoveries, split.late_ooms, split.param_diff, 100 * recovery_cost,
        100 * (split_time - 1));
    std::cout << absl::StrFormat(
        "predict: %d recoveries, %d out-of-memory errors after the last step that learned a cap, "
        "parameters within %.2g of the reference's, samples lost %d; the whole run %+.1f %%\n",
        predict.recoveries, predict.late_ooms, predict.param_diff, predict.samples_lost,
        100 * (predict.seconds / ref.seconds - 1));
    std::cout << absl::StrFormat(
        "SUMMARY {\"bench\": \"oom\", \"steps\": %d, \"die_step\": %d, \"skip_steps_lost\": "
        "%d, \"skip_samples_lost\": %d, \"skip_held_out_vs_reference\": %.4f, "
        "\"split_samples_lost\": %d, \"split_recoveries\": %d, \"split_late_ooms\": %d, "
        "\"split_param_rel_diff\": %.3g, \"split_held_out_vs_reference\": %.5f, "
        "\"split_time_vs_reference\": %.3f, \"split_recovery_cost\": %.4f, "
        "\"predict_recoveries\": %d, \"predict_late_ooms\": %d, \"predict_samples_lost\": %d, "
        "\"predict_param_rel_diff\": %.3g, \"predict_time_vs_reference\": %.3f, "
        "\"reference_held_out\": %.4f}\n",
        steps, die.died_at, skip.steps_lost, skip.samples_lost, skip.held_out / ref.held_out,
        split.samples_lost, split.recoveries, split.late_ooms, split.param_diff,
        split.held_out / ref.held_out, split_time, recovery_cost, predict.recoveries,
        predict.late_ooms, predict.samples_lost, predict.param_diff, predict.seconds / ref.seconds,
        ref.held_out);
  }
  return 0;
}

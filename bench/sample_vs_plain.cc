// The plain fortune trainer against the same trainer wrapped with evenstep,
// side by side in one run: the same data, model, optimizer and global batch
// size on the same ranks (2 by default). Each trainer runs under evenstep-run
// with its timeline on (the plain one with --trace, which records the same
// phases), then evenstep-report measures both the same way:
//   step time      mean over ranks of the mean step (rank 0's evaluation and
//                  torch::save included: everyone waits for them)
//   tokens/s       training tokens over the run's wall time (the trainers'
//                  "done:" line)
//   balance        mean/max over ranks of the busy time before the sync
//   rank skew      the latest minus the earliest arrival at the gradient sync
// and it prints the ratios (evenstep / plain). Last line: SUMMARY {json}.
//   evenstep_bench_sample_vs_plain [--steps 150] [--nproc 2] [--quick]
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "bench/relaunch.h"

ABSL_FLAG(bool, quick, false, "5 steps each (the smoke test).");
ABSL_FLAG(int, steps, 150, "Optimizer steps per trainer (full mode).");
ABSL_FLAG(int, nproc, 2, "Ranks per trainer.");
ABSL_FLAG(std::string, dir, "", "Where the two runs go (default: a temp dir, removed after).");
ABSL_FLAG(std::string, args, "", "More arguments for both trainers (e.g. \"--layers 4\").");

namespace {

using nlohmann::json;

struct Result {
  double step_ms = 0, tokens_per_s = 0, balance = 0, skew_ms = 0;
  double compute_ms = 0, sync_ms = 0;  // per step, mean over ranks
  int64_t steps = 0;
  bool ok = false;
};

// Runs one trainer, then evenstep-report on its run, and reads the figures.
Result Measure(const std::string& name, const std::string& trainer, const std::string& extra,
               const std::string& runs, int steps, int nproc) {
  Result r;
  const std::string run = runs + "/" + name;
  std::filesystem::remove_all(run);
  const std::string command =
      absl::StrCat(EVENSTEP_RUN, " -n ", nproc, " -- ", trainer, " --steps ", steps, " --runs_dir ",
                   runs, " --run ", name, " --log_every ", std::max(1, steps / 5), " ", extra, " ",
                   absl::GetFlag(FLAGS_args));
  std::cout << "  " << name << ": " << command << std::endl;
  const int rc = evenstep::bench::RunLines(command, [&](const std::string& line) {
    std::cout << "    " << line << std::endl;
    // "[0] done: N steps in Ss, T tokens/s" (evenstep-run prefixes the rank)
    const size_t at = line.find("done: ");
    if (at == std::string::npos) return;
    std::vector<std::string> words = absl::StrSplit(line.substr(at), ' ');
    if (words.size() >= 6) (void)absl::SimpleAtod(words[5], &r.tokens_per_s);
  });
  if (rc != 0) {
    std::cerr << name << ": the trainer failed (exit status " << rc << ")\n";
    return r;
  }
  if (evenstep::bench::RunLines(absl::StrCat(EVENSTEP_REPORT, " ", run),
                                [](const std::string&) {}) != 0) {
    std::cerr << name << ": evenstep-report " << run << " failed\n";
    return r;
  }
  std::ifstream in(run + "/report.json");
  json report = json::parse(in, nullptr, false);
  if (report.is_discarded()) {
    std::cerr << name << ": " << run << "/report.json is not JSON\n";
    return r;
  }
  const double ranks = std::max<size_t>(1, report["ranks"].size());
  for (const json& rank : report["ranks"]) {
    r.step_ms += rank.value("step_ms_mean", 0.0) / ranks;
    r.compute_ms += (rank.value("data_ms", 0.0) + rank.value("compute_ms", 0.0)) / ranks;
    r.sync_ms += rank.value("sync_wait_ms", 0.0) / ranks;
  }
  r.balance = report.value("balance_efficiency", 0.0);
  for (const json& step : report["steps"]) {
    std::vector<double> arrivals = step.value("arrival_ms", std::vector<double>{});
    if (arrivals.empty()) continue;
    r.skew_ms += *std::max_element(arrivals.begin(), arrivals.end()) -
                 *std::min_element(arrivals.begin(), arrivals.end());
    ++r.steps;
  }
  if (r.steps > 0) r.skew_ms /= r.steps;
  r.ok = r.tokens_per_s > 0 && r.step_ms > 0;
  return r;
}

json ToJson(const Result& r) {
  return {{"step_ms", r.step_ms},
          {"tokens_per_s", r.tokens_per_s},
          {"balance_efficiency", r.balance},
          {"rank_skew_ms", r.skew_ms},
          {"compute_ms", r.compute_ms},
          {"sync_wait_ms", r.sync_ms},
          {"steps_measured", r.steps}};
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  const bool quick = absl::GetFlag(FLAGS_quick);
  const int steps = quick ? 5 : absl::GetFlag(FLAGS_steps);
  const int nproc = absl::GetFlag(FLAGS_nproc);
  std::string runs = absl::GetFlag(FLAGS_dir);
  const bool temporary = runs.empty();
  if (temporary) {
    std::string pattern = (std::filesystem::temp_directory_path() / "es_vs_plain_XXXXXX").string();
    if (mkdtemp(pattern.data()) == nullptr) {
      perror("mkdtemp");
      return 1;
    }
    runs = pattern;
  }
  std::cout << absl::StrFormat(
                   "sample_vs_plain: the fortune trainer, plain vs evenstep, %d ranks, %d steps "
                   "each, runs in %s",
                   nproc, steps, runs)
            << std::endl;
  // The same global batch (32 samples), evaluation interval and checkpoint
  // interval (torch::save every 50 steps vs --evenstep_ckpt_every=50).
  const std::string common = absl::StrCat("--eval_every ", quick ? 5 : 100);
  const Result plain =
      Measure("plain", EVENSTEP_PLAIN_TRAINER, common + " --trace", runs, steps, nproc);
  const Result es =
      Measure("evenstep", EVENSTEP_TRAINER,
              common + " --evenstep_resume=off --evenstep_ckpt_keep=1", runs, steps, nproc);
  if (temporary) std::filesystem::remove_all(runs);
  if (!plain.ok || !es.ok) return 1;

  // compute: data + forward + backward until the sync; sync: waiting for the
  // gradients after that; rest: optimizer, rank 0's duties, waiting for them.
  std::cout << absl::StrFormat("\n  %-10s %10s %12s %9s %13s | %10s %8s %8s\n", "trainer",
                               "step ms", "tokens/s", "balance", "rank skew ms", "compute", "sync",
                               "rest");
  for (const auto& [name, r] : {std::pair{"plain", plain}, std::pair{"evenstep", es}}) {
    std::cout << absl::StrFormat("  %-10s %10.1f %12.0f %9.3f %13.2f | %10.1f %8.1f %8.1f\n", name,
                                 r.step_ms, r.tokens_per_s, r.balance, r.skew_ms, r.compute_ms,
                                 r.sync_ms, r.step_ms - r.compute_ms - r.sync_ms);
  }
  const double step_ratio = es.step_ms / plain.step_ms;
  const double tokens_ratio = es.tokens_per_s / plain.tokens_per_s;
  const double skew_ratio = plain.skew_ms > 0 ? es.skew_ms / plain.skew_ms : 0;
  std::cout << absl::StrFormat(
      "  evenstep / plain: step time %.3f, tokens/s %.3f, rank skew %.3f; balance %.3f vs %.3f\n",
      step_ratio, tokens_ratio, skew_ratio, es.balance, plain.balance);
  json summary = {{"bench", "sample_vs_plain"},
                  {"nproc", nproc},
                  {"steps", steps},
                  {"quick", quick},
                  {"step_time_ratio", step_ratio},
                  {"tokens_per_s_ratio", tokens_ratio},
                  {"rank_skew_ratio", skew_ratio},
                  {"plain", ToJson(plain)},
                  {"evenstep", ToJson(es)}};
  std::cout << "SUMMARY " << summary.dump() << std::endl;
  return 0;
}

// Runs the fortune trainer (samples/train_fortunes.cc) on real ranks through
// evenstep-run, for the sample tests (sample_test.cc on the CPU, cuda_test.cc
// on a GPU). Header-only: the two test binaries pass their own paths.
#pragma once

#include <map>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "tests/testing/subprocess.h"

namespace evenstep::testing {

// Trains 12 steps of a small model on `world` ranks as run `run` under
// `runs_dir` (checkpoints every 4 steps), with `extra` flags after the
// defaults; returns step -> rank 0's printed global loss. The exit status
// and the combined output go to `exit_code` and `output` when given.
inline std::map<int, double> TrainFortunes(const std::string& trainer, const std::string& runs_dir,
                                           int world, const std::string& run,
                                           const std::vector<std::string>& extra,
                                           int* exit_code = nullptr,
                                           std::string* output = nullptr) {
  std::vector<std::string> argv = {EVENSTEP_RUN,
                                   "-n",
                                   std::to_string(world),
                                   "--",
                                   trainer,
                                   "--runs_dir=" + runs_dir,
                                   "--run=" + run,
                                   "--steps=12",
                                   "--evenstep_ckpt_every=4",
                                   "--eval_every=100",
                                   "--dim=32",
                                   "--layers=1",
                                   "--max_len=64",
                                   "--print_losses",
                                   "--evenstep_timeout=60s"};
  argv.insert(argv.end(), extra.begin(), extra.end());
  auto results = RunAll({{argv, {}}}, HangBound(4));
  if (exit_code != nullptr) *exit_code = results[0].exit_code;
  if (output != nullptr) *output = results[0].output;
  std::map<int, double> losses;
  for (absl::string_view line : absl::StrSplit(results[0].output, '\n')) {
    std::vector<std::string> f = absl::StrSplit(line, ' ', absl::SkipEmpty());
    int step = 0;
    double loss = 0;
    if (f.size() == 4 && f[0] == "[0]" && f[1] == "loss" && absl::SimpleAtoi(f[2], &step) &&
        absl::SimpleAtod(f[3], &loss)) {
      losses[step] = loss;
    }
  }
  return losses;
}

}  // namespace evenstep::testing

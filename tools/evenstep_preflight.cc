// evenstep-preflight: find the asymmetric rank, node, link or disk before a
// run pays for it. Run it on the job's own ranks under any launcher:
//
//   evenstep-run -n 4 -- evenstep-preflight --evenstep_ckpt_dir=/ckpt
//   torchrun --nnodes 2 --nproc-per-node 8 ... evenstep-preflight ...
//   srun -N 2 --ntasks-per-node 8 evenstep-preflight ...
//
// Rank 0 prints the per-rank table (every figure with its ratio to the
// median rank) and the outliers it names, and writes --json. Exit status:
// 0 no outlier, 3 outliers named (the same on every rank: gate a job on it),
// 1 an error (a bad flag, a failed collective). See lib/observe's preflight.h
// for what is measured and docs/preflight.md for what to do about each
// kind of outlier.
#include <fstream>
#include <iostream>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "evenstep/dist_context.h"
#include "evenstep/flags.h"
#include "evenstep/preflight.h"

ABSL_FLAG(bool, quick, false, "A few seconds (same as --evenstep_preflight_quick).");
ABSL_FLAG(std::string, json, "", "Rank 0 writes the report as JSON here.");

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  auto options = evenstep::PreflightOptionsFromFlags();
  if (!options.ok()) {
    std::cerr << "evenstep-preflight: " << options.status() << "\n";
    return 1;
  }
  options->quick = options->quick || absl::GetFlag(FLAGS_quick);
  auto ctx = evenstep::DistContextFromFlags();
  if (!ctx.ok()) {
    std::cerr << "evenstep-preflight: " << ctx.status() << "\n";
    return 1;
  }
  auto report = evenstep::RunPreflight(**ctx, *options);
  if (!report.ok()) {
    std::cerr << "evenstep-preflight: " << report.status() << "\n";
    return 1;
  }
  if ((*ctx)->rank() == 0) {
    std::cout << report->Table() << std::flush;
    if (const std::string path = absl::GetFlag(FLAGS_json); !path.empty()) {
      std::ofstream out(path);
      out << report->Json() << "\n";
      if (!out) {
        std::cerr << "evenstep-preflight: cannot write --json=" << path << "\n";
        return 1;
      }
    }
  }
  for (const evenstep::PreflightFinding& f : report->findings) {
    if (f.metric != "note") return 3;
  }
  return 0;
}

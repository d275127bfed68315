// Preflight: before a run spends hours at the pace of its slowest rank, a
// bounded measurement on the job's own process group finds the asymmetric
// rank, node, link or disk.
//
// Per rank: matrix products on the training device (fp32; bf16 on a GPU),
// host memcpy (and host-to-device copies, pinned and pageable, on a GPU),
// write + fsync and cold read of the checkpoint directory, cold read of the
// data directory, and the memory this process may still use (the least of
// MemAvailable, its cgroup's room and its address-space limit; on a GPU
// also the device's free memory). Over the
// group: all-reduce latency and bus bandwidth (nccl-tests' busbw = algbw x
// 2(n-1)/n) over all ranks, within each node and across nodes, and between
// pairs of ranks in log2(n) rounds of a hypercube (rank i with i xor 2^k),
// which names a slow link or a rank whose every link is slow without
// testing all pairs; and each rank's clock offset from rank 0.
//
// Ranks of one node take turns for the host resources they share (CPU
// compute on a CPU device, memcpy, local disks), so they are compared on
// equal terms; each measure is the best of three turns (on a CPU device each
// turn on another of the rank's allowed cores), and each all-reduce
// figure the fastest of its iterations (noise makes things slower, never
// faster).
//
// The verdict: every per-rank figure as a ratio to the reference rank (the
// median rank; the better one with two ranks); a rank is named when its
// ratio is below the figure's threshold (0.7 for compute; 0.5 for copies,
// disks and memory, which vary more from run to run: a rank on the wrong
// NUMA node or a disk at half speed still shows), e.g. "rank 3 (node
// b): matmul fp32 0.52x the median". A node is named instead when all of
// its ranks are. Pair links below 0.5x the median pair are named as a link,
// or as the rank they share when all of a rank's links are slow.
//
//   auto report = evenstep::RunPreflight(ctx, options);
//   if (report.ok() && ctx.rank() == 0) std::cout << report->Table();
//
// Thread-safety: a collective; one thread per rank, every rank calls it.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "evenstep/dist_context.h"

namespace evenstep {

struct PreflightOptions {
  // A few seconds instead of up to ~30 (smaller sizes, fewer repeats).
  bool quick = false;
  // Where checkpoints will be written (a test file is written, synced, read
  // cold and removed); empty = not measured.
  std::string ckpt_dir;
  // Where the training data is read from (the same test); empty = not
  // measured.
  std::string data_dir;
  // "cpu", "cuda", "cuda:1", ...; empty = CUDA when present, else CPU.
  std::string device;
  // Planting a really slower rank (a benchmark's simulation): this rank
  // does `compute_slowdown` times the work for every matrix product it
  // counts.
  double compute_slowdown = 1;
  // Figures some ranks report instead of their measurements: the verdict,
  // the table and the JSON on known figures (the tests' way to plant an
  // outlier whatever the machine's load; rehearsing a verdict). Applied in
  // order, a later one for the same rank and figure winning.
  struct Injected {
    std::string metric;  // a per-rank figure's name: matmul_fp32_gflops, memcpy_gbps, ...
    std::vector<int> ranks;
    double value = 0;
  };
  std::vector<Injected> injected;
};

// One outlier, named.
struct PreflightFinding {
  std::string metric;  // e.g. "matmul_fp32_gflops", "pair_busbw_gbps", "clock_offset_ms"
  std::vector<int> ranks;
  std::string node;  // when a whole node is named
  double ratio = 1;  // to the reference
  std::string text;  // "rank 3 (node b): matmul fp32 0.52x the median"
};

struct PreflightReport {
  int world_size = 1;
  std::vector<std::string> nodes;  // each rank's node
  // Per-rank figures, metric -> one value per rank (NaN where not measured).
  std::map<std::string, std::vector<double>> per_rank;
  // Group figures: "allreduce_latency_us", "allreduce_busbw_gbps" (all ranks),
  // "local_busbw_gbps" (within nodes, worst node), "cross_node_busbw_gbps".
  std::map<std::string, double> group;
  // Pair links measured: (a, b) -> bus bandwidth in GB/s.
  std::map<std::pair<int, int>, double> pairs;
  std::vector<PreflightFinding> findings;
  absl::Duration elapsed;

  // The per-rank table (values and ratios to the reference), the group
  // figures and the findings, for people.
  std::string Table() const;
  // The same as one JSON object.
  std::string Json() const;
  // Relative compute speed per rank (matmul throughput, summing to 1; a rank
  // within 10 % of the median counts as the median, so noise between equal
  // devices does not start them unequal): the first shares of dynamic
  // balancing.
  std::vector<double> ComputeShares() const;
};

// Runs the measurements on every rank and gathers them (every rank gets the
// whole report). Fails only when a collective fails or the options are bad;
// a figure that cannot be measured is left out (NaN) with a note.
absl::StatusOr<PreflightReport> RunPreflight(DistContext& ctx, const PreflightOptions& options);

// The verdict on gathered figures (RunPreflight calls it; exposed for tests):
// fills report->findings.
void JudgePreflight(PreflightReport* report);

}  // namespace evenstep

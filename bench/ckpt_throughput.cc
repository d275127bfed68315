// Checkpoint throughput on your storage: evenstep's sharded asynchronous
// checkpoints next to the usual practice and the physical limits, in one run.
//
// For each state size and rank count (ranks: evenstep-run -n R):
//   (a) rank 0 torch::save of the whole state + fsync while every rank waits
//   evenstep: TrainCheckpointer::Save stall (snapshot), time until committed
//             (every shard durable, manifest renamed), and load (balanced read
//             + broadcast, page cache dropped with fadvise first)
//   PyTorch DCP (bench/dcp_peer.py, when a Python with torch >= 2.3 is there):
//             dcp.save, and dcp.async_save's stall and time until done, on
//             the same state and ranks over Gloo
// and once per size, in this process:
//   (b) raw sequential write of the same bytes to the same directory + fsync,
//       and the raw read back (page cache dropped)
//   (c) memcpy of the same bytes
//
//   evenstep_bench_ckpt_throughput [--quick] [--dir D] [--sizes_mb 256,1024,4096] [--ranks 1,2,4]
//                                  [--torch_python .torch2/venv/bin/python | none] [--device cuda]
//
// --device=cuda (scripts/gpu_check.sh) keeps the state on the GPU: (a) is
// then torch::save after the device-to-host copy a user writes (.cpu()),
// evenstep snapshots through pinned staging on a side stream, and DCP saves
// the same GPU state (its async_save stages it to the CPU). Several ranks
// share the one GPU over Gloo.
//
// Last line: SUMMARY {json} with stall_vs_torch_save (evenstep stall / torch::save
// stall, target <= 0.05), persist_vs_raw_disk (target >= 0.9) and
// load_vs_raw_read (target >= 0.8), for the largest configuration, and
// stall_vs_dcp_async, commit_vs_dcp_async, commit_vs_dcp_save (evenstep / DCP,
// the largest configuration DCP ran; null without the peer).
#include <fcntl.h>
#include <torch/torch.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <map>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "bench/bench_device.h"
#include "bench/relaunch.h"
#include "evenstep/dist_context.h"
#include "evenstep/flags.h"
#include "evenstep/train_checkpointer.h"

ABSL_FLAG(bool, quick, false, "32 MiB state, 1 and 2 ranks (the smoke test).");
ABSL_FLAG(std::string, dir, "", "Directory on the storage to measure (default: a temp dir).");
ABSL_FLAG(std::string, sizes_mb, "", "State sizes in MiB (default 256,1024,4096; quick 32).");
ABSL_FLAG(std::string, ranks, "", "Rank counts (default 1,2,4; quick 1,2).");
ABSL_FLAG(std::string, worker, "", "Internal: run as a rank for this size (MiB) in this dir.");
ABSL_FLAG(std::string, device, "cpu", "Where the state lives: cpu or cuda (GPU-resident state).");
ABSL_FLAG(std::string, torch_python, "",
          "Python with torch >= 2.3 for the PyTorch DCP peer (bench/dcp_peer.py); default: "
          ".torch2/venv/bin/python of scripts/build_torch2.sh when present; \"none\": skip.");

namespace {

constexpr int kTensors = 32;

double Seconds(absl::Time since) { return absl::ToDoubleSeconds(absl::Now() - since); }

void DropCache(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY);
  if (fd < 0) return;
  ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
  ::close(fd);
}

void DropCacheTree(const std::string& dir) {
  std::error_code error;
  for (const auto& e : std::filesystem::recursive_directory_iterator(dir, error)) {
    if (e.is_regular_file()) DropCache(e.path().string());
  }
}

void Fsync(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY);
  if (fd >= 0) {
    ::fsync(fd);
    ::close(fd);
  }
}

// A module holding `bytes` of float32 parameters in kTensors tensors.
struct Blob : torch::nn::Module {
  Blob(int64_t bytes, const torch::Device& device) {
    const int64_t per = std::max<int64_t>(1, bytes / 4 / kTensors);
    for (int i = 0; i < kTensors; ++i) {
      register_parameter(absl::StrCat("p", i), torch::rand({per}).to(device));
    }
  }
};

// One rank's measurements; printed as "RESULT key=value ...".
int Worker(const std::string& spec) {
  std::vector<std::string> parts = absl::StrSplit(spec, ':');  // size_mb:dir
  int64_t size_mb = 0;
  if (parts.size() != 2 || !absl::SimpleAtoi(parts[0], &size_mb)) return 2;
  const std::string dir = parts[1];
  torch::set_num_threads(1);
  auto ctx = evenstep::DistContextFromFlags();
  if (!ctx.ok()) {
    std::cerr << ctx.status() << "\n";
    return 1;
  }
  evenstep::DistContext& dist = **ctx;
  torch::manual_seed(0);
  Blob model(size_mb << 20, torch::Device(absl::GetFlag(FLAGS_device)));
  // (a) rank-0 torch::save + fsync while everyone waits.
  dist.Barrier().IgnoreError();
  absl::Time t = absl::Now();
  if (dist.rank() == 0) {
    const std::string path = dir + "/torch_save.pt";
    std::vector<torch::Tensor> tensors;
    for (const torch::Tensor& p : model.parameters()) tensors.push_back(p.cpu());
    torch::save(tensors, path);
    Fsync(path);
  }
  dist.Barrier().IgnoreError();
  const double torch_save_s = Seconds(t);
  std::filesystem::remove(dir + "/torch_save.pt");
  // evenstep.
  evenstep::CheckpointOptions options;
  options.dir = dir + "/evenstep";
  options.keep = 1;
  auto ckpt = evenstep::TrainCheckpointer::Create(dist, options);
  if (!ckpt.ok()) {
    std::cerr << ckpt.status() << "\n";
    return 1;
  }
  // A first save lays out the shard and its staging buffer (once per state
  // layout); the measured save reuses them, as every later save in training.
  auto warm = (*ckpt)->Save(0, {&model, nullptr, nullptr, "{}"});
  if (!warm.ok() || !warm->done.get().ok()) {
    std::cerr << "warm-up save failed\n";
    return 1;
  }
  dist.Barrier().IgnoreError();
  t = absl::Now();
  auto ticket = (*ckpt)->Save(1, {&model, nullptr, nullptr, "{}"});
  if (!ticket.ok()) {
    std::cerr << ticket.status() << "\n";
    return 1;
  }
  const double stall_s = Seconds(t);
  if (absl::Status s = ticket->done.get(); !s.ok()) {
    std::cerr << s << "\n";
    return 1;
  }
  dist.Barrier().IgnoreError();
  const double commit_s = Seconds(t);
  // Load: page cache dropped, balanced read + broadcast.
  DropCacheTree(options.dir);
  dist.Barrier().IgnoreError();
  t = absl::Now();
  auto loaded = (*ckpt)->Load({&model, nullptr, nullptr, "{}"});
  if (!loaded.ok()) {
    std::cerr << loaded.status() << "\n";
    return 1;
  }
  dist.Barrier().IgnoreError();
  const double load_s = Seconds(t);
  // Slowest rank's figures.
  at::Tensor v = at::tensor({torch_save_s, stall_s, commit_s, load_s}, at::kDouble);
  dist.AllReduce(v, evenstep::ReduceOp::kMax).IgnoreError();
  if (dist.rank() == 0) {
    std::cout << absl::StrFormat(
        "RESULT torch_save_s=%.6f stall_s=%.6f commit_s=%.6f load_s=%.6f\n", v[0].item<double>(),
        v[1].item<double>(), v[2].item<double>(), v[3].item<double>());
  }
  return 0;
}

struct Raw {
  double write_gbs = 0, read_gbs = 0, memcpy_gbs = 0;
};

Raw MeasureRaw(const std::string& dir, int64_t bytes) {
  Raw raw;
  std::vector<char> buf(64 << 20, 1);
  const std::string path = dir + "/raw.bin";
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  absl::Time t = absl::Now();
  for (int64_t off = 0; off < bytes; off += buf.size()) {
    const size_t n = static_cast<size_t>(std::min<int64_t>(buf.size(), bytes - off));
    if (::pwrite(fd, buf.data(), n, off) != static_cast<ssize_t>(n)) break;
  }
  ::fsync(fd);
  ::close(fd);
  raw.write_gbs = bytes / Seconds(t) / 1e9;
  DropCache(path);
  const int rfd = ::open(path.c_str(), O_RDONLY);
  t = absl::Now();
  for (int64_t off = 0; off < bytes; off += buf.size()) {
    if (::pread(rfd, buf.data(), buf.size(), off) <= 0) break;
  }
  raw.read_gbs = bytes / Seconds(t) / 1e9;
  ::close(rfd);
  std::filesystem::remove(path);
  std::vector<char> src(static_cast<size_t>(bytes), 2), dst(static_cast<size_t>(bytes));
  std::memcpy(dst.data(), src.data(), dst.size());  // fault the pages in first
  t = absl::Now();
  std::memcpy(dst.data(), src.data(), dst.size());
  raw.memcpy_gbs = bytes / Seconds(t) / 1e9;
  return raw;
}

// Adds the key=value pairs of a "RESULT k=v ..." line to *out; echoes other lines.
void ParseResult(const std::string& line, std::map<std::string, double>* out) {
  const auto fields = evenstep::bench::TaggedFields(line);
  if (!fields) {
    std::cerr << "    " << line << "\n";
    return;
  }
  for (const auto& [k, v] : evenstep::bench::NumericFields(*fields)) (*out)[k] = v;
}

std::map<std::string, double> RunRanks(const std::string& self, int ranks, int64_t size_mb,
                                       const std::string& dir) {
  const std::string command =
      absl::StrCat(EVENSTEP_RUN, " -n ", ranks, " -- ", self, " --worker=", size_mb, ":", dir,
                   " --evenstep_timeout=30m --device=", absl::GetFlag(FLAGS_device),
                   // Several ranks share one GPU: NCCL refuses that, Gloo does not.
                   absl::GetFlag(FLAGS_device) == "cpu" ? "" : " --evenstep_backend=gloo");
  std::map<std::string, double> out;
  evenstep::bench::RunLines(command, [&](const std::string& s) { ParseResult(s, &out); });
  return out;
}

// The DCP peer's figures for the same state and ranks; empty when it did not run.
std::map<std::string, double> RunDcpPeer(const std::string& python, int ranks, int64_t size_mb,
                                         const std::string& dir) {
  std::map<std::string, double> out;
  const int rc = evenstep::bench::RunLines(
      absl::StrCat(python, " ", EVENSTEP_DCP_PEER, " --size_mb ", size_mb, " --ranks ", ranks,
                   " --dir ", dir, " --device ", absl::GetFlag(FLAGS_device)),
      [&](const std::string& s) { ParseResult(s, &out); });
  if (rc != 0) out.clear();
  return out;
}

// The Python for the DCP peer, or "" (with the reason printed) when none.
std::string TorchPython() {
  std::string python = absl::GetFlag(FLAGS_torch_python);
  if (python == "none") return "";
  if (python.empty()) {
    python = EVENSTEP_TORCH2_PYTHON;
    if (!std::filesystem::exists(python)) {
      std::cout << "  PyTorch DCP peer: not run (no " << python
                << "; scripts/build_torch2.sh makes it, or pass --torch_python)\n";
      return "";
    }
  }
  return python;
}

// A figure (ratio or seconds) for the SUMMARY line; null when not measured (< 0).
std::string JsonNumber(double r) { return r < 0 ? "null" : absl::StrFormat("%.4f", r); }

std::vector<int64_t> ParseList(const std::string& text) {
  std::vector<int64_t> out;
  for (absl::string_view v : absl::StrSplit(text, ',', absl::SkipEmpty())) {
    int64_t x = 0;
    if (absl::SimpleAtoi(v, &x) && x > 0) out.push_back(x);
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  if (!absl::GetFlag(FLAGS_worker).empty()) return Worker(absl::GetFlag(FLAGS_worker));
  const std::string device = absl::GetFlag(FLAGS_device);
  if (!evenstep::bench::BenchDevice(device, 0)) return 2;
  const bool quick = absl::GetFlag(FLAGS_quick);
  std::vector<int64_t> sizes = ParseList(absl::GetFlag(FLAGS_sizes_mb));
  if (sizes.empty())
    sizes = quick ? std::vector<int64_t>{32} : std::vector<int64_t>{256, 1024, 4096};
  std::vector<int64_t> rank_counts = ParseList(absl::GetFlag(FLAGS_ranks));
  if (rank_counts.empty()) {
    rank_counts = quick ? std::vector<int64_t>{1, 2} : std::vector<int64_t>{1, 2, 4};
  }
  std::string root = absl::GetFlag(FLAGS_dir);
  bool temp = false;
  if (root.empty()) {
    char tmpl[] = "/tmp/evenstep_ckpt_bench_XXXXXX";
    root = mkdtemp(tmpl);
    temp = true;
  }
  const std::string self = evenstep::bench::SelfExecutable();
  std::cout << absl::StrFormat("ckpt_throughput in %s: sizes %s MiB, ranks %s\n", root,
                               absl::StrJoin(sizes, ","), absl::StrJoin(rank_counts, ","));
  std::cout << absl::StrFormat("  %8s %5s | %10s %10s %7s | %10s %9s %9s | %9s %9s %9s\n", "MiB",
                               "ranks", "torch::save", "es stall", "ratio", "commit s", "GB/s",
                               "vs raw", "load GB/s", "vs raw", "memcpy");
  const std::string torch_python = TorchPython();
  // Memory for the peer: every rank holds the state and DCP's staging copy.
  const double memory = static_cast<double>(sysconf(_SC_PHYS_PAGES)) * sysconf(_SC_PAGE_SIZE);
  double stall_ratio = 0, persist_ratio = 0, load_ratio = 0;
  double stall_vs_dcp = -1, commit_vs_dcp_async = -1, commit_vs_dcp_save = -1;
  // Seconds of the largest configuration (the SUMMARY's absolute figures).
  double stall_s = -1, torch_save_s = -1, dcp_async_stall_s = -1;
  for (int64_t size_mb : sizes) {
    const int64_t bytes = size_mb << 20;
    std::cout << "  measuring raw write/read and memcpy of " << size_mb << " MiB ..." << std::endl;
    const Raw raw = MeasureRaw(root, bytes);
    for (int64_t ranks : rank_counts) {
      // Memory: every rank holds the state plus its share as staging.
      const std::string dir = absl::StrCat(root, "/r", ranks, "_", size_mb);
      std::filesystem::create_directories(dir);
      std::cout << "  running " << ranks << " rank(s), " << size_mb << " MiB ..." << std::endl;
      auto r = RunRanks(self, static_cast<int>(ranks), size_mb, dir);
      std::filesystem::remove_all(dir);
      if (!r.count("commit_s")) {
        std::cout << "  (failed; see the output above)\n";
        continue;
      }
      const double persist_gbs = bytes / r["commit_s"] / 1e9;
      const double load_gbs = bytes / r["load_s"] / 1e9;
      stall_ratio = r["stall_s"] / r["torch_save_s"];
      stall_s = r["stall_s"];
      torch_save_s = r["torch_save_s"];
      persist_ratio = persist_gbs / raw.write_gbs;
      load_ratio = load_gbs / raw.read_gbs;
      std::cout << absl::StrFormat(
          "  %8d %5d | %9.3fs %9.4fs %7.4f | %9.3fs %9.2f %9.2f | %9.2f %9.2f %9.2f\n", size_mb,
          ranks, r["torch_save_s"], r["stall_s"], stall_ratio, r["commit_s"], persist_gbs,
          persist_ratio, load_gbs, load_ratio, raw.memcpy_gbs);
      if (torch_python.empty()) continue;
      if (2.2 * ranks * bytes > 0.7 * memory) {
        std::cout << "    PyTorch DCP peer: skipped (" << ranks << " x 2 x " << size_mb
                  << " MiB does not fit in 70 % of this machine's memory)\n";
        continue;
      }
      auto d = RunDcpPeer(torch_python, static_cast<int>(ranks), size_mb, dir + "_dcp");
      if (!d.count("dcp_async_commit_s")) {
        std::cout << "    PyTorch DCP peer: failed (see the output above)\n";
        continue;
      }
      stall_vs_dcp = r["stall_s"] / d["dcp_async_stall_s"];
      dcp_async_stall_s = d["dcp_async_stall_s"];
      commit_vs_dcp_async = r["commit_s"] / d["dcp_async_commit_s"];
      commit_vs_dcp_save = r["commit_s"] / d["dcp_save_s"];
      std::cout << absl::StrFormat(
          "    PyTorch DCP: save %.3fs, async_save stall %.4fs, commit %.3fs | evenstep/DCP: "
          "stall %.3f, commit %.3f (vs save %.3f)\n",
          d["dcp_save_s"], d["dcp_async_stall_s"], d["dcp_async_commit_s"], stall_vs_dcp,
          commit_vs_dcp_async, commit_vs_dcp_save);
    }
    std::cout << absl::StrFormat("  raw disk: write+fsync %.2f GB/s, read %.2f GB/s\n",
                                 raw.write_gbs, raw.read_gbs);
  }
  if (temp) std::filesystem::remove_all(root);
  std::cout << absl::StrFormat(
      "SUMMARY {\"bench\": \"ckpt_throughput\", \"stall_vs_torch_save\": %.4f, "
      "\"persist_vs_raw_disk\": %.4f, \"load_vs_raw_read\": %.4f, \"size_mb\": %d, \"ranks\": %d, "
      "\"stall_vs_dcp_async\": %s, \"commit_vs_dcp_async\": %s, \"commit_vs_dcp_save\": %s, "
      "\"stall_s\": %s, \"torch_save_s\": %s, \"dcp_async_stall_s\": %s, \"device\": \"%s\", "
      "\"quick\": %s}\n",
      stall_ratio, persist_ratio, load_ratio, sizes.back(), rank_counts.back(),
      JsonNumber(stall_vs_dcp), JsonNumber(commit_vs_dcp_async), JsonNumber(commit_vs_dcp_save),
      JsonNumber(stall_s), JsonNumber(torch_save_s), JsonNumber(dcp_async_stall_s), device,
      quick ? "true" : "false");
  return 0;
}

// Gradient sync across simulated nodes with a slow link between them: the
// flat all-reduce, the hierarchical one (--evenstep_sync_topology) and
// PyTorch DDP (Gloo) on the same ranks, model, batch and bucket cap, in one
// run. The hosts are network namespaces (tests/testing/netns.h), each with
// its own name and Debian's /etc/hosts, joined through a switch; each host's
// link is shaped with tbf to --link_mbit, while ranks on one host talk
// through its own stack (the fast path inside a node). Needs root; prints
// why and a SUMMARY with "valid": false where namespaces cannot be made.
//
//   evenstep_bench_sync_topology [--quick] [--layouts 2x2,2x4] [--link_mbit 200]
//                                [--width W --layers L --steps N] [--torch_python P]
//
// Per layout (hosts x ranks per host), steps interleaved mode by mode (2
// warm-up rounds), median step time, max over ranks: (a) compute only, (b)
// flat GradSync, (c) hierarchical GradSync; then DDP's compute and DDP step
// from bench/ddp_grad_sync_peer.py run as ranks on the same hosts
// (GLOO_SOCKET_IFNAME set for it: its Gloo would bind loopback otherwise).
// The exposed sync overhead of a mode is its step time minus compute's.
// Cross-node bytes per step: what the busiest host's link interface sent,
// per step, read from /proc/net/dev around each step. The physical bound of
// any all-reduce between two nodes: the bucket bytes S cross the link in
// each direction; a flat ring of n ranks sends 2(n-1)/n S.
//
// SUMMARY {json}, per layout: hierarchical_vs_flat and hierarchical_vs_ddp
// (exposed overhead ratios), cross_node_bytes_per_step over S for flat and
// hierarchical, and hierarchical's exposed time over the link bound S/rate.
#include "evenstep/sync_topology.h"

#include <torch/torch.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/reflection.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "bench/relaunch.h"
#include "evenstep/dist_context.h"
#include "evenstep/flags.h"
#include "evenstep/grad_sync.h"
#include "evenstep/internal/store_server.h"
#include "evenstep/status_macros.h"
#include "nlohmann/json.hpp"
#include "tests/testing/netns.h"
#include "tests/testing/subprocess.h"

ABSL_FLAG(bool, quick, false, "One small layout, few steps (seconds; the smoke test uses it).");
ABSL_FLAG(std::string, layouts, "",
          "Hosts x ranks per host, comma-separated (default 2x2,2x4; "
          "quick 2x2).");
ABSL_FLAG(double, link_mbit, 200, "Rate of each host's link to the switch, Mbit/s (tbf).");
ABSL_FLAG(int, width, 0, "Width of the MLP (default 1024; quick 384).");
ABSL_FLAG(int, layers, 4, "Linear layers of the MLP.");
ABSL_FLAG(int, steps, 0, "Measured steps per mode (default 8; quick 3).");
ABSL_FLAG(int, batch, 32, "Samples per step and rank.");
ABSL_FLAG(std::string, torch_python, "/usr/bin/python3",
          "The Python with torch that runs the DDP peer (bench/ddp_grad_sync_peer.py).");

namespace {

int Steps() {
  const int s = absl::GetFlag(FLAGS_steps);
  return s > 0 ? s : (absl::GetFlag(FLAGS_quick) ? 3 : 8);
}
int Width() {
  const int w = absl::GetFlag(FLAGS_width);
  return w > 0 ? w : (absl::GetFlag(FLAGS_quick) ? 384 : 1024);
}

double Median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Bytes `device` has sent (its /proc/net/dev line, in this process's network
// namespace); 0 when it is not there.
double TxBytes(const std::string& device) {
  std::ifstream in("/proc/net/dev");
  std::string line;
  while (std::getline(in, line)) {
    const size_t colon = line.find(':');
    if (colon == std::string::npos) continue;
    std::string name = line.substr(0, colon);
    name.erase(0, name.find_first_not_of(' '));
    if (name != device) continue;
    std::vector<std::string> fields =
        absl::StrSplit(line.substr(colon + 1), ' ', absl::SkipEmpty());
    double tx = 0;
    if (fields.size() > 8 && absl::SimpleAtod(fields[8], &tx)) return tx;
  }
  return 0;
}

// The MLP of bench/ddp_grad_sync_peer.py's "mlp" shape.
torch::nn::Sequential Mlp(int width, int layers) {
  torch::manual_seed(0);
  torch::nn::Sequential body;
  for (int i = 0; i < layers; ++i) {
    body->push_back(torch::nn::Linear(width, width));
    body->push_back(torch::nn::ReLU());
  }
  return body;
}

enum Mode { kCompute, kFlat, kHierarchical, kModes };

// One rank: the three modes interleaved step by step; rank 0 prints a
// RESULT line with the medians (max over ranks) and the busiest host's
// cross-node bytes per step.
absl::Status Worker() {
  EVENSTEP_ASSIGN_OR_RETURN(std::unique_ptr<evenstep::DistContext> ctx,
                            evenstep::DistContextFromFlags());
  evenstep::DistContext& dist = *ctx;
  const int width = Width(), layers = absl::GetFlag(FLAGS_layers);
  torch::nn::Sequential models[2] = {Mlp(width, layers), Mlp(width, layers)};
  int64_t params = 0;
  for (const auto& p : models[0]->parameters()) params += p.numel();
  // bench/grad_sync.cc's caps: about 8 buckets, the first a quarter.
  evenstep::GradSyncOptions options;
  options.bucket_cap_bytes = std::max<int64_t>(params * 4 / 8, 1);
  options.first_bucket_cap_bytes = options.bucket_cap_bytes / 4;
  evenstep::GradSyncOptions hierarchical = options;
  EVENSTEP_ASSIGN_OR_RETURN(
      const evenstep::TopologyChoice choice,
      evenstep::ApplySyncTopology(dist, evenstep::SyncTopology::kHierarchical, &hierarchical));
  if (dist.rank() == 0) std::cout << choice.line << std::endl;
  std::unique_ptr<evenstep::GradSync> syncs[2];
  EVENSTEP_ASSIGN_OR_RETURN(syncs[0],
                            evenstep::GradSync::Attach(*models[0], dist.data_group(), options));
  // A second sync needs connections of its own (GradSync refuses a shared group).
  EVENSTEP_ASSIGN_OR_RETURN(std::unique_ptr<evenstep::Subgroup> second, dist.NewDataGroup());
  EVENSTEP_ASSIGN_OR_RETURN(
      syncs[1], evenstep::GradSync::Attach(*models[1], second->process_group(), hierarchical));
  torch::optim::SGD opt0(models[0]->parameters(), torch::optim::SGDOptions(1e-4));
  torch::optim::SGD opt1(models[1]->parameters(), torch::optim::SGDOptions(1e-4));
  torch::optim::SGD* opts[2] = {&opt0, &opt1};
  torch::manual_seed(1 + dist.rank());
  const torch::Tensor x = torch::randn({absl::GetFlag(FLAGS_batch), width});
  const char* uplink = std::getenv("EVENSTEP_BENCH_UPLINK");
  const bool counts = uplink != nullptr && dist.local_rank() == 0;

  std::vector<double> ms[kModes], tx[kModes];
  double tx_before = 0;
  Mode last = kCompute;
  bool measuring = false;
  const int steps = Steps();
  for (int s = 0; s < steps + 3; ++s) {
    for (Mode mode : {kCompute, kFlat, kHierarchical}) {
      at::Tensor flag = at::zeros({1});
      EVENSTEP_RETURN_IF_ERROR(dist.AllReduce(flag));  // start every step together
      // The previous step's traffic is over once every rank is here.
      const double tx_now = counts ? TxBytes(uplink) : 0;
      if (measuring) tx[last].push_back(tx_now - tx_before);
      tx_before = tx_now;
      if (s == steps + 2) break;  // the last round only closes the counts
      const int m = mode == kCompute ? 0 : mode - kFlat;
      syncs[m]->set_sync_enabled(mode != kCompute);
      syncs[m]->SetStep(s);
      const absl::Time start = absl::Now();
      opts[m]->zero_grad();
      models[m]->forward(x).pow(2).mean().backward();
      opts[m]->step();
      const double elapsed = absl::ToDoubleMilliseconds(absl::Now() - start);
      measuring = s >= 2;
      last = mode;
      if (measuring) ms[mode].push_back(elapsed);
    }
  }
  for (auto& sync : syncs) EVENSTEP_RETURN_IF_ERROR(sync->status());
  std::vector<double> figures;
  for (int m = 0; m < kModes; ++m) figures.push_back(Median(ms[m]));
  for (int m = 0; m < kModes; ++m) figures.push_back(Median(tx[m]));
  at::Tensor t = at::tensor(figures, at::kDouble);
  EVENSTEP_RETURN_IF_ERROR(dist.AllReduce(t, evenstep::ReduceOp::kMax));
  if (dist.rank() == 0) {
    std::cout << absl::StrFormat(
                     "RESULT compute_ms=%.3f flat_ms=%.3f hierarchical_ms=%.3f compute_tx=%.0f "
                     "flat_tx=%.0f hierarchical_tx=%.0f bytes=%d cross_gbps=%.4f within_gbps=%.4f",
                     t[0].item<double>(), t[1].item<double>(), t[2].item<double>(),
                     t[3].item<double>(), t[4].item<double>(), t[5].item<double>(), params * 4,
                     choice.cross_node_gbps, choice.within_node_gbps)
              << std::endl;
  }
  return dist.Barrier();
}

struct Layout {
  int hosts = 2, per_host = 2;
};

// The torchrun variables of rank `rank` on `cluster`, the store at
// MASTER_ADDR = host 0's name.
std::vector<std::pair<std::string, std::string>> RankEnv(
    const evenstep::testing::SimulatedCluster& cluster, const Layout& l, int rank, int port,
    bool agent_store) {
  std::vector<std::pair<std::string, std::string>> env = {
      {"RANK", std::to_string(rank)},
      {"WORLD_SIZE", std::to_string(l.hosts * l.per_host)},
      {"LOCAL_RANK", std::to_string(rank % l.per_host)},
      {"LOCAL_WORLD_SIZE", std::to_string(l.per_host)},
      {"GROUP_RANK", std::to_string(rank / l.per_host)},
      {"MASTER_ADDR", cluster.name(0)},
      {"MASTER_PORT", std::to_string(port)},
      {"OMP_NUM_THREADS", "1"},
      {"EVENSTEP_BENCH_UPLINK", cluster.interface(rank / l.per_host)}};
  if (agent_store) env.emplace_back("TORCHELASTIC_USE_AGENT_STORE", "True");
  return env;
}

struct Figures {
  std::map<std::string, double> evenstep;  // the RESULT fields
  double ddp_compute = -1, ddp = -1;
  std::string ddp_torch;
};

// Runs the evenstep ranks and then the DDP peer of one layout.
absl::StatusOr<Figures> RunLayout(const evenstep::testing::SimulatedCluster& cluster,
                                  const Layout& l, const std::string& self) {
  Figures f;
  const absl::Duration bound = absl::Minutes(absl::GetFlag(FLAGS_quick) ? 3 : 10);
  {
    std::unique_ptr<evenstep::internal::StoreServer> store;
    EVENSTEP_RETURN_IF_ERROR(cluster.InHost(0, [&] {
      auto started = evenstep::internal::StoreServer::Start(0);
      if (started.ok()) store = std::move(*started);
    }));
    if (store == nullptr) return absl::UnavailableError("cannot host the store in host 0");
    std::vector<evenstep::testing::ProcessSpec> specs;
    for (int r = 0; r < l.hosts * l.per_host; ++r) {
      std::vector<std::string> argv = {self, "--evenstep_timeout=120s",
                                       "--evenstep_rendezvous_timeout=60s"};
      for (const char* name : {"quick", "width", "layers", "steps", "batch"}) {
        const absl::CommandLineFlag* flag = absl::FindCommandLineFlag(name);
        argv.push_back(absl::StrCat("--", name, "=", flag->CurrentValue()));
      }
      specs.push_back(
          cluster.On(r / l.per_host, argv, RankEnv(cluster, l, r, store->port(), true)));
    }
    const auto results = evenstep::testing::RunAll(specs, bound);
    for (size_t r = 0; r < results.size(); ++r) {
      if (results[r].exit_code != 0) {
        return absl::InternalError(
            absl::StrCat("evenstep rank ", r, " failed:\n", evenstep::testing::Describe(results)));
      }
    }
    std::istringstream lines(results[0].output);
    std::string line;
    while (std::getline(lines, line)) {
      if (line.rfind("gradient sync:", 0) == 0) std::cout << "  " << line << "\n";
      if (auto fields = evenstep::bench::TaggedFields(line)) {
        f.evenstep = evenstep::bench::NumericFields(*fields);
      }
    }
    if (f.evenstep.empty()) return absl::InternalError("rank 0 printed no RESULT line");
  }
  // The DDP peer: Python's own store on rank 0 at a fixed port (nothing else
  // lives in these namespaces).
  const std::string python = absl::GetFlag(FLAGS_torch_python);
  if (evenstep::bench::RunLines(python + " -c 'import torch.distributed' 2>&1",
                                [](const std::string&) {}) != 0) {
    std::cout << "  DDP peer skipped: " << python << " has no torch\n";
    return f;
  }
  const int64_t bytes = static_cast<int64_t>(f.evenstep["bytes"]);
  std::vector<evenstep::testing::ProcessSpec> specs;
  for (int r = 0; r < l.hosts * l.per_host; ++r) {
    auto env = RankEnv(cluster, l, r, 29613, false);
    env.emplace_back("GLOO_SOCKET_IFNAME", cluster.interface(r / l.per_host));
    specs.push_back(
        cluster.On(r / l.per_host,
                   {python, EVENSTEP_DDP_PEER, "--shapes", absl::StrCat("mlp:", Width()),
                    "--layers", absl::StrCat(absl::GetFlag(FLAGS_layers)), "--batch",
                    absl::StrCat(absl::GetFlag(FLAGS_batch)), "--steps", absl::StrCat(Steps()),
                    "--bucket_bytes", absl::StrCat("mlp=", std::max<int64_t>(bytes / 8, 1))},
                   env));
  }
  const auto results = evenstep::testing::RunAll(specs, bound);
  std::istringstream lines(results[0].output);
  std::string line;
  while (std::getline(lines, line)) {
    if (line.rfind("DDP_PEER ", 0) != 0) continue;
    const nlohmann::json peer = nlohmann::json::parse(line.substr(9), nullptr, false);
    if (peer.is_discarded() || !peer["shapes"].contains("mlp")) continue;
    f.ddp_compute = peer["shapes"]["mlp"].value("compute_ms", -1.0);
    f.ddp = peer["shapes"]["mlp"].value("ddp_ms", -1.0);
    f.ddp_torch = peer.value("torch", "?");
  }
  if (f.ddp < 0) {
    std::cout << "  DDP peer failed: no comparison with DDP\n"
              << evenstep::testing::Describe(results).substr(0, 4000) << "\n";
  }
  return f;
}

std::vector<Layout> Layouts() {
  std::string spec = absl::GetFlag(FLAGS_layouts);
  if (spec.empty()) spec = absl::GetFlag(FLAGS_quick) ? "2x2" : "2x2,2x4";
  std::vector<Layout> out;
  for (absl::string_view item : absl::StrSplit(spec, ',', absl::SkipEmpty())) {
    std::vector<std::string> parts = absl::StrSplit(item, 'x');
    Layout l;
    if (parts.size() != 2 || !absl::SimpleAtoi(parts[0], &l.hosts) ||
        !absl::SimpleAtoi(parts[1], &l.per_host) || l.hosts < 2 || l.per_host < 1) {
      std::cerr << "--layouts=" << spec << ": expected HOSTSxRANKS items, hosts >= 2\n";
      std::exit(2);
    }
    out.push_back(l);
  }
  return out;
}

int Parent(const std::string& self) {
  const std::vector<Layout> layouts = Layouts();
  const double mbit = absl::GetFlag(FLAGS_link_mbit);
  int max_hosts = 0;
  for (const Layout& l : layouts) max_hosts = std::max(max_hosts, l.hosts);
  evenstep::testing::SimulatedCluster::Options cluster_options;
  cluster_options.mbit.assign(max_hosts, mbit);
  auto cluster = evenstep::testing::SimulatedCluster::Create(max_hosts, cluster_options);
  nlohmann::json summary = {{"bench", "sync_topology"}, {"link_mbit", mbit}};
  if (!cluster.ok()) {
    std::cout << "no simulated hosts here: " << cluster.status() << "\n";
    summary["valid"] = false;
    summary["skipped"] = std::string(cluster.status().message());
    std::cout << "SUMMARY " << summary.dump() << std::endl;
    return 0;
  }
  const double link_bytes_per_s = mbit * 1e6 / 8;
  std::cout << absl::StrFormat(
      "Hosts joined through a switch, each link shaped to %.0f Mbit/s (tbf); ranks within a host "
      "talk through its own stack. MLP width %d x %d layers, batch %d, %d steps per mode.\n",
      mbit, Width(), absl::GetFlag(FLAGS_layers), absl::GetFlag(FLAGS_batch), Steps());
  bool valid = true;
  for (const Layout& l : layouts) {
    std::cout << absl::StrFormat("%d hosts x %d ranks:\n", l.hosts, l.per_host);
    absl::StatusOr<Figures> f = RunLayout(**cluster, l, self);
    if (!f.ok()) {
      std::cout << "  failed: " << f.status() << "\n";
      valid = false;
      continue;
    }
    auto& e = f->evenstep;
    const double s = e["bytes"], compute = e["compute_ms"];
    const double flat = e["flat_ms"] - compute, hier = e["hierarchical_ms"] - compute;
    const double bound_ms = s / link_bytes_per_s * 1e3;
    const int n = l.hosts * l.per_host;
    std::cout << absl::StrFormat(
        "  S = %.1f MiB of gradients per step; link bound S/rate %.0f ms\n"
        "  (a) compute only           %9.1f ms\n"
        "  (b) flat GradSync          %9.1f ms  (+%.1f exposed; %.3f S crossed the link per "
        "step, a ring's 2(n-1)/n = %.3f)\n"
        "  (c) hierarchical GradSync  %9.1f ms  (+%.1f exposed; %.3f S crossed the link)\n",
        s / 1048576, bound_ms, compute, e["flat_ms"], flat, e["flat_tx"] / s, 2.0 * (n - 1) / n,
        e["hierarchical_ms"], hier, e["hierarchical_tx"] / s);
    nlohmann::json j = {{"layout", absl::StrCat(l.hosts, "x", l.per_host)},
                        {"bytes", s},
                        {"compute_ms", compute},
                        {"flat_exposed_ms", flat},
                        {"hierarchical_exposed_ms", hier},
                        {"hierarchical_vs_flat", flat > 0 ? hier / flat : 0},
                        {"cross_node_bytes_per_step_over_s", e["hierarchical_tx"] / s},
                        {"flat_cross_node_bytes_per_step_over_s", e["flat_tx"] / s},
                        {"hierarchical_exposed_over_link_bound", hier / bound_ms}};
    if (f->ddp >= 0) {
      const double ddp = f->ddp - f->ddp_compute;
      std::cout << absl::StrFormat(
          "  PyTorch %s DDP (Gloo): compute %.1f ms, DDP %.1f ms (+%.1f exposed)\n", f->ddp_torch,
          f->ddp_compute, f->ddp, ddp);
      j["ddp_exposed_ms"] = ddp;
      j["hierarchical_vs_ddp"] = ddp > 0 ? hier / ddp : 0;
    }
    std::cout << absl::StrFormat(
        "  hierarchical_vs_flat %.3f, hierarchical_vs_ddp %s, hierarchical exposed / link bound "
        "%.3f\n",
        flat > 0 ? hier / flat : 0,
        j.contains("hierarchical_vs_ddp")
            ? absl::StrFormat("%.3f", j["hierarchical_vs_ddp"].get<double>())
            : std::string("n/a"),
        hier / bound_ms);
    summary[absl::StrCat(l.hosts, "x", l.per_host)] = j;
  }
  summary["valid"] = valid;
  std::cout << "SUMMARY " << summary.dump() << std::endl;
  return valid ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  torch::set_num_threads(1);
  if (std::getenv("RANK") != nullptr) {
    absl::Status s = Worker();
    if (!s.ok()) {
      std::cerr << "rank " << std::getenv("RANK") << ": " << s << std::endl;
      return 1;
    }
    return 0;
  }
  return Parent(evenstep::bench::SelfExecutable());
}

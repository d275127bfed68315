// Rank-loss benchmark: what a killed rank costs.
//
// 4 real ranks (Gloo, a store this program hosts, as a launcher's agent
// would) train a small MLP with BalancedStep on synthetic regression data.
// At a fixed step one rank kills itself (SIGKILL, inside its first
// micro-batch's loss). Rows, side by side from the same initial model:
//   reference  no rank lost: the final parameters' digest
//   restart    what torchrun does: the survivors fail and exit, the group is
//              launched again and resumes from the newest checkpoint (saved
//              every --ckpt_every steps): the steps lost (done again), the
//              seconds from the kill until a step completes again
//   continue   evenstep (DistOptions::on_rank_loss kContinue,
//              BalancedStep::Regroup): the survivors regroup and redo the
//              interrupted step over 3 ranks: steps lost (0), samples lost
//              (0), the seconds from the kill until the redone step
//              completes, split into detection (the failed step returns)
//              and the regroup; the final digest against the reference's
//   session    the same inside a Session (--evenstep_on_rank_loss=continue):
//              Step regroups and redoes the step itself, and the Session's
//              checkpoints (every --ckpt_every steps), metrics and timeline
//              follow the new world; the seconds from the kill until the
//              redone step's report returns, and the report's regroup_seconds
//   rejoin     continue, and then the new rank 0 starts a replacement for
//              the lost rank (EVENSTEP_JOIN=1, as evenstep-run --respawn
//              does); the survivors admit it at a step boundary
//              (BalancedStep::Admit) and hand it the state over the network
//              (evenstep::HandOver, a part from each survivor, no checkpoint
//              read); the seconds from its start until its first step
//              completes, the bytes it received and from how many ranks,
//              the survivors' stall (admit + handover); the final digest
// Last line: SUMMARY {json}.
//
//   evenstep_bench_rank_loss [--quick] [--steps N] [--kill_step K]
#include <signal.h>
#include <sys/wait.h>
#include <torch/torch.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <map>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "bench/relaunch.h"
#include "evenstep/balanced_step.h"
#include "evenstep/dist_context.h"
#include "evenstep/handover.h"
#include "evenstep/internal/store_server.h"
#include "evenstep/session.h"
#include "evenstep/train_checkpointer.h"

ABSL_FLAG(bool, quick, false, "Few steps (the smoke test).");
ABSL_FLAG(int, steps, 0, "Optimizer steps per row (default 40, quick 8).");
ABSL_FLAG(int, kill_step, 0, "The step the lost rank dies in (default 3/4 of the steps).");
ABSL_FLAG(int, ckpt_every, 0, "restart: checkpoint every N steps (default 10, quick 4).");
ABSL_FLAG(int, world, 4, "Ranks.");
ABSL_FLAG(bool, verbose, false, "Print every line of every rank.");
ABSL_FLAG(double, lost_after_s, 2, "continue: DistOptions::lost_after.");
ABSL_FLAG(double, timeout_s, 10, "The collective timeout.");
// Set by the driver for the ranks it starts.
ABSL_FLAG(std::string, role, "driver", "driver, or rank (started by the driver).");
ABSL_FLAG(std::string, row, "", "rank: reference, restart, continue, session or rejoin.");
ABSL_FLAG(std::string, dir, "", "rank: the checkpoint directory (restart; session: the run's).");
ABSL_FLAG(int, victim, -1, "rank: the launch rank that dies at --kill_step (-1: none).");

namespace {

int64_t NowUs() { return absl::ToUnixMicros(absl::Now()); }

struct Settings {
  int steps, kill_step, ckpt_every, world;
};

Settings Resolve() {
  Settings s;
  const bool quick = absl::GetFlag(FLAGS_quick);
  s.steps = absl::GetFlag(FLAGS_steps) > 0 ? absl::GetFlag(FLAGS_steps) : quick ? 8 : 40;
  s.kill_step = absl::GetFlag(FLAGS_kill_step) > 0 ? absl::GetFlag(FLAGS_kill_step)
                                                   : std::max(2, s.steps * 3 / 4);
  s.ckpt_every = absl::GetFlag(FLAGS_ckpt_every) > 0 ? absl::GetFlag(FLAGS_ckpt_every)
                 : quick                             ? 4
                                                     : 10;
  s.world = absl::GetFlag(FLAGS_world);
  return s;
}

// ---- a rank --------------------------------------------------------------

constexpr int kSamples = 4096, kIn = 256, kHidden = 512;

struct Data {
  torch::Tensor x, y;
};

Data MakeData() {
  torch::manual_seed(7);
  Data d{torch::randn({kSamples, kIn}), torch::Tensor()};
  d.y = torch::sin(d.x.sum(1, /*keepdim=*/true));
  return d;
}

torch::nn::Sequential MakeModel() {
  torch::manual_seed(11);
  return torch::nn::Sequential(torch::nn::Linear(kIn, kHidden), torch::nn::ReLU(),
                               torch::nn::Linear(kHidden, kHidden), torch::nn::ReLU(),
                               torch::nn::Linear(kHidden, 1));
}

double Digest(torch::nn::Sequential& model) {
  double digest = 0;
  int i = 1;
  for (const auto& p : model->parameters()) {
    digest += i++ * p.to(torch::kDouble).abs().sum().item<double>();
  }
  return digest;
}

evenstep::BalanceConfig BenchConfig() {
  evenstep::BalanceConfig config;
  config.sampler.global_batch = 256;
  config.sampler.micro_batch_samples = 32;
  config.sampler.seed = 5;
  config.data_workers = 0;
  return config;
}

// The session row: the same loop through a Session, which goes on by itself.
int RunSessionRank(evenstep::DistContext& dist, const Settings& set) {
  const int me = dist.launch_rank();
  const Data data = MakeData();
  torch::nn::Sequential model = MakeModel();
  torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(0.01).momentum(0.9));
  evenstep::SessionOptions options;
  options.balance = BenchConfig();
  options.run_dir = absl::GetFlag(FLAGS_dir);
  options.ckpt_every = set.ckpt_every;
  options.resume = evenstep::ResumeMode::kOff;
  auto es = evenstep::Session::Create(dist, *model, optimizer, std::vector<int64_t>(kSamples, 1),
                                      options);
  if (!es.ok()) {
    std::cout << "rank " << me << ": " << es.status() << std::endl;
    return 1;
  }
  const int victim = absl::GetFlag(FLAGS_victim);
  for (int s = 1; s <= set.steps; ++s) {
    const int64_t begin = NowUs();
    auto report = (*es)->Step([&](const std::vector<int64_t>& samples) {
      if (me == victim && s == set.kill_step) {
        std::cout << "KILL at_us=" << NowUs() << std::endl;
        raise(SIGKILL);
      }
      const torch::Tensor idx = torch::tensor(samples, torch::kLong);
      return torch::mse_loss(model->forward(data.x.index_select(0, idx)),
                             data.y.index_select(0, idx), torch::Reduction::Sum);
    });
    if (!report.ok()) {
      std::cout << "step " << s << " failed: " << report.status() << std::endl;
      return 3;
    }
    std::cout << "STEP step=" << s << " us=" << NowUs() - begin << " at_us=" << NowUs()
              << (report->lost_ranks.empty()
                      ? std::string()
                      : absl::StrCat(" redone=1 regroup_s=", report->regroup_seconds))
              << std::endl;
  }
  if (!(*es)->Finish().ok()) return 5;
  if (dist.rank() == 0) {
    std::cout << absl::StrFormat("RESULT digest=%.17g world=%d", Digest(model), dist.world_size())
              << std::endl;
  }
  return 0;
}

// The command line of rank `rank` of `row` (this program, the torchrun
// variables of a store on 127.0.0.1:`port`).
std::string RankCommand(const Settings& set, int rank, const std::string& port,
                        const std::string& row, const std::string& dir, int victim) {
  return absl::StrCat("RANK=", rank, " WORLD_SIZE=", set.world, " LOCAL_RANK=", rank,
                      " LOCAL_WORLD_SIZE=", set.world, " MASTER_ADDR=127.0.0.1 MASTER_PORT=", port,
                      " TORCHELASTIC_USE_AGENT_STORE=True OMP_NUM_THREADS=1 ",
                      evenstep::bench::SelfExecutable(), " --role=rank --row=", row, " --dir=", dir,
                      " --victim=", victim, " --steps=", set.steps, " --kill_step=", set.kill_step,
                      " --ckpt_every=", set.ckpt_every,
                      " --lost_after_s=", absl::GetFlag(FLAGS_lost_after_s),
                      " --timeout_s=", absl::GetFlag(FLAGS_timeout_s));
}

// The rejoin row's new rank 0: a replacement of `victim`, in the background
// (its lines go where this rank's go).
void StartReplacement(const Settings& set, int victim) {
  const char* port = std::getenv("MASTER_PORT");
  const std::string command = absl::StrCat(
      "EVENSTEP_JOIN=1 ", RankCommand(set, victim, port ? port : "", "rejoin", "", -1), " &");
  std::cout << "SPAWNED at_us=" << NowUs() << std::endl;
  if (std::system(command.c_str()) != 0)
    std::cout << "starting the replacement failed" << std::endl;
}

// The rejoin row at a step boundary: the survivors wait (before the step
// after the redone one, so that its exchange agrees on the request) until
// the replacement asked, then admit it and hand
// it the state; the replacement receives it first thing. The next step, or
// -1 on failure.
int Rejoin(evenstep::DistContext& dist, evenstep::BalancedStep& step,
           const evenstep::TrainState& state, int s, const Settings& set) {
  if (!dist.joined() && s == set.kill_step + 1) {
    const absl::Time deadline = absl::Now() + absl::Seconds(60);
    while (!dist.JoinPending() && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(5));
  }
  const bool joiner = dist.joined() && step.LacksState();
  if (!joiner && !step.JoinWaiting()) return s;
  const int64_t begin = NowUs();
  if (!joiner) {
    auto admitted = step.Admit();
    if (!admitted.ok()) {
      std::cout << "admit failed: " << admitted.status() << std::endl;
      return -1;
    }
  }
  const int64_t admitted_at = NowUs();
  auto handed = evenstep::HandOver(dist, state);
  if (!handed.ok()) {
    std::cout << "handover failed: " << handed.status() << std::endl;
    return -1;
  }
  std::cout << (joiner ? "JOINED" : "ADMITTED") << " at_us=" << NowUs()
            << " admit_s=" << (admitted_at - begin) / 1e6 << " handover_s=" << handed->seconds
            << " bytes=" << handed->bytes << " bytes_sent=" << handed->bytes_sent
            << " senders=" << handed->senders.size() << std::endl;
  return static_cast<int>(step.state().steps) + 1;
}

int RunRank() {
  const Settings set = Resolve();
  const std::string row = absl::GetFlag(FLAGS_row);
  evenstep::DistOptions options;
  options.backend = evenstep::CommBackend::kGloo;
  options.collective_timeout = absl::Seconds(absl::GetFlag(FLAGS_timeout_s));
  options.lost_after = absl::Seconds(absl::GetFlag(FLAGS_lost_after_s));
  options.rendezvous_timeout = absl::Seconds(60);
  if (row == "continue" || row == "session" || row == "rejoin") {
    options.on_rank_loss = evenstep::DistOptions::OnRankLoss::kContinue;
  }
  auto ctx = evenstep::DistContext::Create(options);
  if (!ctx.ok()) {
    std::cout << "rank setup failed: " << ctx.status() << std::endl;
    return 1;
  }
  evenstep::DistContext& dist = **ctx;
  if (row == "session") return RunSessionRank(dist, set);
  const int me = dist.launch_rank();
  const Data data = MakeData();
  torch::nn::Sequential model = MakeModel();
  torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(0.01).momentum(0.9));
  auto step = evenstep::BalancedStep::Create(dist, *model, optimizer,
                                             std::vector<int64_t>(kSamples, 1), BenchConfig());
  if (!step.ok()) {
    std::cout << "rank " << me << ": " << step.status() << std::endl;
    return 1;
  }
  std::unique_ptr<evenstep::TrainCheckpointer> ckpt;
  int start = 0;
  if (row == "restart") {
    evenstep::CheckpointOptions ckpt_options;
    ckpt_options.dir = absl::GetFlag(FLAGS_dir);
    auto made = evenstep::TrainCheckpointer::Create(dist, ckpt_options);
    if (!made.ok()) return 1;
    ckpt = std::move(*made);
    auto loaded = ckpt->Load({model.ptr().get(), &optimizer, step->get(), "{}"});
    if (loaded.ok()) {
      start = static_cast<int>(loaded->step);
      std::cout << "RESUMED step=" << start << " at_us=" << NowUs() << std::endl;
    }
  }
  const int victim = absl::GetFlag(FLAGS_victim);
  auto load = [&](const evenstep::MicroBatch& mb) {
    return torch::tensor(mb.samples, torch::kLong);
  };
  int64_t failed_at = 0;
  const evenstep::TrainState state{model.ptr().get(), &optimizer, step->get(), "{}"};
  for (int s = start + 1; s <= set.steps;) {
    if (row == "rejoin" && (s = Rejoin(dist, **step, state, s, set)) < 0) return 6;
    if (s > set.steps) break;
    auto loss = [&](const torch::Tensor& idx) {
      if (me == victim && s == set.kill_step) {
        std::cout << "KILL at_us=" << NowUs() << std::endl;
        raise(SIGKILL);
      }
      return torch::mse_loss(model->forward(data.x.index_select(0, idx)),
                             data.y.index_select(0, idx), torch::Reduction::Sum);
    };
    const int64_t begin = NowUs();
    auto report = (*step)->Step(load, loss);
    if (!report.ok()) {
      failed_at = NowUs();
      std::cout << "FAILED step=" << s << " at_us=" << failed_at << std::endl;
      if (row != "continue" && row != "rejoin") return 3;
      auto regrouped = (*step)->Regroup();
      if (!regrouped.ok()) {
        std::cout << "regroup failed: " << regrouped.status() << std::endl;
        return 4;
      }
      std::cout << "REGROUPED at_us=" << NowUs() << " world=" << dist.world_size() << std::endl;
      if (row == "rejoin" && dist.rank() == 0) StartReplacement(set, victim);
      s = static_cast<int>((*step)->state().steps) + 1;  // the failed step, unless applied
      continue;
    }
    std::cout << (dist.joined() ? "JSTEP" : "STEP") << " step=" << s << " us=" << NowUs() - begin
              << " at_us=" << NowUs() << (failed_at > 0 ? " redone=1" : "") << std::endl;
    failed_at = 0;
    if (ckpt && s % set.ckpt_every == 0) {
      auto saved = ckpt->Save(s, {model.ptr().get(), &optimizer, step->get(), "{}"});
      if (!saved.ok() || !saved->done.get().ok()) return 5;
    }
    ++s;
  }
  if (ckpt && !ckpt->WaitAll().ok()) return 5;
  if (dist.rank() == 0) {
    std::cout << absl::StrFormat("RESULT digest=%.17g world=%d", Digest(model), dist.world_size())
              << std::endl;
  }
  return 0;
}

// ---- the driver ----------------------------------------------------------

struct Launch {
  std::vector<std::map<std::string, double>> lines;  // tagged lines, with "tag"
  int failures = 0;                                  // ranks that did not exit 0
};

// Starts `world` ranks of this program against a store of its own; waits.
Launch RunRanks(const Settings& set, const std::string& row, const std::string& dir, int victim) {
  Launch out;
  auto server = evenstep::internal::StoreServer::Start(0);
  if (!server.ok()) {
    std::cerr << server.status() << "\n";
    out.failures = set.world;
    return out;
  }
  std::string command = "(";
  for (int r = 0; r < set.world; ++r) {
    absl::StrAppend(&command,
                    RankCommand(set, r, std::to_string((*server)->port()), row, dir, victim),
                    " 2>&1 | sed 's/^/[", r, "] /' & ");
  }
  absl::StrAppend(&command, "wait)");
  evenstep::bench::RunLines(command, [&](const std::string& line) {
    for (const char* tag : {"KILL ", "FAILED ", "REGROUPED ", "STEP ", "RESULT ", "RESUMED ",
                            "SPAWNED ", "ADMITTED ", "JOINED ", "JSTEP "}) {
      auto fields = evenstep::bench::TaggedFields(line, tag);
      if (!fields) continue;
      auto numbers = evenstep::bench::NumericFields(*fields);
      numbers["tag_" + std::string(tag, std::strlen(tag) - 1)] = 1;
      numbers["rank"] = line.size() > 1 ? line[1] - '0' : -1;
      out.lines.push_back(numbers);
    }
    if (absl::GetFlag(FLAGS_verbose) || line.find("failed") != std::string::npos ||
        line.find("error") != std::string::npos) {
      std::cout << "  " << line << "\n";
    }
  });
  return out;
}

std::vector<std::map<std::string, double>> Tagged(const Launch& l, const std::string& tag) {
  std::vector<std::map<std::string, double>> v;
  for (const auto& f : l.lines) {
    if (f.count("tag_" + tag) > 0) v.push_back(f);
  }
  return v;
}

double Get(const std::vector<std::map<std::string, double>>& v, const std::string& key,
           bool last = false) {
  if (v.empty() || v.front().count(key) == 0) return 0;
  return last ? v.back().at(key) : v.front().at(key);
}

std::string TempDir() {
  char pattern[] = "/tmp/evenstep_rank_loss_XXXXXX";
  const char* made = mkdtemp(pattern);
  return made == nullptr ? std::string() : std::string(made);
}

// The session row: the same, the Session regrouping inside Step.
struct SessionRow {
  double seconds = 0;    // from the kill to the redone step's report
  double regroup_s = 0;  // the report's regroup_seconds
  double rel = 0;        // the final digest against the reference
  bool ok = false;
};

SessionRow RunSessionRow(const Settings& set, int victim, double reference_digest) {
  SessionRow row;
  const std::string dir = TempDir();
  const Launch session = RunRanks(set, "session", dir, victim);
  std::system(absl::StrCat("rm -rf ", dir).c_str());
  const double killed = Get(Tagged(session, "KILL"), "at_us");
  double redone = 0;
  for (const auto& f : Tagged(session, "STEP")) {
    if (f.count("redone") == 0) continue;
    redone = std::max(redone, f.at("at_us"));
    row.regroup_s = std::max(row.regroup_s, f.at("regroup_s"));
  }
  row.seconds = (redone - killed) / 1e6;
  row.rel = std::abs(Get(Tagged(session, "RESULT"), "digest") - reference_digest) /
            std::abs(reference_digest);
  row.ok = killed > 0 && redone > 0 && row.rel < 1e-5;
  return row;
}

// The rejoin row: continue, then a replacement joins from the survivors'
// live state.
struct RejoinRow {
  double continue_s = 0;  // from the kill to the redone step
  double seconds = 0;     // from the replacement's start to its first completed step
  double joiner_steps = 0, bytes = 0, senders = 0;
  double stall_s = 0;  // the survivors' admit + handover
  double rel = 0;      // the final digest against the reference
  bool ok = false;
};

RejoinRow RunRejoinRow(const Settings& set, int victim, double reference_digest) {
  RejoinRow row;
  const Launch rejoin = RunRanks(set, "rejoin", "", victim);
  double redone = 0, joiner_first_step = 0;
  for (const auto& f : Tagged(rejoin, "STEP")) {
    if (f.count("redone") > 0) redone = std::max(redone, f.at("at_us"));
  }
  for (const auto& f : Tagged(rejoin, "JSTEP")) {
    row.joiner_steps += 1;
    if (joiner_first_step == 0 || f.at("at_us") < joiner_first_step) {
      joiner_first_step = f.at("at_us");
    }
  }
  for (const auto& f : Tagged(rejoin, "ADMITTED")) {
    row.stall_s = std::max(row.stall_s, f.at("admit_s") + f.at("handover_s"));
  }
  row.continue_s = (redone - Get(Tagged(rejoin, "KILL"), "at_us")) / 1e6;
  row.seconds = (joiner_first_step - Get(Tagged(rejoin, "SPAWNED"), "at_us")) / 1e6;
  const auto joined = Tagged(rejoin, "JOINED");
  row.bytes = Get(joined, "bytes");
  row.senders = Get(joined, "senders");
  const auto result = Tagged(rejoin, "RESULT");
  row.rel = std::abs(Get(result, "digest") - reference_digest) / std::abs(reference_digest);
  row.ok = joiner_first_step > 0 && Get(result, "world") == set.world &&
           row.senders == set.world - 1 && row.rel < 1e-5;
  return row;
}

int RunDriver() {
  const Settings set = Resolve();
  const int victim = set.world - 1;
  std::cout << absl::StrFormat(
                   "rank loss: %d ranks, %d steps, rank %d killed in step %d; restart "
                   "checkpoints every %d steps; continue: lost_after %.1f s, timeout %.0f s",
                   set.world, set.steps, victim, set.kill_step, set.ckpt_every,
                   absl::GetFlag(FLAGS_lost_after_s), absl::GetFlag(FLAGS_timeout_s))
            << std::endl;
  const Launch reference = RunRanks(set, "reference", "", -1);
  const double reference_digest = Get(Tagged(reference, "RESULT"), "digest");
  double step_us = 0;
  for (const auto& f : Tagged(reference, "STEP")) step_us += f.at("us");
  step_us /= std::max<size_t>(1, Tagged(reference, "STEP").size());

  // restart: the whole group fails, then launches again from the checkpoint.
  const std::string dir = TempDir();
  const Launch first = RunRanks(set, "restart", dir, victim);
  const double killed_restart = Get(Tagged(first, "KILL"), "at_us");
  const Launch second = RunRanks(set, "restart", dir, -1);
  const auto resumed = Tagged(second, "RESUMED");
  const double resumed_step = Get(resumed, "step");
  double first_step_after = 0;
  for (const auto& f : Tagged(second, "STEP")) {
    if (first_step_after == 0 || f.at("at_us") < first_step_after) first_step_after = f.at("at_us");
  }
  const double restart_s = (first_step_after - killed_restart) / 1e6;
  const double restart_lost = set.kill_step - 1 - resumed_step;
  const double restart_digest = Get(Tagged(second, "RESULT"), "digest");
  std::system(absl::StrCat("rm -rf ", dir).c_str());

  // continue: the survivors regroup and redo the step.
  const Launch cont = RunRanks(set, "continue", "", victim);
  const double killed = Get(Tagged(cont, "KILL"), "at_us");
  double detected = 0, regrouped = 0, redone = 0;
  for (const auto& f : Tagged(cont, "FAILED")) detected = std::max(detected, f.at("at_us"));
  for (const auto& f : Tagged(cont, "REGROUPED")) regrouped = std::max(regrouped, f.at("at_us"));
  for (const auto& f : Tagged(cont, "STEP")) {
    if (f.count("redone") > 0) redone = std::max(redone, f.at("at_us"));
  }
  const double continue_digest = Get(Tagged(cont, "RESULT"), "digest");
  const double detect_s = (detected - killed) / 1e6, regroup_s = (regrouped - detected) / 1e6;
  const double continue_s = (redone - killed) / 1e6;
  // The survivors sum the gradient over 3 ranks instead of 4: the same
  // within float rounding, not bit for bit.
  auto rel = [&](double d) { return std::abs(d - reference_digest) / std::abs(reference_digest); };
  const double continue_rel = rel(continue_digest), restart_rel = rel(restart_digest);

  const SessionRow session = RunSessionRow(set, victim, reference_digest);
  const RejoinRow rejoin = RunRejoinRow(set, victim, reference_digest);
  const bool ok = killed > 0 && redone > 0 && killed_restart > 0 && first_step_after > 0 &&
                  session.ok && continue_rel < 1e-5 && restart_rel < 1e-5 && rejoin.ok;

  std::cout << absl::StrFormat("%-10s %12s %12s %14s %s\n", "row", "steps lost", "samples lost",
                               "s to training", "final parameters' digest, relative to reference");
  std::cout << absl::StrFormat("%-10s %12s %12s %14s %.17g\n", "reference", "-", "-", "-",
                               reference_digest);
  std::cout << absl::StrFormat("%-10s %12.0f %12s %14.2f %.2g\n", "restart", restart_lost, "0",
                               restart_s, restart_rel);
  std::cout << absl::StrFormat(
      "%-10s %12d %12d %14.2f %.2g (detection %.2f s, regroup %.2f s, one step %.3f s)\n",
      "continue", 0, 0, continue_s, continue_rel, detect_s, regroup_s, step_us / 1e6);
  std::cout << absl::StrFormat(
      "%-10s %12d %12d %14.2f %.2g (regroup with the Session's files %.2f s)\n", "session", 0, 0,
      session.seconds, session.rel, session.regroup_s);
  std::cout << absl::StrFormat(
      "%-10s %12d %12d %14.2f %.2g (the replacement training %.2f s after its start, %.0f steps; "
      "%.0f bytes from %.0f survivors; their stall %.3f s)\n",
      "rejoin", 0, 0, rejoin.continue_s, rejoin.rel, rejoin.seconds, rejoin.joiner_steps,
      rejoin.bytes, rejoin.senders, rejoin.stall_s);
  double last_step = 0;
  for (const auto& f : Tagged(cont, "STEP")) last_step = std::max(last_step, f.at("step"));
  std::cout << absl::StrFormat(
                   "continue reaches training again in %.2fx the restart's time; the survivors "
                   "reached step %.0f of %d",
                   restart_s > 0 ? continue_s / restart_s : 0, last_step, set.steps)
            << std::endl;
  std::cout
      << absl::StrFormat(
             "SUMMARY {\"bench\": \"rank_loss\", \"world\": %d, \"steps\": %d, \"kill_step\": %d,"
             "\"restart_steps_lost\": %.0f, \"restart_s\": %.3f, \"continue_steps_lost\": 0,"
             "\"continue_samples_lost\": 0, \"continue_s\": %.3f, \"detection_s\": %.3f,"
             "\"regroup_s\": %.3f, \"step_s\": %.4f, \"continue_over_restart\": %.3f,"
             "\"continue_digest_rel\": %.3g, \"restart_digest_rel\": %.3g,"
             "\"session_s\": %.3f, \"session_regroup_s\": %.3f, \"session_digest_rel\": %.3g,"
             "\"rejoin_s\": %.3f, \"rejoin_bytes\": %.0f, \"rejoin_senders\": %.0f,"
             "\"rejoin_stall_s\": %.4f, \"rejoin_digest_rel\": %.3g, \"rejoin_ckpt_reads\": 0,"
             "\"ok\": %s}",
             set.world, set.steps, set.kill_step, restart_lost, restart_s, continue_s, detect_s,
             regroup_s, step_us / 1e6, restart_s > 0 ? continue_s / restart_s : 0, continue_rel,
             restart_rel, session.seconds, session.regroup_s, session.rel, rejoin.seconds,
             rejoin.bytes, rejoin.senders, rejoin.stall_s, rejoin.rel, ok ? "true" : "false")
      << std::endl;
  return ok ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return absl::GetFlag(FLAGS_role) == "rank" ? RunRank() : RunDriver();
}

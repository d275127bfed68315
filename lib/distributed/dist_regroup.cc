// DistContext::Regroup: the ranks still running after a peer was lost agree
// on who is left, through the store, and go on among themselves.
//
// The store (the launcher's agent store, or rank 0's) outlives the lost
// rank. Under "evenstep/regroup/<generation>/" each survivor writes
// "in/<launch rank>" (its host name). A rank that is not in is lost once its
// heartbeat ("evenstep/alive/<launch rank>", beaten by a thread of its own
// through a store connection of its own) has not moved for lost_after, or
// at once when its liveness socket ("evenstep/alive_at/<launch rank>")
// refuses a connection: the process is gone (a frozen one still accepts). The
// first survivor that sees every member in or lost writes "view" by
// compareSet; the others adopt the view that is there. A rank checking in
// after the view was written is not in it and is told so: it was frozen
// longer than lost_after, and the others went on without it.

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "dist_context_internal.h"
#include "evenstep/internal/c10d_compat.h"
#include "evenstep/internal/collective.h"
#include "evenstep/internal/error_text.h"
#include "evenstep/internal/gloo_address.h"
#include "evenstep/log.h"
#include "evenstep/status_macros.h"

namespace evenstep {

using internal::Bytes;
using internal::Text;

std::string Regrouped::Describe() const {
  if (!joined.empty()) {
    return absl::StrCat("rank(s) ", absl::StrJoin(joined, ", "), " joined; ",
                        survivors.size() + joined.size(), " rank(s) go on (regroup ", generation,
                        ")");
  }
  const std::string who =
      lost.empty() ? "no rank lost" : absl::StrCat("rank(s) ", absl::StrJoin(lost, ", "), " lost");
  return absl::StrCat(who, "; ", survivors.size(), " survivor(s) go on (regroup ", generation, ")");
}

void DistContext::Groups::StopHeartbeat() {
  {
    absl::MutexLock lock(&beat_mu);
    stop_beating = true;
  }
  if (heartbeat.joinable()) heartbeat.join();
  if (liveness_fd >= 0) close(liveness_fd);
  liveness_fd = -1;
}

namespace {

// A socket listening on every address, on a port of the OS's choosing, that
// never accepts: -1 and its port 0 where none can be made.
std::pair<int, int> LivenessSocket() {
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return {-1, 0};
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_ANY);
  socklen_t length = sizeof(address);
  if (bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) != 0 ||
      listen(fd, 64) != 0 || getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length) != 0) {
    close(fd);
    return {-1, 0};
  }
  return {fd, ntohs(address.sin_port)};
}

// True when a connection to "ip:port" is refused: the process that listened
// there is gone. False when it connects, times out (a lost host) or cannot
// be tried.
bool Refused(const std::string& at) {
  const size_t colon = at.rfind(':');
  int port = 0;
  sockaddr_in address{};
  address.sin_family = AF_INET;
  if (colon == std::string::npos || !absl::SimpleAtoi(at.substr(colon + 1), &port) ||
      inet_pton(AF_INET, at.substr(0, colon).c_str(), &address.sin_addr) != 1) {
    return false;
  }
  address.sin_port = htons(static_cast<uint16_t>(port));
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) return false;
  int error = 0;
  if (connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) != 0) {
    error = errno;
    if (error == EINPROGRESS) {
      pollfd p{fd, POLLOUT, 0};
      socklen_t length = sizeof(error);
      error = poll(&p, 1, 500) == 1 && getsockopt(fd, SOL_SOCKET, SO_ERROR, &error, &length) == 0
                  ? error
                  : 0;
    }
  }
  close(fd);
  return error == ECONNREFUSED;
}

}  // namespace

absl::Status DistContext::StartHeartbeat() {
  if (options_.on_rank_loss != DistOptions::OnRankLoss::kContinue || env_.world_size == 1) {
    return absl::OkStatus();
  }
  EVENSTEP_ASSIGN_OR_RETURN(
      compat::StorePtr store,
      internal::OwnStoreConnection(env_, options_.rendezvous_timeout, groups_->launch_prefix,
                                   options_.lost_after, "the heartbeat"));
  // Where a connection is refused once this process is gone (IPv4 only;
  // elsewhere the heartbeat alone tells).
  const auto [fd, port] = LivenessSocket();
  absl::StatusOr<std::string> here =
      internal::LocalAddressTowards(env_.master_addr, env_.master_port);
  if (fd >= 0 && here.ok() && here->find(':') == std::string::npos) {
    groups_->liveness_fd = fd;
    try {
      store->set(internal::AliveAtKey(launch_rank_),
                 internal::Bytes(absl::StrCat(*here, ":", port)));
    } catch (const std::exception&) {
      // Regroup finds the store gone too, and names it.
    }
  } else if (fd >= 0) {
    close(fd);
  }
  groups_->heartbeat = std::thread(&Groups::Beat, groups_.get(), store,
                                   internal::AliveKey(launch_rank_), options_.lost_after / 5);
  return absl::OkStatus();
}

void DistContext::Groups::Beat(compat::StorePtr beat_store, std::string key,
                               absl::Duration period) {
  constexpr absl::Duration kLook = absl::Milliseconds(200);
  absl::Time next_beat = absl::InfinitePast();
  absl::MutexLock lock(&beat_mu);
  while (!stop_beating) {
    try {
      if (absl::Now() >= next_beat) {
        beat_store->add(key, 1);
        next_beat = absl::Now() + period;
      }
      const std::string begun = internal::RegroupKey(watched_generation.load() + 1, "begun");
      if (!regroup_begun.load() && beat_store->check({begun})) regroup_begun.store(true);
      if (!join_pending.load() &&
          beat_store->add(internal::JoinKey("requests"), 0) > joins_seen.load()) {
        join_pending.store(true);
      }
    } catch (const std::exception&) {
      // The store is gone: Regroup names it; nothing to beat into.
    }
    beat_mu.AwaitWithTimeout(absl::Condition(&stop_beating), std::min(kLook, period));
  }
}

bool DistContext::RegroupBegun() const { return groups_->regroup_begun.load(); }

bool DistContext::JoinPending() const { return groups_->join_pending.load(); }

std::function<bool()> DistContext::Abandon() const {
  if (options_.on_rank_loss != DistOptions::OnRankLoss::kContinue) return nullptr;
  const Groups* groups = groups_.get();
  return [groups] { return groups->regroup_begun.load(); };
}

void DistContext::Retire(std::unique_ptr<Subgroup> group) {
  if (group != nullptr) groups_->retired_subgroups.push_back(std::move(group));
}

std::string DistContext::Scoped(const std::string& key) const {
  return groups_->generation == 0 ? key : absl::StrCat("evenstep/g", groups_->generation, "/", key);
}

namespace {

std::string Joined(const std::vector<int>& ranks) { return absl::StrJoin(ranks, ","); }

std::vector<int> Parsed(const std::string& text) {
  std::vector<int> ranks;
  for (absl::string_view part : absl::StrSplit(text, ',', absl::SkipEmpty())) {
    int r = 0;
    if (absl::SimpleAtoi(part, &r)) ranks.push_back(r);
  }
  return ranks;
}

bool Holds(const std::vector<int>& ranks, int m) {
  return std::find(ranks.begin(), ranks.end(), m) != ranks.end();
}

// The host each member of regroup `generation`'s `view` checked in from.
std::vector<std::string> HostsOf(c10d::Store& store, int generation, const std::vector<int>& view) {
  std::vector<std::string> hosts;
  for (int m : view) {
    hosts.push_back(Text(store.get(internal::RegroupKey(generation, absl::StrCat("in/", m)))));
  }
  return hosts;
}

// Regroup `generation` from `members` (launch ranks, index = old rank) to
// `view`: the old ranks kept and lost, and the new ranks of those that
// joined.
Regrouped Outcome(int generation, const std::vector<int>& members, const std::vector<int>& view) {
  Regrouped result;
  result.generation = generation;
  for (size_t old_rank = 0; old_rank < members.size(); ++old_rank) {
    (Holds(view, members[old_rank]) ? result.survivors : result.lost)
        .push_back(static_cast<int>(old_rank));
  }
  for (size_t i = 0; i < view.size(); ++i) {
    if (!Holds(members, view[i])) result.joined.push_back(static_cast<int>(i));
  }
  return result;
}

// What one survivor sees while it waits for the view: who is in, and how
// long each other member's heartbeat has stood still.
struct Watch {
  std::map<int, int64_t> beats;       // launch rank -> last heartbeat count seen
  std::map<int, absl::Time> changed;  // ... and when it last changed
  std::set<int> gone;                 // ... whose liveness socket refused
};

// The members in, or "" while some member is neither in nor lost yet.
std::string ViewIfDecided(c10d::Store& store, int generation, const std::vector<int>& members,
                          absl::Duration lost_after, Watch* watch) {
  std::vector<int> in;
  const absl::Time now = absl::Now();
  for (int m : members) {
    if (store.check({internal::RegroupKey(generation, absl::StrCat("in/", m))})) {
      in.push_back(m);
      continue;
    }
    const int64_t beat = store.add(internal::AliveKey(m), 0);
    auto seen = watch->beats.find(m);
    if (seen == watch->beats.end()) {
      // Seen for the first time: a process that is gone refuses at once.
      const std::string at_key = internal::AliveAtKey(m);
      if (store.check({at_key}) && Refused(Text(store.get(at_key)))) watch->gone.insert(m);
    }
    if (seen == watch->beats.end() || seen->second != beat) {
      watch->beats[m] = beat;
      watch->changed[m] = now;
    }
    if (watch->gone.count(m) > 0) continue;
    if (now - watch->changed[m] < lost_after) return "";  // still beating: wait for it
  }
  return Joined(in);
}

}  // namespace

absl::StatusOr<Regrouped> DistContext::Regroup() {
  if (options_.on_rank_loss != DistOptions::OnRankLoss::kContinue) {
    return absl::FailedPreconditionError(absl::StrCat(
        "rank ", env_.rank,
        ": Regroup needs DistOptions::on_rank_loss = kContinue: "
        "without the heartbeat it starts, a lost rank cannot be told from a slow one"));
  }
  const int generation = groups_->generation + 1;
  const std::string view_key = internal::RegroupKey(generation, "view");
  auto in_key = [generation](int m) {
    return internal::RegroupKey(generation, absl::StrCat("in/", m));
  };
  c10d::Store& store = *groups_->store;
  std::vector<int> survivors;
  std::vector<std::string> hosts;
  try {
    // The ranks still waiting on a collective stop waiting (RegroupBegun).
    store.set(internal::RegroupKey(generation, "begun"), Bytes("1"));
    store.set(in_key(launch_rank_), Bytes(internal::HostName()));
    Watch watch;
    const absl::Time deadline = absl::Now() + options_.rendezvous_timeout;
    while (!store.check({view_key})) {
      const std::string decided =
          ViewIfDecided(store, generation, groups_->members, options_.lost_after, &watch);
      if (!decided.empty()) {
        store.compareSet(view_key, {}, Bytes(decided));
        break;
      }
      if (absl::Now() > deadline) {
        return absl::DeadlineExceededError(
            absl::StrCat("rank ", env_.rank, ": regroup ", generation, ": no view within ",
                         absl::FormatDuration(options_.rendezvous_timeout),
                         " (a rank neither checked in nor stopped beating its heartbeat)"));
      }
      absl::SleepFor(absl::Milliseconds(20));
    }
    survivors = Parsed(Text(store.get(view_key)));
    hosts = HostsOf(store, generation, survivors);
  } catch (const std::exception& e) {
    return absl::UnavailableError(
        absl::StrCat(internal::StoreLost(env_, absl::StrCat("regroup ", generation), e),
                     ": the survivors cannot agree without the store"));
  }
  if (!Holds(survivors, launch_rank_)) {
    return absl::FailedPreconditionError(
        absl::StrCat("rank ", env_.rank, " (launch rank ", launch_rank_, "): left out of regroup ",
                     generation, ": the survivors (launch ranks ", Joined(survivors),
                     ") went on without it, since it checked in after "
                     "its heartbeat had stood still for ",
                     absl::FormatDuration(options_.lost_after), " (frozen, or its host stalled)"));
  }
  Regrouped result = Outcome(generation, groups_->members, survivors);
  EVENSTEP_RETURN_IF_ERROR(AdoptView(generation, survivors, hosts));
  return result;
}

absl::Status DistContext::AdoptView(int generation, const std::vector<int>& view,
                                    const std::vector<std::string>& hosts) {
  const int rank =
      static_cast<int>(std::find(view.begin(), view.end(), launch_rank_) - view.begin());
  LaunchEnv env = env_;
  env.rank = rank;
  env.world_size = static_cast<int>(view.size());
  env.local_world_size = 0;
  env.local_rank = 0;
  for (int i = 0; i < env.world_size; ++i) {
    if (hosts[i] != hosts[rank]) continue;
    if (i < rank) ++env.local_rank;
    ++env.local_world_size;
  }
  // The world's numbering first: should its groups not come about (a
  // joiner gone while they connect), the next regroup is of this view.
  groups_->generation = generation;
  groups_->watched_generation.store(generation);
  groups_->members = view;
  compat::ProcessGroupPtr control;
  compat::ProcessGroupPtr data;
  const auto timeout = internal::ToChronoMillis(options_.collective_timeout);
  try {
    control = compat::MakeGlooGroup(
        compat::MakePrefixStore(internal::RegroupKey(generation, "gloo"), groups_->store), rank,
        env.world_size, timeout, gloo_device_);
    data = control;
#if EVENSTEP_HAVE_NCCL
    if (groups_->nccl) {
      data = compat::MakeNcclGroup(
          compat::MakePrefixStore(internal::RegroupKey(generation, "nccl"), groups_->store), rank,
          env.world_size, timeout);
    }
#endif
  } catch (const std::exception& e) {
    absl::Status failed = absl::UnavailableError(
        absl::StrCat("rank ", rank, " (launch rank ", launch_rank_, "): regroup ", generation,
                     ": creating the process groups of the new world: ", internal::ErrorText(e)));
    absl::MutexLock lock(&groups_->mu);
    groups_->broken = failed;
    return failed;
  }
  for (compat::ProcessGroupPtr* g : {&groups_->control, &groups_->data, &groups_->sync_order}) {
    if (*g &&
        std::find(groups_->retired.begin(), groups_->retired.end(), *g) == groups_->retired.end()) {
      groups_->retired.push_back(*g);
    }
  }
  groups_->control = control;
  groups_->data = data;
  groups_->sync_order = compat::ProcessGroupPtr();
  groups_->ctx_store =
      compat::MakePrefixStore(absl::StrCat("evenstep/ctx/g", generation), groups_->store);
  groups_->regroup_begun.store(false);
  // Every count that names keys starts again in the new world's keys, so a
  // process that joined it names them as its members do.
  groups_->commit_stores = 0;
  groups_->agreements = 0;
  data_groups_ = 0;
  {
    absl::MutexLock lock(&groups_->mu);
    groups_->broken = absl::OkStatus();
    groups_->prefixes.clear();
  }
  env_ = env;
  op_seq_ = 0;
  nodes_.reset();
  return Barrier();
}

namespace {

// "<generation>\n<nonce>" (admitted) or "refused\n<nonce>\n<why>": the
// answer to a replacement's request under "evenstep/join/admitted/<launch
// rank>", for the request that carried `nonce` (an earlier replacement's
// answer stays there until this one's replaces it).
struct JoinAnswer {
  bool refused = false;
  int generation = 0;
  std::string why;
};

std::optional<JoinAnswer> AnswerFor(const std::string& text, const std::string& nonce) {
  std::vector<std::string> lines = absl::StrSplit(text, absl::MaxSplits('\n', 2));
  if (lines.size() < 2 || lines[1] != nonce) return std::nullopt;
  JoinAnswer answer;
  answer.refused = lines[0] == "refused";
  if (answer.refused) {
    answer.why = lines.size() > 2 ? lines[2] : "";
  } else if (!absl::SimpleAtoi(lines[0], &answer.generation)) {
    return std::nullopt;
  }
  return answer;
}

std::string Admission(int generation, const std::string& nonce) {
  return absl::StrCat(generation, "\n", nonce);
}
std::string Refusal(const std::string& nonce, const std::string& why) {
  return absl::StrCat("refused\n", nonce, "\n", why);
}

int64_t CountIn(c10d::Store& store, const std::string& key) {
  int64_t n = 0;
  return absl::SimpleAtoi(Text(store.get(key)), &n) ? n : 0;
}

}  // namespace

absl::Status DistContext::Join() {
  const std::string me =
      absl::StrCat("rank ", env_.rank, " (a replacement joining a running job: EVENSTEP_JOIN)");
  if (options_.on_rank_loss != DistOptions::OnRankLoss::kContinue) {
    return absl::FailedPreconditionError(
        absl::StrCat(me,
                     ": joining needs --evenstep_on_rank_loss=continue (DistOptions::"
                     "on_rank_loss = kContinue), as the running ranks have it"));
  }
  if (env_.world_size == 1) {
    return absl::InvalidArgumentError(absl::StrCat(me, ": a job of one rank has none to join"));
  }
  if (!env_.run_namespace.empty()) {
    return absl::FailedPreconditionError(absl::StrCat(
        me,
        ": torchrun's agent restarts every worker of the job when one fails, so there are "
        "no running ranks to join; a replacement can join under evenstep-run --respawn or "
        "a new srun step"));
  }
  if (env_.rank == 0 && !env_.agent_store) {
    return absl::FailedPreconditionError(absl::StrCat(
        me,
        ": rank 0 hosted the job's store (MASTER_ADDR:MASTER_PORT), which ended with it: "
        "there is nothing to join (a launcher's store, TORCHELASTIC_USE_AGENT_STORE as "
        "evenstep-run hosts it, outlives rank 0)"));
  }
  EVENSTEP_RETURN_IF_ERROR(Connect());
  EVENSTEP_RETURN_IF_ERROR(ChooseGlooDevice());
  EVENSTEP_ASSIGN_OR_RETURN(groups_->nccl, internal::PrepareNccl(options_, env_));
  // No regroup is this process's to watch until it is a member.
  groups_->watched_generation.store(1 << 29);
  EVENSTEP_RETURN_IF_ERROR(StartHeartbeat());
  c10d::Store& store = *groups_->store;
  const std::string nonce =
      absl::StrCat(getpid(), "@", internal::HostName(), "#", absl::ToUnixMicros(absl::Now()));
  const std::string answer_key = internal::JoinKey(absl::StrCat("admitted/", launch_rank_));
  std::optional<JoinAnswer> answer;
  std::vector<int> view;
  std::vector<std::string> hosts;
  try {
    store.set(internal::JoinKey(absl::StrCat("want/", launch_rank_)),
              Bytes(absl::StrCat(internal::HostName(), "\n", nonce)));
    store.add(internal::JoinKey("requests"), 1);
    Log(LogLevel::kInfo, absl::StrCat(me,
                                      ": asked the running ranks to admit it; they do at their "
                                      "next step boundary (waiting up to ",
                                      absl::FormatDuration(options_.rendezvous_timeout), ")"));
    const absl::Time deadline = absl::Now() + options_.rendezvous_timeout;
    while (!(answer = store.check({answer_key}) ? AnswerFor(Text(store.get(answer_key)), nonce)
                                                : std::nullopt)) {
      if (absl::Now() > deadline) {
        return absl::DeadlineExceededError(absl::StrCat(
            me, ": not admitted within ", absl::FormatDuration(options_.rendezvous_timeout),
            ": the running ranks admit a replacement at a step boundary (BalancedStep::Admit; a "
            "Session does not admit replacements yet) and only under "
            "--evenstep_on_rank_loss=continue; are they still running?"));
      }
      absl::SleepFor(absl::Milliseconds(20));
    }
    if (answer->refused) {
      return absl::FailedPreconditionError(
          absl::StrCat(me, ": refused by the running ranks: ", answer->why));
    }
    const int g = answer->generation;
    view = Parsed(Text(store.get(internal::RegroupKey(g, "view"))));
    hosts = HostsOf(store, g, view);
    groups_->joins_seen.store(CountIn(store, internal::RegroupKey(g, "requests")));
  } catch (const std::exception& e) {
    return absl::UnavailableError(internal::StoreLost(env_, "joining the running job", e));
  }
  if (!Holds(view, launch_rank_)) {
    return absl::FailedPreconditionError(
        absl::StrCat(me, ": admitted to regroup ", answer->generation, " but not in its view (",
                     Joined(view), "): a rank was lost while it was admitted; start it again"));
  }
  joined_ = true;
  groups_->join_pending.store(false);
  EVENSTEP_RETURN_IF_ERROR(AdoptView(answer->generation, view, hosts));
  groups_->raw_store->setTimeout(internal::ToChronoMillis(options_.collective_timeout));
  Log(LogLevel::kInfo, absl::StrCat("launch rank ", launch_rank_, ": admitted in regroup ",
                                    answer->generation, " as rank ", env_.rank, " of ",
                                    env_.world_size, "; the state comes from the running ranks"));
  return absl::OkStatus();
}

absl::StatusOr<Regrouped> DistContext::Admit() {
  if (options_.on_rank_loss != DistOptions::OnRankLoss::kContinue) {
    return absl::FailedPreconditionError(
        absl::StrCat("rank ", env_.rank, ": Admit needs DistOptions::on_rank_loss = kContinue"));
  }
  const int generation = groups_->generation + 1;
  const std::vector<int> members = groups_->members;
  c10d::Store& store = *groups_->store;
  const std::string view_key = internal::RegroupKey(generation, "view");
  auto in_key = [generation](int m) {
    return internal::RegroupKey(generation, absl::StrCat("in/", m));
  };
  std::vector<std::string> notes;  // rank 0's: requests it did not admit, and why
  std::vector<int> view;
  std::vector<std::string> hosts;
  try {
    store.set(in_key(launch_rank_), Bytes(internal::HostName()));
    if (env_.rank == 0) {
      const int64_t requests = store.add(internal::JoinKey("requests"), 0);
      std::vector<int> next = members;
      std::vector<std::pair<int, std::string>> admitted;  // launch rank, nonce
      for (int m = 0; m < groups_->launch_world; ++m) {
        const std::string want_key = internal::JoinKey(absl::StrCat("want/", m));
        if (!store.check({want_key})) continue;
        const std::vector<std::string> want =
            absl::StrSplit(Text(store.get(want_key)), absl::MaxSplits('\n', 1));
        store.deleteKey(want_key);
        const std::string nonce = want.size() > 1 ? want[1] : "";
        const std::string answer_key = internal::JoinKey(absl::StrCat("admitted/", m));
        if (Holds(members, m)) {
          const std::string why =
              absl::StrCat("launch rank ", m,
                           " is still running: two processes for one rank (check the "
                           "replacement's RANK)");
          store.set(answer_key, Bytes(Refusal(nonce, why)));
          notes.push_back(why);
          continue;
        }
        const std::string at_key = internal::AliveAtKey(m);
        if (store.check({at_key}) && Refused(Text(store.get(at_key)))) {
          notes.push_back(absl::StrCat("the replacement for launch rank ", m,
                                       " was gone before its admission"));
          continue;
        }
        store.set(in_key(m), Bytes(want[0]));
        next.push_back(m);
        admitted.emplace_back(m, nonce);
      }
      store.set(internal::RegroupKey(generation, "requests"), Bytes(std::to_string(requests)));
      const std::string proposed = Joined(next);
      const std::string decided = Text(store.compareSet(view_key, {}, Bytes(proposed)));
      for (const auto& [m, nonce] : admitted) {
        const std::string answer =
            decided == proposed
                ? Admission(generation, nonce)
                : Refusal(nonce, "a rank was lost while this one was admitted; start it again");
        store.set(internal::JoinKey(absl::StrCat("admitted/", m)), Bytes(answer));
      }
    }
    const absl::Time deadline = absl::Now() + options_.collective_timeout;
    while (!store.check({view_key})) {
      if (absl::Now() > deadline || RegroupBegun()) {
        return absl::UnavailableError(absl::StrCat(
            "rank ", env_.rank, ": admitting replacements (regroup ", generation,
            "): rank 0 wrote no view within ", absl::FormatDuration(options_.collective_timeout),
            RegroupBegun() ? " (a regroup began: a rank was lost)" : ""));
      }
      absl::SleepFor(absl::Milliseconds(5));
    }
    view = Parsed(Text(store.get(view_key)));
    hosts = HostsOf(store, generation, view);
    groups_->joins_seen.store(CountIn(store, internal::RegroupKey(generation, "requests")));
    groups_->join_pending.store(false);
  } catch (const std::exception& e) {
    return absl::UnavailableError(internal::StoreLost(
        env_, absl::StrCat("admitting replacements (regroup ", generation, ")"), e));
  }
  if (env_.rank == 0) {
    for (const std::string& note : notes)
      Log(LogLevel::kWarning, absl::StrCat("admission: ", note));
  }
  // (A regroup's view, when a rank was lost meanwhile and its view won,
  // leaves members out.)
  Regrouped result = Outcome(generation, members, view);
  EVENSTEP_RETURN_IF_ERROR(AdoptView(generation, view, hosts));
  return result;
}

}  // namespace evenstep

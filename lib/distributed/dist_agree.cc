// DistContext: the stages every rank passes before any goes on, agreed
// through the job's store rather than discovered in a collective: the
// rendezvous and the start-up stages of DistContext::Create, and Agree.
//
// Rendezvous protocol (keys under "evenstep/ctx/" in the job's store):
//   1. compareSet("rdzv/world_size", "", "<W> <rank>"): the first rank fixes
//      the world size; a rank that reads a different W fails at once with
//      InvalidArgument and publishes its message under "rdzv/error".
//   2. add("rdzv/rank/<r>", 1) > 1 means two processes claim rank r.
//   3. Each start-up stage (joined: the rendezvous; gloo_address: each rank
//      chose where Gloo binds) is agreed before any rank goes on: set
//      "rdzv/<stage>/<r>", add("rdzv/<stage>", 1), then poll until it is W,
//      "rdzv/error" shows up, or the rendezvous timeout passes
//      (DeadlineExceeded naming the ranks whose "rdzv/<stage>/<r>" is absent).
//      A rank that fails a stage publishes its message under "rdzv/error"
//      (the first one stays); the others stop naming it instead of waiting in
//      Gloo's connect for a peer that is gone (its timeout, then "Broken
//      pipe"). Every rank that stops adds to "rdzv/error_seen"; the rank that
//      hosts the store keeps it up until all W did (at most 10 s), so that
//      each rank can read why.
//   4. Agree(what, status) is one such stage under "agree/<n>/" (n counts
//      the context's calls), step "done", up to the collective timeout.
#include <ATen/ATen.h>

#include <algorithm>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "dist_context_internal.h"
#include "evenstep/dist_context.h"
#include "evenstep/internal/error_text.h"

namespace evenstep {

using internal::AwaitStage;
using internal::Bytes;
using internal::PublishFailure;
using internal::Stage;
using internal::StartUpStage;
using internal::StoreLost;
using internal::Text;

namespace {

// Whether this process hosts the job's c10d store (rank 0 without a
// launcher's agent store): the store ends with it.
bool HostsTheStore(const LaunchEnv& env) {
  return env.world_size > 1 && env.rank == 0 && !env.agent_store;
}

// This rank stops in a stage: the store of a process that hosts it stays up
// until every rank has read why (at most 10 s), then `status` is returned.
absl::Status StopInStage(c10d::Store& store, const LaunchEnv& env, const Stage& stage,
                         absl::Status status) {
  try {
    store.add(stage.prefix + "error_seen", 1);
    if (!HostsTheStore(env)) return status;
    const absl::Time deadline = absl::Now() + absl::Seconds(10);
    while (store.add(stage.prefix + "error_seen", 0) < env.world_size && absl::Now() < deadline) {
      absl::SleepFor(absl::Milliseconds(20));
    }
  } catch (const std::exception&) {
    // The store is gone: nobody is left to read it.
  }
  return status;
}

}  // namespace

namespace internal {

// What a store operation of `what` that threw becomes: this rank, where the
// store is and c10d's words, and for a rank that does not host the store
// and has no launcher's agent store, that rank 0 hosts it.
std::string StoreLost(const LaunchEnv& env, const std::string& what, const std::exception& e) {
  return absl::StrCat(
      "rank ", env.rank, ": ", what, " at ", env.master_addr, ":", env.master_port,
      " failed: ", internal::ErrorText(e),
      env.agent_store || env.rank == 0
          ? ""
          : " (rank 0 hosts that store: rank 0 has stopped or cannot be reached; its own output "
            "says why)");
}

// This rank failed a stage: its message published for the other ranks (the
// first failure's stays), then StopInStage.
absl::Status PublishFailure(c10d::Store& store, const LaunchEnv& env, const Stage& stage,
                            absl::Status status) {
  if (env.world_size == 1) return status;
  try {
    store.compareSet(stage.prefix + "error", {}, Bytes(status.message()));
  } catch (const std::exception&) {
    // The store is gone; the other ranks name its host.
  }
  return StopInStage(store, env, stage, std::move(status));
}

// Waits up to `timeout` for every rank to pass `stage`'s step `step`
// (`passed` says what that means, for the timeout's message), or for a
// rank's failure.
absl::Status AwaitStage(c10d::Store& store, const LaunchEnv& env, absl::Duration timeout,
                        const Stage& stage, const std::string& step, const std::string& passed) {
  const std::string counter = stage.prefix + step;
  try {
    store.set(absl::StrCat(counter, "/", env.rank), Bytes("1"));
    store.add(counter, 1);
    const absl::Time deadline = absl::Now() + timeout;
    absl::Duration pause = absl::Milliseconds(1);
    while (true) {
      // Every rank passed this step: go on, also when one has already
      // failed a later one (this rank meets that failure, or its own, there).
      const int64_t count = store.add(counter, 0);
      if (count >= env.world_size) return absl::OkStatus();
      if (store.check({stage.prefix + "error"})) {
        return StopInStage(store, env, stage,
                           absl::FailedPreconditionError(
                               absl::StrCat("rank ", env.rank, ": ", stage.stopped,
                                            " stopped on every rank because one failed: ",
                                            Text(store.get(stage.prefix + "error")))));
      }
      if (absl::Now() >= deadline) {
        std::vector<int> missing;
        for (int r = 0; r < env.world_size; ++r) {
          if (!store.check({absl::StrCat(counter, "/", r)})) missing.push_back(r);
        }
        return absl::DeadlineExceededError(absl::StrCat(
            "rank ", env.rank, ": ", stage.waited, " at ", env.master_addr, ":", env.master_port,
            " timed out after ", absl::FormatDuration(timeout), " with ", count, " of ",
            env.world_size, " ranks ", passed, "; missing rank(s) ", absl::StrJoin(missing, ", ")));
      }
      absl::SleepFor(pause);
      pause = std::min(pause * 2, absl::Milliseconds(50));
    }
  } catch (const std::exception& e) {
    return absl::UnavailableError(StoreLost(env, stage.waited, e));
  }
}

const Stage& StartUpStage() {
  static const Stage* const stage = new Stage{"rdzv/", "start-up", "rendezvous"};
  return *stage;
}

}  // namespace internal

absl::Status DistContext::Rendezvous() {
  if (env_.world_size == 1) return absl::OkStatus();
  c10d::Store& store = *groups_->ctx_store;
  const std::string where = absl::StrCat(env_.master_addr, ":", env_.master_port);
  try {
    const std::string mine = absl::StrCat(env_.world_size, " ", env_.rank);
    const std::string agreed = Text(store.compareSet("rdzv/world_size", {}, Bytes(mine)));
    std::vector<std::string> parts = absl::StrSplit(agreed, ' ');
    int agreed_world = 0;
    if (parts.size() != 2 || !absl::SimpleAtoi(parts[0], &agreed_world)) {
      return absl::InternalError(absl::StrCat("rank ", env_.rank, ": unreadable rendezvous key \"",
                                              agreed, "\" in the store at ", where));
    }
    if (agreed_world != env_.world_size) {
      return PublishFailure(
          store, env_, StartUpStage(),
          absl::InvalidArgumentError(absl::StrCat(
              "world size mismatch: rank ", env_.rank, " has WORLD_SIZE=", env_.world_size,
              " but rank ", parts[1], " joined with WORLD_SIZE=", agreed_world)));
    }
    // Where MASTER_ADDR is reached from this host, for a master host that
    // has its own name on loopback (ChooseGlooDevice): set before joining,
    // so every rank's is there once all have joined.
    store.set(absl::StrCat("rdzv/master_seen/", env_.rank), Bytes(MasterSeenHere()));
    if (store.add(absl::StrCat("rdzv/rank/", env_.rank), 1) > 1) {
      return PublishFailure(
          store, env_, StartUpStage(),
          absl::AlreadyExistsError(absl::StrCat("two processes claim rank ", env_.rank,
                                                " (check RANK / SLURM_PROCID of the job)")));
    }
  } catch (const std::exception& e) {
    return absl::UnavailableError(StoreLost(env_, "rendezvous", e));
  }
  return AwaitStage(store, env_, options_.rendezvous_timeout, StartUpStage(), "joined", "joined");
}

absl::Status DistContext::Agree(const std::string& what, const absl::Status& mine) {
  if (env_.world_size == 1) return mine;
  const Stage stage{absl::StrCat("agree/", groups_->agreements++, "/"), what, what};
  c10d::Store& store = *groups_->ctx_store;
  if (!mine.ok()) return PublishFailure(store, env_, stage, mine);
  return AwaitStage(store, env_, options_.collective_timeout, stage, "done", "done");
}

}  // namespace evenstep

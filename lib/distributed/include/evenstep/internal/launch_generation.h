// Which launch of a torchrun job this process belongs to, agreed through the
// job's store.
//
// torchrun's agent keeps one store for the whole job (TORCHELASTIC_USE_AGENT_
// STORE), so a restarted worker group meets the keys of the groups before it.
// TORCHELASTIC_RESTART_COUNT cannot tell them apart across hosts: an agent
// counts only its own workers' failures, so after a worker on host A dies the
// restarted group has RESTART_COUNT 1 on A and 0 on B (pytorch#108158,
// #135712), and a namespace built from it splits the group in two, each
// half waiting out the rendezvous timeout for the other.
//
// Generations instead, under the store prefix given (the run id's):
//   "gen"                   the newest generation (decimal; absent = 0)
//   "gen/<g>/claim/<r>"     add(1): 1 = rank r's first process in g
//   "gen/<g>/ready/<r>"     rank r saw every rank's claim in g
//   "gen/<g>/state"         g's fate, set once (compareSet): "done" or
//                           "abandoned"
// A rank claims its slot in the newest generation; a claim that is not the
// first (a process of an earlier launch claimed it) abandons g, moves "gen"
// to g + 1 and claims there. A rank that sees every rank ready in g decides
// it "done"; one that sees "gen" move on decides it "abandoned" and follows,
// unless g was decided "done" first (then it stays: every rank that was
// ready in g takes g). An earlier
// launch's processes are gone when the next one starts (the agents stop
// every worker before they meet again), so a generation where every rank is
// ready holds the claims of live processes only, one per rank.
#pragma once

#include <cstdint>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "evenstep/internal/c10d_compat.h"

namespace evenstep::internal {

// The generation this launch's `world` ranks agree on (rank `rank` calling);
// DeadlineExceeded after `timeout` naming the ranks missing from it;
// AlreadyExists when another live process keeps claiming this rank.
absl::StatusOr<int64_t> JoinLaunchGeneration(::c10d::Store& store, int rank, int world,
                                             absl::Duration timeout);

}  // namespace evenstep::internal

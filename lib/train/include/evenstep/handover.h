// evenstep::HandOver: a replacement that joined a running job
// (DistOptions::join, admitted by BalancedStep::Admit) gets the run's state
// from the running ranks over the network, without reading a checkpoint.
//
//   // the running ranks, at a step boundary:
//   if (step->JoinWaiting()) {
//     auto admitted = step->Admit();                  // the world grows
//     auto got = evenstep::HandOver(*ctx, {model.get(), &optimizer, step.get(), user});
//   }
//   // the replacement (EVENSTEP_JOIN=1), after BalancedStep::Create:
//   auto got = evenstep::HandOver(*ctx, {model.get(), &optimizer, step.get()});
//   // got->user_json: the running ranks' loop state; step->state().steps done
//
// What is sent: everything a checkpoint holds (train_checkpointer.h's
// TrainState: the model's parameters and buffers, the optimizers' state,
// the balancing state, the extra tensors and the user's JSON), checked on
// the joiner as a resume checks a checkpoint (names, shapes, dtypes, the
// optimizer's kind) before anything is written. The tensors are dealt to
// the running ranks by bytes (largest first to the least loaded), and each
// broadcasts its part: no one rank sends it all.
//
// Collective over the whole world (the running ranks and the joiners), at
// the same point on every rank; the next step refuses to begin before it.
// A joiner lost during it makes it fail (Unavailable) on the running ranks:
// they Regroup, and call HandOver again, which then finds no rank lacking
// the state and only clears the step's guard.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "evenstep/train_checkpointer.h"

namespace evenstep {

class DistContext;

struct HandOverResult {
  bool received = false;         // this rank lacked the state and got it
  std::string user_json = "{}";  // the running ranks' TrainState::user_json
  int64_t step = 0;              // their steps done (BalanceState::steps)
  std::vector<int> receivers;    // the ranks that got the state
  std::vector<int> senders;      // the ranks that sent a part of it
  int64_t bytes = 0;             // the state's size: what each receiver got
  int64_t bytes_sent = 0;        // this rank's part
  double seconds = 0;
};

// `state.balance` is required: the BalancedStep that admitted (or was
// created on the joiner) knows which ranks lack the state.
absl::StatusOr<HandOverResult> HandOver(DistContext& ctx, const TrainState& state);

}  // namespace evenstep

// Sharded, asynchronous, crash-consistent checkpoints.
//
// Every rank owns a share of the state's bytes (tensors larger than
// `slice_bytes` are split into slices; the shares differ by at most one
// slice) and writes it as its own HDF5 shard; nothing is gathered to rank 0.
// Save() blocks the training thread only for the snapshot into a reusable
// staging buffer (for device tensors, only for queueing asynchronous copies
// into page-locked staging on a side stream); the rest runs on the I/O
// fibers.
//
// Commit protocol (one checkpoint = DIR/step-SSSSSSSSSS/), written down once
// with what a crash at each write leaves: docs/design.md, "Checkpoints:
// commit protocol and crash states". In short: every rank writes its shard
// (tmp, fsync, rename, fsync), reports through the CommitStore, and the last
// to report writes manifest.json the same way (or, when a rank failed,
// removes the directory): a checkpoint is committed if and only if its
// manifest exists, and every rank's save returns the same outcome.
//
// Thread-safety: one training thread calls Save/Wait; the I/O runs on the
// writer's own runtime.
#pragma once

#include <cstdint>
#include <future>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "evenstep/env.h"
#include "evenstep/named_tensor.h"

namespace evenstep {

// The small shared key-value store ranks commit through (lib/ implements it
// over the c10d store; tests/testing/in_process_commit_store.h holds one for
// ranks as threads of one process).
class CommitStore {
 public:
  virtual ~CommitStore() = default;
  virtual absl::Status Set(const std::string& key, const std::string& value) = 0;
  // Waits until `key` is set (bounded by the store's timeout).
  virtual absl::StatusOr<std::string> Get(const std::string& key) = 0;
  virtual absl::StatusOr<int64_t> Add(const std::string& key, int64_t delta) = 0;
  // Another connection to the same keys, for a thread other than those
  // that may be waiting in Get on this one; null when this one is safe to
  // share between threads.
  virtual absl::StatusOr<std::unique_ptr<CommitStore>> Reconnect() {
    return std::unique_ptr<CommitStore>();
  }
};

enum class WhenBusy { kWait, kSkip };

struct CheckpointOptions {
  std::string dir;  // root: holds step-*/ and latest
  int keep = 3;     // committed checkpoints kept (the newest is never removed)
  int max_in_flight = 1;
  WhenBusy when_busy = WhenBusy::kWait;
  int64_t slice_bytes = 64 << 20;
  int io_threads = 2;
  Env* env = nullptr;  // null: Env::Default()
};

struct CheckpointContents {
  int64_t step = 0;
  // Names are '/'-separated segments ("model/fc.weight", "optimizer/3/exp_avg");
  // every rank passes the same names, shapes and dtypes in the same order.
  NamedTensors tensors;
  std::string extras_json = "{}";  // user state (sampler position, RNG, ...)
};

struct SaveTicket {
  int64_t step = 0;
  bool skipped = false;  // WhenBusy::kSkip and K saves were in flight
  // The save's outcome, the same on every rank: OK once the manifest is
  // committed; otherwise the first failing rank's error (naming the step,
  // the rank and the file), and no file of this save is left behind.
  std::shared_future<absl::Status> done;
  double snapshot_seconds = 0;  // the training stall
};

class CheckpointWriter {
 public:
  static absl::StatusOr<std::unique_ptr<CheckpointWriter>> Create(CheckpointOptions options,
                                                                  CommitStore* store, int rank,
                                                                  int world_size);
  ~CheckpointWriter();  // waits for saves in flight

  // Snapshots `state` and writes it in the background. InvalidArgument naming
  // the tensor for a bad name or dtype; the I/O outcome comes in the ticket.
  absl::StatusOr<SaveTicket> Save(const CheckpointContents& state);
  // Waits for every save in flight; the first error of any save since the
  // last WaitAll (none is dropped unread), OK otherwise.
  absl::Status WaitAll();
  // After a rank was lost (DistContext::Regroup): every save in flight that
  // not every rank has reported on can never commit. Each is ended now with
  // `why` as its outcome, on every rank that waits for it, instead of at the
  // store's timeout; a rank that reports on it later reads that outcome, so
  // none commits it (a fenced rank that wakes up included). Saves that every
  // rank reported on keep their outcome (one rank is committing them). Call
  // it on every survivor: the outcome is set once, and each returns the same
  // number of saves ended; wait for them with WaitAll.
  absl::StatusOr<int> Abandon(const absl::Status& why);

 private:
  struct Impl;
  explicit CheckpointWriter(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace evenstep

// FaultEnv (in the test library, not in libevenstep): an Env for tests that
// wraps another (usually Env::Default()) and counts its write points —
// Create, PWrite, Sync, Close, Rename, SyncDir, Remove, CreateDirs,
// RemoveTree — so a test can run an operation once to count them and then
// fail or crash at each one in turn:
//
//   FaultEnv env(Env::Default());
//   env.FailAt(7, ENOSPC);          // the 7th write point returns ENOSPC
//   env.CrashAt(7);                 // the 7th and every later one fail (Aborted)
//   ...                             // run the save; it reports the failure
//   env.RecoverFromCrash();         // what a power cut leaves behind:
//                                   // data written since the file's last Sync
//                                   // dropped, renames, creations and
//                                   // removals since the directory's last
//                                   // SyncDir undone (a file a rename replaced
//                                   // or a Remove unlinked comes back with its
//                                   // synced bytes; a directory CreateDirs
//                                   // made vanishes with all inside it unless
//                                   // its parent was synced). RemoveTree is
//                                   // not undone: the trees evenstep removes
//                                   // (old or uncommitted checkpoints) may
//                                   // come back after a real crash, and
//                                   // nothing depends on their absence.
//
// Thread-safety: thread-safe.
#pragma once

#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "evenstep/env.h"

namespace evenstep {

class FaultEnv : public EnvWrapper {
 public:
  explicit FaultEnv(Env* base) : EnvWrapper(base) {}

  // The n-th write point from now (1-based) fails with `error`; with
  // `persistent`, every later one as well.
  void FailAt(int64_t n, int error, bool persistent = false);
  // The n-th write point from now and all after it fail as if the machine
  // had stopped.
  void CrashAt(int64_t n);
  // Write points since construction or the last Reset().
  int64_t write_points() const;
  // Applies a crash's effects to the files touched through this Env, then
  // clears the crash and the counters.
  void RecoverFromCrash();
  // Clears faults and counters (tracking of unsynced state continues).
  void Reset();

  // The write points; reads, listings and the rest forward (EnvWrapper).
  absl::StatusOr<std::unique_ptr<File>> Create(const std::string& path) override;
  absl::Status Rename(const std::string& from, const std::string& to) override;
  absl::Status SyncDir(const std::string& dir) override;
  absl::Status Remove(const std::string& path) override;
  absl::Status CreateDirs(const std::string& dir) override;
  absl::Status RemoveTree(const std::string& dir) override;

 private:
  class FaultFile;
  friend class FaultFile;
  struct Tracked {
    int64_t synced_size = -1;  // -1: never synced
    bool dirty = false;        // written since the last Sync
    bool created_since_dir_sync = false;
  };
  struct PendingRename {
    std::string from, to;
    // The file `to` held before the rename replaced it (a crash before the
    // directory fsync brings it back: a real crash leaves the old entry or
    // the new one, never neither). Kept for files of up to 64 MiB.
    std::optional<std::string> replaced;
  };
  struct PendingRemove {
    std::string path;
    std::string durable;  // the bytes a crash brings back (its synced size)
  };
  // Counts a write point named `what` on `path`; non-OK when it must fail.
  absl::Status Point(const std::string& what, const std::string& path);

  mutable std::mutex mu_;
  int64_t points_ = 0;
  int64_t fail_at_ = 0;
  int fail_errno_ = 0;
  bool fail_persistent_ = false;
  int64_t crash_at_ = 0;
  bool crashed_ = false;
  std::map<std::string, Tracked> files_;
  std::map<std::string, std::vector<PendingRename>> renames_;  // by directory
  std::map<std::string, std::vector<PendingRemove>> removes_;  // by directory
  std::map<std::string, std::vector<std::string>> new_dirs_;   // by parent directory
};

}  // namespace evenstep

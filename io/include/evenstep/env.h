// Env: the file-system seam of evenstep's I/O. Every file operation of a
// checkpoint (create, pwrite, pread, fsync, rename, directory fsync, remove,
// list, free space) goes through an Env, so tests can inject failures (no
// space, I/O errors) and crashes (FaultEnv) without mocking HDF5: HDF5 only
// lays out a shard in memory, and the bytes reach the disk through Env.
//
// Errors are absl::Status with the path and the operation: ENOSPC/EDQUOT ->
// ResourceExhausted, ENOENT -> NotFound, EACCES/EPERM -> PermissionDenied,
// EEXIST -> AlreadyExists, others (EIO, ...) -> Internal/Unavailable.
// Thread-safety: Env methods are thread-safe; a File is used by one thread at
// a time (distinct Files may be used concurrently).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace evenstep {

class File {
 public:
  virtual ~File() = default;
  virtual const std::string& path() const = 0;
  // Writes all `n` bytes at `offset` (retrying short writes).
  virtual absl::Status PWrite(int64_t offset, const void* data, size_t n) = 0;
  // Reads exactly `n` bytes at `offset`; OutOfRange past the end.
  virtual absl::Status PRead(int64_t offset, void* data, size_t n) const = 0;
  // fsync: data and size are durable once this returns OK.
  virtual absl::Status Sync() = 0;
  virtual absl::StatusOr<int64_t> Size() const = 0;
  virtual absl::Status Close() = 0;
};

class Env {
 public:
  virtual ~Env() = default;
  // The POSIX file system (process-wide instance).
  static Env* Default();

  // Creates (or truncates) `path` for writing and reading.
  virtual absl::StatusOr<std::unique_ptr<File>> Create(const std::string& path) = 0;
  // Opens an existing regular file for reading. FailedPrecondition for a
  // symbolic link (the last component), a directory, FIFO or device: the
  // open never blocks.
  virtual absl::StatusOr<std::unique_ptr<File>> OpenForRead(const std::string& path) = 0;
  // Atomic replace of `to` by `from` (rename(2)); durable after SyncDir.
  virtual absl::Status Rename(const std::string& from, const std::string& to) = 0;
  // fsync of a directory: makes creations, renames and removals in it durable.
  virtual absl::Status SyncDir(const std::string& dir) = 0;
  // unlink(2); durable after SyncDir of its directory (a crash before that
  // may bring the file back).
  virtual absl::Status Remove(const std::string& path) = 0;
  // Creates `dir` and missing parents (mkdir -p); OK when it exists. Each
  // new directory's entry is durable only after SyncDir of its parent
  // (CreateDirsDurably does both).
  virtual absl::Status CreateDirs(const std::string& dir) = 0;
  // Removes `dir` and everything below it (durable after SyncDir of its
  // parent).
  virtual absl::Status RemoveTree(const std::string& dir) = 0;
  // Entry names (not paths) in `dir`, sorted.
  virtual absl::StatusOr<std::vector<std::string>> List(const std::string& dir) = 0;
  virtual absl::StatusOr<int64_t> FreeSpace(const std::string& dir) = 0;
  virtual bool Exists(const std::string& path) = 0;
};

// An Env that forwards every call to `target` (leveldb's EnvWrapper): a
// wrapper overrides only the calls it changes (FaultEnv: the write points).
class EnvWrapper : public Env {
 public:
  explicit EnvWrapper(Env* target) : target_(target) {}
  Env* target() const { return target_; }

  absl::StatusOr<std::unique_ptr<File>> Create(const std::string& path) override {
    return target_->Create(path);
  }
  absl::StatusOr<std::unique_ptr<File>> OpenForRead(const std::string& path) override {
    return target_->OpenForRead(path);
  }
  absl::Status Rename(const std::string& from, const std::string& to) override {
    return target_->Rename(from, to);
  }
  absl::Status SyncDir(const std::string& dir) override { return target_->SyncDir(dir); }
  absl::Status Remove(const std::string& path) override { return target_->Remove(path); }
  absl::Status CreateDirs(const std::string& dir) override { return target_->CreateDirs(dir); }
  absl::Status RemoveTree(const std::string& dir) override { return target_->RemoveTree(dir); }
  absl::StatusOr<std::vector<std::string>> List(const std::string& dir) override {
    return target_->List(dir);
  }
  absl::StatusOr<int64_t> FreeSpace(const std::string& dir) override {
    return target_->FreeSpace(dir);
  }
  bool Exists(const std::string& path) override { return target_->Exists(path); }

 private:
  Env* const target_;
};

// Status for a failed syscall: the code from errno, the message naming the
// operation and the path.
absl::Status ErrnoStatus(int error, const std::string& operation, const std::string& path);

// Reads a whole (small) file through `env`; DataLoss naming the file, before
// anything is allocated, when it holds more than `max_bytes`.
absl::StatusOr<std::string> ReadFileToString(Env& env, const std::string& path,
                                             int64_t max_bytes = int64_t{64} << 20);
// `path` lexically normalised, without a trailing slash ("." when empty).
std::string NormalPath(const std::string& path);
// The directory holding `path` ("." for a bare name).
std::string ParentDir(const std::string& path);
// The last component of `path`, normalised ("." for ".").
std::string BaseName(const std::string& path);

namespace internal {
// PosixEnv's directory work in POSIX calls (never std::filesystem, whose
// functions the torch wheel's libraries export copies of): the names in
// `dir` (sorted, without . and ..); `dir` and its missing ancestors;
// `path` and everything below it (OK when it does not exist; links are
// removed, never followed).
absl::StatusOr<std::vector<std::string>> ListDir(const std::string& dir);
absl::Status MakeDirs(const std::string& dir);
absl::Status RemoveTree(const std::string& path);
}  // namespace internal
// `dir` and those of its ancestors that do not exist, innermost first,
// normalised: up to the first that exists (or the root, or ".").
std::vector<std::string> MissingDirs(Env& env, const std::string& dir);
// CreateDirs(dir), then SyncDir of the parent of every directory it found
// missing and of `dir`'s own parent, always (top down; a peer may have
// created `dir` a moment ago without syncing yet), so that a crash cannot
// lose `dir` and with it what is later written and synced inside it.
absl::Status CreateDirsDurably(Env& env, const std::string& dir);
// Writes `data` to `path` crash-safely: `path`.tmp (in writes of at most
// 64 MiB), fsync, rename over `path`, fsync of the directory; a crash leaves
// the old file or the new one, whole. On a failure before the rename the
// tmp file is removed. When only the directory sync fails, `path` holds the
// new bytes but its name may not survive a crash: with `remove_if_unsynced`
// it is removed (a checkpoint shard that must not count), otherwise left.
absl::Status WriteFileAtomically(Env& env, const std::string& path, const char* data, size_t size,
                                 bool remove_if_unsynced = false);
inline absl::Status WriteFileAtomically(Env& env, const std::string& path,
                                        const std::string& data) {
  return WriteFileAtomically(env, path, data.data(), data.size());
}

}  // namespace evenstep

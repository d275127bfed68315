// AsyncAppender: a text file that one thread appends to without waiting for
// the disk. Appends are buffered up to `flush_bytes` and then written by a
// fiber of a private IoRuntime (pwrite through the Env), so memory stays
// bounded and the caller never blocks on I/O. Used for timelines and metric
// logs.
// Thread-safety: one thread appends; Flush/Close from the same thread.
#pragma once

#include <cstdint>
#include <future>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "evenstep/env.h"

namespace evenstep {

class IoRuntime;

class AsyncAppender {
 public:
  static absl::StatusOr<std::unique_ptr<AsyncAppender>> Create(const std::string& path,
                                                               size_t flush_bytes = 256 << 10,
                                                               Env* env = nullptr);
  // A new segment of a log that earlier runs (a resume) may have written:
  // STEM + EXT when there is none yet, else STEM.N + EXT for the first free
  // N = 1, 2, ...; nothing an earlier segment wrote is overwritten.
  static absl::StatusOr<std::unique_ptr<AsyncAppender>> CreateSegment(const std::string& stem,
                                                                      const std::string& ext,
                                                                      size_t flush_bytes = 256
                                                                                           << 10,
                                                                      Env* env = nullptr);
  ~AsyncAppender();
  void Append(const std::string& text);
  // Writes what is buffered and waits for every write; the first error.
  absl::Status Flush();
  // Flush, fsync, close.
  absl::Status Close();
  const std::string& path() const { return path_; }

 private:
  AsyncAppender(std::string path, std::unique_ptr<File> file, size_t flush_bytes);
  void StartWrite();

  std::string path_;
  std::unique_ptr<File> file_;
  std::unique_ptr<IoRuntime> io_;
  size_t flush_bytes_;
  std::string buffer_;
  int64_t offset_ = 0;
  bool closed_ = false;
  std::vector<std::future<absl::Status>> writes_;
  absl::Status first_error_;
};

}  // namespace evenstep

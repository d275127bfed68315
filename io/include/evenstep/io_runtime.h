// IoRuntime: the fibers that carry evenstep's background I/O. One scheduler
// thread runs Boost.Fiber fibers that orchestrate (snapshot written ->
// checksum -> fsync -> rename -> report -> commit); blocking calls (pwrite,
// fsync, rename) run on a small pool of I/O threads through Blocking(), which
// suspends only the calling fiber, so a long write never holds up a log
// flush or another rank's report. The training thread gets a std::future.
//
//   IoRuntime io(/*io_threads=*/2);
//   std::future<absl::Status> done = io.Spawn([&] {
//     return io.Blocking([&] { return file->Sync(); });
//   });
//
// Destruction drains: every spawned task finishes before it returns.
// Thread-safety: Spawn may be called from any thread; Blocking only from a
// fiber of this runtime.
#pragma once

#include <functional>
#include <future>
#include <memory>

#include "absl/status/status.h"

namespace evenstep {

class IoRuntime {
 public:
  explicit IoRuntime(int io_threads = 2);
  ~IoRuntime();
  IoRuntime(const IoRuntime&) = delete;
  IoRuntime& operator=(const IoRuntime&) = delete;

  std::future<absl::Status> Spawn(std::function<absl::Status()> task);
  absl::Status Blocking(std::function<absl::Status()> call);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace evenstep

// A dataset on real storage: variable-length samples (bytes) in one file,
// read one sample at a time with pread, so that the samples and benchmarks
// pay the storage path's latency instead of reading from memory.
//
// Format (little-endian): "ESSAMP01", u64 n, u64 offsets[n + 1] (from the
// start of the data), then the samples' bytes back to back. Written once by
// WriteSampleFile (to a temporary name, synced, renamed: never half there).
//
//   EVENSTEP_RETURN_IF_ERROR(WriteSampleFile(path, texts));
//   EVENSTEP_ASSIGN_OR_RETURN(auto file, SampleFile::Open(path));
//   file->DropCache();                        // the next reads are cold
//   absl::StatusOr<std::string> s = file->Read(17);
//
// Thread-safety: Read, DropCache and ResidentFraction from any thread.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace evenstep::samples {

// Writes `samples` to `path` durably. An error names the path and the step.
absl::Status WriteSampleFile(const std::string& path, const std::vector<std::string>& samples);

class SampleFile {
 public:
  // Opens and checks the header and offsets (an error names the path and
  // what is wrong: not a sample file, truncated, offsets out of order).
  static absl::StatusOr<std::unique_ptr<SampleFile>> Open(const std::string& path);
  ~SampleFile();
  SampleFile(const SampleFile&) = delete;
  SampleFile& operator=(const SampleFile&) = delete;

  int64_t size() const { return static_cast<int64_t>(offsets_.size()) - 1; }
  // Sample i's length in bytes (from the offsets; no read).
  int64_t length(int64_t i) const { return offsets_[i + 1] - offsets_[i]; }
  std::vector<int64_t> lengths() const;
  // Sample i's bytes by pread. OutOfRange for a bad index; DataLoss naming
  // the path and the sample for a short read or an I/O error.
  absl::StatusOr<std::string> Read(int64_t i) const;
  // Asks the kernel to drop the file's cached pages (posix_fadvise
  // DONTNEED), so the next reads come from the device. Filesystems that hold
  // files in memory (tmpfs) keep them: ResidentFraction tells.
  absl::Status DropCache() const;
  // The fraction of the file's pages in the page cache now (mincore), or -1
  // when it cannot be told.
  double ResidentFraction() const;
  const std::string& path() const { return path_; }

 private:
  SampleFile(std::string path, int fd, std::vector<int64_t> offsets, int64_t data_start,
             int64_t file_size);
  std::string path_;
  int fd_ = -1;
  std::vector<int64_t> offsets_;
  int64_t data_start_ = 0;
  int64_t file_size_ = 0;
};

}  // namespace evenstep::samples

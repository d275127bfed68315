#include "samples/sample_file.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"

namespace evenstep::samples {

namespace {

constexpr char kMagic[8] = {'E', 'S', 'S', 'A', 'M', 'P', '0', '1'};

std::string Errno() { return std::strerror(errno); }

// Writes all of `bytes` at the end of `fd`.
bool WriteAll(int fd, const void* bytes, size_t n) {
  const char* p = static_cast<const char*>(bytes);
  while (n > 0) {
    const ssize_t w = ::write(fd, p, n);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return false;
    p += w;
    n -= static_cast<size_t>(w);
  }
  return true;
}

// Reads exactly n bytes at `offset`; false on a short read or an error
// (errno 0 for a short read).
bool ReadAll(int fd, void* bytes, size_t n, int64_t offset) {
  char* p = static_cast<char*>(bytes);
  while (n > 0) {
    const ssize_t r = ::pread(fd, p, n, offset);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) {
      if (r == 0) errno = 0;
      return false;
    }
    p += r;
    n -= static_cast<size_t>(r);
    offset += r;
  }
  return true;
}

}  // namespace

absl::Status WriteSampleFile(const std::string& path, const std::vector<std::string>& samples) {
  const std::string tmp = path + ".tmp";
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return absl::UnavailableError(absl::StrCat("creating ", tmp, ": ", Errno()));
  std::vector<uint64_t> head = {0, samples.size()};
  std::memcpy(&head[0], kMagic, sizeof(kMagic));
  uint64_t at = 0;
  head.push_back(at);
  for (const std::string& s : samples) head.push_back(at += s.size());
  bool ok = WriteAll(fd, head.data(), head.size() * sizeof(uint64_t));
  for (size_t i = 0; ok && i < samples.size(); ++i) {
    ok = WriteAll(fd, samples[i].data(), samples[i].size());
  }
  ok = ok && ::fsync(fd) == 0;
  const std::string error = ok ? "" : Errno();
  ::close(fd);
  if (!ok || ::rename(tmp.c_str(), path.c_str()) != 0) {
    const std::string why = ok ? Errno() : error;
    ::unlink(tmp.c_str());
    return absl::UnavailableError(absl::StrCat("writing ", path, ": ", why));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<SampleFile>> SampleFile::Open(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return absl::NotFoundError(absl::StrCat("opening ", path, ": ", Errno()));
  auto fail = [&](const std::string& what) {
    ::close(fd);
    return absl::DataLossError(absl::StrCat(path, ": ", what));
  };
  struct stat st {};
  if (::fstat(fd, &st) != 0) return fail(absl::StrCat("fstat: ", Errno()));
  const int64_t file_size = st.st_size;
  uint64_t head[2] = {0, 0};
  if (!ReadAll(fd, head, sizeof(head), 0) || std::memcmp(head, kMagic, sizeof(kMagic)) != 0) {
    return fail("not an evenstep sample file (no ESSAMP01 header)");
  }
  const uint64_t n = head[1];
  const int64_t data_start = static_cast<int64_t>(sizeof(head) + (n + 1) * sizeof(uint64_t));
  if (n > static_cast<uint64_t>(file_size) || data_start > file_size) {
    return fail(absl::StrCat("truncated: ", n, " samples need ", data_start,
                             " bytes of header, the file has ", file_size));
  }
  std::vector<uint64_t> raw(n + 1);
  if (!ReadAll(fd, raw.data(), raw.size() * sizeof(uint64_t), sizeof(head))) {
    return fail("reading the offsets");
  }
  std::vector<int64_t> offsets(raw.begin(), raw.end());
  for (uint64_t i = 0; i < n; ++i) {
    if (offsets[i + 1] < offsets[i]) {
      return fail(absl::StrCat("offsets out of order at sample ", i));
    }
  }
  if (offsets[0] != 0 || data_start + offsets[n] != file_size) {
    return fail(absl::StrCat("the samples should end at byte ", data_start + offsets[n],
                             ", the file has ", file_size, " bytes"));
  }
  return std::unique_ptr<SampleFile>(
      new SampleFile(path, fd, std::move(offsets), data_start, file_size));
}

SampleFile::SampleFile(std::string path, int fd, std::vector<int64_t> offsets, int64_t data_start,
                       int64_t file_size)
    : path_(std::move(path)),
      fd_(fd),
      offsets_(std::move(offsets)),
      data_start_(data_start),
      file_size_(file_size) {}

SampleFile::~SampleFile() {
  if (fd_ >= 0) ::close(fd_);
}

std::vector<int64_t> SampleFile::lengths() const {
  std::vector<int64_t> out;
  for (int64_t i = 0; i < size(); ++i) out.push_back(length(i));
  return out;
}

absl::StatusOr<std::string> SampleFile::Read(int64_t i) const {
  if (i < 0 || i >= size()) {
    return absl::OutOfRangeError(
        absl::StrCat(path_, ": sample ", i, " does not exist (", size(), " samples)"));
  }
  std::string out(static_cast<size_t>(length(i)), '\0');
  if (!out.empty() && !ReadAll(fd_, out.data(), out.size(), data_start_ + offsets_[i])) {
    return absl::DataLossError(
        absl::StrCat(path_, ": reading sample ", i, ": ", errno == 0 ? "short read" : Errno()));
  }
  return out;
}

absl::Status SampleFile::DropCache() const {
  const int rc = ::posix_fadvise(fd_, 0, 0, POSIX_FADV_DONTNEED);
  if (rc != 0) {
    return absl::UnavailableError(
        absl::StrCat(path_, ": posix_fadvise(DONTNEED): ", std::strerror(rc)));
  }
  return absl::OkStatus();
}

double SampleFile::ResidentFraction() const {
  if (file_size_ == 0) return 0;
  void* map = ::mmap(nullptr, static_cast<size_t>(file_size_), PROT_READ, MAP_SHARED, fd_, 0);
  if (map == MAP_FAILED) return -1;
  const long page = ::sysconf(_SC_PAGESIZE);
  const size_t pages = (static_cast<size_t>(file_size_) + page - 1) / page;
  std::vector<unsigned char> in(pages);
  double out = -1;
  if (::mincore(map, static_cast<size_t>(file_size_), in.data()) == 0) {
    size_t resident = 0;
    for (unsigned char c : in) resident += c & 1;
    out = static_cast<double>(resident) / static_cast<double>(pages);
  }
  ::munmap(map, static_cast<size_t>(file_size_));
  return out;
}

}  // namespace evenstep::samples

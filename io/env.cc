// PosixEnv: Env over POSIX syscalls. No std::filesystem: the torch wheel's
// libtorch_cpu.so exports its own copies of std::filesystem's functions
// (remove_all and the directory iterators among them), and which copy a
// program binds to depends on its link order; a mismatched one crashed a
// GPU run's test processes. Directories are listed, made and removed here
// with opendir/mkdir/unlink/rmdir, and paths are normalised as strings.
#include "evenstep/env.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "evenstep/status_macros.h"

namespace evenstep {

absl::Status ErrnoStatus(int error, const std::string& operation, const std::string& path) {
  const std::string message = absl::StrCat(operation, " ", path, ": ", std::strerror(error));
  switch (error) {
    case ENOSPC:
    case EDQUOT:
      return absl::ResourceExhaustedError(message);
    case ENOENT:
      return absl::NotFoundError(message);
    case EACCES:
    case EPERM:
    case EROFS:
      return absl::PermissionDeniedError(message);
    case EEXIST:
      return absl::AlreadyExistsError(message);
    case EINTR:
    case EAGAIN:
      return absl::UnavailableError(message);
    default:
      return absl::InternalError(message);
  }
}

namespace {

class PosixFile : public File {
 public:
  PosixFile(std::string path, int fd) : path_(std::move(path)), fd_(fd) {}
  ~PosixFile() override {
    if (fd_ >= 0) ::close(fd_);
  }
  const std::string& path() const override { return path_; }
  absl::Status PWrite(int64_t offset, const void* data, size_t n) override {
    const char* p = static_cast<const char*>(data);
    while (n > 0) {
      const ssize_t w = ::pwrite(fd_, p, std::min<size_t>(n, 1 << 30), offset);
      if (w < 0) {
        if (errno == EINTR) continue;
        return ErrnoStatus(errno, "pwrite", path_);
      }
      p += w;
      offset += w;
      n -= static_cast<size_t>(w);
    }
    return absl::OkStatus();
  }
  absl::Status PRead(int64_t offset, void* data, size_t n) const override {
    char* p = static_cast<char*>(data);
    while (n > 0) {
      const ssize_t r = ::pread(fd_, p, std::min<size_t>(n, 1 << 30), offset);
      if (r < 0) {
        if (errno == EINTR) continue;
        return ErrnoStatus(errno, "pread", path_);
      }
      if (r == 0) {
        return absl::OutOfRangeError(
            absl::StrCat("pread ", path_, ": ", n, " bytes missing at offset ", offset));
      }
      p += r;
      offset += r;
      n -= static_cast<size_t>(r);
    }
    return absl::OkStatus();
  }
  absl::Status Sync() override {
    if (::fsync(fd_) != 0) return ErrnoStatus(errno, "fsync", path_);
    return absl::OkStatus();
  }
  absl::StatusOr<int64_t> Size() const override {
    struct stat st;
    if (::fstat(fd_, &st) != 0) return ErrnoStatus(errno, "fstat", path_);
    return static_cast<int64_t>(st.st_size);
  }
  absl::Status Close() override {
    if (fd_ < 0) return absl::OkStatus();
    const int fd = fd_;
    fd_ = -1;
    if (::close(fd) != 0) return ErrnoStatus(errno, "close", path_);
    return absl::OkStatus();
  }

 private:
  std::string path_;
  int fd_;
};

class PosixEnv : public Env {
 public:
  absl::StatusOr<std::unique_ptr<File>> Create(const std::string& path) override {
    const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0) return ErrnoStatus(errno, "create", path);
    return std::unique_ptr<File>(new PosixFile(path, fd));
  }
  absl::StatusOr<std::unique_ptr<File>> OpenForRead(const std::string& path) override {
    // O_NONBLOCK: opening a FIFO must not wait for a writer; O_NOFOLLOW: the
    // last component may not be a symbolic link. Then only regular files.
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
    if (fd < 0) {
      if (errno == ELOOP) {
        return absl::FailedPreconditionError(
            absl::StrCat("open ", path, ": a symbolic link (evenstep reads regular files only)"));
      }
      return ErrnoStatus(errno, "open", path);
    }
    struct stat st;
    if (::fstat(fd, &st) != 0) {
      const int error = errno;
      ::close(fd);
      return ErrnoStatus(error, "fstat", path);
    }
    if (!S_ISREG(st.st_mode)) {
      ::close(fd);
      return absl::FailedPreconditionError(absl::StrCat("open ", path, ": not a regular file (a ",
                                                        S_ISDIR(st.st_mode)    ? "directory"
                                                        : S_ISFIFO(st.st_mode) ? "FIFO"
                                                                               : "device or socket",
                                                        "); evenstep reads regular files only"));
    }
    return std::unique_ptr<File>(new PosixFile(path, fd));
  }
  absl::Status Rename(const std::string& from, const std::string& to) override {
    if (::rename(from.c_str(), to.c_str()) != 0) {
      return ErrnoStatus(errno, "rename", from + " -> " + to);
    }
    return absl::OkStatus();
  }
  absl::Status SyncDir(const std::string& dir) override {
    const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0) return ErrnoStatus(errno, "open directory", dir);
    const int rc = ::fsync(fd);
    const int error = errno;
    ::close(fd);
    if (rc != 0) return ErrnoStatus(error, "fsync directory", dir);
    return absl::OkStatus();
  }
  absl::Status Remove(const std::string& path) override {
    if (::unlink(path.c_str()) != 0) return ErrnoStatus(errno, "remove", path);
    return absl::OkStatus();
  }
  absl::Status CreateDirs(const std::string& dir) override { return internal::MakeDirs(dir); }
  absl::Status RemoveTree(const std::string& dir) override { return internal::RemoveTree(dir); }
  absl::StatusOr<std::vector<std::string>> List(const std::string& dir) override {
    return internal::ListDir(dir);
  }
  absl::StatusOr<int64_t> FreeSpace(const std::string& dir) override {
    struct statvfs st;
    if (::statvfs(dir.c_str(), &st) != 0) return ErrnoStatus(errno, "statvfs", dir);
    return static_cast<int64_t>(st.f_bavail) * static_cast<int64_t>(st.f_frsize);
  }
  bool Exists(const std::string& path) override { return ::access(path.c_str(), F_OK) == 0; }
};

}  // namespace

Env* Env::Default() {
  static PosixEnv* env = new PosixEnv;
  return env;
}

absl::StatusOr<std::string> ReadFileToString(Env& env, const std::string& path, int64_t max_bytes) {
  EVENSTEP_ASSIGN_OR_RETURN(std::unique_ptr<File> file, env.OpenForRead(path));
  EVENSTEP_ASSIGN_OR_RETURN(const int64_t size, file->Size());
  if (size > max_bytes) {
    return absl::DataLossError(absl::StrCat(path, ": ", size, " bytes, more than the ", max_bytes,
                                            " such a file may hold"));
  }
  std::string data(static_cast<size_t>(size), '\0');
  EVENSTEP_RETURN_IF_ERROR(file->PRead(0, data.data(), data.size()));
  return data;
}

std::string NormalPath(const std::string& path) {
  const bool absolute = !path.empty() && path[0] == '/';
  std::vector<absl::string_view> parts;
  for (absl::string_view part : absl::StrSplit(path, '/', absl::SkipEmpty())) {
    if (part == ".") continue;
    if (part == ".." && !parts.empty() && parts.back() != "..") {
      parts.pop_back();
    } else if (part != ".." || !absolute) {
      parts.push_back(part);  // ".." above the root is the root
    }
  }
  const std::string joined = absl::StrJoin(parts, "/");
  if (absolute) return "/" + joined;
  return joined.empty() ? "." : joined;
}

std::string ParentDir(const std::string& path) {
  const std::string p = NormalPath(path);
  const size_t slash = p.rfind('/');
  if (slash == std::string::npos) return ".";
  return slash == 0 ? "/" : p.substr(0, slash);
}

std::string BaseName(const std::string& path) {
  const std::string p = NormalPath(path);
  const size_t slash = p.rfind('/');
  return slash == std::string::npos ? p : p.substr(slash + 1);
}

namespace internal {

absl::StatusOr<std::vector<std::string>> ListDir(const std::string& dir) {
  DIR* d = ::opendir(dir.c_str());
  if (d == nullptr) return ErrnoStatus(errno, "list", dir);
  std::vector<std::string> names;
  errno = 0;
  while (const struct dirent* entry = ::readdir(d)) {
    const std::string name = entry->d_name;
    if (name != "." && name != "..") names.push_back(name);
  }
  const int error = errno;
  ::closedir(d);
  if (error != 0) return ErrnoStatus(error, "list", dir);
  std::sort(names.begin(), names.end());
  return names;
}

absl::Status MakeDirs(const std::string& dir) {
  const std::string target = NormalPath(dir);
  std::string prefix = target[0] == '/' ? "/" : "";
  for (absl::string_view part : absl::StrSplit(target, '/', absl::SkipEmpty())) {
    if (!prefix.empty() && prefix != "/") prefix += '/';
    absl::StrAppend(&prefix, part);
    if (::mkdir(prefix.c_str(), 0755) == 0) continue;
    const int error = errno;
    struct stat st;
    if (error == EEXIST && ::stat(prefix.c_str(), &st) == 0 && S_ISDIR(st.st_mode)) continue;
    return ErrnoStatus(error == EEXIST ? ENOTDIR : error, "create directory", prefix);
  }
  return absl::OkStatus();
}

absl::Status RemoveTree(const std::string& path) {
  struct stat st;
  if (::lstat(path.c_str(), &st) != 0) {
    return errno == ENOENT ? absl::OkStatus() : ErrnoStatus(errno, "remove", path);
  }
  if (!S_ISDIR(st.st_mode)) {  // a file or a link (never followed)
    if (::unlink(path.c_str()) != 0 && errno != ENOENT) return ErrnoStatus(errno, "remove", path);
    return absl::OkStatus();
  }
  EVENSTEP_ASSIGN_OR_RETURN(const std::vector<std::string> names, ListDir(path));
  for (const std::string& name : names) {
    EVENSTEP_RETURN_IF_ERROR(RemoveTree(path + "/" + name));
  }
  if (::rmdir(path.c_str()) != 0 && errno != ENOENT) {
    return ErrnoStatus(errno, "remove directory", path);
  }
  return absl::OkStatus();
}

}  // namespace internal

std::vector<std::string> MissingDirs(Env& env, const std::string& dir) {
  std::vector<std::string> missing;
  for (std::string p = NormalPath(dir); p != "." && p != "/" && !env.Exists(p); p = ParentDir(p)) {
    missing.push_back(p);
  }
  return missing;
}

absl::Status CreateDirsDurably(Env& env, const std::string& dir) {
  // `dir` itself, always (a peer may have just created it and not synced
  // yet; one more sync is cheap, and the count of syncs does not depend on
  // who came first), then every missing ancestor, innermost first.
  const std::string leaf = NormalPath(dir);
  std::vector<std::string> entries = MissingDirs(env, ParentDir(leaf));
  entries.insert(entries.begin(), leaf);
  EVENSTEP_RETURN_IF_ERROR(env.CreateDirs(dir));
  for (auto it = entries.rbegin(); it != entries.rend(); ++it) {
    EVENSTEP_RETURN_IF_ERROR(env.SyncDir(ParentDir(*it)), "making the directory ", *it, " durable");
  }
  return absl::OkStatus();
}

absl::Status WriteFileAtomically(Env& env, const std::string& path, const char* data, size_t size,
                                 bool remove_if_unsynced) {
  constexpr size_t kChunk = size_t{64} << 20;
  const std::string tmp = path + ".tmp";
  EVENSTEP_ASSIGN_OR_RETURN(std::unique_ptr<File> file, env.Create(tmp));
  absl::Status s;
  for (size_t off = 0; s.ok() && off < size; off += kChunk) {
    s = file->PWrite(static_cast<int64_t>(off), data + off, std::min(kChunk, size - off));
  }
  if (s.ok()) s = file->Sync();
  absl::Status closed = file->Close();
  if (s.ok()) s = closed;
  if (s.ok()) s = env.Rename(tmp, path);
  if (!s.ok()) {
    env.Remove(tmp).IgnoreError();
    return s;
  }
  s = env.SyncDir(ParentDir(path));
  if (!s.ok() && remove_if_unsynced) env.Remove(path).IgnoreError();
  return s;
}

}  // namespace evenstep

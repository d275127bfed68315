// BuildShardImage: HDF5 container layout in memory (see h5_shard.h).
#include "evenstep/internal/h5_shard.h"

#include <dlfcn.h>
#include <fcntl.h>
#include <hdf5.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "evenstep/status_macros.h"
#include "nlohmann/json.hpp"

extern char** environ;

namespace evenstep::internal {
namespace {

std::mutex& Hdf5Mutex() {
  static std::mutex mu;
  return mu;
}

// Closes an HDF5 handle with the right function when it goes out of scope.
class Handle {
 public:
  Handle(hid_t id, herr_t (*close)(hid_t)) : id_(id), close_(close) {}
  ~Handle() {
    if (id_ >= 0) close_(id_);
  }
  Handle(const Handle&) = delete;
  Handle& operator=(const Handle&) = delete;
  hid_t get() const { return id_; }
  bool ok() const { return id_ >= 0; }

 private:
  hid_t id_;
  herr_t (*close_)(hid_t);
};

// The HDF5 file type of a dtype name (a new copy the caller closes), or -1.
hid_t FileType(const std::string& dtype) {
  if (dtype == "float32") return H5Tcopy(H5T_IEEE_F32LE);
  if (dtype == "float64") return H5Tcopy(H5T_IEEE_F64LE);
  if (dtype == "int8") return H5Tcopy(H5T_STD_I8LE);
  if (dtype == "int16") return H5Tcopy(H5T_STD_I16LE);
  if (dtype == "int32") return H5Tcopy(H5T_STD_I32LE);
  if (dtype == "int64") return H5Tcopy(H5T_STD_I64LE);
  if (dtype == "uint8" || dtype == "bool") return H5Tcopy(H5T_STD_U8LE);
  if (dtype == "bfloat16") return H5Tcopy(H5T_STD_U16LE);
  if (dtype == "float16") {
    // IEEE 754 binary16: sign bit 15, exponent bits 10-14 (bias 15), mantissa 0-9.
    hid_t t = H5Tcopy(H5T_IEEE_F32LE);
    H5Tset_fields(t, 15, 10, 5, 0, 10);
    H5Tset_precision(t, 16);
    H5Tset_size(t, 2);
    H5Tset_ebias(t, 15);
    return t;
  }
  return -1;
}

std::string Hdf5Error() {
  std::string message;
  H5Ewalk2(
      H5E_DEFAULT, H5E_WALK_DOWNWARD,
      [](unsigned, const H5E_error2_t* e, void* out) -> herr_t {
        auto* m = static_cast<std::string*>(out);
        if (!m->empty()) m->append("; ");
        m->append(e->desc ? e->desc : "?");
        return 0;
      },
      &message);
  H5Eclear2(H5E_DEFAULT);
  return message.empty() ? "unknown HDF5 error" : message;
}

absl::Status WriteStringAttribute(hid_t object, const char* name, const std::string& value) {
  Handle type(H5Tcopy(H5T_C_S1), H5Tclose);
  H5Tset_size(type.get(), std::max<size_t>(value.size(), 1));
  Handle space(H5Screate(H5S_SCALAR), H5Sclose);
  Handle attr(H5Acreate2(object, name, type.get(), space.get(), H5P_DEFAULT, H5P_DEFAULT),
              H5Aclose);
  if (!attr.ok() || H5Awrite(attr.get(), type.get(), value.c_str()) < 0) {
    return absl::InternalError(absl::StrCat("HDF5 attribute ", name, ": ", Hdf5Error()));
  }
  return absl::OkStatus();
}

absl::Status WriteInt64Attribute(hid_t object, const char* name, const std::vector<int64_t>& v) {
  const hsize_t n = v.size();
  Handle space(H5Screate_simple(1, &n, nullptr), H5Sclose);
  Handle attr(H5Acreate2(object, name, H5T_STD_I64LE, space.get(), H5P_DEFAULT, H5P_DEFAULT),
              H5Aclose);
  if (!attr.ok() || H5Awrite(attr.get(), H5T_NATIVE_INT64, v.data()) < 0) {
    return absl::InternalError(absl::StrCat("HDF5 attribute ", name, ": ", Hdf5Error()));
  }
  return absl::OkStatus();
}

}  // namespace

int64_t DtypeSize(const std::string& dtype) {
  static const std::map<std::string, int64_t> sizes = {
      {"float32", 4}, {"float64", 8}, {"float16", 2}, {"bfloat16", 2}, {"int8", 1},
      {"int16", 2},   {"int32", 4},   {"int64", 8},   {"uint8", 1},    {"bool", 1}};
  auto it = sizes.find(dtype);
  return it == sizes.end() ? 0 : it->second;
}

absl::StatusOr<std::string> BuildShardImage(std::vector<ShardDataset>* datasets) {
  std::lock_guard<std::mutex> lock(Hdf5Mutex());
  H5Eset_auto2(H5E_DEFAULT, nullptr, nullptr);  // errors come back as statuses
  Handle fapl(H5Pcreate(H5P_FILE_ACCESS), H5Pclose);
  H5Pset_fapl_core(fapl.get(), 1 << 20, /*backing_store=*/0);
  // The earliest file format: an image taken from a file still open for
  // writing has version-2 superblock checksums that do not match yet, and
  // h5py / h5dump refuse it; version 0 carries no metadata checksums (the
  // data has XXH3 checksums in the manifest).
  Handle file(H5Fcreate("evenstep-shard.h5", H5F_ACC_TRUNC, H5P_DEFAULT, fapl.get()), H5Fclose);
  if (!file.ok())
    return absl::InternalError("HDF5: cannot create an in-memory file: " + Hdf5Error());
  std::map<std::string, bool> groups;
  for (ShardDataset& d : *datasets) {
    if (d.path.size() < 2 || d.path[0] != '/') {
      return absl::InvalidArgumentError(
          absl::StrCat("dataset path \"", d.path, "\" must be absolute"));
    }
    // Intermediate groups.
    std::vector<std::string> parts = absl::StrSplit(d.path.substr(1), '/');
    std::string prefix;
    for (size_t i = 0; i + 1 < parts.size(); ++i) {
      prefix += "/" + parts[i];
      if (groups.count(prefix)) continue;
      Handle g(H5Gcreate2(file.get(), prefix.c_str(), H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT),
               H5Gclose);
      if (!g.ok()) {
        return absl::InternalError(absl::StrCat("HDF5 group ", prefix, ": ", Hdf5Error()));
      }
      groups[prefix] = true;
    }
    const int64_t element = DtypeSize(d.dtype);
    Handle type(FileType(d.dtype), H5Tclose);
    if (element == 0 || !type.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor ", d.tensor, ": dtype ", d.dtype, " cannot be checkpointed"));
    }
    int64_t count = 1;
    std::vector<hsize_t> dims;
    for (int64_t s : d.shape) {
      dims.push_back(static_cast<hsize_t>(s));
      count *= s;
    }
    d.bytes = count * element;
    Handle space(d.shape.empty()
                     ? H5Screate(H5S_SCALAR)
                     : H5Screate_simple(static_cast<int>(dims.size()), dims.data(), nullptr),
                 H5Sclose);
    Handle dcpl(H5Pcreate(H5P_DATASET_CREATE), H5Pclose);
    H5Pset_layout(dcpl.get(), H5D_CONTIGUOUS);
    H5Pset_alloc_time(dcpl.get(), H5D_ALLOC_TIME_EARLY);
    H5Pset_fill_time(dcpl.get(), H5D_FILL_TIME_NEVER);
    Handle dset(H5Dcreate2(file.get(), d.path.c_str(), type.get(), space.get(), H5P_DEFAULT,
                           dcpl.get(), H5P_DEFAULT),
                H5Dclose);
    if (!dset.ok()) {
      return absl::InternalError(absl::StrCat("HDF5 dataset ", d.path, ": ", Hdf5Error()));
    }
    EVENSTEP_RETURN_IF_ERROR(WriteStringAttribute(dset.get(), "dtype", d.dtype), "HDF5 dataset ",
                             d.path);
    EVENSTEP_RETURN_IF_ERROR(WriteStringAttribute(dset.get(), "tensor", d.tensor), "HDF5 dataset ",
                             d.path);
    EVENSTEP_RETURN_IF_ERROR(WriteInt64Attribute(dset.get(), "element_range", {d.begin, d.end}),
                             "HDF5 dataset ", d.path);
    const haddr_t offset = H5Dget_offset(dset.get());
    d.offset = (d.bytes == 0 || offset == HADDR_UNDEF) ? -1 : static_cast<int64_t>(offset);
    if (d.bytes > 0 && d.offset < 0) {
      return absl::InternalError(absl::StrCat("HDF5 dataset ", d.path, ": no contiguous storage"));
    }
  }
  if (H5Fflush(file.get(), H5F_SCOPE_GLOBAL) < 0) {
    return absl::InternalError("HDF5 flush: " + Hdf5Error());
  }
  const ssize_t size = H5Fget_file_image(file.get(), nullptr, 0);
  if (size < 0) return absl::InternalError("HDF5 file image: " + Hdf5Error());
  std::string image(static_cast<size_t>(size), '\0');
  if (H5Fget_file_image(file.get(), image.data(), image.size()) < 0) {
    return absl::InternalError("HDF5 file image: " + Hdf5Error());
  }
  for (const ShardDataset& d : *datasets) {
    if (d.bytes > 0 && d.offset + d.bytes > static_cast<int64_t>(image.size())) {
      return absl::InternalError(absl::StrCat("HDF5 dataset ", d.path, " ends at ",
                                              d.offset + d.bytes, " past the image's ",
                                              image.size(), " bytes"));
    }
  }
  return image;
}

std::vector<std::string> CheckShardFileHere(const std::string& path,
                                            const std::vector<ShardDataset>& expected) {
  std::lock_guard<std::mutex> lock(Hdf5Mutex());
  H5Eset_auto2(H5E_DEFAULT, nullptr, nullptr);
  std::vector<std::string> problems;
  Handle file(H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT), H5Fclose);
  if (!file.ok()) {
    problems.push_back(absl::StrCat(path, ": not readable as HDF5: ", Hdf5Error()));
    return problems;
  }
  for (const ShardDataset& d : expected) {
    auto problem = [&](const std::string& what) {
      problems.push_back(absl::StrCat(path, ", dataset ", d.path, ": ", what));
    };
    if (H5Lexists(file.get(), d.path.c_str(), H5P_DEFAULT) <= 0) {
      H5Eclear2(H5E_DEFAULT);
      problem("missing from the HDF5 file");
      continue;
    }
    Handle dset(H5Dopen2(file.get(), d.path.c_str(), H5P_DEFAULT), H5Dclose);
    if (!dset.ok()) {
      problem("cannot be opened: " + Hdf5Error());
      continue;
    }
    Handle type(H5Dget_type(dset.get()), H5Tclose);
    Handle want(FileType(d.dtype), H5Tclose);
    if (!type.ok() || !want.ok() || H5Tequal(type.get(), want.get()) <= 0) {
      H5Eclear2(H5E_DEFAULT);
      problem(absl::StrCat("its HDF5 type is not that of ", d.dtype));
      continue;
    }
    if (H5Aexists(dset.get(), "dtype") > 0) {
      Handle attr(H5Aopen(dset.get(), "dtype", H5P_DEFAULT), H5Aclose);
      Handle atype(attr.ok() ? H5Aget_type(attr.get()) : -1, H5Tclose);
      std::string value;
      if (atype.ok() && H5Tget_class(atype.get()) == H5T_STRING &&
          H5Tis_variable_str(atype.get()) == 0) {
        value.assign(H5Tget_size(atype.get()), '\0');
        if (H5Aread(attr.get(), atype.get(), value.data()) < 0) value.clear();
        value.erase(std::find(value.begin(), value.end(), '\0'), value.end());
      }
      if (value != d.dtype) {
        H5Eclear2(H5E_DEFAULT);
        problem(absl::StrCat("its dtype attribute is \"", value.substr(0, 40),
                             "\", the manifest says ", d.dtype));
        continue;
      }
    } else {
      H5Eclear2(H5E_DEFAULT);
      problem("no dtype attribute");
      continue;
    }
    Handle space(H5Dget_space(dset.get()), H5Sclose);
    const int rank = space.ok() ? H5Sget_simple_extent_ndims(space.get()) : -1;
    std::vector<hsize_t> dims(rank > 0 ? rank : 0);
    if (rank < 0 ||
        (rank > 0 && H5Sget_simple_extent_dims(space.get(), dims.data(), nullptr) < 0)) {
      H5Eclear2(H5E_DEFAULT);
      problem("no readable shape");
      continue;
    }
    std::vector<int64_t> shape(dims.begin(), dims.end());
    if (shape != d.shape) {
      problem(absl::StrCat("shape [", absl::StrJoin(shape, ","), "], the manifest says [",
                           absl::StrJoin(d.shape, ","), "]"));
      continue;
    }
    Handle dcpl(H5Dget_create_plist(dset.get()), H5Pclose);
    if (!dcpl.ok() || H5Pget_layout(dcpl.get()) != H5D_CONTIGUOUS) {
      H5Eclear2(H5E_DEFAULT);
      problem("not stored contiguously");
      continue;
    }
    const haddr_t offset = H5Dget_offset(dset.get());
    const int64_t at = offset == HADDR_UNDEF ? -1 : static_cast<int64_t>(offset);
    const int64_t stored = static_cast<int64_t>(H5Dget_storage_size(dset.get()));
    H5Eclear2(H5E_DEFAULT);
    if (d.bytes > 0 && (at != d.offset || stored != d.bytes)) {
      problem(absl::StrCat(stored, " bytes at offset ", at, ", the manifest says ", d.bytes, " at ",
                           d.offset));
    }
  }
  return problems;
}

std::string ShardCheckRequest(const std::vector<ShardDataset>& expected) {
  nlohmann::json datasets = nlohmann::json::array();
  for (const ShardDataset& d : expected) {
    datasets.push_back({{"path", d.path},
                        {"dtype", d.dtype},
                        {"shape", d.shape},
                        {"tensor", d.tensor},
                        {"offset", d.offset},
                        {"bytes", d.bytes}});
  }
  return datasets.dump();
}

absl::StatusOr<std::vector<ShardDataset>> ParseShardCheckRequest(const std::string& text) {
  std::vector<ShardDataset> expected;
  try {
    for (const nlohmann::json& j : nlohmann::json::parse(text)) {
      ShardDataset d;
      d.path = j.at("path").get<std::string>();
      d.dtype = j.at("dtype").get<std::string>();
      d.shape = j.at("shape").get<std::vector<int64_t>>();
      d.tensor = j.at("tensor").get<std::string>();
      d.offset = j.at("offset").get<int64_t>();
      d.bytes = j.at("bytes").get<int64_t>();
      expected.push_back(std::move(d));
    }
  } catch (const std::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat("not a shard check request: ", e.what()));
  }
  return expected;
}

namespace {

// The checker program: $EVENSTEP_H5CHECK, else the one installed with this
// library (LIBDIR/../libexec/evenstep-h5check, as GNUInstallDirs lays them
// out), else the build tree's.
std::string CheckerProgram() {
  if (const char* set = std::getenv("EVENSTEP_H5CHECK"); set != nullptr && *set != '\0') {
    return set;
  }
#ifdef EVENSTEP_H5CHECK_FROM_LIB
  Dl_info info{};
  if (::dladdr(reinterpret_cast<void*>(&CheckShardFile), &info) != 0 && info.dli_fname != nullptr) {
    const std::string lib = info.dli_fname;
    const size_t slash = lib.rfind('/');
    const std::string installed =
        (slash == std::string::npos ? std::string(".") : lib.substr(0, slash)) + "/" +
        EVENSTEP_H5CHECK_FROM_LIB;
    if (::access(installed.c_str(), X_OK) == 0) return installed;
  }
#endif
#ifdef EVENSTEP_H5CHECK_BUILD_PATH
  return EVENSTEP_H5CHECK_BUILD_PATH;
#else
  return "evenstep-h5check";
#endif
}

// Writes `request` to `in` and reads `*out` from `out` until the child
// closes it or `deadline`; false on the deadline. SIGPIPE (a child that
// died before reading) is blocked on this thread and discarded: the
// caller's process never sees it.
bool Exchange(int in, int out, const std::string& request,
              std::chrono::steady_clock::time_point deadline, std::string* text) {
  sigset_t pipe_signal, old;
  sigemptyset(&pipe_signal);
  sigaddset(&pipe_signal, SIGPIPE);
  pthread_sigmask(SIG_BLOCK, &pipe_signal, &old);
  size_t sent = 0;
  bool timed_out = false;
  char buffer[4096];
  for (;;) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) {
      timed_out = true;
      break;
    }
    struct pollfd fds[2] = {{out, POLLIN, 0}, {in, POLLOUT, 0}};
    const int ready = ::poll(fds, in >= 0 ? 2 : 1, static_cast<int>(left.count()));
    if (ready < 0 && errno == EINTR) continue;
    if (ready <= 0) {
      timed_out = ready == 0;
      break;
    }
    if (in >= 0 && fds[1].revents != 0) {
      const ssize_t w = ::write(in, request.data() + sent, request.size() - sent);
      if (w > 0) sent += static_cast<size_t>(w);
      if (w < 0 && errno != EINTR && errno != EAGAIN) sent = request.size();  // EPIPE: it died
      if (sent == request.size()) {
        ::close(in);
        in = -1;
      }
    }
    if (fds[0].revents == 0) continue;
    const ssize_t n = ::read(out, buffer, sizeof(buffer));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    text->append(buffer, static_cast<size_t>(n));
  }
  if (in >= 0) ::close(in);
  const struct timespec now = {0, 0};
  while (sigtimedwait(&pipe_signal, nullptr, &now) > 0) {
  }
  pthread_sigmask(SIG_SETMASK, &old, nullptr);
  return !timed_out;
}

}  // namespace

std::vector<std::string> CheckShardFile(const std::string& path,
                                        const std::vector<ShardDataset>& expected) {
  // Not even HDF5's signature: nothing for HDF5 to parse.
  {
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
    char head[8] = {};
    const bool signed_file =
        fd >= 0 && ::pread(fd, head, 8, 0) == 8 && std::memcmp(head, "\x89HDF\r\n\x1a\n", 8) == 0;
    if (fd >= 0) ::close(fd);
    if (!signed_file) return {absl::StrCat(path, ": not an HDF5 file (no HDF5 signature)")};
  }
  // libhdf5 is not hardened against hostile files (the manifest fuzzer finds
  // heap overflows and huge allocations inside it on corrupt object headers),
  // so it parses the shard in a process of its own: a crash, a runaway
  // allocation or a hang there is a finding about the file, not the end of
  // the caller. That process is a program started with posix_spawn
  // (tools/evenstep_h5check.cc), never a fork of the caller: a threaded
  // trainer's fork would inherit locks (malloc's, HDF5's) that another
  // thread held, and could deadlock in the child.
  const std::string program = CheckerProgram();
  int to_child[2], from_child[2];
  if (::pipe2(to_child, O_CLOEXEC) != 0) {
    return {absl::StrCat(path, ": pipe: ", std::strerror(errno))};
  }
  if (::pipe2(from_child, O_CLOEXEC) != 0) {
    ::close(to_child[0]);
    ::close(to_child[1]);
    return {absl::StrCat(path, ": pipe: ", std::strerror(errno))};
  }
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, to_child[0], STDIN_FILENO);
  posix_spawn_file_actions_adddup2(&actions, from_child[1], STDOUT_FILENO);
  posix_spawn_file_actions_addopen(&actions, STDERR_FILENO, "/dev/null", O_WRONLY, 0);
  std::string arg0 = program, arg1 = path;
  char* argv[] = {arg0.data(), arg1.data(), nullptr};
  pid_t child = -1;
  const int spawned = ::posix_spawn(&child, program.c_str(), &actions, nullptr, argv, environ);
  posix_spawn_file_actions_destroy(&actions);
  ::close(to_child[0]);
  ::close(from_child[1]);
  if (spawned != 0) {
    ::close(to_child[1]);
    ::close(from_child[0]);
    return {absl::StrCat(path, ": not checked: cannot start the HDF5 checker ", program, " (",
                         std::strerror(spawned), "; EVENSTEP_H5CHECK names another)")};
  }
  ::fcntl(to_child[1], F_SETFL, O_NONBLOCK);
  std::string text;
  const bool timed_out =
      !Exchange(to_child[1], from_child[0], ShardCheckRequest(expected),
                std::chrono::steady_clock::now() + std::chrono::seconds(120), &text);
  ::close(from_child[0]);
  if (timed_out) ::kill(child, SIGKILL);
  int status = 0;
  while (::waitpid(child, &status, 0) < 0 && errno == EINTR) {
  }
  if (timed_out) return {absl::StrCat(path, ": HDF5 did not finish reading it within 120 s")};
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    return {absl::StrCat(path, ": HDF5 cannot read it (the library ",
                         WIFSIGNALED(status) ? absl::StrCat("died of signal ", WTERMSIG(status))
                                             : absl::StrCat("exited with ", WEXITSTATUS(status)),
                         " on this file's metadata)")};
  }
  std::vector<std::string> problems;
  for (absl::string_view line : absl::StrSplit(text, '\n', absl::SkipEmpty())) {
    problems.emplace_back(line);
  }
  return problems;
}

}  // namespace evenstep::internal

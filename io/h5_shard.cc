// BuildShardImage: HDF5 container layout in memory (see h5_shard.h).
#include "evenstep/internal/h5_shard.h"

#include <fcntl.h>
#include <hdf5.h>
#include <poll.h>
#include <signal.h>
#include <sys/resource.h>
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

namespace {

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
  // so it parses the shard in a child process: a crash, a runaway allocation
  // or a hang there is a finding about the file, not the end of the caller.
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC) != 0) return {absl::StrCat(path, ": pipe: ", std::strerror(errno))};
  const pid_t child = ::fork();
  if (child < 0) {
    ::close(fds[0]);
    ::close(fds[1]);
    return {absl::StrCat(path, ": fork: ", std::strerror(errno))};
  }
  if (child == 0) {
    ::close(fds[0]);
    const int null = ::open("/dev/null", O_WRONLY);
    if (null >= 0) ::dup2(null, STDERR_FILENO);  // HDF5's own diagnostics
#if !defined(__SANITIZE_ADDRESS__)
    // 4 GiB of address space beyond what the process already maps (a
    // trainer on a GPU maps tens of GiB before HDF5 allocates anything).
    rlim_t mapped = 0;
    if (const int statm = ::open("/proc/self/statm", O_RDONLY | O_CLOEXEC); statm >= 0) {
      char pages[64] = {};
      if (::read(statm, pages, sizeof(pages) - 1) > 0) {
        mapped = static_cast<rlim_t>(std::strtoull(pages, nullptr, 10)) *
                 static_cast<rlim_t>(::sysconf(_SC_PAGESIZE));
      }
      ::close(statm);
    }
    struct rlimit limit = {mapped + (rlim_t{4} << 30), mapped + (rlim_t{4} << 30)};
    ::setrlimit(RLIMIT_AS, &limit);
#endif
    std::string out;
    for (const std::string& p : CheckShardFileHere(path, expected)) out += p + '\n';
    for (size_t done = 0; done < out.size();) {
      const ssize_t w = ::write(fds[1], out.data() + done, out.size() - done);
      if (w <= 0) break;
      done += static_cast<size_t>(w);
    }
    ::_exit(0);
  }
  ::close(fds[1]);
  std::string text;
  char buffer[4096];
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
  bool timed_out = false;
  for (;;) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) {
      timed_out = true;
      break;
    }
    struct pollfd pfd = {fds[0], POLLIN, 0};
    const int ready = ::poll(&pfd, 1, static_cast<int>(left.count()));
    if (ready < 0 && errno == EINTR) continue;
    if (ready <= 0) {
      timed_out = ready == 0;
      break;
    }
    const ssize_t n = ::read(fds[0], buffer, sizeof(buffer));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    text.append(buffer, static_cast<size_t>(n));
  }
  ::close(fds[0]);
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

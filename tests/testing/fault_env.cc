// FaultEnv: write-point counting, injected errors and simulated crashes.
#include "tests/testing/fault_env.h"

#include <unistd.h>

#include <fstream>

#include "absl/strings/str_cat.h"
#include "evenstep/status_macros.h"

namespace evenstep {

class FaultEnv::FaultFile : public File {
 public:
  FaultFile(FaultEnv* env, std::unique_ptr<File> base) : env_(env), base_(std::move(base)) {}
  const std::string& path() const override { return base_->path(); }
  absl::Status PWrite(int64_t offset, const void* data, size_t n) override {
    if (absl::Status s = env_->Point("pwrite", path()); !s.ok()) return s;
    std::lock_guard<std::mutex> lock(env_->mu_);
    env_->files_[path()].dirty = true;
    return base_->PWrite(offset, data, n);
  }
  absl::Status PRead(int64_t offset, void* data, size_t n) const override {
    return base_->PRead(offset, data, n);
  }
  absl::Status Sync() override {
    if (absl::Status s = env_->Point("fsync", path()); !s.ok()) return s;
    absl::Status s = base_->Sync();
    if (s.ok()) {
      auto size = base_->Size();
      std::lock_guard<std::mutex> lock(env_->mu_);
      Tracked& t = env_->files_[path()];
      t.dirty = false;
      t.synced_size = size.ok() ? *size : 0;
    }
    return s;
  }
  absl::StatusOr<int64_t> Size() const override { return base_->Size(); }
  absl::Status Close() override {
    absl::Status point = env_->Point("close", path());
    absl::Status closed = base_->Close();  // the descriptor is released either way
    return point.ok() ? closed : point;
  }

 private:
  FaultEnv* env_;
  std::unique_ptr<File> base_;
};

void FaultEnv::FailAt(int64_t n, int error, bool persistent) {
  std::lock_guard<std::mutex> lock(mu_);
  fail_at_ = points_ + n;
  fail_errno_ = error;
  fail_persistent_ = persistent;
}

void FaultEnv::CrashAt(int64_t n) {
  std::lock_guard<std::mutex> lock(mu_);
  crash_at_ = points_ + n;
}

int64_t FaultEnv::write_points() const {
  std::lock_guard<std::mutex> lock(mu_);
  return points_;
}

void FaultEnv::Reset() {
  std::lock_guard<std::mutex> lock(mu_);
  points_ = fail_at_ = crash_at_ = 0;
  crashed_ = false;
}

// A directory's one spelling ("a/./b/" -> "a/b"), so that the directory of a
// path and the argument of SyncDir compare equal.
absl::Status FaultEnv::Point(const std::string& what, const std::string& path) {
  std::lock_guard<std::mutex> lock(mu_);
  ++points_;
  if (crashed_ || (crash_at_ > 0 && points_ >= crash_at_)) {
    crashed_ = true;
    return absl::AbortedError(absl::StrCat("simulated crash before ", what, " ", path));
  }
  if (fail_at_ > 0 && (points_ == fail_at_ || (fail_persistent_ && points_ > fail_at_))) {
    return ErrnoStatus(fail_errno_, what + " (injected)", path);
  }
  return absl::OkStatus();
}

void FaultEnv::RecoverFromCrash() {
  std::lock_guard<std::mutex> lock(mu_);
  // Renames not made durable by a directory fsync are undone, newest first.
  for (auto& [dir, pending] : renames_) {
    for (auto it = pending.rbegin(); it != pending.rend(); ++it) {
      if (target()->Exists(it->to)) target()->Rename(it->to, it->from).IgnoreError();
      if (it->replaced) std::ofstream(it->to, std::ios::binary | std::ios::trunc) << *it->replaced;
      auto node = files_.extract(it->to);
      if (!node.empty()) {
        node.key() = it->from;
        files_.insert(std::move(node));
      }
    }
  }
  renames_.clear();
  // Removals not made durable: the file is back with what had been synced.
  for (auto& [dir, pending] : removes_) {
    for (auto it = pending.rbegin(); it != pending.rend(); ++it) {
      if (target()->Exists(it->path)) continue;
      std::ofstream(it->path, std::ios::binary | std::ios::trunc) << it->durable;
      files_.erase(it->path);
    }
  }
  removes_.clear();
  for (auto& [path, t] : files_) {
    if (!target()->Exists(path)) continue;
    if (t.created_since_dir_sync || t.synced_size < 0) {
      target()->Remove(path).IgnoreError();  // the directory entry or the data never became durable
    } else if (t.dirty) {
      ::truncate(path.c_str(), t.synced_size);  // unsynced data is lost
    }
  }
  files_.clear();
  // Directories whose entry in their parent never became durable vanish
  // with everything below them.
  for (auto& [parent, dirs] : new_dirs_) {
    for (const std::string& dir : dirs) {
      internal::RemoveTree(dir).IgnoreError();
    }
  }
  new_dirs_.clear();
  points_ = fail_at_ = crash_at_ = 0;
  crashed_ = false;
}

absl::StatusOr<std::unique_ptr<File>> FaultEnv::Create(const std::string& path) {
  EVENSTEP_RETURN_IF_ERROR(Point("create", path));
  EVENSTEP_ASSIGN_OR_RETURN(std::unique_ptr<File> file, target()->Create(path));
  {
    std::lock_guard<std::mutex> lock(mu_);
    Tracked& t = files_[path];
    t = Tracked{};
    t.created_since_dir_sync = true;
  }
  return std::unique_ptr<File>(new FaultFile(this, std::move(file)));
}

absl::Status FaultEnv::Rename(const std::string& from, const std::string& to) {
  if (absl::Status s = Point("rename", from + " -> " + to); !s.ok()) return s;
  std::optional<std::string> replaced;
  if (target()->Exists(to)) {
    absl::StatusOr<std::string> old = ReadFileToString(*target(), to, int64_t{64} << 20);
    if (old.ok()) replaced = *std::move(old);
  }
  absl::Status s = target()->Rename(from, to);
  if (s.ok()) {
    std::lock_guard<std::mutex> lock(mu_);
    renames_[ParentDir(to)].push_back({from, to, std::move(replaced)});
    auto node = files_.extract(from);
    if (!node.empty()) {
      node.key() = to;
      files_.insert(std::move(node));
    }
  }
  return s;
}

absl::Status FaultEnv::SyncDir(const std::string& dir) {
  if (absl::Status s = Point("fsync directory", dir); !s.ok()) return s;
  absl::Status s = target()->SyncDir(dir);
  if (s.ok()) {
    std::lock_guard<std::mutex> lock(mu_);
    const std::string key = NormalPath(dir);
    renames_.erase(key);
    removes_.erase(key);
    new_dirs_.erase(key);
    for (auto& [path, t] : files_) {
      if (ParentDir(path) == key) t.created_since_dir_sync = false;
    }
  }
  return s;
}

absl::Status FaultEnv::Remove(const std::string& path) {
  if (absl::Status s = Point("remove", path); !s.ok()) return s;
  // What a crash before the directory's sync brings back: nothing for a file
  // whose entry or data never became durable, else its synced bytes (all of
  // a file this Env has not seen written). Kept for files of up to 64 MiB.
  std::optional<PendingRemove> pending;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto t = files_.find(path);
    const bool durable =
        t == files_.end() || (!t->second.created_since_dir_sync && t->second.synced_size >= 0);
    if (durable) {
      absl::StatusOr<std::string> bytes = ReadFileToString(*target(), path, int64_t{64} << 20);
      if (bytes.ok()) {
        if (t != files_.end())
          bytes->resize(std::min<size_t>(bytes->size(), t->second.synced_size));
        pending = PendingRemove{path, *std::move(bytes)};
      }
    }
  }
  absl::Status s = target()->Remove(path);
  if (s.ok()) {
    std::lock_guard<std::mutex> lock(mu_);
    files_.erase(path);
    if (pending) removes_[ParentDir(path)].push_back(*std::move(pending));
  }
  return s;
}

absl::Status FaultEnv::CreateDirs(const std::string& dir) {
  if (absl::Status s = Point("create directory", dir); !s.ok()) return s;
  const std::vector<std::string> missing = MissingDirs(*target(), dir);
  absl::Status s = target()->CreateDirs(dir);
  if (s.ok()) {
    std::lock_guard<std::mutex> lock(mu_);
    for (const std::string& m : missing) new_dirs_[ParentDir(m)].push_back(m);
  }
  return s;
}

absl::Status FaultEnv::RemoveTree(const std::string& dir) {
  if (absl::Status s = Point("remove directory", dir); !s.ok()) return s;
  return target()->RemoveTree(dir);
}

}  // namespace evenstep

#include "evenstep/async_appender.h"

#include <chrono>

#include "absl/strings/str_cat.h"
#include "evenstep/io_runtime.h"
#include "evenstep/status_macros.h"

namespace evenstep {

absl::StatusOr<std::unique_ptr<AsyncAppender>> AsyncAppender::Create(const std::string& path,
                                                                     size_t flush_bytes, Env* env) {
  Env& e = env != nullptr ? *env : *Env::Default();
  EVENSTEP_RETURN_IF_ERROR(e.CreateDirs(ParentDir(path)));
  EVENSTEP_ASSIGN_OR_RETURN(std::unique_ptr<File> file, e.Create(path));
  return std::unique_ptr<AsyncAppender>(new AsyncAppender(path, std::move(file), flush_bytes));
}

absl::StatusOr<std::unique_ptr<AsyncAppender>> AsyncAppender::CreateSegment(const std::string& stem,
                                                                            const std::string& ext,
                                                                            size_t flush_bytes,
                                                                            Env* env) {
  Env& e = env != nullptr ? *env : *Env::Default();
  std::string path = stem + ext;
  for (int n = 1; e.Exists(path); ++n) path = absl::StrCat(stem, ".", n, ext);
  return Create(path, flush_bytes, &e);
}

AsyncAppender::AsyncAppender(std::string path, std::unique_ptr<File> file, size_t flush_bytes)
    : path_(std::move(path)),
      file_(std::move(file)),
      io_(std::make_unique<IoRuntime>(/*io_threads=*/1)),
      flush_bytes_(flush_bytes) {}

AsyncAppender::~AsyncAppender() { Close().IgnoreError(); }

void AsyncAppender::Append(const std::string& text) {
  if (closed_) return;
  buffer_ += text;
  if (buffer_.size() >= flush_bytes_) StartWrite();
}

void AsyncAppender::StartWrite() {
  if (buffer_.empty()) return;
  auto chunk = std::make_shared<std::string>(std::move(buffer_));
  buffer_.clear();
  const int64_t at = offset_;
  offset_ += static_cast<int64_t>(chunk->size());
  File* file = file_.get();
  IoRuntime* io = io_.get();
  writes_.push_back(io_->Spawn([io, file, chunk, at] {
    return io->Blocking([&] { return file->PWrite(at, chunk->data(), chunk->size()); });
  }));
  for (auto it = writes_.begin(); it != writes_.end();) {
    if (it->wait_for(std::chrono::seconds(0)) != std::future_status::ready) {
      ++it;
      continue;
    }
    absl::Status s = it->get();
    if (first_error_.ok() && !s.ok()) first_error_ = s;
    it = writes_.erase(it);
  }
}

absl::Status AsyncAppender::Flush() {
  StartWrite();
  for (auto& w : writes_) {
    absl::Status s = w.get();
    if (first_error_.ok() && !s.ok()) first_error_ = s;
  }
  writes_.clear();
  return first_error_;
}

absl::Status AsyncAppender::Close() {
  if (closed_) return first_error_;
  absl::Status s = Flush();
  closed_ = true;
  if (s.ok()) s = file_->Sync();
  absl::Status c = file_->Close();
  return s.ok() ? c : s;
}

}  // namespace evenstep

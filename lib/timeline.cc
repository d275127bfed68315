// Timeline: streamed Chrome trace of one rank.
#include "evenstep/timeline.h"

#include <future>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "evenstep/balanced_step.h"
#include "evenstep/env.h"
#include "evenstep/io_runtime.h"

namespace evenstep {
namespace {

constexpr size_t kFlushBytes = 256 << 10;

int64_t Micros(absl::Time t) { return absl::ToUnixMicros(t); }

}  // namespace

struct Timeline::Pending {
  std::vector<std::future<absl::Status>> writes;
  absl::Status first_error;
};

absl::StatusOr<std::unique_ptr<Timeline>> Timeline::Open(const std::string& dir, int rank) {
  Env& env = *Env::Default();
  if (absl::Status s = env.CreateDirs(dir); !s.ok()) return s;
  auto file = env.Create(absl::StrFormat("%s/trace-%05d.json", dir, rank));
  if (!file.ok()) return file.status();
  std::unique_ptr<Timeline> t(
      new Timeline(rank, *std::move(file), std::make_unique<IoRuntime>(/*io_threads=*/1)));
  t->buffer_ = "[\n";
  t->Append(absl::StrFormat(
      R"({"name": "process_name", "ph": "M", "pid": %d, "tid": 0, "args": {"name": "rank %d"}})",
      rank, rank));
  t->Append(absl::StrFormat(
      R"({"name": "process_sort_index", "ph": "M", "pid": %d, "tid": 0, "args": {"sort_index": %d}})",
      rank, rank));
  return t;
}

Timeline::Timeline(int rank, std::unique_ptr<File> file, std::unique_ptr<IoRuntime> io)
    : rank_(rank), file_(std::move(file)), io_(std::move(io)), pending_(new Pending) {}

Timeline::~Timeline() { Close().IgnoreError(); }

void Timeline::Append(const std::string& event) {
  if (closed_) return;
  if (!first_) buffer_ += ",\n";
  first_ = false;
  buffer_ += event;
  if (buffer_.size() >= kFlushBytes) StartWrite();
}

void Timeline::StartWrite() {
  if (buffer_.empty()) return;
  auto chunk = std::make_shared<std::string>(std::move(buffer_));
  buffer_.clear();
  const int64_t at = offset_;
  offset_ += static_cast<int64_t>(chunk->size());
  File* file = file_.get();
  IoRuntime* io = io_.get();
  pending_->writes.push_back(io_->Spawn([io, file, chunk, at] {
    return io->Blocking([&] { return file->PWrite(at, chunk->data(), chunk->size()); });
  }));
  // Keep the list short: collect finished writes.
  auto& w = pending_->writes;
  for (auto it = w.begin(); it != w.end();) {
    if (it->wait_for(std::chrono::seconds(0)) == std::future_status::ready) {
      absl::Status s = it->get();
      if (pending_->first_error.ok() && !s.ok()) pending_->first_error = s;
      it = w.erase(it);
    } else {
      ++it;
    }
  }
}

void Timeline::Span(const std::string& phase, absl::Time begin, absl::Time end, int64_t step) {
  Append(absl::StrFormat(
      R"({"name": "%s", "cat": "evenstep", "ph": "X", "pid": %d, "tid": 0, "ts": %d, "dur": %d, "args": {"step": %d}})",
      phase, rank_, Micros(begin), std::max<int64_t>(0, Micros(end) - Micros(begin)), step));
}

void Timeline::Instant(const std::string& name, absl::Time at, int64_t step) {
  Append(absl::StrFormat(
      R"({"name": "%s", "cat": "evenstep", "ph": "i", "s": "p", "pid": %d, "tid": 0, "ts": %d, "args": {"step": %d}})",
      name, rank_, Micros(at), step));
}

void Timeline::AddStep(const StepReport& r) {
  for (size_t i = 0; i < r.micro.size(); ++i) {
    const MicroTiming& m = r.micro[i];
    Span("data", m.begin, m.data_end, r.step);
    // The last backward also waits for the gradient collectives; that part
    // is sync_wait, from the arrival on.
    const bool last = i + 1 == r.micro.size();
    Span("compute", m.data_end, last ? std::min(m.end, r.arrived) : m.end, r.step);
  }
  Instant("arrive", r.arrived, r.step);
  Span("sync_wait", r.arrived, r.synced, r.step);
  Span("optimizer", r.optimizer_begin, r.optimizer_begin + r.optimizer, r.step);
  Span("exchange", r.optimizer_begin + r.optimizer, r.end, r.step);
}

absl::Status Timeline::Flush() {
  StartWrite();
  for (auto& f : pending_->writes) {
    absl::Status s = f.get();
    if (pending_->first_error.ok() && !s.ok()) pending_->first_error = s;
  }
  pending_->writes.clear();
  return pending_->first_error;
}

absl::Status Timeline::Close() {
  if (closed_) return pending_->first_error;
  buffer_ += "\n]\n";
  absl::Status s = Flush();
  closed_ = true;
  if (s.ok()) s = file_->Sync();
  absl::Status c = file_->Close();
  return s.ok() ? c : s;
}

}  // namespace evenstep

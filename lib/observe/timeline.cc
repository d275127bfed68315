// Timeline: streamed Chrome trace of one rank (through an AsyncAppender).
#include "evenstep/timeline.h"

#include <algorithm>

#include "absl/strings/str_format.h"
#include "evenstep/async_appender.h"
#include "evenstep/balanced_step.h"

namespace evenstep {
namespace {

int64_t Micros(absl::Time t) { return absl::ToUnixMicros(t); }

}  // namespace

absl::StatusOr<std::unique_ptr<Timeline>> Timeline::Open(const std::string& dir, int rank) {
  // After a resume, a new segment (trace-RRRRR.N.json) that evenstep-report
  // reads with the earlier ones.
  auto out = AsyncAppender::CreateSegment(absl::StrFormat("%s/trace-%05d", dir, rank), ".json");
  if (!out.ok()) return out.status();
  std::unique_ptr<Timeline> t(new Timeline(rank, *std::move(out)));
  t->out_->Append("[\n");
  t->Append(absl::StrFormat(
      R"({"name": "process_name", "ph": "M", "pid": %d, "tid": 0, "args": {"name": "rank %d"}})",
      rank, rank));
  t->Append(absl::StrFormat(
      R"({"name": "process_sort_index", "ph": "M", "pid": %d, "tid": 0, "args": {"sort_index": %d}})",
      rank, rank));
  return t;
}

Timeline::Timeline(int rank, std::unique_ptr<AsyncAppender> out)
    : rank_(rank), out_(std::move(out)) {}

Timeline::~Timeline() { Close().IgnoreError(); }

void Timeline::Append(const std::string& event) {
  if (closed_) return;
  out_->Append(first_ ? event : ",\n" + event);
  first_ = false;
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
  // This rank's online health (its micro-step speed against its own best).
  if (static_cast<size_t>(rank_) < r.rank_health.size()) {
    Append(absl::StrFormat(
        R"({"name": "health", "ph": "C", "pid": %d, "tid": 0, "ts": %d, "args": {"health": %.4f, "step": %d}})",
        rank_, Micros(r.end), r.rank_health[rank_], r.step));
  }
  // The step's peak memory (a Chrome counter track; its other figures are
  // args that evenstep-report reads).
  constexpr double kMiB = 1 << 20;
  Append(absl::StrFormat(
      R"({"name": "memory", "ph": "C", "pid": %d, "tid": 0, "ts": %d, "args": {"peak_mb": %.1f, "step": %d, "reserved_mb": %.1f, "growth_mb": %.1f, "largest_micro_batch": %d, "device": %d}})",
      rank_, Micros(r.end), r.memory.peak_bytes / kMiB, r.step, r.memory.reserved_bytes / kMiB,
      r.memory.growth_bytes / kMiB, r.largest_micro_batch, r.memory.device ? 1 : 0));
}

absl::Status Timeline::Flush() { return out_->Flush(); }

absl::Status Timeline::Close() {
  if (closed_) return absl::OkStatus();
  out_->Append("\n]\n");
  closed_ = true;
  return out_->Close();
}

}  // namespace evenstep

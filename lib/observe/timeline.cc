// Timeline: streamed Chrome trace of one rank (through an AsyncAppender).
#include "evenstep/timeline.h"

#include <algorithm>
#include <nlohmann/json.hpp>

#include "absl/strings/str_format.h"
#include "evenstep/async_appender.h"
#include "evenstep/balanced_step.h"

namespace evenstep {
namespace {

using nlohmann::json;

int64_t Micros(absl::Time t) { return absl::ToUnixMicros(t); }

// A Chrome trace event of this rank (pid) on its one thread.
json Event(const std::string& name, const char* phase, int rank) {
  return {{"name", name}, {"ph", phase}, {"pid", rank}, {"tid", 0}};
}

// A counter track's sample ("ph": "C"): `args` are its series.
json Counter(const std::string& name, int rank, absl::Time at, json args) {
  json e = Event(name, "C", rank);
  e["ts"] = Micros(at);
  e["args"] = std::move(args);
  return e;
}

}  // namespace

absl::StatusOr<std::unique_ptr<Timeline>> Timeline::Open(const std::string& dir, int rank) {
  // After a resume, a new segment (trace-RRRRR.N.json) that evenstep-report
  // reads with the earlier ones.
  auto out = AsyncAppender::CreateSegment(absl::StrFormat("%s/trace-%05d", dir, rank), ".json");
  if (!out.ok()) return out.status();
  std::unique_ptr<Timeline> t(new Timeline(rank, *std::move(out)));
  t->out_->Append("[\n");
  json name = Event("process_name", "M", rank);
  name["args"] = {{"name", absl::StrFormat("rank %d", rank)}};
  t->Append(name.dump());
  json order = Event("process_sort_index", "M", rank);
  order["args"] = {{"sort_index", rank}};
  t->Append(order.dump());
  return t;
}

Timeline::Timeline(int rank, std::unique_ptr<AsyncAppender> out)
    : rank_(rank), index_(rank), out_(std::move(out)) {}

void Timeline::Renumber(int rank, absl::Time at, int64_t step) {
  index_ = rank;
  Instant("regroup", at, step);
}

Timeline::~Timeline() { Close().IgnoreError(); }

void Timeline::Append(const std::string& event) {
  if (closed_) return;
  out_->Append(first_ ? event : ",\n" + event);
  first_ = false;
}

void Timeline::Span(const std::string& phase, absl::Time begin, absl::Time end, int64_t step) {
  json e = Event(phase, "X", rank_);
  e["cat"] = "evenstep";
  e["ts"] = Micros(begin);
  e["dur"] = std::max<int64_t>(0, Micros(end) - Micros(begin));
  e["args"] = {{"step", step}};
  Append(e.dump());
}

void Timeline::Instant(const std::string& name, absl::Time at, int64_t step) {
  json e = Event(name, "i", rank_);
  e["cat"] = "evenstep";
  e["s"] = "p";
  e["ts"] = Micros(at);
  e["args"] = {{"step", step}};
  Append(e.dump());
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
  if (static_cast<size_t>(index_) < r.rank_health.size()) {
    Append(Counter("health", rank_, r.end, {{"health", r.rank_health[index_]}, {"step", r.step}})
               .dump());
  }
  // The step's peak memory (a Chrome counter track; its other figures are
  // args that evenstep-report reads).
  constexpr double kMiB = 1 << 20;
  Append(Counter("memory", rank_, r.end,
                 {{"peak_mb", r.memory.peak_bytes / kMiB},
                  {"step", r.step},
                  {"reserved_mb", r.memory.reserved_bytes / kMiB},
                  {"growth_mb", r.memory.growth_bytes / kMiB},
                  {"largest_micro_batch", r.largest_micro_batch},
                  {"device", r.memory.device ? 1 : 0}})
             .dump());
}

absl::Status Timeline::Flush() { return out_->Flush(); }

absl::Status Timeline::Close() {
  if (closed_) return absl::OkStatus();
  out_->Append("\n]\n");
  closed_ = true;
  return out_->Close();
}

}  // namespace evenstep

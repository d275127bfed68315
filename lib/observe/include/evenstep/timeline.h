// Timeline: this rank's phase spans as Chrome Trace Event JSON (one process
// per rank), streamed to DIR/trace-RRRRR.json with bounded memory: events
// are buffered up to 256 KiB and written by an I/O fiber, never by the
// training thread. `evenstep-report DIR` merges the ranks' files into
// DIR/trace.json (Perfetto, chrome://tracing) and analyses them.
//
//   auto timeline = evenstep::Timeline::Open(run_dir, ctx->rank());
//   ... auto report = step->Step(...);
//   (*timeline)->AddStep(*report);          // data / compute per micro-batch,
//                                           // arrival, sync wait, optimizer
//   (*timeline)->Span("checkpoint", t0, t1, step);   // any other duty
//
// Phase names the report knows: data, compute, sync_wait, optimizer,
// exchange, checkpoint, eval, log; any other name counts as "other".
// Times are wall-clock microseconds (ranks on one host share the clock;
// across hosts the report's arrival skew is only as good as NTP).
// Thread-safety: one thread records; Close() (or the destructor) flushes.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace evenstep {

struct StepReport;
class AsyncAppender;

class Timeline {
 public:
  static absl::StatusOr<std::unique_ptr<Timeline>> Open(const std::string& dir, int rank);
  ~Timeline();

  void Span(const std::string& phase, absl::Time begin, absl::Time end, int64_t step);
  // An instant marker (e.g. "arrive": this rank reached the gradient sync).
  void Instant(const std::string& name, absl::Time at, int64_t step);
  // Every phase of a BalancedStep step.
  void AddStep(const StepReport& report);
  // After DistContext::Regroup: this process is now `rank` of the new world
  // (its per-rank figures are read there); its track keeps its first rank,
  // with a "regroup" marker at `at`.
  void Renumber(int rank, absl::Time at, int64_t step);
  // Writes what is buffered and waits for it; the first write error, if any.
  absl::Status Flush();
  absl::Status Close();

 private:
  Timeline(int rank, std::unique_ptr<AsyncAppender> out);
  void Append(const std::string& event);

  int rank_;   // the track
  int index_;  // the rank in the current world (per-rank figures)
  std::unique_ptr<AsyncAppender> out_;
  bool first_ = true;
  bool closed_ = false;
};

}  // namespace evenstep

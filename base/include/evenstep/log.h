// Every line evenstep prints goes through one sink, which an application may
// replace (to route the lines into its own logger, to tag them, or to
// silence them) and a test may capture:
//
//   evenstep::SetLogSink([](evenstep::LogLevel level, absl::string_view line) {
//     my_logger.Write(level == evenstep::LogLevel::kWarning ? "WARN" : "INFO", line);
//   });
//
// The default sink writes "[evenstep] " and the line to stdout (kInfo:
// progress, resumes, preemption) or stderr (kWarning: failed saves, memory
// recoveries, damaged shards), one line at a time, flushed; kReport (a
// multi-line table the program asked for) goes to stdout as it is.
//
// Thread-safety: Log and SetLogSink may be called from any thread; a sink
// is called under a lock, one line at a time.
#pragma once

#include <functional>

#include "absl/strings/string_view.h"

namespace evenstep {

enum class LogLevel { kInfo, kWarning, kReport };

using LogSink = std::function<void(LogLevel level, absl::string_view line)>;

// Replaces the sink; null restores the default. Returns the previous sink
// (null for the default).
LogSink SetLogSink(LogSink sink);

// One line (without the prefix and the newline), or with kReport a block.
void Log(LogLevel level, absl::string_view line);

}  // namespace evenstep

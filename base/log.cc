// The one sink every line evenstep prints goes through (log.h).
#include "evenstep/log.h"

#include <cstdio>
#include <mutex>
#include <string>
#include <utility>

namespace evenstep {
namespace {

std::mutex& SinkMutex() {
  static auto* mu = new std::mutex;
  return *mu;
}

LogSink& Sink() {
  static auto* sink = new LogSink;
  return *sink;
}

void DefaultSink(LogLevel level, absl::string_view line) {
  std::FILE* out = level == LogLevel::kWarning ? stderr : stdout;
  if (level != LogLevel::kReport) std::fputs("[evenstep] ", out);
  std::fwrite(line.data(), 1, line.size(), out);
  if (level != LogLevel::kReport || line.empty() || line.back() != '\n') std::fputc('\n', out);
  std::fflush(out);
}

}  // namespace

LogSink SetLogSink(LogSink sink) {
  std::lock_guard<std::mutex> lock(SinkMutex());
  return std::exchange(Sink(), std::move(sink));
}

void Log(LogLevel level, absl::string_view line) {
  std::lock_guard<std::mutex> lock(SinkMutex());
  if (Sink()) {
    Sink()(level, line);
  } else {
    DefaultSink(level, line);
  }
}

}  // namespace evenstep

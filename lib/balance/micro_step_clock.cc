// MicroStepClock: host times on the CPU, timing events on devices that can
// measure with them; see internal/micro_step_clock.h.
#include "evenstep/internal/micro_step_clock.h"

#include <c10/core/Event.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include <algorithm>
#include <map>
#include <utility>

#include "absl/time/clock.h"
#include "evenstep/internal/device_compat.h"

namespace evenstep {
namespace internal {

struct MicroStepClock::Mark {
  absl::Time host;
  std::unique_ptr<c10::Event> event;  // deferred marks only
};

struct MicroStepClock::Marks {
  Mark begin;
  std::vector<Mark> start, end;
  // By micro-step: its arrival at a gradient sync (the last micro-step of
  // each model part), and the mark its data wait counts from when it is not
  // the previous micro-step's end (Resume).
  std::map<size_t, Mark> arrive, resume;
};

MicroStepClock::MicroStepClock(c10::Device device, std::function<absl::Time()> now)
    : device_(device), now_(std::move(now)), marks_(std::make_unique<Marks>()) {
  if (!now_) now_ = [] { return absl::Now(); };
}

MicroStepClock::~MicroStepClock() = default;

bool MicroStepClock::deferred() const { return device_compat::kEventsCanTime && !device_.is_cpu(); }

MicroStepClock::Mark MicroStepClock::Take() {
  Mark mark;
  if (device_.is_cpu()) {
    mark.host = now_();
    return mark;
  }
  c10::impl::VirtualGuardImpl guard(device_.type());
  const c10::Stream stream = guard.getStream(device_);
  if (deferred()) {
    // BACKEND_DEFAULT: an event that records timing (PYTORCH_DEFAULT turns
    // timing off on CUDA).
    mark.event = std::make_unique<c10::Event>(device_.type(), c10::EventFlag::BACKEND_DEFAULT);
    mark.event->record(stream);
  } else {
    guard.synchronizeStream(stream);
  }
  mark.host = now_();
  return mark;
}

absl::Time MicroStepClock::begun() const { return marks_->begin.host; }

void MicroStepClock::Begin() {
  marks_ = std::make_unique<Marks>();
  marks_->begin = Take();
}

void MicroStepClock::Start() { marks_->start.push_back(Take()); }

void MicroStepClock::Arrive() { marks_->arrive[marks_->end.size()] = Take(); }

void MicroStepClock::Resume() { marks_->resume[marks_->start.size()] = Take(); }

void MicroStepClock::End() { marks_->end.push_back(Take()); }

absl::Duration MicroStepClock::Between(const Mark& from, const Mark& to) {
  if (from.event && to.event) {
    return absl::Microseconds(1e3 * device_compat::ElapsedMs(*from.event, *to.event));
  }
  return to.host - from.host;
}

MicroStepTimes MicroStepClock::Read() {
  MicroStepTimes times;
  Marks& m = *marks_;
  const size_t done = std::min(m.start.size(), m.end.size());
  // Every event, not just the last: the arrival may have been recorded by
  // the autograd engine's thread on another stream.
  auto wait = [](const Mark& mark) {
    if (mark.event) device_compat::Synchronize(*mark.event);
  };
  wait(m.begin);
  for (const Mark& mark : m.start) wait(mark);
  for (const Mark& mark : m.end) wait(mark);
  for (const auto& [k, mark] : m.arrive) wait(mark);
  for (const auto& [k, mark] : m.resume) wait(mark);
  const Mark* previous = &m.begin;
  for (size_t k = 0; k < done; ++k) {
    if (auto r = m.resume.find(k); r != m.resume.end()) previous = &r->second;
    times.data.push_back(Between(*previous, m.start[k]));
    if (auto a = m.arrive.find(k); a != m.arrive.end()) {
      times.compute.push_back(Between(m.start[k], a->second));
      times.sync += Between(a->second, m.end[k]);
    } else {
      times.compute.push_back(Between(m.start[k], m.end[k]));
    }
    previous = &m.end[k];
  }
  return times;
}

}  // namespace internal
}  // namespace evenstep

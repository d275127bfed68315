// The device-generic pieces of the libtorch compatibility layer: how
// c10::Event can be waited for and timed, which differs between libtorch
// releases (c10::Event measures elapsed time and synchronizes in 2.x only).
// Every layer (io/ for checkpoint snapshots, lib/ for micro-step timing)
// waits on and times device events through these functions; the c10d parts
// live in lib/distributed/'s c10d_compat.h. Stateless; header-only.
#pragma once

#include <c10/core/Event.h>

#include <stdexcept>
#include <thread>

#include "evenstep/internal/build_config.h"

namespace evenstep::internal::device_compat {

// Whether device events can be timed: ElapsedMs only then.
inline constexpr bool kEventsCanTime = EVENSTEP_HAVE_EVENT_TIMING != 0;

// Waits until `event` has completed (a host wait on the device's event where
// libtorch has one, polling otherwise).
inline void Synchronize(const c10::Event& event) {
#if EVENSTEP_HAVE_EVENT_TIMING
  event.synchronize();
#else
  while (!event.query()) std::this_thread::yield();
#endif
}

// Milliseconds from `from` to `to` (both recorded with timing and
// completed). Throws where kEventsCanTime is false.
inline double ElapsedMs(const c10::Event& from, const c10::Event& to) {
#if EVENSTEP_HAVE_EVENT_TIMING
  return from.elapsedTime(to);
#else
  (void)from;
  (void)to;
  throw std::logic_error("c10::Event of this libtorch cannot measure elapsed time");
#endif
}

}  // namespace evenstep::internal::device_compat

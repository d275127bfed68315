// Does c10::Event measure elapsed time (libtorch 2.x)? 1.13's does not.
#include <c10/core/Event.h>

double Elapsed(const c10::Event& a, const c10::Event& b) {
  b.synchronize();
  return a.elapsedTime(b);
}

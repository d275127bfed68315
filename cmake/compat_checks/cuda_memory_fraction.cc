// Does the CUDA caching allocator say its per-process memory fraction (newer
// 2.x CUDA libtorch)? Older ones only set it.
#include <c10/cuda/CUDACachingAllocator.h>

double Fraction(c10::DeviceIndex index) {
  return c10::cuda::CUDACachingAllocator::getMemoryFraction(index);
}

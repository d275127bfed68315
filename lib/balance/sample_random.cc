// Generators keyed by sample (sample_random.h).
#include "evenstep/sample_random.h"

#include <ATen/CPUGeneratorImpl.h>
#include <xxhash.h>

namespace evenstep {
namespace {
// The seed and epoch of the load running on this thread.
thread_local uint64_t t_seed = 0;
thread_local int64_t t_epoch = 0;
}  // namespace

at::Generator SampleGenerator(uint64_t seed, int64_t epoch, int64_t sample, int64_t stream) {
  const uint64_t key[4] = {seed, static_cast<uint64_t>(epoch), static_cast<uint64_t>(sample),
                           static_cast<uint64_t>(stream)};
  return at::make_generator<at::CPUGeneratorImpl>(XXH64(key, sizeof(key), 0x73616d70));
}

at::Generator SampleGenerator(int64_t sample, int64_t stream) {
  return SampleGenerator(t_seed, t_epoch, sample, stream);
}

namespace internal {
SampleDrawScope::SampleDrawScope(uint64_t seed, int64_t epoch)
    : seed_before_(t_seed), epoch_before_(t_epoch) {
  t_seed = seed;
  t_epoch = epoch;
}
SampleDrawScope::~SampleDrawScope() {
  t_seed = seed_before_;
  t_epoch = epoch_before_;
}
}  // namespace internal

}  // namespace evenstep

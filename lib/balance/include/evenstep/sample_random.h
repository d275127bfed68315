// Random draws keyed by sample: an augmentation drawn in a dataset's
// get(index) gives a sample the same numbers whichever rank, data worker or
// micro-batch loads it, in a rerun and after a resume, under any balance.
//
//   Example<> get(size_t index) override {
//     at::Generator g = evenstep::SampleGenerator(index);   // this epoch's, this run's
//     torch::Tensor shift = torch::randint(-4, 5, {2}, g);
//     ...
//   }
//
// torch's default generator is one for the whole process: data workers that
// draw from it concurrently get whatever another thread left there, so
// those draws repeat only with --evenstep_data_workers=0.
#pragma once

#include <ATen/core/Generator.h>

#include <cstdint>

namespace evenstep {

// A CPU generator seeded from (seed, epoch, sample, stream) alone; `stream`
// tells apart independent draws of one sample (0, 1, ...).
at::Generator SampleGenerator(uint64_t seed, int64_t epoch, int64_t sample, int64_t stream = 0);

// The same with the seed (--evenstep_seed) and epoch of the micro-batch that
// evenstep's torch::data loaders (LoaderOf, BatchesOf) are loading on this
// thread; outside such a load, seed 0 and epoch 0.
at::Generator SampleGenerator(int64_t sample, int64_t stream = 0);

namespace internal {
// While it lives, SampleGenerator(sample) on this thread uses `seed` and
// `epoch` (scopes nest).
class SampleDrawScope {
 public:
  SampleDrawScope(uint64_t seed, int64_t epoch);
  ~SampleDrawScope();
  SampleDrawScope(const SampleDrawScope&) = delete;
  SampleDrawScope& operator=(const SampleDrawScope&) = delete;

 private:
  uint64_t seed_before_;
  int64_t epoch_before_;
};
}  // namespace internal

}  // namespace evenstep

// torch::data datasets in BalancedStep / Session: keep the map-style dataset
// and its collate (e.g. .map(torch::data::transforms::Stack<>())), and let
// evenstep choose each rank's samples instead of a DataLoader with a
// DistributedRandomSampler:
//
//   auto dataset = MyDataset(...).map(torch::data::transforms::Stack<>());
//   auto lengths = evenstep::UniformLengths(*dataset.size());  // or real lengths
//   auto es = evenstep::Session::Create(*ctx, *model, optimizer, lengths, run_dir);
//   auto batches = evenstep::LoaderOf(dataset);
//   while ((*es)->epoch() < epochs) {
//     auto report = (*es)->Step(batches, [&](const torch::data::Example<>& batch) {
//       return torch::nll_loss(model->forward(batch.data), batch.target);
//     });  // a MEAN: run with --evenstep_loss_reduction=mean
//   }
//
// The micro-batch's sample indices (int64_t) become the dataset's size_t
// indices. LoaderOf copies the dataset into an evenstep::Loader (loader.h):
// like torch::data's DataLoader with workers, each data worker calls
// get_batch on a copy of its own, so the loads run on the data workers and
// ahead into the next step by default (a torch::data dataset copies cheaply:
// its tensors share their storage). BatchesOf(dataset) instead refers to the
// caller's dataset: loaded on the training thread, or with
// --evenstep_data_workers=N > 0 on N threads calling get_batch on that one
// dataset concurrently. Random draws in the dataset's get(index) repeat
// whichever worker runs them when they come from
// evenstep::SampleGenerator(index) (sample_random.h). This header includes
// torch/data; nothing else of evenstep does.
#pragma once

#include <torch/data/datasets/base.h>

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "evenstep/loader.h"
#include "evenstep/sample_random.h"
#include "evenstep/sampler.h"

namespace evenstep {

// The size of a torch::data dataset: FailedPrecondition for one without a
// size (a stream-style dataset, which evenstep's sampler cannot index).
template <typename Dataset>
absl::StatusOr<int64_t> DatasetSize(const Dataset& dataset) {
  const auto size = dataset.size();
  if (!size.has_value()) {
    return absl::FailedPreconditionError(
        "the torch::data dataset has no size(): evenstep needs a map-style dataset whose "
        "samples it can index");
  }
  return static_cast<int64_t>(*size);
}

// A load function for Step: dataset.get_batch(the micro-batch's samples).
// The dataset must outlive the returned function.
template <typename Dataset>
auto BatchesOf(Dataset& dataset) {
  return [&dataset](const MicroBatch& mb) {
    std::vector<size_t> indices(mb.samples.begin(), mb.samples.end());
    internal::SampleDrawScope draws(mb.seed, mb.epoch);  // SampleGenerator(index) in get
    return dataset.get_batch(indices);
  };
}

// The Loader of a copy of `dataset` (see the top of this file): made once,
// before the loop, and passed to every Step.
template <typename Dataset>
auto LoaderOf(Dataset dataset) {
  return Loader([dataset = std::move(dataset)](const MicroBatch& mb) mutable {
    return BatchesOf(dataset)(mb);
  });
}

}  // namespace evenstep

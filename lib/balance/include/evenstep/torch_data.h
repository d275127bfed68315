// torch::data datasets in BalancedStep / Session: keep the map-style dataset
// and its collate (e.g. .map(torch::data::transforms::Stack<>())), and let
// evenstep choose each rank's samples instead of a DataLoader with a
// DistributedRandomSampler:
//
//   auto dataset = MyDataset(...).map(torch::data::transforms::Stack<>());
//   auto lengths = evenstep::UniformLengths(*dataset.size());  // or real lengths
//   auto es = evenstep::Session::Create(*ctx, *model, optimizer, lengths, run_dir);
//   while ((*es)->epoch() < epochs) {
//     auto report = (*es)->Step(evenstep::BatchesOf(dataset),
//                               [&](const torch::data::Example<>& batch) {
//                                 return torch::nll_loss(model->forward(batch.data), batch.target);
//                               });  // a MEAN: run with --evenstep_loss_reduction=mean
//   }
//
// The micro-batch's sample indices (int64_t) become the dataset's size_t
// indices; get_batch runs on --evenstep_data_workers threads when set (like
// torch::data's own workers, it must then be safe to call concurrently). This
// header includes torch/data; nothing else of evenstep does.
#pragma once

#include <torch/data/datasets/base.h>

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "evenstep/sampler.h"

namespace evenstep {

// Lengths for samples that all cost the same (images, fixed-size records):
// `n` ones. With them, work and dynamic balancing split by sample counts.
inline std::vector<int64_t> UniformLengths(int64_t n) {
  return std::vector<int64_t>(n > 0 ? static_cast<size_t>(n) : 0, 1);
}

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

// The load function for Step: dataset.get_batch(the micro-batch's samples).
// The dataset must outlive the returned function.
template <typename Dataset>
auto BatchesOf(Dataset& dataset) {
  return [&dataset](const MicroBatch& mb) {
    std::vector<size_t> indices(mb.samples.begin(), mb.samples.end());
    return dataset.get_batch(indices);
  };
}

}  // namespace evenstep

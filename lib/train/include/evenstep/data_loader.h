// evenstep::MakeDataLoader: a torch::data loop over `*data_loader` keeps its
// `for` line as written (as Hugging Face Accelerate's prepare(dataloader)
// keeps the loop over the loader it returns):
//
//   auto data_loader = evenstep::MakeDataLoader(*es, std::move(dataset));
//   //   was: torch::data::make_data_loader(std::move(dataset), options)
//   for (int64_t epoch = es->first_epoch(); epoch < epochs; ++epoch) {
//     for (torch::data::Example<>& batch : *data_loader) {  // unchanged
//       ...
//       es->Backward(loss);  // was: zero_grad, backward, step
//     }
//   }
//
// `*data_loader` is Session::Batches(LoaderOf(dataset)): this rank's
// balanced micro-batches of the epoch's remaining steps (see
// Session::Batches for what the loop's body may and may not do). The
// batch size is the Session's global batch (--evenstep_global_batch), the
// order its sampler's (--evenstep_shuffle, --evenstep_seed), the loading on
// its data workers (--evenstep_data_workers).
#pragma once

#include <utility>

#include "evenstep/session.h"
#include "evenstep/torch_data.h"

namespace evenstep {

template <typename Data>
class DataLoader {
 public:
  DataLoader(Session& session, Loader<Data> loader)
      : session_(&session), loader_(std::move(loader)) {}
  // The epoch's batches, as `*torch_data_loader` is.
  LoopBatches<Data> operator*() const { return session_->Batches(loader_); }
  const Loader<Data>& loader() const { return loader_; }

 private:
  Session* session_;
  Loader<Data> loader_;
};

namespace internal {
template <typename Data>
DataLoader<Data> DataLoaderOf(Session& session, Loader<Data> loader) {
  return DataLoader<Data>(session, std::move(loader));
}
}  // namespace internal

// A torch::data dataset (with its transforms) loaded through `session`.
template <typename Dataset>
auto MakeDataLoader(Session& session, Dataset dataset) {
  return internal::DataLoaderOf(session, LoaderOf(std::move(dataset)));
}

}  // namespace evenstep

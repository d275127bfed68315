// The training loop of pytorch/examples' cpp/distributed/dist-mnist.cpp on
// SyntheticDigits (no download): dist_mnist_plain.cc as it is (torch::data
// loader, DistributedRandomSampler, an all-reduce per parameter), and
// dist_mnist.cc ported to evenstep; the README shows the diff.
//   evenstep-run -n 2 -- dist_mnist[_plain] [--epochs 2] [--samples 4096]
#include <torch/torch.h>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "evenstep/dist_context.h"
#include "evenstep/flags.h"
#include "samples/dist_mnist_common.h"

ABSL_FLAG(int, epochs, 2, "Passes over the dataset.");
ABSL_FLAG(int64_t, samples, 4096, "Samples in the synthetic dataset.");

using namespace evenstep::samples;

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  torch::set_num_threads(1);
  auto ctx = evenstep::DistContextFromFlags();
  if (!ctx.ok()) return Fail(ctx.status());
  const int rank = (*ctx)->rank(), world = (*ctx)->world_size();
  torch::manual_seed(0);
  auto model = std::make_shared<Net>();
  torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(0.05).momentum(0.5));
  auto dataset = SyntheticDigits(absl::GetFlag(FLAGS_samples))
                     .map(torch::data::transforms::Normalize<>(0.5, 0.3))
                     .map(torch::data::transforms::Stack<>());
  auto sampler = torch::data::samplers::DistributedRandomSampler(*dataset.size(), world, rank);
  auto loader = torch::data::make_data_loader(std::move(dataset), sampler, 64 / world);
  for (int epoch = 0; epoch < absl::GetFlag(FLAGS_epochs); ++epoch) {
    for (auto& batch : *loader) {
      optimizer.zero_grad();
      torch::Tensor loss = torch::nll_loss(model->forward(batch.data), batch.target);
      loss.backward();
      for (auto& param : model->parameters()) {  // average the gradients over the ranks
        if (!(*ctx)->AllReduce(param.mutable_grad()).ok()) return 1;
        param.mutable_grad().div_(world);
      }
      optimizer.step();
      Progress(rank, epoch, loss.item<double>());
    }
  }
  return 0;
}

// The training loop of pytorch/examples' cpp/distributed/dist-mnist.cpp on
// SyntheticDigits (no download): dist_mnist_plain.cc as it is (torch::data
// loader, DistributedRandomSampler, an all-reduce per parameter), and
// dist_mnist.cc ported to evenstep; the README shows the diff.
//   evenstep-run -n 2 -- dist_mnist[_plain] [--epochs 2] [--samples 4096]
#include <torch/torch.h>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "evenstep/flags.h"
#include "evenstep/session.h"
#include "evenstep/torch_data.h"
#include "samples/dist_mnist_common.h"

ABSL_FLAG(int, epochs, 2, "Passes over the dataset.");
ABSL_FLAG(int64_t, samples, 4096, "Samples in the synthetic dataset.");
ABSL_FLAG(std::string, run_dir, "dist_mnist_run", "Checkpoints and logs (resumed from).");

using namespace evenstep::samples;

int main(int argc, char** argv) {
  evenstep::SetFlagDefaults("global_batch=64 loss_reduction=mean");  // nll_loss is a mean
  absl::ParseCommandLine(argc, argv);
  torch::set_num_threads(1);
  auto ctx = evenstep::DistContextFromFlags();
  if (!ctx.ok()) return Fail(ctx.status());
  const int rank = (*ctx)->rank();
  torch::manual_seed(0);
  auto model = std::make_shared<Net>();
  torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(0.05).momentum(0.5));
  auto dataset = SyntheticDigits(absl::GetFlag(FLAGS_samples))
                     .map(torch::data::transforms::Normalize<>(0.5, 0.3))
                     .map(torch::data::transforms::Stack<>());
  auto es =
      evenstep::Session::Create(**ctx, *model, optimizer, evenstep::UniformLengths(*dataset.size()),
                                absl::GetFlag(FLAGS_run_dir));
  if (!es.ok()) return Fail(es.status());
  auto loader = evenstep::LoaderOf(dataset);  // data workers, next step loaded ahead
  while ((*es)->epoch() < absl::GetFlag(FLAGS_epochs)) {
    auto report = (*es)->Step(loader, [&](const auto& batch) {
      return torch::nll_loss(model->forward(batch.data), batch.target);
    });
    if (!report.ok()) return Fail(report.status());
    Progress(rank, report->epoch, report->loss);
  }
  return (*es)->Finish().ok() ? 0 : 1;
}

// A deep residual network, ported from prabhuomkar/pytorch-cpp
// (tutorials/intermediate/deep_residual_network) to synthetic images
// (samples/resnet_common.h): Adam with its learning rate divided by 3 every
// --decay_every epochs, per-sample augmentation, the epoch's loss and
// accuracy. The order is sequential (the original shuffles) so that the port
// can be compared step by step. resnet_plain.cc is the single-process loop;
// resnet.cc the same on evenstep; docs/usage.md shows the diff.
#include <torch/torch.h>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "samples/resnet_common.h"

ABSL_FLAG(int, epochs, 20, "Passes over the dataset (the original's 20).");
ABSL_FLAG(int, decay_every, 8, "Epochs between learning-rate decays (the original's 8).");
ABSL_FLAG(int64_t, samples, 5000, "Images in the synthetic dataset.");
ABSL_FLAG(int64_t, image, 32, "Image height and width (CIFAR-10's 32).");
ABSL_FLAG(int64_t, width, 16, "Channels of the first stage (the original's 16).");

using namespace evenstep::samples;
using torch::data::samplers::SequentialSampler;

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  torch::set_num_threads(1);
  const int64_t n = absl::GetFlag(FLAGS_samples), epochs = absl::GetFlag(FLAGS_epochs);
  auto dataset =
      SyntheticImages(n, absl::GetFlag(FLAGS_image)).map(torch::data::transforms::Stack<>());
  torch::manual_seed(0);
  ResNet model(absl::GetFlag(FLAGS_width), 10);
  torch::optim::Adam optimizer(model->parameters(), torch::optim::AdamOptions(1e-3));
  torch::optim::StepLR decay(optimizer, absl::GetFlag(FLAGS_decay_every), 1.0 / 3);  // per epoch
  EpochMetrics metrics;
  int64_t epoch = 0;  // the augmentation is keyed by (epoch, sample)
  auto loss_of = [&](const torch::data::Example<>& batch) {
    Augmented b = Augment(batch, epoch);
    torch::Tensor output = model->forward(b.images);
    metrics.batch_correct = output.argmax(1).eq(b.labels).sum().item<double>();
    return torch::nn::functional::cross_entropy(output, b.labels);
  };
  auto loader = torch::data::make_data_loader(std::move(dataset), SequentialSampler(n), 100);
  for (; epoch < epochs; ++epoch) {
    for (auto& batch : *loader) {
      torch::Tensor loss = loss_of(batch);
      optimizer.zero_grad();
      loss.backward();
      optimizer.step();
      metrics.Add(loss.item<double>(), batch.data.size(0), metrics.batch_correct);
    }
    decay.step();
    metrics.EndEpoch(epoch, epochs);
  }
  return 0;
}

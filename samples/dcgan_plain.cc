// DCGAN, ported from pytorch/examples cpp/dcgan/dcgan.cpp to synthetic digits
// (samples/dcgan_common.h): a discriminator step then a generator step per
// batch, each with its own Adam; the generator's loss draws the
// discriminator step's noise again (keyed by sample) instead of keeping its
// fakes. dcgan_plain.cc is the single-process loop; dcgan.cc the same on
// evenstep (one Session, two model parts); docs/ports.md shows the diff.
#include <torch/torch.h>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "samples/dcgan_common.h"

ABSL_FLAG(int, epochs, 2, "Passes over the dataset.");
ABSL_FLAG(int64_t, samples, 1024, "Samples in the synthetic dataset.");
ABSL_FLAG(int64_t, channels, 64, "Width of the first/last convolution (the original's 64).");

using namespace evenstep::samples;
using torch::data::samplers::SequentialSampler;

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  torch::set_num_threads(1);
  torch::manual_seed(1);
  auto generator = MakeGenerator(absl::GetFlag(FLAGS_channels));
  auto discriminator = MakeDiscriminator(absl::GetFlag(FLAGS_channels));
  torch::optim::Adam g_optimizer(generator->parameters(),
                                 torch::optim::AdamOptions(2e-4).betas({0.5, 0.999}));
  torch::optim::Adam d_optimizer(discriminator->parameters(),
                                 torch::optim::AdamOptions(2e-4).betas({0.5, 0.999}));
  const int64_t n = absl::GetFlag(FLAGS_samples);
  auto dataset = DigitImages(n).map(torch::data::transforms::Stack<>());
  int64_t epoch = 0;  // the losses' draws are keyed by (epoch, sample)
  auto d_loss_of = [&](const torch::data::Example<>& batch) {
    torch::Tensor real_output = discriminator->forward(batch.data);
    torch::Tensor d_loss_real =
        torch::binary_cross_entropy(real_output, RealLabels(batch.target, epoch));
    torch::Tensor fake_images = generator->forward(Noise(batch.target, epoch));
    torch::Tensor fake_output = discriminator->forward(fake_images.detach());
    return d_loss_real + torch::binary_cross_entropy(fake_output, torch::zeros_like(fake_output));
  };
  auto g_loss_of = [&](const torch::data::Example<>& batch) {
    torch::Tensor fake_output =
        discriminator->forward(generator->forward(Noise(batch.target, epoch)));
    return torch::binary_cross_entropy(fake_output, torch::ones_like(fake_output));
  };
  auto loader = torch::data::make_data_loader(std::move(dataset), SequentialSampler(n), 64);
  for (int64_t step = 0; epoch < absl::GetFlag(FLAGS_epochs); ++epoch) {
    for (auto& batch : *loader) {
      discriminator->zero_grad();
      torch::Tensor d_loss = d_loss_of(batch);
      d_loss.backward();
      d_optimizer.step();
      generator->zero_grad();
      torch::Tensor g_loss = g_loss_of(batch);
      g_loss.backward();
      g_optimizer.step();
      GanProgress(0, ++step, d_loss.item<double>(), g_loss.item<double>());
    }
  }
  return 0;
}

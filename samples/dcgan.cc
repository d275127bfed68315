// A plain libtorch trainer in the shape of pytorch/examples' cpp/dcgan
// (written here in its shape, not copied): a generator and a discriminator,
// each with its own Adam; per batch the discriminator's step on real images
// (smoothed labels) and on the generator's fakes, then the generator's step
// through the stepped discriminator on the same fakes; a progress line every
// kLogInterval batches, the models, optimizers and sample images saved every
// kCheckpointEvery batches. The data is SyntheticDigits (MNIST's shapes);
// flags replace the constants a test must change. dcgan.cc is the same
// program on evenstep (one Session, two model parts), loop-shaped.
#include <torch/torch.h>

#include <cmath>
#include <cstdio>
#include <iostream>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "evenstep/evenstep.h"
#include "samples/dcgan_common.h"

ABSL_FLAG(int64_t, epochs, 30, "Passes over the dataset (the original's 30).");
ABSL_FLAG(int64_t, samples, 60000, "Training images (synthetic; MNIST has 60000).");
ABSL_FLAG(int64_t, channels, 64, "Width of the first/last convolution (the original's 64).");
ABSL_FLAG(int64_t, log_interval, 10, "Batches between progress lines (the original's 10).");

using namespace evenstep::samples;

int main(int argc, char** argv) {
  evenstep::SetFlagDefaults("global_batch=64 loss_reduction=mean");  // kBatchSize; BCE: a mean
  absl::ParseCommandLine(argc, argv);
  torch::set_num_threads(1);
  torch::manual_seed(1);

  // Hyper parameters
  const int64_t kBatchSize = 64;
  const int64_t kNumberOfEpochs = absl::GetFlag(FLAGS_epochs);
  const int64_t kCheckpointEvery = 200;
  const int64_t kNumberOfSamplesPerCheckpoint = 10;
  const bool kRestoreFromCheckpoint = false;
  const int64_t kLogInterval = absl::GetFlag(FLAGS_log_interval);

  // Device
  torch::Device device(torch::cuda::is_available() ? torch::kCUDA : torch::kCPU);

  // Models
  auto generator = MakeGenerator(absl::GetFlag(FLAGS_channels));
  generator->to(device);
  auto discriminator = MakeDiscriminator(absl::GetFlag(FLAGS_channels));
  discriminator->to(device);

  // MNIST-shaped images in [-1, 1]
  auto dataset = SyntheticDigits(absl::GetFlag(FLAGS_samples))
                     .map(torch::data::transforms::Normalize<>(0.5, 0.5))
                     .map(torch::data::transforms::Stack<>());
  const int64_t batches_per_epoch =
      std::ceil(dataset.size().value() / static_cast<double>(kBatchSize));

  // Optimizers
  torch::optim::Adam generator_optimizer(generator->parameters(),
                                         torch::optim::AdamOptions(2e-4).betas({0.5, 0.999}));
  torch::optim::Adam discriminator_optimizer(discriminator->parameters(),
                                             torch::optim::AdamOptions(2e-4).betas({0.5, 0.999}));

  auto es = evenstep::Session::Create({{"discriminator", *discriminator, discriminator_optimizer},
                                       {"generator", *generator, generator_optimizer}},
                                      dataset.size().value());
  if (!es.ok()) return Fail(es.status());
  auto data_loader = evenstep::MakeDataLoader(**es, std::move(dataset));
  if (kRestoreFromCheckpoint) {
    torch::load(generator, "generator-checkpoint.pt");
    torch::load(generator_optimizer, "generator-optimizer-checkpoint.pt");
    torch::load(discriminator, "discriminator-checkpoint.pt");
    torch::load(discriminator_optimizer, "discriminator-optimizer-checkpoint.pt");
  }

  evenstep::Kept<int64_t> checkpoint_counter(**es, "checkpoint_counter", 1);
  for (int64_t epoch = (*es)->first_epoch() + 1; epoch <= kNumberOfEpochs; ++epoch) {
    int64_t batch_index = (*es)->step_in_epoch();
    for (torch::data::Example<>& batch : *data_loader) {
      // The discriminator on real images
      discriminator->zero_grad();
      torch::Tensor real_images = batch.data.to(device);
      torch::Tensor real_labels = torch::empty(batch.data.size(0), device).uniform_(0.8, 1.0);
      torch::Tensor real_output = discriminator->forward(real_images).reshape(real_labels.sizes());
      torch::Tensor d_loss_real = torch::binary_cross_entropy(real_output, real_labels);

      // ... and on fake images
      torch::Tensor noise = torch::randn({batch.data.size(0), kNoiseSize, 1, 1}, device);
      torch::Tensor fake_images = generator->forward(noise);
      torch::Tensor fake_labels = torch::zeros(batch.data.size(0), device);
      torch::Tensor fake_output =
          discriminator->forward(fake_images.detach()).reshape(fake_labels.sizes());
      torch::Tensor d_loss_fake = torch::binary_cross_entropy(fake_output, fake_labels);

      torch::Tensor d_loss = d_loss_real + d_loss_fake;
      (*es)->Backward(d_loss);

      // The generator
      generator->zero_grad();
      fake_labels.fill_(1);
      fake_output = discriminator->forward(fake_images).reshape(fake_labels.sizes());
      torch::Tensor g_loss = torch::binary_cross_entropy(fake_output, fake_labels);
      (*es)->Backward(g_loss);
      batch_index++;

      if (batch_index % kLogInterval == 0) {
        std::printf("\r[%2ld/%2ld][%3ld/%3ld] D_loss: %.4f | G_loss: %.4f\n", epoch,
                    kNumberOfEpochs, batch_index, batches_per_epoch, d_loss.item<float>(),
                    g_loss.item<float>());
      }

      if (batch_index % kCheckpointEvery == 0 && (*es)->rank() == 0) {
        // The models and optimizers, and a few sample images
        torch::save(generator, "generator-checkpoint.pt");
        torch::save(generator_optimizer, "generator-optimizer-checkpoint.pt");
        torch::save(discriminator, "discriminator-checkpoint.pt");
        torch::save(discriminator_optimizer, "discriminator-optimizer-checkpoint.pt");
        torch::Tensor samples = generator->forward(
            torch::randn({kNumberOfSamplesPerCheckpoint, kNoiseSize, 1, 1}, device));
        torch::save((samples + 1.0) / 2.0, torch::str("dcgan-sample-", checkpoint_counter, ".pt"));
        std::cout << "\n-> checkpoint " << ++checkpoint_counter << '\n';
      }
    }
  }

  std::cout << "Training complete!" << std::endl;
  return evenstep::ExitCode((*es)->Finish());
}

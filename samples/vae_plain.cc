// A plain libtorch trainer in the shape of prabhuomkar/pytorch-cpp's
// variational autoencoder tutorial (written here in its shape, not copied):
// Adam over a VAE, a RandomSampler loader of 100, the objective a batch SUM
// (binary cross-entropy summed over pixels plus the KL divergence summed
// over the batch), a progress line every log_every batches, and at each
// epoch's end a batch of sampled images and the last batch's
// reconstructions written to output_dir. The data is SyntheticDigits
// (MNIST's shapes); flags replace the constants a test must change. vae.cc
// is the same program on evenstep, loop-shaped.
#include <torch/torch.h>

#include <iomanip>
#include <iostream>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "samples/vae_common.h"

ABSL_FLAG(size_t, epochs, 15, "Passes over the training set (the original's 15).");
ABSL_FLAG(int64_t, samples, 60000, "Training images (synthetic; MNIST has 60000).");
ABSL_FLAG(size_t, log_every, 100, "A progress line every this many batches (the original's 100).");
ABSL_FLAG(std::string, output_dir, "output/", "Where the images go (must exist).");

using namespace evenstep::samples;

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  torch::set_num_threads(1);
  torch::manual_seed(1);
  std::cout << "Variational Autoencoder\n\n";

  // Device
  torch::Device device(torch::cuda::is_available() ? torch::kCUDA : torch::kCPU);

  // Hyper parameters
  const int64_t h_dim = 400;
  const int64_t z_dim = 20;
  const int64_t image_size = 28 * 28;
  const int64_t batch_size = 100;
  const size_t num_epochs = absl::GetFlag(FLAGS_epochs);
  const double learning_rate = 1e-3;
  const std::string sample_output_dir_path = absl::GetFlag(FLAGS_output_dir);

  // MNIST-shaped dataset
  auto dataset =
      SyntheticDigits(absl::GetFlag(FLAGS_samples)).map(torch::data::transforms::Stack<>());
  auto num_samples = dataset.size().value();

  // Data loader
  auto dataloader = torch::data::make_data_loader<torch::data::samplers::RandomSampler>(
      std::move(dataset), batch_size);

  // Model and optimizer
  VAE model(image_size, h_dim, z_dim);
  model->to(device);
  torch::optim::Adam optimizer(model->parameters(), torch::optim::AdamOptions(learning_rate));

  std::cout << std::fixed << std::setprecision(4);
  std::cout << "Training...\n";
  for (size_t epoch = 0; epoch != num_epochs; ++epoch) {
    torch::Tensor images;
    size_t batch_index = 0;
    model->train();
    for (auto& batch : *dataloader) {
      images = batch.data.reshape({-1, image_size}).to(device);
      auto output = model->forward(images);
      auto reconstruction_loss = torch::nn::functional::binary_cross_entropy(
          output.reconstruction, images,
          torch::nn::functional::BinaryCrossEntropyFuncOptions().reduction(torch::kSum));
      auto kl_divergence =
          -0.5 * torch::sum(1 + output.log_var - output.mu.pow(2) - output.log_var.exp());
      auto loss = reconstruction_loss + kl_divergence;
      optimizer.zero_grad();
      loss.backward();
      optimizer.step();
      if ((batch_index + 1) % absl::GetFlag(FLAGS_log_every) == 0) {
        std::cout << "Epoch [" << epoch + 1 << "/" << num_epochs << "], Step [" << batch_index + 1
                  << "/" << num_samples / batch_size << "], Reconstruction loss: "
                  << reconstruction_loss.item<double>() / batch.data.size(0)
                  << ", KL-divergence: " << kl_divergence.item<double>() / batch.data.size(0)
                  << "\n";
      }
      ++batch_index;
    }
    model->eval();
    torch::NoGradGuard no_grad;
    // Decoded codings drawn from the unit Gaussian, and the last batch's
    // images beside their reconstructions.
    auto z = torch::randn({batch_size, z_dim}).to(device);
    auto images_decoded = model->decode(z).view({-1, 1, 28, 28});
    SaveImage(images_decoded,
              sample_output_dir_path + "sampled-" + std::to_string(epoch + 1) + ".pgm");
    auto output = model->forward(images);
    auto images_concatenated =
        torch::cat({images.view({-1, 1, 28, 28}), output.reconstruction.view({-1, 1, 28, 28})}, 3);
    SaveImage(images_concatenated,
              sample_output_dir_path + "reconstruction-" + std::to_string(epoch + 1) + ".pgm");
  }
  std::cout << "Training finished!\n";
}

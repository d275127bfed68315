// A plain libtorch trainer in the shape of prabhuomkar/pytorch-cpp's deep
// residual network tutorial (written here in its shape, not copied): Adam
// over a ResNet, the training set augmented by tensor transforms that draw
// from torch's default generator, a RandomSampler loader of 100, a running
// loss and correct count declared at each epoch's top, the loop's own copy
// of the learning rate divided by 3 every decay_every epochs and written
// into the optimizer, then one pass over the test set. The data is
// SyntheticImages (CIFAR-10's shapes; samples/resnet_common.h); flags
// replace the constants a test must change. resnet.cc is the same program
// on evenstep, loop-shaped.
#include <torch/torch.h>

#include <iomanip>
#include <iostream>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "samples/resnet_common.h"

ABSL_FLAG(size_t, epochs, 20, "Passes over the training set (the original's 20).");
ABSL_FLAG(size_t, decay_every, 8, "Epochs between learning-rate decays (the original's 8).");
ABSL_FLAG(int64_t, samples, 50000, "Training images (synthetic; CIFAR-10 has 50000).");
ABSL_FLAG(int64_t, image, 32, "Image height and width (CIFAR-10's 32).");
ABSL_FLAG(int64_t, width, 16, "Channels of the first stage (the original's 16).");

using namespace evenstep::samples;

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  torch::set_num_threads(1);
  std::cout << "Deep Residual Network\n\n";

  // Device
  torch::Device device(torch::cuda::is_available() ? torch::kCUDA : torch::kCPU);

  // Hyper parameters
  const int64_t num_classes = 10;
  const int64_t batch_size = 100;
  const size_t num_epochs = absl::GetFlag(FLAGS_epochs);
  const double learning_rate = 0.001;
  const size_t learning_rate_decay_frequency = absl::GetFlag(FLAGS_decay_every);
  const double learning_rate_decay_factor = 1.0 / 3.0;
  const int64_t image = absl::GetFlag(FLAGS_image);

  // CIFAR-10-shaped datasets
  auto train_dataset = SyntheticImages(absl::GetFlag(FLAGS_samples), image)
                           .map(ConstantPad(4))
                           .map(RandomHorizontalFlip())
                           .map(RandomCrop({image, image}))
                           .map(torch::data::transforms::Stack<>());
  auto num_train_samples = train_dataset.size().value();
  auto test_dataset =
      SyntheticImages(1000, image, /*seed=*/12).map(torch::data::transforms::Stack<>());
  auto num_test_samples = test_dataset.size().value();

  // Data loaders
  auto train_loader = torch::data::make_data_loader<torch::data::samplers::RandomSampler>(
      std::move(train_dataset), batch_size);
  auto test_loader = torch::data::make_data_loader<torch::data::samplers::SequentialSampler>(
      std::move(test_dataset), batch_size);

  // Model and optimizer
  torch::manual_seed(0);
  ResNet model(absl::GetFlag(FLAGS_width), num_classes);
  model->to(device);
  torch::optim::Adam optimizer(model->parameters(), torch::optim::AdamOptions(learning_rate));

  std::cout << std::fixed << std::setprecision(4);
  auto current_learning_rate = learning_rate;
  std::cout << "Training...\n";
  for (size_t epoch = 0; epoch != num_epochs; ++epoch) {
    double running_loss = 0.0;
    size_t num_correct = 0;
    for (auto& batch : *train_loader) {
      auto data = batch.data.to(device);
      auto target = batch.target.to(device);
      auto output = model->forward(data);
      auto loss = torch::nn::functional::cross_entropy(output, target);
      running_loss += loss.item<double>() * data.size(0);
      auto prediction = output.argmax(1);
      num_correct += prediction.eq(target).sum().item<int64_t>();
      optimizer.zero_grad();
      loss.backward();
      optimizer.step();
    }

    // Decay learning rate
    if ((epoch + 1) % learning_rate_decay_frequency == 0) {
      current_learning_rate *= learning_rate_decay_factor;
      static_cast<torch::optim::AdamOptions&>(optimizer.param_groups().front().options())
          .lr(current_learning_rate);
    }

    auto sample_mean_loss = running_loss / num_train_samples;
    auto accuracy = static_cast<double>(num_correct) / num_train_samples;
    std::cout << "Epoch [" << (epoch + 1) << "/" << num_epochs
              << "], Trainset - Loss: " << sample_mean_loss << ", Accuracy: " << accuracy << '\n';
  }
  std::cout << "Training finished!\n\n";

  std::cout << "Testing...\n";
  model->eval();
  torch::NoGradGuard no_grad;
  double running_loss = 0.0;
  size_t num_correct = 0;
  for (const auto& batch : *test_loader) {
    auto data = batch.data.to(device);
    auto target = batch.target.to(device);
    auto output = model->forward(data);
    auto loss = torch::nn::functional::cross_entropy(output, target);
    running_loss += loss.item<double>() * data.size(0);
    auto prediction = output.argmax(1);
    num_correct += prediction.eq(target).sum().item<int64_t>();
  }
  std::cout << "Testing finished!\n";
  auto test_accuracy = static_cast<double>(num_correct) / num_test_samples;
  auto test_sample_mean_loss = running_loss / num_test_samples;
  std::cout << "Testset - Loss: " << test_sample_mean_loss << ", Accuracy: " << test_accuracy
            << '\n';
}

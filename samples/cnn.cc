// A plain libtorch trainer in the shape of prabhuomkar/pytorch-cpp's
// convolutional neural network tutorial (written here in its shape, not
// copied): Adam over a ConvNet with batch norm, a RandomSampler loader of
// 100, a running loss and correct count declared at each epoch's top and
// printed at its end, then one pass over the test set. The data is
// SyntheticDigits (MNIST's shapes); two flags replace the constants a test
// must change. cnn.cc is the same program on evenstep, loop-shaped.
#include <torch/torch.h>

#include <iomanip>
#include <iostream>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "evenstep/evenstep.h"
#include "samples/cnn_common.h"

ABSL_FLAG(size_t, epochs, 5, "Passes over the training set (the original's 5).");
ABSL_FLAG(int64_t, samples, 60000, "Training images (synthetic; MNIST has 60000).");

using namespace evenstep::samples;

int main(int argc, char** argv) {
  evenstep::SetFlagDefaults("global_batch=100 loss_reduction=mean");
  absl::ParseCommandLine(argc, argv);
  torch::set_num_threads(1);
  torch::manual_seed(1);
  std::cout << "Convolutional Neural Network\n\n";

  // Device
  torch::Device device(torch::cuda::is_available() ? torch::kCUDA : torch::kCPU);

  // Hyper parameters
  const size_t num_epochs = absl::GetFlag(FLAGS_epochs);
  const int64_t num_classes = 10;
  const int64_t batch_size = 100;
  const double learning_rate = 0.001;

  // MNIST-shaped datasets
  auto train_dataset = SyntheticDigits(absl::GetFlag(FLAGS_samples))
                           .map(torch::data::transforms::Normalize<>(0.1307, 0.3081))
                           .map(torch::data::transforms::Stack<>());
  auto num_train_samples = train_dataset.size().value();
  auto test_dataset = SyntheticDigits(1000, /*seed=*/8, /*pattern_seed=*/7)
                          .map(torch::data::transforms::Normalize<>(0.1307, 0.3081))
                          .map(torch::data::transforms::Stack<>());
  auto num_test_samples = test_dataset.size().value();

  // Data loaders
  auto train_loader = evenstep::LoaderOf(train_dataset);
  auto test_loader = torch::data::make_data_loader<torch::data::samplers::SequentialSampler>(
      std::move(test_dataset), batch_size);

  // Model and optimizer
  ConvNet model(num_classes);
  model->to(device);
  auto optimizer =
      torch::optim::Adam(model->parameters(), torch::optim::AdamOptions(learning_rate));
  auto es = evenstep::Session::Create(*model, optimizer, num_train_samples);
  if (!es.ok()) return Fail(es.status());

  std::cout << std::fixed << std::setprecision(4);
  std::cout << "Training...\n";
  for (size_t epoch = (*es)->first_epoch(); epoch != num_epochs; ++epoch) {
    evenstep::KeptSum<float> running_loss(**es, "running_loss", 0.0);
    evenstep::KeptSum<size_t> num_correct(**es, "num_correct", 0);
    for (auto& batch : (*es)->Batches(train_loader)) {
      auto data = batch.data.to(device);
      auto target = batch.target.to(device);
      auto output = model->forward(data);
      auto loss = torch::nll_loss(output, target);
      running_loss += loss.item<float>() * data.size(0);
      auto prediction = output.argmax(1);
      num_correct += prediction.eq(target).sum().item<int64_t>();
      (*es)->Backward(loss);
    }
    if ((*es)->stopped()) break;
    auto sample_mean_loss = running_loss / num_train_samples;
    auto accuracy = static_cast<float>(num_correct) / num_train_samples;
    std::cout << "Epoch [" << (epoch + 1) << "/" << num_epochs
              << "], Trainset - Loss: " << sample_mean_loss << ", Accuracy: " << accuracy << '\n';
  }
  std::cout << "Training finished!\n\n";
  if (auto s = (*es)->Finish(); !s.ok() || (*es)->rank() != 0) return evenstep::ExitCode(s);

  std::cout << "Testing...\n";
  model->eval();
  torch::NoGradGuard no_grad;
  float running_loss = 0.0;
  size_t num_correct = 0;
  for (const auto& batch : *test_loader) {
    auto data = batch.data.to(device);
    auto target = batch.target.to(device);
    auto output = model->forward(data);
    auto loss = torch::nll_loss(output, target);
    running_loss += loss.item<float>() * data.size(0);
    auto prediction = output.argmax(1);
    num_correct += prediction.eq(target).sum().item<int64_t>();
  }
  std::cout << "Testing finished!\n";
  auto test_accuracy = static_cast<float>(num_correct) / num_test_samples;
  auto test_sample_mean_loss = running_loss / num_test_samples;
  std::cout << "Testset - Loss: " << test_sample_mean_loss << ", Accuracy: " << test_accuracy
            << '\n';
}

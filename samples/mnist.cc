// A plain libtorch MNIST trainer in the shape of pytorch/examples' cpp/mnist
// (written here in its shape, not copied): a train function over a
// torch::data loader (zero_grad, forward, nll_loss, backward, step, a
// progress line every kLogInterval batches), a test function under
// NoGradGuard, SGD with momentum, on SyntheticDigits. mnist.cc is the same
// program on evenstep in the loop-shaped form (Session::Batches):
// docs/usage.md opens with the diff.
#include <torch/torch.h>

#include <cstdio>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "evenstep/evenstep.h"
#include "samples/dist_mnist_common.h"

ABSL_FLAG(int, epochs, 3, "Passes over the training set.");
ABSL_FLAG(int64_t, samples, 2048, "Training images (synthetic).");

using namespace evenstep::samples;

constexpr int64_t kBatchSize = 64;
constexpr int64_t kLogInterval = 10;

template <typename Loader>
void Train(int epoch, Net& model, Loader& loader, evenstep::Session& es, size_t size) {
  model.train();
  size_t batch_index = 0;
  for (auto& batch : es.Batches(loader)) {
    torch::Tensor output = model.forward(batch.data);
    torch::Tensor loss = torch::nll_loss(output, batch.target);
    es.Backward(loss);
    if (batch_index++ % kLogInterval == 0 && es.rank() == 0) {
      std::printf("Train Epoch: %d [%5zu/%5zu] Loss: %.6f\n", epoch,
                  batch_index * static_cast<size_t>(batch.data.size(0)), size, loss.item<float>());
    }
  }
}

template <typename Loader>
void Test(Net& model, Loader& loader, size_t size) {
  torch::NoGradGuard no_grad;
  model.eval();
  double test_loss = 0;
  int64_t correct = 0;
  for (const auto& batch : loader) {
    torch::Tensor output = model.forward(batch.data), targets = batch.target;
    test_loss += torch::nll_loss(output, targets, {}, at::Reduction::Sum).item<double>();
    correct += output.argmax(1).eq(targets).sum().item<int64_t>();
  }
  std::printf("Test set: Average loss: %.6f | Accuracy: %.4f\n", test_loss / size,
              static_cast<double>(correct) / size);
}

int main(int argc, char** argv) {
  evenstep::SetFlagDefaults("global_batch=64 loss_reduction=mean shuffle=false");
  absl::ParseCommandLine(argc, argv);
  torch::set_num_threads(1);
  torch::manual_seed(1);
  Net model;
  auto train_set = SyntheticDigits(absl::GetFlag(FLAGS_samples))
                       .map(torch::data::transforms::Normalize<>(0.5, 0.3))
                       .map(torch::data::transforms::Stack<>());
  const size_t train_size = *train_set.size();
  auto train_loader = evenstep::LoaderOf(train_set);
  auto test_set = SyntheticDigits(1000, /*seed=*/8)
                      .map(torch::data::transforms::Normalize<>(0.5, 0.3))
                      .map(torch::data::transforms::Stack<>());
  const size_t test_size = *test_set.size();
  auto test_loader = torch::data::make_data_loader(std::move(test_set), 1000);
  torch::optim::SGD optimizer(model.parameters(), torch::optim::SGDOptions(0.01).momentum(0.5));
  auto es = evenstep::Session::Create(model, optimizer, train_size);
  if (!es.ok()) return Fail(es.status());
  for (int epoch = (*es)->first_epoch() + 1; epoch <= absl::GetFlag(FLAGS_epochs); ++epoch) {
    Train(epoch, model, train_loader, **es, train_size);
    if ((*es)->stopped()) break;
    Test(model, *test_loader, test_size);
  }
  return evenstep::ExitCode((*es)->Finish());
}

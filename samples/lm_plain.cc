// A plain libtorch trainer in the shape of prabhuomkar/pytorch-cpp's
// language model tutorial (written here in its shape, not copied): an LSTM
// language model over batch_size token rows; each epoch starts the hidden
// and cell states at zeros and carries them from chunk to chunk (truncated
// BPTT), keeps a running loss and perplexity and prints them at its end;
// then the model writes sampled word ids to a file. The corpus is
// SyntheticCorpus (samples/lm_common.h); flags replace the constants a test
// must change. lm.cc is the same program on evenstep, loop-shaped (stream
// mode: each row a stream that stays on its rank).
#include <torch/torch.h>

#include <fstream>
#include <iomanip>
#include <iostream>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "samples/lm_common.h"

ABSL_FLAG(size_t, epochs, 5, "Passes over the corpus (the original's 5).");
ABSL_FLAG(int64_t, chunks, 40, "Chunks of sequence_length tokens per row (synthetic corpus).");
ABSL_FLAG(int64_t, hidden, 1024, "LSTM hidden size (the original's 1024).");
ABSL_FLAG(int64_t, vocab, 1000, "Vocabulary size (synthetic corpus).");
ABSL_FLAG(std::string, sample_output, "sample.txt", "Where the sampled word ids go.");

using namespace evenstep::samples;

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  torch::set_num_threads(1);
  std::cout << "Language Model\n\n";

  // Device
  auto cuda_available = torch::cuda::is_available();
  torch::Device device(cuda_available ? torch::kCUDA : torch::kCPU);
  std::cout << (cuda_available ? "CUDA available. Training on GPU." : "Training on CPU.") << '\n';

  // Hyper parameters
  const int64_t embed_size = 128;
  const int64_t hidden_size = absl::GetFlag(FLAGS_hidden);
  const int64_t num_layers = 1;
  const int64_t num_samples = 1000;  // the number of words to be sampled
  const int64_t batch_size = 20;
  const int64_t sequence_length = 30;
  const size_t num_epochs = absl::GetFlag(FLAGS_epochs);
  const double learning_rate = 0.002;

  // The corpus: batch_size rows of token ids
  auto ids = SyntheticCorpus(batch_size, absl::GetFlag(FLAGS_chunks), sequence_length,
                             absl::GetFlag(FLAGS_vocab));
  auto vocab_size = absl::GetFlag(FLAGS_vocab);
  const std::string sample_output_path = absl::GetFlag(FLAGS_sample_output);

  // Model
  torch::manual_seed(0);
  LanguageModel model(vocab_size, embed_size, hidden_size, num_layers);
  model->to(device);

  // Optimizer
  torch::optim::Adam optimizer(model->parameters(), torch::optim::AdamOptions(learning_rate));

  // Set floating point output precision
  std::cout << std::fixed << std::setprecision(6);

  std::cout << "Training...\n";

  // Train the model
  for (size_t epoch = 0; epoch != num_epochs; ++epoch) {
    // Initialize running metrics
    double running_loss = 0.0;
    double running_perplexity = 0.0;
    size_t running_num_samples = 0;

    // Initialize hidden- and cell-states.
    auto h = torch::zeros({num_layers, batch_size, hidden_size}).to(device).detach();
    auto c = torch::zeros({num_layers, batch_size, hidden_size}).to(device).detach();

    for (int64_t i = 0; i < ids.size(1) - sequence_length; i += sequence_length) {
      // Transfer data and target labels to device
      auto data = ids.slice(1, i, i + sequence_length).to(device);
      auto target = ids.slice(1, i + 1, i + 1 + sequence_length).reshape(-1).to(device);

      // Forward pass
      auto rnn_output = model->forward(data, std::make_tuple(h, c));
      auto output = std::get<0>(rnn_output);
      h = std::get<0>(std::get<1>(rnn_output)).detach();
      c = std::get<1>(std::get<1>(rnn_output)).detach();

      // Calculate the loss
      auto loss = torch::nn::functional::nll_loss(output, target);

      // Update running metrics
      running_loss += loss.item<double>() * data.size(0);
      running_perplexity += torch::exp(loss).item<double>() * data.size(0);
      running_num_samples += data.size(0);

      // Backward pass and optimize
      optimizer.zero_grad();
      loss.backward();
      torch::nn::utils::clip_grad_norm_(model->parameters(), 0.5);
      optimizer.step();
    }

    auto sample_mean_loss = running_loss / running_num_samples;
    auto sample_mean_perplexity = running_perplexity / running_num_samples;

    std::cout << "Epoch [" << (epoch + 1) << "/" << num_epochs
              << "], Trainset - Loss: " << sample_mean_loss
              << ", Perplexity: " << sample_mean_perplexity << '\n';
  }

  std::cout << "Training finished!\n\n";
  std::cout << "Generating samples...\n";

  // Generate samples
  model->eval();
  torch::NoGradGuard no_grad;

  std::ofstream sample_output_file(sample_output_path);

  // Initialize hidden- and cell-states.
  auto h = torch::zeros({num_layers, 1, hidden_size}).to(device);
  auto c = torch::zeros({num_layers, 1, hidden_size}).to(device);

  // Select one word-id at random
  auto prob = torch::ones(vocab_size);
  auto data = prob.multinomial(1).unsqueeze(1).to(device);

  for (int64_t i = 0; i != num_samples; ++i) {
    // Forward pass
    auto rnn_output = model->forward(data, std::make_tuple(h, c));
    auto out = std::get<0>(rnn_output);
    h = std::get<0>(std::get<1>(rnn_output));
    c = std::get<1>(std::get<1>(rnn_output));

    // Sample a word id
    prob = out.exp();
    auto word_id = prob.multinomial(1).item();

    // Fill input data with sampled word id for the next time step
    data.fill_(word_id);

    // Write the word id (the synthetic corpus has no dictionary) to the file
    sample_output_file << word_id.toLong() << ((i + 1) % 20 == 0 ? "\n" : " ");
  }

  std::cout << "Finished generating samples!\nSaved output to: " << sample_output_path << "\n";
}

// Links the installed evenstep::evenstep after ${TORCH_LIBRARIES} (the link
// order that binds the torch wheel's copies of std:: functions first), joins
// a world of one, and saves checkpoints through several rotations (the
// retention removes old step directories) and removes a tree: evenstep's
// directory work must not depend on which copy a program binds to.
#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>

#include <iostream>

#include "evenstep/checkpoint_manifest.h"
#include "evenstep/dist_context.h"
#include "evenstep/env.h"
#include "evenstep/train_checkpointer.h"

int main(int argc, char** argv) {
  auto ctx = evenstep::DistContext::Create(evenstep::DistOptions{});
  if (!ctx.ok()) {
    std::cerr << ctx.status() << "\n";
    return 1;
  }
  std::cout << "consumer: " << (*ctx)->env().Describe() << ", backend " << (*ctx)->backend_name()
            << std::endl;
  if (argc < 2) return 0;
  const std::string dir = argv[1];
  torch::nn::Linear model(4, 2);
  torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(0.1));
  evenstep::CheckpointOptions options;
  options.dir = dir + "/ckpt";
  options.keep = 2;
  auto ckpt = evenstep::TrainCheckpointer::Create(**ctx, options);
  if (!ckpt.ok()) {
    std::cerr << ckpt.status() << "\n";
    return 1;
  }
  evenstep::TrainState state;
  state.model = model.get();
  state.optimizer = &optimizer;
  for (int64_t step = 1; step <= 5; ++step) {
    auto ticket = (*ckpt)->Save(step, state);
    absl::Status saved = ticket.ok() ? ticket->done.get() : ticket.status();
    if (!saved.ok()) {
      std::cerr << "save of step " << step << ": " << saved << "\n";
      return 1;
    }
  }
  if (absl::Status s = (*ckpt)->WaitAll(); !s.ok()) {
    std::cerr << s << "\n";
    return 1;
  }
  auto listing = evenstep::ListCheckpoints(*evenstep::Env::Default(), options.dir);
  if (!listing.ok()) {
    std::cerr << listing.status() << "\n";
    return 1;
  }
  std::cout << "kept:";
  for (int64_t step : listing->committed) std::cout << " " << step;
  std::cout << std::endl;
  if (absl::Status s = evenstep::Env::Default()->RemoveTree(dir); !s.ok()) {
    std::cerr << s << "\n";
    return 1;
  }
  std::cout << "removed: " << (evenstep::Env::Default()->Exists(dir) ? "no" : "yes") << std::endl;
  return 0;
}

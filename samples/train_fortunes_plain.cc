// The fortune trainer written the way C++ data-parallel trainers usually
// are: equal sample counts per rank, gradients all-reduced one tensor at a
// time after backward, evaluation and torch::save on rank 0 while the others
// wait. train_fortunes.cc is this program wrapped with evenstep.
//   evenstep-run -n 2 -- train_fortunes_plain [--steps 300] [--run NAME]
#include <filesystem>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include "absl/flags/parse.h"
#include "evenstep/dist_context.h"
#include "samples/trainer_common.h"

using namespace evenstep::samples;

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  torch::set_num_threads(1);
  auto ctx = evenstep::DistContext::CreateFromFlags();
  auto data = LoadData();
  if (!ctx.ok() || !data.ok()) {
    std::cerr << (ctx.ok() ? data.status() : ctx.status()) << "\n";
    return 1;
  }
  const int rank = (*ctx)->rank(), world = (*ctx)->world_size();
  ByteLM model = MakeModel();
  torch::optim::Adam optimizer(model->parameters(),
                               torch::optim::AdamOptions(absl::GetFlag(FLAGS_lr)));
  std::filesystem::create_directories(RunDir());
  const auto order = ShuffledOrder(data->train.size());
  const int64_t steps = absl::GetFlag(FLAGS_steps), first = 1;
  const absl::Time start = absl::Now();
  double tokens = 0;
  for (int64_t s = first; s <= steps; ++s) {
    const std::vector<int64_t> mine = RankSlice(order, s, rank, world);
    optimizer.zero_grad();
    torch::Tensor loss = LossSum(model, data->train, mine) / Tokens(data->train, mine);
    loss.backward();
    for (auto& p : model->parameters()) {  // one blocking all-reduce per tensor
      std::vector<at::Tensor> grads{p.grad()};
      (*ctx)->data_group().allreduce(grads)->wait();
      p.mutable_grad().div_(world);
    }
    optimizer.step();
    at::Tensor global = loss.detach() / world;
    (void)(*ctx)->AllReduce(global);
    tokens += Tokens(data->train, mine) * world;
    AfterStep(rank, s, first, global.item<double>(), tokens, /*balance=*/-1, start);
    if (s % absl::GetFlag(FLAGS_eval_every) == 0 || s == steps) {
      EvalOnRank0(rank, s, model, data->eval);
    }
    if (rank == 0 && (s % 50 == 0 || s == steps)) torch::save(model, RunDir() + "/model.pt");
    (void)(*ctx)->Barrier();  // everyone waits for rank 0's duties
  }
  if (rank == 0) PrintSample(model);
  return 0;
}

// The fortune trainer: a byte-level transformer LM on Debian's fortunes, data parallel over c10d.
// Written as C++ trainers usually are: one all-reduce per tensor after backward, rank 0 evaluates
// and saves with torch::save while the others wait. train_fortunes.cc wraps it with evenstep.
//   evenstep-run -n 2 -- train_fortunes[_plain] [--steps 300] [--run NAME] [--evenstep_* ...]
#include "absl/flags/parse.h"
#include "samples/trainer_common.h"

using namespace evenstep::samples;

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  torch::set_num_threads(1);
  auto ctx = evenstep::DistContextFromFlags();
  auto data = LoadData();
  if (!ctx.ok() || !data.ok()) return Fail(ctx.ok() ? data.status() : ctx.status());
  const int rank = (*ctx)->rank();
  ByteLM model = MakeModel();
  torch::optim::Adam optimizer(model->parameters(),
                               torch::optim::AdamOptions(absl::GetFlag(FLAGS_lr)));
  const auto order = ShuffledOrder(data->train.size());
  const int64_t steps = absl::GetFlag(FLAGS_steps), first = 1;
  Progress progress(first);
  for (int64_t s = first; s <= steps; ++s) {
    const std::vector<int64_t> mine = RankSlice(order, s, rank, (*ctx)->world_size());
    optimizer.zero_grad();
    torch::Tensor loss = LossSum(model, data->train, mine) / Tokens(data->train, mine);
    loss.backward();
    AllReduceGradients(model, **ctx);  // one blocking all-reduce per tensor
    optimizer.step();
    const double tokens = Tokens(data->train, mine) * (*ctx)->world_size();
    progress.After(rank, s, GlobalMean(**ctx, loss), tokens, /*balance=*/-1);
    if (s % absl::GetFlag(FLAGS_eval_every) == 0 || s == steps) {
      EvalOnRank0(rank, s, model, data->eval);
    }
    if (rank == 0 && (s % 50 == 0 || s == steps)) torch::save(model, RunDir() + "/model.pt");
    (void)(*ctx)->Barrier();  // everyone waits for rank 0's duties
  }
  if (rank == 0) PrintSample(model);
  return 0;
}

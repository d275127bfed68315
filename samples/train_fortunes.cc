// The fortune trainer wrapped with evenstep: an evenstep::Session balances,
// syncs, checkpoints (resuming), logs, evaluates on all ranks and traces;
// train_fortunes_plain.cc is the program before. --evenstep_* flags switch it.
//   evenstep-run -n 2 -- train_fortunes [--steps 300] [--run NAME] [--evenstep_* ...]
#include "absl/flags/parse.h"
#include "evenstep/flags.h"
#include "evenstep/session.h"
#include "samples/trainer_common.h"

using namespace evenstep::samples;

int main(int argc, char** argv) {
  absl::SetFlag(&FLAGS_evenstep_global_batch, 32);  // the sample's defaults
  absl::SetFlag(&FLAGS_evenstep_micro_batch_tokens, 2048);
  absl::SetFlag(&FLAGS_evenstep_normalize, "tokens");
  absl::SetFlag(&FLAGS_evenstep_ckpt_every, 50);
  absl::ParseCommandLine(argc, argv);
  torch::set_num_threads(1);
  auto ctx = evenstep::DistContext::CreateFromFlags();
  auto data = LoadData();
  if (!ctx.ok() || !data.ok()) {
    std::cerr << (ctx.ok() ? data.status() : ctx.status()) << "\n";
    return 1;
  }
  const int rank = (*ctx)->rank();
  ByteLM model = MakeModel();
  torch::optim::Adam optimizer(model->parameters(),
                               torch::optim::AdamOptions(absl::GetFlag(FLAGS_lr)));
  auto es = evenstep::Session::Create(**ctx, *model, optimizer, Lengths(data->train), RunDir());
  if (!es.ok()) {
    std::cerr << es.status() << "\n";
    return 1;
  }
  const int64_t steps = absl::GetFlag(FLAGS_steps), first = (*es)->first_step();
  const absl::Time start = absl::Now();
  double tokens = 0;
  for (int64_t s = first; s <= steps; ++s) {
    auto report = (*es)->Step(
        [&](const evenstep::MicroBatch& mb) { return mb.samples; },
        [&](const std::vector<int64_t>& mine) { return LossSum(model, data->train, mine); });
    if (!report.ok()) {
      std::cerr << report.status() << "\n";
      return 1;
    }
    tokens += (*es)->balanced_step().global_batch().tokens;
    AfterStep(rank, s, first, report->loss, tokens, report->balance_efficiency, start);
    if (s % absl::GetFlag(FLAGS_eval_every) == 0 || s == steps) {
      auto sums = (*es)->Evaluate(Lengths(data->eval), [&](const evenstep::MicroBatch& mb) {
        return EvalSums(model, data->eval, mb.samples);
      });
      if (sums.ok() && rank == 0) PrintEval(s, (*sums)[0], (*sums)[1]);
    }
  }
  if (absl::Status done = (*es)->Finish(); !done.ok()) {
    std::cerr << done << "\n";
    return 1;
  }
  if (rank == 0) PrintSample(model);
  if (rank == 0) std::cout << "run: " << RunDir() << " (ckpt/, trace-*.json, metrics-*.jsonl)\n";
  return 0;
}

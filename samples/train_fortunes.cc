// The fortune trainer: a byte-level transformer LM on Debian's fortunes, data parallel over c10d.
// Wrapped with evenstep::Session (balanced, synced, checkpointed, logged, evaluated on all ranks,
// traced; switched by --evenstep_* flags). train_fortunes_plain.cc is the program before.
//   evenstep-run -n 2 -- train_fortunes[_plain] [--steps 300] [--run NAME] [--evenstep_* ...]
#include "absl/flags/parse.h"
#include "evenstep/flags.h"
#include "evenstep/session.h"
#include "samples/trainer_common.h"

using namespace evenstep::samples;

int main(int argc, char** argv) {
  evenstep::SetFlagDefaults(
      "global_batch=32 micro_batch_tokens=2048 normalize=tokens ckpt_every=50 sort_window=0");
  absl::ParseCommandLine(argc, argv);
  torch::set_num_threads(1);
  auto ctx = evenstep::DistContextFromFlags();
  auto data = LoadData();
  if (!ctx.ok() || !data.ok()) return Fail(ctx.ok() ? data.status() : ctx.status());
  const int rank = (*ctx)->rank();
  ByteLM model = MakeModel();
  torch::optim::Adam optimizer(model->parameters(),
                               torch::optim::AdamOptions(absl::GetFlag(FLAGS_lr)));
  auto es = evenstep::Session::Create(**ctx, *model, optimizer, Lengths(data->train), RunDir());
  if (!es.ok()) return Fail(es.status());
  const int64_t steps = absl::GetFlag(FLAGS_steps), first = (*es)->first_step();
  Progress progress(first);
  for (int64_t s = first; s <= steps; ++s) {
    auto report = (*es)->Step([&](const auto& mine) { return LossSum(model, data->train, mine); });
    if (!report.ok()) return Fail(report.status());
    progress.After(rank, s, report->loss, report->global_tokens, report->balance_efficiency);
    if (s % absl::GetFlag(FLAGS_eval_every) == 0 || s == steps) {
      auto sums = (*es)->Evaluate(Lengths(data->eval), EvalFn(model, data->eval));
      if (!sums.ok()) return Fail(sums.status());
      if (rank == 0) PrintEval(s, (*sums)[0], (*sums)[1]);
    }
  }
  if (absl::Status done = (*es)->Finish(); !done.ok()) return Fail(done);
  if (rank == 0) PrintSample(model);
  return 0;
}

// An LSTM language model with truncated BPTT, ported from prabhuomkar/pytorch-cpp
// (tutorials/intermediate/language_model) to a synthetic corpus (samples/lm_common.h):
// the hidden state of every row is carried from chunk to chunk and reset each epoch.
// lm_plain.cc is the single-process loop; lm.cc the same on evenstep (stream mode:
// each row a stream that stays on its rank); docs/ports.md shows the diff.
#include <torch/torch.h>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "evenstep/evenstep.h"
#include "samples/lm_common.h"

ABSL_FLAG(int, epochs, 2, "Passes over the corpus.");
ABSL_FLAG(int64_t, rows, 20, "Token streams (the original's batch_size).");
ABSL_FLAG(int64_t, chunks, 40, "Chunks of seq tokens per row.");
ABSL_FLAG(int64_t, hidden, 1024, "LSTM hidden size (the original's 1024).");
ABSL_FLAG(int64_t, vocab, 1000, "Vocabulary size.");

using namespace evenstep::samples;

int main(int argc, char** argv) {
  evenstep::SetFlagDefaults("loss_reduction=mean clip_grad_norm=0.5");  // nll_loss is a mean
  absl::ParseCommandLine(argc, argv);
  torch::set_num_threads(1);
  const int64_t rows = absl::GetFlag(FLAGS_rows), chunks = absl::GetFlag(FLAGS_chunks), seq = 30;
  absl::SetFlag(&FLAGS_evenstep_streams, rows);  // each row is a stream: sample row * chunks + t
  const int64_t layers = 1, hidden = absl::GetFlag(FLAGS_hidden),
                vocab = absl::GetFlag(FLAGS_vocab);
  const torch::Tensor ids = SyntheticCorpus(rows, chunks, seq, vocab);
  torch::manual_seed(0);
  RnnLm model(vocab, 128, hidden, layers);
  torch::optim::Adam optimizer(model->parameters(), torch::optim::AdamOptions(0.002));
  torch::Tensor state = torch::zeros({2, layers, rows, hidden});
  // The loss of chunk t of the rows `r`; carries their state on.
  auto loss_of = [&](const torch::Tensor& r, int64_t t) {
    if (t == 0) state.index_fill_(2, r, 0);  // a row's first chunk starts from zeros
    torch::Tensor data = ids.index_select(0, r).slice(1, t * seq, t * seq + seq);
    torch::Tensor target =
        ids.index_select(0, r).slice(1, t * seq + 1, t * seq + seq + 1).reshape(-1);
    LmOutput out = model->forward(data, state.index_select(2, r));
    state.index_copy_(2, r, out.state.detach());
    return torch::nll_loss(out.output, target);
  };
  auto es = evenstep::Session::Create(*model, optimizer, rows * chunks);
  if (!es.ok()) return Fail(es.status());
  if (absl::Status s = (*es)->AddStreamState("lstm", &state, 2); !s.ok()) return Fail(s);
  RunningMetrics metrics;
  (*es)->Keep(metrics, [&](auto& r) { metrics.Add(r.loss); });
  for (int64_t epoch = (*es)->first_epoch(); epoch < absl::GetFlag(FLAGS_epochs); ++epoch) {
    while ((*es)->epoch() == epoch) {
      auto report = (*es)->Step([&](auto& s) { return loss_of(Rows(s, chunks), s[0] % chunks); });
      if (!report.ok()) return Fail(report.status());
    }
    metrics.EndEpoch(epoch);
  }
  return (*es)->Finish().ok() ? 0 : 1;
}

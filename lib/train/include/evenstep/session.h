// Session: everything evenstep does for a training loop, behind one object —
// balanced steps (BalancedStep), resume and sharded background checkpoints
// (TrainCheckpointer), the per-rank timeline (Timeline) and logs (MetricsLogger),
// evaluation split across all ranks (Evaluate). Every part is configured by
// SessionOptions (session_options.h), filled from code or from the
// --evenstep_* flags; this is what keeps the diff to a user's loop small:
//
//   auto es = evenstep::Session::Create(**ctx, *model, optimizer, lengths, run_dir);
//   for (int64_t s = (*es)->first_step(); s <= steps; ++s) {
//     auto report = (*es)->Step(loss_sum);   // + timeline, logs, checkpoint
//   }
//   (*es)->Finish();                         // waits for the last checkpoint
//
// Several models per step (a GAN): Create with named ModelParts and Step with
// one loss function per part (see balanced_step.h): one plan, one
// checkpoint, one resume step for all of them.
//
// Thread-safety: one training thread; Create, Step, Evaluate and Finish are
// collective.
#pragma once

#include <signal.h>

#include <algorithm>
#include <deque>
#include <exception>
#include <functional>
#include <future>
#include <memory>
#include <optional>
#include <string>
#include <variant>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/clock.h"
#include "evenstep/balanced_step.h"
#include "evenstep/launch_env.h"  // kPreemptedExitCode
#include "evenstep/loader.h"
#include "evenstep/loop_driver.h"
#include "evenstep/session_options.h"

namespace torch::optim {
class LRScheduler;
}

namespace evenstep {

struct TrainState;
class TrainCheckpointer;
class MetricsLogger;
class Timeline;
namespace internal {
class KeptValues;
class SaveTracker;
}  // namespace internal
template <typename Data>
class LoopBatches;

// Stream mode's layout (a truncated-BPTT corpus): `streams` rows of
// `positions` steps each; sample s * positions + t is stream s's position t.
struct StreamLayout {
  int64_t streams = 0;
  int64_t positions = 0;
};
// The layout of `ids`, a [rows, tokens] tensor of token streams, stepped by
// `stride` tokens as a loop `for (i = 0; i < ids.size(1) - stride; i +=
// stride)` visits it (each position reads stride + 1 tokens: the inputs and
// the targets one token later).
StreamLayout StreamsOf(const at::Tensor& ids, int64_t stride);

class Session {
 public:
  // One Session per DistContext at a time: a second one is refused
  // (FailedPrecondition) while the first exists; one after the other, each
  // with its own options, is fine.
  // Checks `options` (InvalidArgument naming the field and its flag),
  // creates the parts from them, with options.run_dir as the default place
  // for checkpoints (RUN_DIR/ckpt), timelines and logs, and resumes
  // (options.resume): from the newest committed checkpoint if there is one,
  // an error naming it if it cannot be loaded.
  static absl::StatusOr<std::unique_ptr<Session>> Create(DistContext& ctx,
                                                         std::vector<ModelPart> parts,
                                                         std::vector<int64_t> lengths,
                                                         SessionOptions options,
                                                         std::vector<double> counts = {});
  static absl::StatusOr<std::unique_ptr<Session>> Create(DistContext& ctx, torch::nn::Module& model,
                                                         torch::optim::Optimizer& optimizer,
                                                         std::vector<int64_t> lengths,
                                                         SessionOptions options,
                                                         std::vector<double> counts = {}) {
    return Create(ctx, {ModelPart("model", model, optimizer)}, std::move(lengths),
                  std::move(options), std::move(counts));
  }
  // The same on a DistContext created from options.dist and the launcher's
  // environment, which the Session owns.
  static absl::StatusOr<std::unique_ptr<Session>> Create(std::vector<ModelPart> parts,
                                                         std::vector<int64_t> lengths,
                                                         SessionOptions options,
                                                         std::vector<double> counts = {});

  // The forms below take their options from the --evenstep_* flags
  // (SessionOptions::FromFlags), with `run_dir` (when not empty) for
  // --evenstep_run_dir.
  static absl::StatusOr<std::unique_ptr<Session>> Create(DistContext& ctx, torch::nn::Module& model,
                                                         torch::optim::Optimizer& optimizer,
                                                         std::vector<int64_t> lengths,
                                                         const std::string& run_dir,
                                                         std::vector<double> counts = {});
  // Several models stepped in order over the same micro-batches, each with
  // its optimizer (ModelPart in balanced_step.h); all are checkpointed
  // together ("model/<part>.<name>", "optimizer-<part>/...").
  static absl::StatusOr<std::unique_ptr<Session>> Create(DistContext& ctx,
                                                         std::vector<ModelPart> parts,
                                                         std::vector<int64_t> lengths,
                                                         const std::string& run_dir,
                                                         std::vector<double> counts = {});
  // The same on a DistContext created from the launcher's environment and
  // the --evenstep_* flags (DistContextFromFlags), which the Session
  // owns: for a loop that needs no collective of its own. An empty
  // `run_dir` is --evenstep_run_dir's.
  static absl::StatusOr<std::unique_ptr<Session>> Create(std::vector<ModelPart> parts,
                                                         std::vector<int64_t> lengths,
                                                         const std::string& run_dir = "",
                                                         std::vector<double> counts = {});
  // Samples that all cost the same (images): their number instead of their
  // lengths (UniformLengths).
  static absl::StatusOr<std::unique_ptr<Session>> Create(std::vector<ModelPart> parts,
                                                         int64_t samples,
                                                         const std::string& run_dir = "") {
    return Create(std::move(parts), UniformLengths(samples), run_dir);
  }
  static absl::StatusOr<std::unique_ptr<Session>> Create(torch::nn::Module& model,
                                                         torch::optim::Optimizer& optimizer,
                                                         int64_t samples,
                                                         const std::string& run_dir = "") {
    return Create(model, optimizer, UniformLengths(samples), run_dir);
  }
  // Stream mode (see Positions): one model over `layout`'s streams, the
  // flags' options with --evenstep_streams set to layout.streams (another
  // value given for it is refused, naming both), on a DistContext the
  // Session creates and owns.
  static absl::StatusOr<std::unique_ptr<Session>> Create(torch::nn::Module& model,
                                                         torch::optim::Optimizer& optimizer,
                                                         StreamLayout layout,
                                                         const std::string& run_dir = "");
  // One model, on a DistContext the Session creates and owns.
  static absl::StatusOr<std::unique_ptr<Session>> Create(torch::nn::Module& model,
                                                         torch::optim::Optimizer& optimizer,
                                                         std::vector<int64_t> lengths,
                                                         const std::string& run_dir = "",
                                                         std::vector<double> counts = {}) {
    return Create({ModelPart("model", model, optimizer)}, std::move(lengths), run_dir,
                  std::move(counts));
  }
  ~Session();
  DistContext& context() { return ctx_; }
  int rank() const;
  int world_size() const;

  // Setup before the first step: ScheduleLearningRate, Schedule, DeclareSum
  // and Keep return nothing; a misuse (an unknown part, a sum declared
  // twice or after the first step, a scheduler that cannot be replayed)
  // makes the next Step return the error, naming the call, and run nothing.
  //
  // The learning rate of every parameter group of `part`'s optimizer (""
  // = the first part) set to lr(step, epoch) before each step (step 1-based,
  // epoch 0-based, as epoch() reports): a pure function of the step, so a
  // resumed run has the uninterrupted run's rates.
  void ScheduleLearningRate(std::function<double(int64_t step, int64_t epoch)> lr,
                            const std::string& part = "");
  // A libtorch scheduler (torch::optim::StepLR or another LRScheduler)
  // stepped after every step (kStep) or after each epoch's last step
  // (kEpoch), as the plain loop does. Its count of steps is checkpointed: on
  // resume it is replayed (the optimizers' restored rates kept), so the
  // schedule goes on where it stopped. Register schedulers in the same order
  // in every run.
  enum class Every { kStep, kEpoch };
  void Schedule(torch::optim::LRScheduler& scheduler, Every every);
  // The loop's own variables, saved with every checkpoint and restored
  // exactly on resume: one line each, before the first step, e.g.
  //   es->Keep("lr", &current_learning_rate);   // a local copy of the rate
  //   es->Keep("running_loss", &running_loss);
  //   es->Keep("batches", &batch_index);
  //   es->Keep("confusion", &confusion);        // a tensor
  // A resumed run writes the saved value into the variable here (a tensor:
  // into the given tensor, which must already have the saved shape and
  // dtype). A checkpoint reads every kept variable when it is taken, at an
  // iteration boundary (see Step): as the loop's code left it after the
  // step, end-of-epoch resets and decays included. Doubles and floats
  // round-trip exactly (NaN and infinities too). Errors (a name kept twice
  // or after the first step, a resumed checkpoint without the name or with
  // a value of another type) make the next Step return them, naming the
  // variable. Each pointer must outlive the Session.
  void Keep(const std::string& name, double* value);
  void Keep(const std::string& name, float* value);
  void Keep(const std::string& name, int64_t* value);
  void Keep(const std::string& name, int* value);
  void Keep(const std::string& name, size_t* value);
  void Keep(const std::string& name, bool* value);
  void Keep(const std::string& name, std::string* value);
  void Keep(const std::string& name, std::vector<double>* value);
  void Keep(const std::string& name, std::vector<int64_t>* value);
  void Keep(const std::string& name, at::Tensor* value);
  // A running sum the loop adds to (a training loss, correct predictions),
  // kept as Keep does and summed over the ranks: after every step the
  // variable holds, on every rank, its value before the step plus what
  // every rank added to it during the step, as one process adding the whole
  // global batch would have it. Add to it in the loop's body before
  // Backward (in the callback form: in the loss function); the loop may
  // reset or set it between steps, on every rank alike. On one rank the
  // variable is left as the loop leaves it. Each addition is logged as the
  // step sum "kept/<name>". In the callback form a micro-batch retried after
  // an out-of-memory error runs its loss function again, so its additions
  // count twice: there, add through AddToSum (which the retry rewinds).
  //   double running_loss = 0; int64_t num_correct = 0;
  //   es.KeepSum("running_loss", &running_loss);
  //   es.KeepSum("num_correct", &num_correct);
  // A variable the loop declares inside its loop over epochs (reset at each
  // epoch's top) is kept by declaring it as evenstep::Kept<T> or
  // evenstep::KeptSum<T> instead (evenstep/kept.h).
  void KeepSum(const std::string& name, double* value);
  void KeepSum(const std::string& name, float* value);
  void KeepSum(const std::string& name, int64_t* value);
  void KeepSum(const std::string& name, size_t* value);
  void KeepSum(const std::string& name, int* value);
  // The loop's state as one JSON document, for state that is not a few
  // variables: `update(report)` runs inside Step after every completed step;
  // `save()` returns the state as JSON when a checkpoint is taken (at an
  // iteration boundary, like Keep's variables). After a resume,
  // resumed_user_state() is what the checkpoint held ("{}" if none).
  void set_user_state(std::function<void(const StepReport&)> update,
                      std::function<std::string()> save) {
    loop_vars_.update = std::move(update);
    loop_vars_.save = std::move(save);
  }
  const std::string& resumed_user_state() const { return loop_vars_.resumed_state; }
  // The same for a state object with `std::string Json() const` and
  // `void Restore(const std::string& json)`: restored now from the resumed
  // checkpoint (when there is one), saved with every checkpoint, and
  // updated by `update(report)` after every step. `state` must outlive the
  // Session.
  template <typename State>
  void Keep(State& state, std::function<void(const StepReport&)> update) {
    if (loop_vars_.resumed_state != "{}") state.Restore(loop_vars_.resumed_state);
    set_user_state(std::move(update), [&state] { return std::string(state.Json()); });
  }
  // Stream mode (--evenstep_streams=S): per-stream state the loop keeps in
  // `*state`, a tensor whose dimension `stream_dim` has size S (an LSTM's
  // hidden state [layers, S, hidden]); a rank reads and writes only the
  // rows of its own streams (stream_range()). Every checkpoint gathers the
  // rows from their ranks (one all-reduce) and saves the whole tensor as
  // "stream/<name>"; registered after a resume, it is loaded from the
  // resumed checkpoint (an error naming it when that checkpoint lacks it).
  // `*state` may be reassigned between steps (it is read when saving).
  // Collective: every rank registers the same names in the same order.
  absl::Status AddStreamState(const std::string& name, at::Tensor* state, int64_t stream_dim);
  // Stream mode: the streams [first, last) this rank owns this epoch.
  std::pair<int64_t, int64_t> stream_range() const { return step_->owned_streams(); }
  // Stream mode, loop-shaped: a truncated-BPTT loop over a [streams,
  // tokens] tensor keeps its `for` over positions and its body:
  //
  //   auto es = evenstep::Session::Create(*model, optimizer, evenstep::StreamsOf(ids, seq));
  //   ids = es->OwnRows(ids);  // this rank's rows
  //   for (size_t epoch = es->first_epoch(); epoch != epochs; ++epoch) {
  //     evenstep::KeptRows h(*es, "h", torch::zeros({layers, rows, hidden}));  // was: auto h =
  //     for (int64_t i : es->Positions(0, ids.size(1) - seq, seq)) {  // was: i = 0; i < ...
  //       ... ids.slice(1, i, i + seq) ... h = new_state.detach(); ...
  //       es->Backward(loss);  // was: loss.backward(), clipping, optimizer.step()
  //     }
  //     if (es->stopped()) break;
  //   }
  //
  // OwnRows pins each rank's streams for the rest of the run (they no
  // longer move between ranks at epochs' starts: the loop slices its
  // tensors once) and returns `t`'s rows of them along `dim`. Call it
  // before the first step (later, the next step names the misuse).
  at::Tensor OwnRows(const at::Tensor& t, int64_t dim = 0);
  // The positions begin, begin + stride, ... before `end`, one per step of
  // the current epoch (from where a resumed run stopped), as a loop over
  // Batches (see there) whose data is the position. Each rank's rows of a
  // step are one micro-batch: the body runs once per step, as the plain
  // loop's does, and may keep its optimizer.zero_grad(). The positions
  // must be the streams' (StreamsOf), else the loop ends at once and
  // Finish names both counts.
  LoopBatches<int64_t> Positions(int64_t begin, int64_t end, int64_t stride);
  // KeptRows' binding (kept.h): `*rows` is set to this rank's rows (along
  // `dim`, -1: the one dimension of the stream count's size) of `initial`,
  // or in a resumed run's first binding of `name` of the checkpoint's
  // "stream/<name>"; every checkpoint gathers the bound rows from all
  // ranks. Misuse is named by the next step.
  void BindRows(const std::string& name, at::Tensor* rows, const at::Tensor& initial, int64_t dim);
  void UnbindRows(const std::string& name);
  // Step sums over all ranks (StepReport::sums; see BalancedStep::DeclareSum):
  // declare before the first step, add inside the loss functions; each sum
  // is also logged as a metric under its name.
  void DeclareSum(const std::string& name) { KeepError(step_->DeclareSum(name)); }
  void AddToSum(const std::string& name, double value) { step_->AddToSum(name, value); }
  void AddToSum(const std::string& name, const at::Tensor& value) { step_->AddToSum(name, value); }
  // The last completed step's report.
  const StepReport& last_report() const { return last_report_; }

  // The first step to run: 1, or the resumed checkpoint's step + 1.
  int64_t first_step() const { return first_step_; }
  // The epoch of the next step (BalancedStep::epoch): restored on resume.
  int64_t epoch() const;
  // Where a loop over epochs starts: the epoch of the first step to run (0
  // in a fresh run). In
  //   for (int64_t e = es->first_epoch(); e < epochs; ++e) {
  //     while (es->epoch() == e) es->Step(...);
  //     ... the end of epoch e (printing its figures, evaluating) ...
  //   }
  // a checkpoint is taken at an iteration boundary (see Step), after the
  // end of the epoch it closes ran: a resumed run goes on with the next
  // epoch, or inside the epoch it stopped in. (A checkpoint of an earlier
  // evenstep, taken inside the step, resumes at its step's epoch, whose end
  // then runs again.)
  int64_t first_epoch() const { return first_epoch_; }
  // The steps of the epoch epoch() already done: 0 at an epoch's start, and
  // at the top of the epoch a run resumed inside it starts with, the steps
  // done there before the stop. A loop's count of batches in the epoch
  // (`int64_t batch_index = 0;` at the epoch's top) starts there:
  // `int64_t batch_index = es->step_in_epoch();`.
  int64_t step_in_epoch() const { return step_->step_in_epoch(); }
  BalancedStep& balanced_step() { return *step_; }

  // One step (see BalancedStep::Step), then: timeline, log of loss and
  // balance efficiency. Every --evenstep_ckpt_every steps the step is saved
  // at the next iteration boundary: when the loop next calls Step,
  // Checkpoint or Finish, so the checkpoint holds the loop's kept state as
  // its code after the step left it.
  //
  // Preemption: a --evenstep_preempt_signals signal (SIGTERM, SIGUSR1 by
  // default) on any rank is shared in the next step's exchange. That step
  // completes and returns its report as usual (preemption_pending() is then
  // true on every rank); the loop's next Step (or Finish) saves it, waits
  // for the commit and returns CANCELLED without running another step
  // (preempted() is then true): exit with kPreemptedExitCode, and the next
  // run resumes at the following step. The loop's code between the two
  // calls runs before the save: keep it shorter than the launcher's grace
  // period, or skip long work (an evaluation) while preemption_pending().
  //
  // A lost rank (--evenstep_on_rank_loss=continue, DistOptions::on_rank_loss
  // kContinue): the survivors regroup inside Step and run the step again
  // over themselves with its global batch, so the loss functions are called
  // again for it (KeepSum variables are rewound first); the report names the
  // lost ranks (StepReport::lost_ranks). Checkpoints, metrics, the timeline
  // and Evaluate follow the new world. Refused by name (the step's error):
  // several model parts, a replay, stream mode (docs/balancing.md).
  template <typename Load, typename LossSum>
  absl::StatusOr<StepReport> Step(Load&& load, LossSum&& loss_sum) {
    // Not forwarded: a step redone after a lost rank calls them again.
    return Around([&] { return step_->Step(load, loss_sum); });
  }
  // The same with the loop's own loss: `loss_sum(samples)` gets a
  // micro-batch's dataset indices (const std::vector<int64_t>&), loads them
  // and returns the SUM of their losses (data and compute timed as one).
  // A step of a Session with several model parts: `losses[k]` is part k's
  // loss of a micro-batch (BalancedStep::Step with PartLoss).
  absl::StatusOr<StepReport> Step(const std::vector<PartLoss>& losses);
  // The same with one Loader: each micro-batch loaded once, `losses[k](data)`
  // part k's loss of it (BalancedStep::Step with a Loader and losses).
  template <typename Data>
  absl::StatusOr<StepReport> Step(
      const Loader<Data>& loader,
      const std::vector<std::function<at::Tensor(const Data&)>>& losses) {
    return Around([&] { return step_->Step(loader, losses); });
  }
  template <typename LossSum>
  absl::StatusOr<StepReport> Step(LossSum&& loss_sum) {
    return Step([](const MicroBatch& mb) -> const MicroBatch* { return &mb; },
                [&](const MicroBatch* mb) { return loss_sum(mb->samples); });
  }
  // The loop-shaped form: the trainer keeps its loop, its forward and its
  // loss; evenstep hands out this rank's balanced micro-batches of the
  // epoch's steps, loaded by `loader`, and Backward replaces
  // `loss.backward()`, `optimizer.zero_grad()` and `optimizer.step()`:
  //
  //   for (int64_t epoch = es->first_epoch(); epoch < epochs; ++epoch) {
  //     for (auto& batch : es->Batches(loader)) {      // was: *data_loader
  //       auto output = model->forward(batch.data);
  //       auto loss = torch::nll_loss(output, batch.target);
  //       es->Backward(loss);                           // was: zero_grad, backward, step
  //       if (es->step_ended()) print(es->last_report());
  //     }
  //     if (es->stopped()) break;                       // preempted, or a step failed
  //     ... the end of the epoch ...
  //   }
  //   return ExitCode(es->Finish());
  //
  // Each step runs as Step(loader, loss) does (the gradient of the global
  // batch's mean or sum, whatever the split; the sync, clipping, optimizer
  // step, exchange, logs and checkpoints), with the loop's body as the loss
  // function of each micro-batch: Backward returns after the micro-batch's
  // backward pass (and, for a step's last one, after the whole step). An
  // idle rank's step runs without entering the body. Checkpoints and a
  // preemption's stop happen between steps, after the loop's code for the
  // last one ran. The loop ends with the epoch, or at the first error (a
  // step abandoned, a preemption: Finish then returns it). What it gives up:
  // out-of-memory split-and-retry (it would run the body again; an
  // out-of-memory error abandons the step on every rank: use the callback
  // form, Step(loader, loss_of), for recovery). An exception or a `break`
  // that leaves the body mid-step abandons the step on every rank (no peer
  // waits for a timeout); a micro-batch whose body does not call Backward (a
  // `continue`) does the same, naming it.
  //
  // With several model parts (a GAN's discriminator and generator) the body
  // calls Backward once per part, in the parts' order, where the plain loop
  // steps that part's optimizer: each Backward runs that part's backward,
  // sync and optimizer step on every rank before it returns, so the body's
  // next loss sees the stepped part, as in the plain loop. Each rank's share
  // of a step is then one micro-batch (the body runs once per step; a
  // micro-batch cap is refused by name), and the body's zero_grad() before a
  // part's loss is allowed (the part's gradients are zero then).
  template <typename Data>
  LoopBatches<Data> Batches(const Loader<Data>& loader);
  // The current micro-batch's loss in the loop over Batches (see there).
  void Backward(const at::Tensor& loss);
  // In the loop over Batches: the last Backward completed a step
  // (last_report() is its report).
  bool step_ended() const { return loop_ != nullptr && loop_->at_boundary(); }
  // A loop over Batches ended before its epoch did (a preemption, a failed
  // step): leave the loop over epochs before its end-of-epoch code, then
  // Finish returns why.
  bool stopped() const { return !loop_status_.ok(); }
  // Evaluation split across all ranks by work (Evaluate in metrics.h), with
  // a timeline span; `fn(samples)` returns the metric sums of some of the
  // evaluation set's indices. The sums over the whole set, on every rank.
  // It runs with the model and every submodule in eval mode (each restored
  // to its own mode after, also on an error) and without autograd
  // (NoGradGuard); micro-batches are capped by
  // --evenstep_eval_micro_batch_tokens (0: the training caps, else a rank's
  // share of one global batch), so a rank's share is never one huge padded
  // batch.
  absl::StatusOr<std::vector<double>> Evaluate(
      const std::vector<int64_t>& lengths,
      const std::function<at::Tensor(const std::vector<int64_t>&)>& fn);
  // Saves a checkpoint of the current step now (in the background). Its
  // outcome is reported at a later step, on every rank, in one line naming
  // the step, rank, file and error (see --evenstep_ckpt_on_error).
  absl::Status Checkpoint();
  // Saves the last step if it is not saved yet, waits for the checkpoints
  // in flight, closes logs and timeline. An error when the last save
  // failed. A Session destroyed without Finish (an error path) starts no
  // save: it only waits for those in flight and reports their outcome.
  absl::Status Finish();
  // A preemption signal was agreed at the last step: the next Step or
  // Finish saves that step and returns CANCELLED.
  bool preemption_pending() const { return preempt_signal_ > 0; }
  // Step or Finish returned CANCELLED for a preemption (the step is saved).
  bool preempted() const { return preempted_; }

 private:
  template <typename Data>
  friend class LoopBatches;
  struct LrSchedule {
    std::function<double(int64_t, int64_t)> lr;  // a function of (step, epoch), or
    torch::optim::LRScheduler* scheduler = nullptr;
    size_t part = 0;
    bool per_epoch = false;
    int64_t count = 0;  // scheduler steps taken (checkpointed)
  };
  Session(DistContext& ctx, std::vector<ModelPart> parts);
  // Create without a context: the one made here, destroyed after every
  // other member (declared first).
  std::unique_ptr<DistContext> owned_ctx_;
  // What a checkpoint holds: every part, the balancing state, the loop's
  // state and the schedulers' counts.
  TrainState State() const;
  absl::Status AfterStep(StepReport* report);
  absl::Status AddScheduler(torch::optim::LRScheduler& scheduler, Every every);
  // The schedulers' steps after `report`'s step.
  void StepSchedulers(const StepReport& report);
  absl::StatusOr<size_t> PartIndex(const std::string& part) const;
  // Keeps the first setup error for the next Step.
  void KeepError(const absl::Status& status) {
    if (setup_error_.ok()) setup_error_ = status;
  }
  absl::Status setup_error_;
  // The setup's error (see DeclareSum), else OK after setting the
  // scheduled learning rates.
  absl::Status BeforeStep();
  // BeforeStep, `run()` (a BalancedStep::Step), then AfterStep on its report.
  // With DistOptions::on_rank_loss kContinue, a step that failed because a
  // rank was lost is redone by the survivors (GoOnAfterLoss), as often as
  // ranks are lost in it.
  template <typename Run>
  absl::StatusOr<StepReport> Around(Run&& run) {
    EVENSTEP_RETURN_IF_ERROR(BeforeStep());
    const int64_t epoch = step_->epoch();
    absl::StatusOr<StepReport> report = run();
    StepReport losses;  // lost_ranks and regroup_seconds, as they come
    while (!report.ok() && RankLost(report.status())) {
      EVENSTEP_ASSIGN_OR_RETURN(std::optional<StepReport> applied,
                                GoOnAfterLoss(report.status(), epoch, &losses));
      report = applied ? *std::move(applied) : run();
    }
    if (!report.ok()) return report;
    report->lost_ranks = losses.lost_ranks;
    report->regroup_seconds = losses.regroup_seconds;
    EVENSTEP_RETURN_IF_ERROR(AfterStep(&*report));
    return report;
  }
  // A step's failure is a lost rank that the survivors go on after
  // (DistOptions::on_rank_loss kContinue).
  bool RankLost(const absl::Status& failure) const;
  // After a rank was lost in step last_step_ + 1 (of epoch `epoch`): the
  // survivors regroup (BalancedStep::Regroup); the checkpointer, metrics
  // and timeline follow the new world; saves in flight that can never
  // commit are abandoned and the last step saved again; the loss is said
  // once (the new rank 0) and added to `losses`. The step is to be redone
  // (nullopt), or was applied before the loss was known (its report, whose
  // loss and sums are lost with the rank: StepReport::figures_lost).
  absl::StatusOr<std::optional<StepReport>> GoOnAfterLoss(const absl::Status& failure,
                                                          int64_t epoch, StepReport* losses);
  absl::Status StopForPreemption(int signal, int64_t step);
  template <typename T>
  void KeepValue(const std::string& name, T* value);
  // The tensor `name` of the resumed checkpoint into `*tensor` (NotFound
  // when the checkpoint lacks it).
  absl::Status LoadResumedTensor(const std::string& name, at::Tensor* tensor);
  absl::Status LockRunDir(const std::string& run_dir);
  // Create's parts that each rank runs alone, each agreed on before the next
  // (DistContext::Agree): the options checked and the run directory locked;
  // then the split record, checkpoint, timeline and metric files opened.
  absl::Status ClaimRunDir(const SessionOptions& options);
  absl::Status OpenRunFiles(const SessionOptions& options, const std::vector<int64_t>& lengths,
                            const CheckpointOptions& ckpt, BalanceConfig* config);
  // --evenstep_resume: the newest committed checkpoint in `ckpt_dir` loaded
  // (with `fallback`, the newest that loads) into the run's state, or none
  // there (said on rank 0).
  absl::Status Resume(const std::string& ckpt_dir, bool fallback);

  DistContext& ctx_;
  std::vector<ModelPart> parts_;
  // With several parts: one module holding them as children, named by part.
  std::shared_ptr<torch::nn::Module> parts_module_;
  struct Schedules {
    std::vector<LrSchedule> list;
    std::vector<int64_t> resumed_counts;  // scheduler counts from the checkpoint
  };
  Schedules schedules_;
  // KeepSum's variables: the value at the step's start, and at the last
  // addition to the step sum.
  struct SumBinding {
    std::string sum;  // "kept/<name>"
    std::variant<double*, float*, int64_t*, size_t*, int*> value;
    double start = 0, added = 0;
    bool bound = true;  // false: an evenstep::KeptSum out of scope
  };
  // The loop's own state: Keep's and KeepSum's variables, the state object
  // (set_user_state), and what the resumed checkpoint held of them.
  struct LoopVars {
    std::unique_ptr<internal::KeptValues> kept;
    std::vector<SumBinding> sums;
    std::string resumed_kept;  // the resumed checkpoint's kept values ("" = no resume)
    std::function<void(const StepReport&)> update;
    std::function<std::string()> save;
    std::string resumed_state = "{}";
  };
  LoopVars loop_vars_;
  template <typename T>
  friend class Kept;
  template <typename T>
  friend class KeptSum;
  // evenstep::Kept / KeptSum: `name` bound to `*value` (the first time: as
  // Keep / KeepSum register it; again: the new variable replaces the old
  // one, whose scope ended); Unbind when the variable's scope ends.
  template <typename T>
  void BindKept(const std::string& name, T* value, bool sum);
  void UnbindKept(const std::string& name);
  template <typename T>
  void KeepSumOf(const std::string& name, T* value);
  // What each kept sum gained since its last addition, into its step sum
  // (after each part's sync, before the exchange).
  void AddKeptSums();
  StepReport last_report_;
  struct StreamState {
    std::string name;
    at::Tensor* tensor;  // null: a KeptRows out of scope
    int64_t dim;
    bool own_rows = false;  // KeptRows: only this rank's rows (else all streams')
  };
  // Every bound stream state, all ranks' rows gathered (one all-reduce
  // each), into `state` as "stream/<name>".
  absl::Status GatherStreamStates(TrainState* state);
  // Positions' range checked against the streams' positions, and each
  // rank's share made one micro-batch.
  absl::Status CheckPositions(int64_t begin, int64_t end, int64_t stride);
  std::vector<StreamState> stream_states_;
  std::string resumed_path_;  // the checkpoint this run resumed from ("" = none)
  std::unique_ptr<BalancedStep> step_;
  std::unique_ptr<TrainCheckpointer> checkpointer_;
  std::unique_ptr<Timeline> timeline_;
  std::unique_ptr<MetricsLogger> metrics_;
  int64_t first_step_ = 1;
  int64_t first_epoch_ = 0;
  int64_t last_step_ = 0;
  int64_t last_saved_ = 0;
  bool created_ = false;       // Create finished: every part exists
  bool owns_context_ = false;  // the one Session registered on ctx_
  int run_dir_lock_ = -1;      // rank 0: RUN_DIR/.evenstep.lock, flock'ed while it lives
  bool finished_ = false;
  bool preempted_ = false;
  int preempt_signal_ = 0;                // agreed at the last step: stop at the next boundary
  internal::LoopDriver* loop_ = nullptr;  // the running loop over Batches
  absl::Status loop_status_;              // how the last loop over Batches ended
  bool save_due_ = false;                 // --evenstep_ckpt_every: save at the next boundary
  std::vector<std::pair<int, struct sigaction>> old_handlers_;
  std::unique_ptr<internal::SaveTracker> saves_;  // saves in flight and their outcomes
  SessionOptions options_;  // as Create was given them (nothing rereads the flags)
};

// The range Session::Batches returns: one epoch's micro-batches on this
// rank (the Loader's Data), for a range-based for.
template <typename Data>
class LoopBatches {
 public:
  struct End {};
  class Iterator {
   public:
    Iterator(internal::LoopDriver* driver, void* data) : driver_(driver), data_(data) {}
    Data& operator*() const { return *static_cast<Data*>(data_); }
    Data* operator->() const { return static_cast<Data*>(data_); }
    Iterator& operator++() {
      data_ = driver_->Next();
      return *this;
    }
    bool operator!=(End) const { return data_ != nullptr; }
    bool operator==(End) const { return data_ == nullptr; }

   private:
    internal::LoopDriver* driver_;
    void* data_;
  };

  LoopBatches(Session& session, const Loader<Data>& loader)
      : session_(session), loader_(loader), uncaught_(std::uncaught_exceptions()) {}
  LoopBatches(const LoopBatches&) = delete;
  LoopBatches& operator=(const LoopBatches&) = delete;
  ~LoopBatches() {
    if (driver_ == nullptr) return;
    if (!driver_->done()) {
      // Left mid-epoch: an open step is abandoned on every rank.
      driver_->Abort(std::uncaught_exceptions() > uncaught_
                         ? "an exception left the body of the loop over Session::Batches"
                         : "the loop over Session::Batches was left before the epoch's end (a "
                           "break or return)");
    }
    if (!driver_->status().ok()) session_.loop_status_ = driver_->status();
    session_.loop_ = nullptr;
  }
  // Empty after a loop over Batches ended with an error (Finish returns it).
  Iterator begin() {
    if (!session_.loop_status_.ok()) return Iterator(nullptr, nullptr);
    const size_t parts = session_.parts_.size();
    if (parts > 1) {
      // The body runs part k + 1's loss after part k stepped: one
      // micro-batch per rank and step.
      absl::Status whole = session_.step_->SetWholeShare(
          "a loop over Session::Batches with " + std::to_string(parts) +
          " model parts runs each rank's share of a step as one micro-batch (its body runs "
          "part 2's loss after part 1 has stepped)");
      if (!whole.ok()) {
        session_.loop_status_ = whole;
        return Iterator(nullptr, nullptr);
      }
    }
    const int64_t epoch = session_.epoch();
    driver_ = std::make_unique<internal::LoopDriver>(
        [this, epoch, parts](const internal::LoopDriver::Give& give,
                             const internal::LoopDriver::Boundary& boundary) -> absl::Status {
          // Kept until the loop's body for it ends: the body may read it
          // after Backward, while the engine hands out the next micro-batch.
          auto hand = [&](Data& data) {
            return give(&held_[next_held_ ^= 1].emplace(std::move(data)));
          };
          while (session_.epoch() == epoch) {
            absl::StatusOr<StepReport> report = session_.Around([&] {
              if (parts == 1) return session_.step_->StepOnce(loader_, hand);
              return session_.step_->StepPartsOnce(
                  loader_, [&](size_t, Data& data) { return hand(data); },
                  [&](size_t, size_t) { return give(nullptr); });
            });
            if (!report.ok()) return report.status();
            if (!boundary()) break;
          }
          return absl::OkStatus();
        },
        static_cast<int>(parts));
    session_.loop_ = driver_.get();
    return Iterator(driver_.get(), driver_->Next());
  }
  End end() const { return {}; }

 private:
  Session& session_;
  Loader<Data> loader_;
  int uncaught_;
  std::unique_ptr<internal::LoopDriver> driver_;
  std::optional<Data> held_[2];  // the micro-batch the body has, and the next
  int next_held_ = 0;
};

template <typename Data>
LoopBatches<Data> Session::Batches(const Loader<Data>& loader) {
  return LoopBatches<Data>(*this, loader);
}

inline LoopBatches<int64_t> Session::Positions(int64_t begin, int64_t end, int64_t stride) {
  if (absl::Status checked = CheckPositions(begin, end, stride);
      !checked.ok() && loop_status_.ok()) {
    loop_status_ = checked;
  }
  const int64_t streams = std::max<int64_t>(step_->sampler().options().streams, 1);
  const int64_t positions = step_->sampler().num_samples() / streams;
  return LoopBatches<int64_t>(
      *this, Loader<int64_t>([begin, stride, positions](const MicroBatch& mb) {
        return positions > 0 ? begin + stride * (mb.samples.front() % positions) : begin;
      }));
}

}  // namespace evenstep

// BalancedStep: drives the micro-steps of one optimizer step; see
// balanced_step.h for the contract.
//
// Timing (internal/micro_step_clock.h): data wait runs from the end of the
// previous micro-step (or the start of the step) to DataReady(); compute from
// DataReady() to the end of backward, on the last micro-step only up to the
// arrival at the gradient sync (the rest is sync wait). Marks are host times
// on the CPU and timing events on a device, read once per step after the
// optimizer step has been queued, so the host does not wait for the device
// between micro-steps; the micro-batch losses are summed on the device for the
// same reason.
#include "evenstep/balanced_step.h"

#include <ATen/Context.h>
#include <c10/util/Exception.h>
#include <torch/nn/module.h>
#include <torch/nn/utils/clip_grad.h>
#include <torch/optim/optimizer.h>
#include <xxhash.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <iostream>
#include <limits>
#include <map>
#include <numeric>
#include <set>
#include <stdexcept>
#include <thread>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "balanced_step_internal.h"
#include "evenstep/internal/error_text.h"
#include "evenstep/internal/memory_caps.h"
#include "evenstep/internal/micro_step_clock.h"
#include "evenstep/internal/rank_health.h"
#include "evenstep/internal/split_record.h"
#include "evenstep/internal/step_sums.h"
#include "evenstep/log.h"
#include "evenstep/status_macros.h"

namespace evenstep {

using internal::ModelDevice;

namespace {

// Bytes a rank's micro-batches may peak at: the limit (the config's, else
// the device's) times the headroom; 0 = no limit known.
double MemoryBudget(const BalanceConfig& config, const MemoryProbe& probe) {
  const int64_t limit =
      config.memory_limit_bytes == 0 ? probe.DeviceLimit() : config.memory_limit_bytes;
  return limit > 0 ? static_cast<double>(limit) * config.memory_headroom : 0;
}
}  // namespace

BalancedStep::BalancedStep(DistContext& ctx, std::vector<Part> parts, Sampler sampler,
                           BalanceConfig config, std::unique_ptr<internal::MicroStepClock> clock)
    : ctx_(ctx),
      parts_(std::move(parts)),
      sampler_(std::move(sampler)),
      config_(std::move(config)),
      clock_(std::move(clock)),
      memory_probe_(ModelDevice(*parts_[0].spec.module)),
      caps_(std::make_unique<internal::MemoryCaps>(MemoryBudget(config_, memory_probe_),
                                                   parts_.size())),
      cost_model_(config_.cost_model),
      planner_(ctx.world_size(), config_.planner),
      sums_(std::make_unique<internal::StepSums>()),
      health_(std::make_unique<internal::RankHealth>()) {}

absl::Status BalancedStep::OnePart() const {
  if (parts_.size() == 1) return absl::OkStatus();
  return absl::FailedPreconditionError(
      absl::StrCat("BalancedStep: rank ", ctx_.rank(), ": this step has ", parts_.size(),
                   " model parts: Step takes one loss function per part (Step({loss_",
                   parts_[0].spec.name, ", ...}))"));
}

std::string BalancedStep::Where() const {
  return absl::StrCat("rank ", ctx_.rank(), ", step ", steps_ + 1,
                      parts_.size() > 1 ? absl::StrCat(", part '", parts_[run_.part].spec.name, "'")
                                        : std::string());
}

int DefaultDataWorkers(int local_world_size) {
  const int threads = static_cast<int>(std::thread::hardware_concurrency());
  return std::clamp(threads / std::max(local_world_size, 1), 8, 32);
}

uint64_t MicroBatchSeed(uint64_t seed, int64_t step, int rank, int64_t micro_batch) {
  const uint64_t key[4] = {seed, static_cast<uint64_t>(step), static_cast<uint64_t>(rank),
                           static_cast<uint64_t>(micro_batch)};
  return XXH64(key, sizeof(key), 0x65766e73);
}

void BalancedStep::Reseed(size_t i) {
  if (!config_.reseed || i >= run_.micro.size()) return;
  // Seeds the CPU generator and every accelerator's.
  at::manual_seed(
      MicroBatchSeed(sampler_.options().seed, steps_ + 1, ctx_.rank(), static_cast<int64_t>(i)));
}

void BalancedStep::StartPart(size_t k) {
  run_.part = k;
  run_.next_micro = 0;
  run_.data_marked = false;
  if (caps_->predicting()) memory_probe_.Lap();  // a part's first micro-step from here
  Reseed(0);
  Part& part = parts_[k];
  // An earlier step's failed synchronisation is settled: a failure in this
  // one joins this step's synchronisation.
  part.sync->ForgetFailure();
  part.sync->SetStep(steps_);
  run_.syncs_at_begin = part.sync->syncs_completed();
  sums_->MarkPart(run_.loss_on_device[k]);
  oom_.slot_pieces.assign(run_.micro.size(), 1);
  oom_.released_for.clear();
  oom_.released_bytes = 0;
  oom_.unsplit_retries = 0;
  if (parts_.size() > 1) {
    // What the plain loop's zero_grad does before this model's backward: drop
    // what other parts' backwards left here, and their use marks.
    part.spec.optimizer->zero_grad();
    part.sync->ForgetUse();
  }
  NoteGradients();
}

void BalancedStep::NoteGradients() {
  untouched_.clear();
  for (const at::Tensor& p : parts_[run_.part].spec.module->parameters()) {
    if (!p.requires_grad()) continue;
    const at::Tensor& g = p.grad();
    untouched_.push_back({g.defined() ? g.unsafeGetTensorImpl() : nullptr,
                          g.defined() ? static_cast<int64_t>(g._version()) : -1,
                          static_cast<int64_t>(p._version())});
  }
}

absl::Status BalancedStep::CheckUntouched(bool* replica_changed) const {
  size_t i = 0;
  for (const auto& item : parts_[run_.part].spec.module->named_parameters()) {
    const at::Tensor& p = item.value();
    if (!p.requires_grad()) continue;
    if (i >= untouched_.size()) break;
    const Untouched& was = untouched_[i++];
    const at::Tensor& g = p.grad();
    const void* grad = g.defined() ? g.unsafeGetTensorImpl() : nullptr;
    const int64_t grad_version = g.defined() ? static_cast<int64_t>(g._version()) : -1;
    const char* what = nullptr;
    if (static_cast<int64_t>(p._version()) != was.version) {
      what = "the parameter itself changed (optimizer.step() inside it?)";
      *replica_changed = true;
    } else if (grad != was.grad || grad_version != was.grad_version) {
      // With the share whole (SetWholeShare) this is the part's only
      // backward on this rank, before which the plain loop zeroes the
      // gradients: the loop's own zero_grad() there is allowed (values put
      // there, by a backward of the loop's own, are not).
      if (whole_share_ && (!g.defined() || g.count_nonzero().item<int64_t>() == 0)) continue;
      what = "its gradient changed (loss.backward() or zero_grad() inside it?)";
    }
    if (what != nullptr) {
      return absl::FailedPreconditionError(absl::StrCat(
          "while the loss function ran, ", what, " for parameter '", item.key(),
          "': evenstep runs backward, the optimizer step and zero_grad itself; the loss function "
          "returns the loss and must not call loss.backward(), optimizer.step() or "
          "optimizer.zero_grad() (a backward through this model between steps is fine)"));
    }
  }
  return absl::OkStatus();
}

absl::Status BalancedStep::PartCount(size_t losses) const {
  if (losses == parts_.size()) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat("BalancedStep: rank ", ctx_.rank(), ": ", losses,
                                                 " loss functions for ", parts_.size(),
                                                 " model parts"));
}

absl::StatusOr<StepReport> BalancedStep::Step(const std::vector<PartLoss>& losses) {
  EVENSTEP_RETURN_IF_ERROR(PartCount(losses.size()));
  carry_.next_step_loads = false;
  CancelPrefetch();
  EVENSTEP_RETURN_IF_ERROR(BeginStep());
  const std::vector<MicroBatch>& mbs = micro_batches();
  // For the whole step, the parts' synchronisations (EndPart, FinishStep)
  // included: a rank with no micro-batch learns there that a peer ran out
  // of memory, and must join the vote on a retry as the others do.
  RecomputeScope scope(this,
                       [this, &losses](const MicroBatch& mb) { return losses[run_.part](mb); });
  for (size_t k = 0; k < parts_.size(); ++k) {
    if (k > 0) EVENSTEP_RETURN_IF_ERROR(EndPart());
    for (size_t i = 0; i < mbs.size(); ++i) {
      try {
        DataReady();
        EVENSTEP_RETURN_IF_ERROR(Backward(losses[k](mbs[i])));
      } catch (const c10::OutOfMemoryError& e) {
        EVENSTEP_RETURN_IF_ERROR(OutOfMemory(i, false, internal::ErrorText(e)));
      } catch (const std::exception& e) {
        return Abandon(i, internal::ErrorText(e));
      }
    }
  }
  return FinishStep();
}

absl::Status BalancedStep::OpenSplitLog() {
  if (config_.split_record.empty() && config_.split_replay.empty()) return absl::OkStatus();
  split_log_ = std::make_unique<SplitLog>();
  if (!config_.split_replay.empty()) {
    split_log_->replay_file = internal::SplitRecordFile(config_.split_replay, ctx_.rank());
    EVENSTEP_ASSIGN_OR_RETURN(
        split_log_->replay, internal::ReadSplitRecord(split_log_->replay_file, ctx_.world_size()),
        "rank ", ctx_.rank(), ": replaying the splits of ", config_.split_replay);
  }
  if (!config_.split_record.empty()) {
    EVENSTEP_ASSIGN_OR_RETURN(
        split_log_->recorder,
        internal::SplitRecorder::Open(internal::SplitRecordFile(config_.split_record, ctx_.rank())),
        "rank ", ctx_.rank());
  }
  return absl::OkStatus();
}

BalancedStep::~BalancedStep() { CancelPrefetch(); }

namespace {
// This rank's micro-batches of `batch` learn where they stand: the epoch,
// their place, the global batch's totals.
void Label(const GlobalBatch& batch, uint64_t seed, std::vector<MicroBatch>* micro) {
  for (size_t i = 0; i < micro->size(); ++i) {
    MicroBatch& mb = (*micro)[i];
    mb.epoch = batch.epoch;
    mb.seed = seed;
    mb.index = static_cast<int>(i);
    mb.global_samples = static_cast<int64_t>(batch.samples.size());
    mb.global_tokens = batch.tokens;
  }
}
}  // namespace

void BalancedStep::PlanNextStep(int64_t steps_done) {
  NextStep next;
  next.sampler_before = sampler_.state();
  next.shares_before = planner_.plan().shares;
  next.stream_shares_before = stream_shares_;
  next.batch = sampler_.Next();
  if (!fits_.empty() && steps_done % config_.plan_interval == 0) {
    planner_.Update(fits_, next.batch.cost, sampler_.micro_batch_cost_cap());
  }
  Plan plan = planner_.plan();
  int64_t cap = caps_->cap();
  const int64_t step = steps_done + 1;
  if (split_log_ != nullptr && !split_log_->replay_file.empty() && split_log_->error.ok()) {
    split_log_->error = split_log_->Replay(step, next.batch, &plan, &cap);
  }
  std::vector<std::vector<int64_t>> parts;
  if (sampler_.options().streams > 0) {
    // Streams move between ranks only at an epoch's start.
    if ((next.batch.step == 0 && !pinned_streams_) || stream_shares_.empty()) {
      stream_shares_ = plan.shares;
    }
    parts = sampler_.PartitionStreams(next.batch, stream_shares_);
  } else {
    parts = SplitGlobalBatch(sampler_, next.batch, plan);
  }
  next.micro = whole_share_ ? sampler_.PackWhole(std::move(parts[ctx_.rank()]))
                            : sampler_.Pack(std::move(parts[ctx_.rank()]), cap);
  Label(next.batch, sampler_.options().seed, &next.micro);
  if (split_log_ != nullptr && split_log_->recorder != nullptr && split_log_->error.ok()) {
    split_log_->error =
        split_log_->recorder->Append(internal::RecordOf(step, next.batch, plan, cap));
  }
  next.shares = std::move(plan.shares);
  planned_ = std::move(next);
}

void BalancedStep::CancelPrefetch() {
  carry_.prefetch.reset();  // waits for the loads in flight
  carry_.data = nullptr;
  carry_.loader = nullptr;
}

absl::Status BalancedStep::BeginStep() {
  if (!abandoned_.ok()) {
    // A collective failed: the peers may still be in the abandoned step's
    // collectives. A new step here would pair this rank's collectives with
    // theirs and mix two steps' gradients. Never run on.
    return absl::FailedPreconditionError(
        absl::StrCat("BalancedStep: rank ", ctx_.rank(), ": no further step runs after step ",
                     steps_ + 1, " was abandoned (", abandoned_.message(),
                     "); the ranks are out of step: restart from the last checkpoint"));
  }
  if (run_.in_step) {
    return absl::FailedPreconditionError(absl::StrCat("BalancedStep: rank ", ctx_.rank(),
                                                      ": BeginStep while step ", steps_ + 1,
                                                      " is still open (call FinishStep first)"));
  }
  if (handover_due_) {
    return absl::FailedPreconditionError(
        absl::StrCat("BalancedStep: rank ", ctx_.rank(), ": step ", steps_ + 1, " cannot begin: ",
                     lacks_state_ ? "this process joined the job and has not received its state"
                                  : "a replacement was admitted and has not received the state",
                     " (call evenstep::HandOver on every rank after Admit, and on the joiner after "
                     "BalancedStep::Create)"));
  }
  report_ = StepReport{};
  report_.begin = absl::Now();
  caps_->BeginStep();
  run_.late_failure.clear();
  memory_probe_.Begin();
  cost_model_.BeginStep();
  if (!planned_) PlanNextStep(steps_);
  if (split_log_ != nullptr && !split_log_->error.ok()) {
    // Before any collective of the step: a record every rank replays lacks
    // the step on every rank.
    return Annotate(split_log_->error, absl::StrCat("BalancedStep: rank ", ctx_.rank()));
  }
  run_.before = state();
  run_.batch = std::move(planned_->batch);
  run_.micro = std::move(planned_->micro);
  const std::vector<double> shares = std::move(planned_->shares);
  planned_.reset();
  run_.scale = config_.objective == Objective::kSum ? 1.0
               : run_.batch.count > 0               ? 1.0 / run_.batch.count
                                                    : 0.0;
  run_.loss_on_device.assign(parts_.size(), at::Tensor());
  sums_->BeginStep();
  run_.part_loss_sums.assign(parts_.size(), 0.0);
  run_.in_step = true;
  StartPart(0);
  clock_->Begin();
  report_.epoch = run_.batch.epoch;
  report_.epoch_step = run_.batch.step;
  report_.micro_batches = static_cast<int>(run_.micro.size());
  // Static and work plans do not depend on the exchange: the next step is
  // planned now, so that its loads can run during this one.
  if (carry_.next_step_loads && config_.planner.mode != BalanceMode::kDynamic) {
    PlanNextStep(steps_ + 1);
  }
  report_.global_count = run_.batch.count;
  report_.global_tokens = run_.batch.tokens;
  report_.shares = shares;
  for (const MicroBatch& mb : run_.micro) {
    report_.samples += static_cast<int64_t>(mb.samples.size());
    report_.tokens += mb.tokens;
    report_.units += mb.cost;
  }
  return absl::OkStatus();
}

void BalancedStep::DataReady() {
  clock_->Start();
  run_.data_marked = true;
  sums_->MarkMicroBatch(run_.loss_on_device[run_.part]);
}

absl::Status BalancedStep::Backward(const at::Tensor& loss_sum) {
  if (!run_.in_step || run_.next_micro >= run_.micro.size()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "BalancedStep: ", Where(), ": Backward without a pending micro-batch (", run_.micro.size(),
        " in this step", parts_.size() > 1 ? "; EndPart?" : "", ")"));
  }
  if (!run_.data_marked) DataReady();
  const size_t index = run_.next_micro++;
  const bool last = run_.next_micro == run_.micro.size();
  bool replica_changed = false;
  if (absl::Status touched = CheckUntouched(&replica_changed); !touched.ok()) {
    // A loss function that ran backward may also have stepped the optimizer
    // (through .data(), which leaves no trace in the version): each rank's
    // replica may have moved by its own gradient, so no later step runs.
    (void)replica_changed;
    absl::Status status = Abandon(index, std::string(touched.message()));
    abandoned_ = status;
    return status;
  }
  // Whatever this backward leaves (and an out-of-memory retry inside it) is
  // evenstep's own.
  absl::Cleanup note = [this] { NoteGradients(); };
  try {
    if (loss_sum.dim() != 0) {
      return Abandon(
          index,
          absl::StrCat("the loss must be a scalar (the ",
                       config_.loss_reduction == LossReduction::kMean ? "mean" : "sum",
                       " of the micro-batch's losses); got shape ", c10::str(loss_sum.sizes())));
    }
    MicroStep(loss_sum, run_.micro[index], last);
    clock_->End();
  } catch (const c10::OutOfMemoryError& e) {
    const bool started = oom_.backward_started;
    oom_.backward_started = false;
    if (!(started && last && SyncedDespiteFailure())) {
      return OutOfMemory(index, started, internal::ErrorText(e));
    }
    // Out of memory after every gradient was in the synchronisation, which
    // completed on every rank: the step's gradient is whole.
    clock_->End();
  } catch (const std::exception& e) {
    oom_.backward_started = false;
    if (!(last && SyncedDespiteFailure())) {
      if (last && Bystander(e)) {
        // Another rank abandoned this synchronisation: if it ran out of
        // memory (and nobody failed otherwise), every rank runs the part again.
        EVENSTEP_ASSIGN_OR_RETURN(const bool retry, VoteToRetry(false, false));
        if (retry) return Replay(0, run_.micro.size() - 1, run_.micro.size());
      }
      return Abandon(index, internal::ErrorText(e));
    }
    // After every gradient was in the synchronisation, which completed on
    // every rank: the peers step with the whole gradient, so this rank steps
    // too (no replica drifts) and joins the exchange (no peer waits for a
    // rank that left), which carries the failure to every rank.
    run_.late_failure = absl::StrCat("micro-batch ", index + 1, " of ", run_.micro.size(), ": ",
                                     internal::ErrorText(e));
    clock_->End();
  }
  if (last) {
    const SyncStats stats = parts_[run_.part].sync->last_stats();
    report_.arrived = stats.arrived;
    report_.synced = stats.done;
  }
  run_.data_marked = false;
  Reseed(run_.next_micro);
  return absl::OkStatus();
}

void BalancedStep::MicroStep(const at::Tensor& loss_sum, const MicroBatch& mb, bool sync_now) {
  const double count = mb.count;
  GradSync& sync = *parts_[run_.part].sync;
  sync.set_sync_enabled(sync_now);
  // The factor that makes this micro-batch's loss its share of the global
  // batch's mean: 1 / (global count) for a SUM; for a MEAN, times the
  // micro-batch's own count first.
  const double factor = run_.scale * (config_.loss_reduction == LossReduction::kMean ? count : 1.0);
  at::Tensor scaled_loss = loss_sum * factor;
  if (sync_now) {
    sync.SetStep(steps_);  // each synchronisation carries the step (a replay's too)
    // Parameters the loss cannot reach are ready at once (their buckets
    // are not held back to the end of backward).
    if (absl::Status s = sync.PrepareForBackward(scaled_loss); !s.ok()) {
      throw std::runtime_error(std::string(s.message()));
    }
  }
  // Counted before backward: a replay or an abandoned step restores the sums.
  const at::Tensor scaled = loss_sum.detach().to(at::kDouble) * factor;
  at::Tensor& sum = run_.loss_on_device[run_.part];
  sum = sum.defined() ? sum + scaled : scaled;
  oom_.syncs_before_micro = sync.syncs_completed();
  oom_.backward_started = true;
  scaled_loss.backward();
  oom_.backward_started = false;
  report_.largest_micro_batch = std::max(report_.largest_micro_batch, mb.padded_tokens());
  if (caps_->predicting()) {  // predicted caps: the micro-step's peak into its part's fit
    const int64_t peak =
        config_.micro_peak_bytes ? config_.micro_peak_bytes(mb) : memory_probe_.Lap();
    caps_->Record(run_.part, mb.padded_tokens(), peak);
  }
}

void BalancedStep::RepackPlanned() {
  if (!planned_ || (caps_->cap() <= 0 && !whole_share_)) return;
  std::vector<int64_t> samples;
  for (const MicroBatch& mb : planned_->micro) {
    samples.insert(samples.end(), mb.samples.begin(), mb.samples.end());
  }
  std::vector<MicroBatch> micro = whole_share_ ? sampler_.PackWhole(std::move(samples))
                                               : sampler_.Pack(std::move(samples), caps_->cap());
  if (micro.size() == planned_->micro.size()) return;  // already so
  CancelPrefetch();                                    // its loads were for the old micro-batches
  Label(planned_->batch, sampler_.options().seed, &micro);
  planned_->micro = std::move(micro);
}

int64_t BalancedStep::epoch() const {
  if (planned_) return planned_->batch.epoch;
  const SamplerState at = sampler_.state();
  return at.step >= sampler_.steps_per_epoch() ? at.epoch + 1 : at.epoch;
}

int64_t BalancedStep::step_in_epoch() const {
  if (planned_) return planned_->batch.step;
  const SamplerState at = sampler_.state();
  return at.step >= sampler_.steps_per_epoch() ? 0 : at.step;
}

absl::Status BalancedStep::SetWholeShare(const std::string& what) {
  const SamplerOptions& o = sampler_.options();
  std::string flag;
  if (o.micro_batch_samples > 0) {
    flag = absl::StrCat("--evenstep_micro_batch_samples=", o.micro_batch_samples);
  } else if (o.micro_batch_tokens > 0) {
    flag = absl::StrCat("--evenstep_micro_batch_tokens=", o.micro_batch_tokens);
  } else if (o.min_micro_batches > 1) {
    flag = absl::StrCat("--evenstep_min_micro_batches=", o.min_micro_batches);
  }
  if (!flag.empty()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "BalancedStep: rank ", ctx_.rank(), ": ", what, ", but ", flag,
        " would cut it into several: leave it unset",
        parts_.size() > 1 ? ", or use the callback form Session::Step(loader, {loss_of_part_1, "
                            "loss_of_part_2, ...}), which keeps the caps"
                          : ""));
  }
  whole_share_ = true;
  RepackPlanned();
  return absl::OkStatus();
}

std::pair<int64_t, int64_t> BalancedStep::PinStreams() {
  if (sampler_.options().streams <= 0) return {0, 0};
  if (stream_shares_.empty()) stream_shares_ = planner_.plan().shares;
  pinned_streams_ = true;
  // What every later step partitions by (a step planned already did too).
  return sampler_.StreamRange(stream_shares_, ctx_.rank());
}

int64_t BalancedStep::last_step_epoch() const {
  const SamplerState at = planned_ ? planned_->sampler_before : sampler_.state();
  if (at.step == 0) return std::max<int64_t>(at.epoch - 1, 0);
  return at.epoch;  // also at.step == steps_per_epoch: the epoch's last step was the last
}

std::string BalancedStep::LoadFailure(size_t micro_batch, const absl::Status& error) const {
  const std::vector<int64_t>& samples = run_.micro[micro_batch].samples;
  constexpr size_t kNamed = 8;
  std::vector<int64_t> named(samples.begin(), samples.begin() + std::min(samples.size(), kNamed));
  return absl::StrCat(
      "loading samples [", absl::StrJoin(named, ", "),
      samples.size() > kNamed ? absl::StrCat(", ... ", samples.size(), " in all") : "",
      "] on a data worker: ", error.message());
}

absl::Status BalancedStep::ApplyPart() {
  if (run_.next_micro != run_.micro.size()) {
    return Abandon(run_.next_micro,
                   absl::StrCat(run_.part + 1 < parts_.size() ? "EndPart" : "FinishStep", " after ",
                                run_.next_micro, " of ", run_.micro.size(), " micro-batches"));
  }
  Part& part = parts_[run_.part];
  part.sync->set_sync_enabled(false);
  if (run_.micro.empty()) {
    // No work on this rank this step: join the collectives with zeros.
    const absl::Time arrived = absl::Now();
    part.sync->SetStep(steps_);
    absl::Status synced = part.sync->SyncNow();
    // A peer that ran out of memory in the synchronised backward: join the
    // vote, and the repeated synchronisation.
    while (synced.code() == absl::StatusCode::kAborted && Recovers() &&
           part.sync->fatal_status().ok()) {
      absl::StatusOr<bool> retry = VoteToRetry(false, false);
      if (!retry.ok()) {
        synced = retry.status();
        break;
      }
      if (!*retry) break;
      part.sync->SetStep(steps_);
      synced = part.sync->SyncNow();
    }
    report_.arrived = arrived;
    report_.synced = absl::Now();
    report_.sync_wait += report_.synced - arrived;
    if (!synced.ok()) run_.in_step = false;
    EVENSTEP_RETURN_IF_ERROR(synced, "BalancedStep: ", Where(), " (no micro-batch on this rank)");
  } else if (absl::Status synced = part.sync->status(); !synced.ok()) {
    run_.in_step = false;
    return Annotate(synced, absl::StrCat("BalancedStep: ", Where()));
  }
  const absl::Time optimizer_begin = absl::Now();
  report_.optimizer_begin = optimizer_begin;
  try {
    if (config_.after_sync) config_.after_sync();
    if (config_.clip_grad_norm > 0) {
      torch::nn::utils::clip_grad_norm_(part.spec.module->parameters(), config_.clip_grad_norm);
    }
    part.spec.optimizer->step();
    part.spec.optimizer->zero_grad();
  } catch (const std::exception& e) {
    run_.in_step = false;
    return absl::InternalError(
        absl::StrCat("BalancedStep: ", Where(), ", optimizer step: ", internal::ErrorText(e)));
  }
  report_.optimizer = absl::Now() - optimizer_begin;
  return absl::OkStatus();
}

absl::Status BalancedStep::EndPart() {
  if (!run_.in_step || run_.part + 1 >= parts_.size()) {
    return absl::FailedPreconditionError(
        absl::StrCat("BalancedStep: rank ", ctx_.rank(), ": EndPart ",
                     run_.in_step ? "in the last part (call FinishStep)" : "without BeginStep"));
  }
  EVENSTEP_RETURN_IF_ERROR(ApplyPart());
  StartPart(run_.part + 1);
  clock_->Resume();  // the optimizer step just taken is no data wait
  return absl::OkStatus();
}

absl::StatusOr<StepReport> BalancedStep::FinishStep() {
  if (!run_.in_step) {
    return absl::FailedPreconditionError(
        absl::StrCat("BalancedStep: rank ", ctx_.rank(), ": FinishStep without BeginStep"));
  }
  if (run_.part + 1 < parts_.size()) {
    return Abandon(run_.next_micro,
                   absl::StrCat("FinishStep in part ", run_.part + 1, " of ", parts_.size(),
                                " (EndPart moves to the next part)"));
  }
  EVENSTEP_RETURN_IF_ERROR(ApplyPart());
  run_.in_step = false;
  EVENSTEP_RETURN_IF_ERROR(Account(), "BalancedStep: step ", steps_ + 1, ", accounting costs");
  ++steps_;
  report_.step = steps_;
  report_.memory = memory_probe_.End();
  PredictMemoryCap();
  EVENSTEP_RETURN_IF_ERROR(Exchange(), "BalancedStep: step ", steps_,
                           ", exchanging cost fits for the next plan");
  // A later part's loss may run an earlier part's module in train mode
  // (G's loss through D): its BatchNorm statistics then differ per rank
  // since that part's synchronisation. Rank 0's, as that part's next sync
  // would give, so that a checkpoint or evaluation sees one value.
  if (config_.grad_sync.buffers_from_root_every_step) {
    for (size_t k = 0; k + 1 < parts_.size(); ++k) {
      EVENSTEP_RETURN_IF_ERROR(parts_[k].sync->BroadcastBuffers(), "BalancedStep: step ", steps_,
                               ", part ", k + 1, "'s buffers after the later parts' forwards");
    }
  }
  if (!report_.late_failures.empty()) {
    return absl::AbortedError(
        absl::StrCat("BalancedStep: rank ", ctx_.rank(), ", step ", steps_, ": rank(s) ",
                     absl::StrJoin(report_.late_failures, ","),
                     " threw after every gradient of the step was synchronised",
                     run_.late_failure.empty() ? std::string(" (see their output)")
                                               : absl::StrCat(" (here: ", run_.late_failure, ")"),
                     "; the gradient was whole, so the step was applied on every rank alike"));
  }
  // Dynamic plans need the exchanged fits: with prefetching across steps the
  // next step is planned now, so that its loads can start.
  if (carry_.next_step_loads && !planned_) PlanNextStep(steps_);
  report_.end = absl::Now();
  return report_;
}

absl::Status BalancedStep::DeclareSum(const std::string& name) {
  return sums_->Declare(name, ctx_.rank());
}

void BalancedStep::AddToSum(const std::string& name, double value) {
  sums_->Add(name, value, run_.in_step);
}

void BalancedStep::AddToSum(const std::string& name, const at::Tensor& value) {
  sums_->Add(name, value, run_.in_step);
}

std::pair<int64_t, int64_t> BalancedStep::owned_streams() const {
  const std::vector<double>& shares = planned_ ? planned_->stream_shares_before : stream_shares_;
  if (sampler_.options().streams <= 0 || shares.empty()) return {0, 0};
  return sampler_.StreamRange(shares, ctx_.rank());
}

}  // namespace evenstep

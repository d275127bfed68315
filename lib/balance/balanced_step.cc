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
#include "evenstep/internal/error_text.h"
#include "evenstep/internal/micro_step_clock.h"
#include "evenstep/internal/split_record.h"
#include "evenstep/log.h"
#include "evenstep/status_macros.h"

namespace evenstep {
namespace {

// Doubles each rank contributes to the exchange after a step.
enum ExchangeField {
  kFitFixed,
  kFitPerUnit,
  kFitObservations,
  kBusy,
  kMicroBatches,
  kOomSplits,
  kMemoryCap,
  kOomFailed,
  kPeakMemory,
  kLargestMicro,
  kLateFailure,  // 1: an exception after this rank's gradients were all synchronised
  kAgreed,       // kAgreementSlots values follow
  kPartLosses = kAgreed + kAgreementSlots,  // one loss sum per part follows
};

// The device the model trains on (its first parameter's; CPU without any).
c10::Device ModelDevice(torch::nn::Module& model) {
  for (const at::Tensor& p : model.parameters()) return p.device();
  return c10::Device(c10::kCPU);
}

}  // namespace

namespace {

// --evenstep_max_micro_batches is a bound the step keeps: with a sample cap
// per micro-batch, a global batch the ranks cannot hold within it even when
// evenly split is refused (the packer would otherwise make more micro-batches
// than the bound, which a model part that hands tensors to the next part
// relies on).
absl::Status CheckMicroBatchBound(const SamplerOptions& sampler, int max_micro_batches, int world) {
  if (max_micro_batches <= 0 || sampler.micro_batch_samples <= 0 || sampler.streams > 0 ||
      sampler.budget_unit != BatchUnit::kSamples) {
    return absl::OkStatus();
  }
  const int64_t per_rank = (sampler.global_batch + world - 1) / world;
  if (per_rank <= int64_t{max_micro_batches} * sampler.micro_batch_samples) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      "--evenstep_max_micro_batches=", max_micro_batches,
      " with --evenstep_micro_batch_samples=", sampler.micro_batch_samples, " holds at most ",
      max_micro_batches * sampler.micro_batch_samples,
      " samples per rank and step; --evenstep_global_batch=", sampler.global_batch, " over ", world,
      " ranks needs ", per_rank, ": raise one of them, or lower the global batch"));
}

}  // namespace

absl::StatusOr<std::unique_ptr<BalancedStep>> BalancedStep::Create(
    DistContext& ctx, torch::nn::Module& model, torch::optim::Optimizer& optimizer,
    std::vector<int64_t> lengths, BalanceConfig config, std::vector<double> counts) {
  return Create(ctx, {ModelPart("model", model, optimizer)}, std::move(lengths), std::move(config),
                std::move(counts));
}

namespace {

// Up to four names, then how many more.
std::string SomeNames(const std::vector<std::string>& names) {
  std::vector<std::string> shown(names.begin(), names.begin() + std::min<size_t>(names.size(), 4));
  return absl::StrCat("'", absl::StrJoin(shown, "', '"), "'",
                      names.size() > 4 ? absl::StrCat(" and ", names.size() - 4, " more") : "");
}

// A part's optimizer steps exactly the part's trainable parameters: one it
// lacks would be synchronised and never stepped; one from outside the part
// (an optimizer over two modules) would be stepped without ever being
// synchronised, and the ranks' copies drift apart without a word.
absl::Status CheckOptimizer(const ModelPart& part) {
  std::map<const c10::TensorImpl*, std::string> in_module;
  for (const auto& p : part.module->named_parameters(/*recurse=*/true)) {
    in_module.emplace(p.value().unsafeGetTensorImpl(), p.key());
  }
  std::set<const c10::TensorImpl*> stepped;
  int64_t extra = 0;
  for (const auto& group : part.optimizer->param_groups()) {
    for (const at::Tensor& t : group.params()) {
      stepped.insert(t.unsafeGetTensorImpl());
      extra += in_module.count(t.unsafeGetTensorImpl()) == 0 ? 1 : 0;
    }
  }
  std::vector<std::string> missing;
  for (const auto& p : part.module->named_parameters(/*recurse=*/true)) {
    if (p.value().requires_grad() && stepped.count(p.value().unsafeGetTensorImpl()) == 0) {
      missing.push_back(p.key());
    }
  }
  if (missing.empty() && extra == 0) return absl::OkStatus();
  const std::string fix =
      "one optimizer over several modules goes with one module that holds them all (register "
      "both as submodules of a container module and pass that), or give each module its own "
      "model part and optimizer";
  if (extra > 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "BalancedStep: the optimizer of model part '", part.name, "' steps ", extra,
        " tensor(s) that are not parameters of its module: they would be stepped on every rank "
        "without ever being synchronised, and the replicas would drift apart",
        missing.empty() ? "" : absl::StrCat("; it also lacks ", SomeNames(missing)), ". ", fix));
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "BalancedStep: the optimizer of model part '", part.name, "' lacks ", missing.size(),
      " trainable parameter(s) of its module: ", SomeNames(missing),
      ". Give the optimizer every parameter that trains (module.parameters()), or freeze the "
      "ones that do not (requires_grad(false)) before creating the step"));
}

absl::Status CheckParts(const std::vector<ModelPart>& parts) {
  if (parts.empty()) return absl::InvalidArgumentError("BalancedStep: no model part");
  std::map<const torch::optim::Optimizer*, std::string> optimizers;
  std::map<const c10::TensorImpl*, std::string> owner;  // parameter -> "part 'P' (name)"
  std::set<std::string> names;
  for (const ModelPart& part : parts) {
    const bool name_ok =
        !part.name.empty() && std::all_of(part.name.begin(), part.name.end(), [](char c) {
          return std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '-';
        });
    if (!name_ok || !names.insert(part.name).second) {
      return absl::InvalidArgumentError(absl::StrCat(
          "BalancedStep: model part name '", part.name,
          "': ", name_ok ? "given twice" : "expected letters, digits, '_' and '-' (not empty)"));
    }
    if (part.module == nullptr || part.optimizer == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat("BalancedStep: model part '", part.name, "' has no ",
                       part.module == nullptr ? "module" : "optimizer"));
    }
    auto [first, fresh_optimizer] = optimizers.emplace(part.optimizer, part.name);
    if (!fresh_optimizer) {
      return absl::InvalidArgumentError(absl::StrCat(
          "BalancedStep: model parts '", first->second, "' and '", part.name,
          "' were given the same optimizer: it would step twice per step. Give each part its "
          "own optimizer over its own module's parameters, or make the two modules one part "
          "(one container module holding both)"));
    }
    for (const auto& p : part.module->named_parameters(/*recurse=*/true)) {
      const std::string here = absl::StrCat("part '", part.name, "' (", p.key(), ")");
      auto [it, fresh] = owner.emplace(p.value().unsafeGetTensorImpl(), here);
      if (!fresh && it->second != here) {
        return absl::InvalidArgumentError(absl::StrCat(
            "BalancedStep: a parameter is in two model parts, ", it->second, " and ", here,
            ": it would be synchronised and stepped twice; give each parameter to one part"));
      }
    }
  }
  for (const ModelPart& part : parts) EVENSTEP_RETURN_IF_ERROR(CheckOptimizer(part));
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<BalancedStep>> BalancedStep::Create(
    DistContext& ctx, std::vector<ModelPart> model_parts, std::vector<int64_t> lengths,
    BalanceConfig config, std::vector<double> counts) {
  EVENSTEP_RETURN_IF_ERROR(CheckParts(model_parts));
  if (config.plan_interval < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("BalancedStep: plan_interval=", config.plan_interval, ": must be >= 1"));
  }
  if (config.clip_grad_norm < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("BalancedStep: clip_grad_norm=", config.clip_grad_norm, ": must be >= 0"));
  }
  if (config.data_workers < BalanceConfig::kAutoDataWorkers || config.prefetch < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("BalancedStep: data_workers=", config.data_workers,
                     " (>= 0, or -1 = auto), prefetch=", config.prefetch, " (>= 1)"));
  }
  if (!(config.memory_headroom > 0 && config.memory_headroom <= 1)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "BalancedStep: memory_headroom=", config.memory_headroom, ": must be in (0, 1]"));
  }
  EVENSTEP_ASSIGN_OR_RETURN(Sampler sampler, Sampler::Create(std::move(lengths), config.sampler,
                                                             config.cost, std::move(counts)));
  EVENSTEP_RETURN_IF_ERROR(
      CheckMicroBatchBound(sampler.options(), config.planner.max_micro_batches, ctx.world_size()));
  EVENSTEP_ASSIGN_OR_RETURN(const TopologyChoice topology,
                            ApplySyncTopology(ctx, config.sync_topology, &config.grad_sync));
  if (topology.say && ctx.rank() == 0) Log(LogLevel::kInfo, topology.line);
  // A failed gradient bucket names the ranks that never reached the sync.
  config.grad_sync.diagnosis.arrive = [&ctx] { return ctx.MarkArrival(); };
  config.grad_sync.diagnosis.diagnose = [&ctx](int64_t seq, const std::string& what,
                                               absl::Duration elapsed, const std::string& error) {
    return ctx.Diagnose(seq, what, elapsed, error);
  };
  // The arrival at the sync splits the last micro-step's compute from its
  // sync wait on the same clock.
  const c10::Device device = ModelDevice(*model_parts[0].module);
  auto clock = std::make_unique<internal::MicroStepClock>(device, config.now);
  config.grad_sync.on_arrival = [c = clock.get()] { c->Arrive(); };
  std::vector<Part> parts;
  for (ModelPart& spec : model_parts) {
    const std::string what =
        model_parts.size() > 1 ? absl::StrCat("model part '", spec.name, "'") : std::string();
    EVENSTEP_ASSIGN_OR_RETURN(std::unique_ptr<Subgroup> group, ctx.NewDataGroup(), what);
    EVENSTEP_ASSIGN_OR_RETURN(
        std::unique_ptr<GradSync> sync,
        GradSync::Attach(*spec.module, group->process_group(), config.grad_sync), what);
    // Outside its part of a step the hooks only mark gradients as used: a
    // backward through this model outside it (a GAN generator's loss through
    // the discriminator) accumulates locally, as in one process, and starts
    // no collective that the other ranks would not join.
    sync->set_sync_enabled(false);
    parts.push_back({std::move(spec), std::move(group), std::move(sync)});
  }
  std::unique_ptr<BalancedStep> step(new BalancedStep(ctx, std::move(parts), std::move(sampler),
                                                      std::move(config), std::move(clock)));
  if (!step->config_.initial_shares.empty()) {
    EVENSTEP_RETURN_IF_ERROR(step->planner_.SetShares(step->config_.initial_shares));
  }
  EVENSTEP_RETURN_IF_ERROR(step->OpenSplitLog());
  // Asked-for workers start now; the default ones with the first Loader.
  if (step->config_.data_workers > 0) step->StartWorkers();
  return step;
}

void BalancedStep::StartWorkers() {
  if (workers_ != nullptr) return;
  const int n = config_.data_workers == BalanceConfig::kAutoDataWorkers
                    ? DefaultDataWorkers(ctx_.local_world_size())
                    : config_.data_workers;
  if (n <= 0) return;
  workers_ = std::make_unique<WorkerPool>(n);
  const c10::Device device = ModelDevice(*parts_[0].spec.module);
  if (config_.pin_memory && !device.is_cpu()) {
    feeder_ = std::make_unique<DeviceFeeder>(device, /*pinned=*/true);
  }
}

BalancedStep::BalancedStep(DistContext& ctx, std::vector<Part> parts, Sampler sampler,
                           BalanceConfig config, std::unique_ptr<internal::MicroStepClock> clock)
    : ctx_(ctx),
      parts_(std::move(parts)),
      sampler_(std::move(sampler)),
      config_(std::move(config)),
      clock_(std::move(clock)),
      memory_probe_(ModelDevice(*parts_[0].spec.module)),
      cost_model_(config_.cost_model),
      planner_(ctx.world_size(), config_.planner) {
  const int64_t limit =
      config_.memory_limit_bytes == 0 ? memory_probe_.DeviceLimit() : config_.memory_limit_bytes;
  if (limit > 0) memory_budget_ = static_cast<double>(limit) * config_.memory_headroom;
  memory_fits_.resize(parts_.size());
}

absl::Status BalancedStep::OnePart() const {
  if (parts_.size() == 1) return absl::OkStatus();
  return absl::FailedPreconditionError(
      absl::StrCat("BalancedStep: rank ", ctx_.rank(), ": this step has ", parts_.size(),
                   " model parts: Step takes one loss function per part (Step({loss_",
                   parts_[0].spec.name, ", ...}))"));
}

std::string BalancedStep::Where() const {
  return absl::StrCat(
      "rank ", ctx_.rank(), ", step ", steps_ + 1,
      parts_.size() > 1 ? absl::StrCat(", part '", parts_[part_].spec.name, "'") : std::string());
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
  if (!config_.reseed || i >= micro_.size()) return;
  // Seeds the CPU generator and every accelerator's.
  at::manual_seed(
      MicroBatchSeed(sampler_.options().seed, steps_ + 1, ctx_.rank(), static_cast<int64_t>(i)));
}

void BalancedStep::StartPart(size_t k) {
  part_ = k;
  next_micro_ = 0;
  data_marked_ = false;
  if (memory_budget_ > 0) memory_probe_.Lap();  // a part's first micro-step from here
  Reseed(0);
  Part& part = parts_[k];
  // An earlier step's failed synchronisation is settled: a failure in this
  // one joins this step's synchronisation.
  part.sync->ForgetFailure();
  part.sync->SetStep(steps_);
  syncs_at_begin_ = part.sync->syncs_completed();
  part_sums_ = {step_sums_, step_sum_tensors_, loss_on_device_[k]};
  slot_pieces_.assign(micro_.size(), 1);
  released_for_.clear();
  released_bytes_ = 0;
  unsplit_retries_ = 0;
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
  for (const at::Tensor& p : parts_[part_].spec.module->parameters()) {
    if (!p.requires_grad()) continue;
    const at::Tensor& g = p.grad();
    untouched_.push_back({g.defined() ? g.unsafeGetTensorImpl() : nullptr,
                          g.defined() ? static_cast<int64_t>(g._version()) : -1,
                          static_cast<int64_t>(p._version())});
  }
}

absl::Status BalancedStep::CheckUntouched(bool* replica_changed) const {
  size_t i = 0;
  for (const auto& item : parts_[part_].spec.module->named_parameters()) {
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
  next_step_loads_ = false;
  CancelPrefetch();
  EVENSTEP_RETURN_IF_ERROR(BeginStep());
  const std::vector<MicroBatch>& mbs = micro_batches();
  // For the whole step, the parts' synchronisations (EndPart, FinishStep)
  // included: a rank with no micro-batch learns there that a peer ran out
  // of memory, and must join the vote on a retry as the others do.
  RecomputeScope scope(this, [this, &losses](const MicroBatch& mb) { return losses[part_](mb); });
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

struct BalancedStep::SplitLog {
  std::unique_ptr<internal::SplitRecorder> recorder;  // null: not recording
  std::string replay_file;                            // "": not replaying
  std::map<int64_t, internal::SplitRecord> replay;
  absl::Status error;  // the first failure, returned by the next BeginStep

  // Replaces `plan` and `cap` by the record's for `step` of `batch`.
  absl::Status Replay(int64_t step, const GlobalBatch& batch, Plan* plan, int64_t* cap) const {
    auto it = replay.find(step);
    if (it == replay.end()) {
      return absl::OutOfRangeError(absl::StrCat(
          "step ", step, ": the split record ", replay_file, " has no such step (it holds ",
          replay.empty()
              ? std::string("none")
              : absl::StrCat("steps ", replay.begin()->first, "-", replay.rbegin()->first),
          ")"));
    }
    const internal::SplitRecord& r = it->second;
    const internal::SplitRecord now = internal::RecordOf(step, batch, *plan, *cap);
    if (r.epoch != now.epoch || r.batch_step != now.batch_step ||
        r.batch_samples != now.batch_samples || r.batch_hash != now.batch_hash) {
      return absl::FailedPreconditionError(absl::StrCat(
          "step ", step, ": the global batch (epoch ", now.epoch, ", step ", now.batch_step, ", ",
          now.batch_samples, " samples) is not the one ", replay_file, " split (epoch ", r.epoch,
          ", step ", r.batch_step, ", ", r.batch_samples,
          " samples, or other samples): replay with the recorded run's seed, global batch and "
          "data"));
    }
    *plan = r.plan;
    *cap = r.memory_cap;
    return absl::OkStatus();
  }
};

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
  int64_t cap = MemoryCap();
  const int64_t step = steps_done + 1;
  if (split_log_ != nullptr && !split_log_->replay_file.empty() && split_log_->error.ok()) {
    split_log_->error = split_log_->Replay(step, next.batch, &plan, &cap);
  }
  std::vector<std::vector<int64_t>> parts;
  if (sampler_.options().streams > 0) {
    // Streams move between ranks only at an epoch's start.
    if (next.batch.step == 0 || stream_shares_.empty()) stream_shares_ = plan.shares;
    parts = sampler_.PartitionStreams(next.batch, stream_shares_);
  } else {
    parts = SplitGlobalBatch(sampler_, next.batch, plan);
  }
  next.micro = sampler_.Pack(std::move(parts[ctx_.rank()]), cap);
  Label(next.batch, sampler_.options().seed, &next.micro);
  if (split_log_ != nullptr && split_log_->recorder != nullptr && split_log_->error.ok()) {
    split_log_->error =
        split_log_->recorder->Append(internal::RecordOf(step, next.batch, plan, cap));
  }
  next.shares = std::move(plan.shares);
  planned_ = std::move(next);
}

void BalancedStep::CancelPrefetch() {
  carried_.reset();  // waits for the loads in flight
  carried_data_ = nullptr;
  carried_id_ = nullptr;
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
  if (in_step_) {
    return absl::FailedPreconditionError(absl::StrCat("BalancedStep: rank ", ctx_.rank(),
                                                      ": BeginStep while step ", steps_ + 1,
                                                      " is still open (call FinishStep first)"));
  }
  report_ = StepReport{};
  report_.begin = absl::Now();
  step_failed_max_ = 0;
  late_failure_.clear();
  memory_probe_.Begin();
  began_ = true;
  cost_model_.BeginStep();
  if (!planned_) PlanNextStep(steps_);
  if (split_log_ != nullptr && !split_log_->error.ok()) {
    // Before any collective of the step: a record every rank replays lacks
    // the step on every rank.
    return Annotate(split_log_->error, absl::StrCat("BalancedStep: rank ", ctx_.rank()));
  }
  batch_ = std::move(planned_->batch);
  micro_ = std::move(planned_->micro);
  const std::vector<double> shares = std::move(planned_->shares);
  planned_.reset();
  scale_ = config_.objective == Objective::kSum ? 1.0 : batch_.count > 0 ? 1.0 / batch_.count : 0.0;
  loss_on_device_.assign(parts_.size(), at::Tensor());
  step_sums_.assign(sum_names_.size(), 0.0);
  step_sum_tensors_.assign(sum_names_.size(), at::Tensor());
  part_loss_sums_.assign(parts_.size(), 0.0);
  in_step_ = true;
  StartPart(0);
  clock_->Begin();
  report_.epoch = batch_.epoch;
  report_.epoch_step = batch_.step;
  report_.micro_batches = static_cast<int>(micro_.size());
  // Static and work plans do not depend on the exchange: the next step is
  // planned now, so that its loads can run during this one.
  if (next_step_loads_ && config_.planner.mode != BalanceMode::kDynamic) {
    PlanNextStep(steps_ + 1);
  }
  report_.global_count = batch_.count;
  report_.global_tokens = batch_.tokens;
  report_.shares = shares;
  for (const MicroBatch& mb : micro_) {
    report_.samples += static_cast<int64_t>(mb.samples.size());
    report_.tokens += mb.tokens;
    report_.units += mb.cost;
  }
  return absl::OkStatus();
}

void BalancedStep::DataReady() {
  clock_->Start();
  data_marked_ = true;
  slot_sums_ = {step_sums_, step_sum_tensors_, loss_on_device_[part_]};
}

absl::Status BalancedStep::Backward(const at::Tensor& loss_sum) {
  if (!in_step_ || next_micro_ >= micro_.size()) {
    return absl::FailedPreconditionError(
        absl::StrCat("BalancedStep: ", Where(), ": Backward without a pending micro-batch (",
                     micro_.size(), " in this step", parts_.size() > 1 ? "; EndPart?" : "", ")"));
  }
  if (!data_marked_) DataReady();
  const size_t index = next_micro_++;
  const bool last = next_micro_ == micro_.size();
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
    MicroStep(loss_sum, micro_[index], last);
    clock_->End();
  } catch (const c10::OutOfMemoryError& e) {
    const bool started = backward_started_;
    backward_started_ = false;
    if (!(started && last && SyncedDespiteFailure())) {
      return OutOfMemory(index, started, internal::ErrorText(e));
    }
    // Out of memory after every gradient was in the synchronisation, which
    // completed on every rank: the step's gradient is whole.
    clock_->End();
  } catch (const std::exception& e) {
    backward_started_ = false;
    if (!(last && SyncedDespiteFailure())) {
      if (last && Bystander(e)) {
        // Another rank abandoned this synchronisation: if it ran out of
        // memory (and nobody failed otherwise), every rank runs the part again.
        EVENSTEP_ASSIGN_OR_RETURN(const bool retry, VoteToRetry(false, false));
        if (retry) return Replay(0, micro_.size() - 1, micro_.size());
      }
      return Abandon(index, internal::ErrorText(e));
    }
    // After every gradient was in the synchronisation, which completed on
    // every rank: the peers step with the whole gradient, so this rank steps
    // too (no replica drifts) and joins the exchange (no peer waits for a
    // rank that left), which carries the failure to every rank.
    late_failure_ = absl::StrCat("micro-batch ", index + 1, " of ", micro_.size(), ": ",
                                 internal::ErrorText(e));
    clock_->End();
  }
  if (last) {
    const SyncStats stats = parts_[part_].sync->last_stats();
    report_.arrived = stats.arrived;
    report_.synced = stats.done;
  }
  data_marked_ = false;
  Reseed(next_micro_);
  return absl::OkStatus();
}

void BalancedStep::MicroStep(const at::Tensor& loss_sum, const MicroBatch& mb, bool sync_now) {
  const double count = mb.count;
  GradSync& sync = *parts_[part_].sync;
  sync.set_sync_enabled(sync_now);
  // The factor that makes this micro-batch's loss its share of the global
  // batch's mean: 1 / (global count) for a SUM; for a MEAN, times the
  // micro-batch's own count first.
  const double factor = scale_ * (config_.loss_reduction == LossReduction::kMean ? count : 1.0);
  at::Tensor scaled_loss = loss_sum * factor;
  if (sync_now) {
    // Parameters the loss cannot reach are ready at once (their buckets
    // are not held back to the end of backward).
    if (absl::Status s = sync.PrepareForBackward(scaled_loss); !s.ok()) {
      throw std::runtime_error(std::string(s.message()));
    }
  }
  // Counted before backward: a replay or an abandoned step restores the sums.
  const at::Tensor scaled = loss_sum.detach().to(at::kDouble) * factor;
  at::Tensor& sum = loss_on_device_[part_];
  sum = sum.defined() ? sum + scaled : scaled;
  syncs_before_micro_ = sync.syncs_completed();
  backward_started_ = true;
  scaled_loss.backward();
  backward_started_ = false;
  report_.largest_micro_batch = std::max(report_.largest_micro_batch, mb.padded_tokens());
  if (memory_budget_ > 0) {  // predicted caps: the micro-step's peak into its part's fit
    const int64_t peak =
        config_.micro_peak_bytes ? config_.micro_peak_bytes(mb) : memory_probe_.Lap();
    if (peak > 0) memory_fits_[part_].Record(mb.padded_tokens(), peak);
  }
}

bool BalancedStep::SyncedDespiteFailure() const {
  const GradSync& sync = *parts_[part_].sync;
  return sync.syncs_completed() > syncs_before_micro_ && sync.status().ok();
}

bool BalancedStep::Recovers() const {
  return config_.oom == BalanceConfig::OomPolicy::kSplit && recompute_ != nullptr;
}

bool BalancedStep::Bystander(const std::exception& e) const {
  const GradSync& sync = *parts_[part_].sync;
  const absl::Status status = sync.status();
  return Recovers() && status.code() == absl::StatusCode::kAborted && sync.fatal_status().ok() &&
         status.ToString() == e.what();
}

absl::StatusOr<bool> BalancedStep::VoteToRetry(bool oom, bool other) {
  voted_at_ = parts_[part_].sync->syncs_completed();
  at::Tensor votes = at::tensor({oom ? 1.0 : 0.0, other ? 1.0 : 0.0}, at::kDouble);
  EVENSTEP_RETURN_IF_ERROR(ctx_.AllReduce(votes, ReduceOp::kMax), "BalancedStep: ", Where(),
                           ", agreeing whether to retry after an out-of-memory error");
  return votes[0].item<double>() > 0 && votes[1].item<double>() == 0;
}

std::vector<MicroBatch> BalancedStep::SplitMicroBatch(const MicroBatch& mb, int pieces) const {
  const size_t n = std::min<size_t>(static_cast<size_t>(pieces), mb.samples.size());
  std::vector<MicroBatch> out(std::max<size_t>(n, 1));
  for (MicroBatch& piece : out) {
    piece.epoch = mb.epoch;
    piece.index = mb.index;
    piece.global_samples = mb.global_samples;
    piece.global_tokens = mb.global_tokens;
  }
  for (size_t k = 0; k < mb.samples.size(); ++k) {
    MicroBatch& piece = out[k % out.size()];
    const int64_t i = mb.samples[k];
    piece.samples.push_back(i);
    piece.tokens += sampler_.length(i);
    piece.max_length = std::max(piece.max_length, sampler_.length(i));
    piece.cost += sampler_.cost(i);
    piece.count += sampler_.count(i);
  }
  return out;
}

absl::Status BalancedStep::OutOfMemory(size_t slot, bool backward_started,
                                       const std::string& what) {
  // A recovery resets and replays gradients: what it leaves is evenstep's
  // (an out-of-memory error in a loss function comes here outside Backward).
  absl::Cleanup note = [this] { NoteGradients(); };
  const std::string why = absl::StrCat("out of memory: ", what);
  if (!Recovers()) {
    NoteFailedSize(micro_[slot]);
    return Abandon(slot, absl::StrCat(why, config_.oom == BalanceConfig::OomPolicy::kFail
                                               ? " (--evenstep_oom=fail)"
                                               : " (not retried: the loop calls Backward itself)"));
  }
  const size_t n = micro_.size();
  // With the allocator's cache released the micro-batch may fit as it is.
  const size_t split = RetryAfterReleasingCache(slot) ? n : slot;
  if (split < n) NoteFailedSize(micro_[slot]);
  if (backward_started && slot + 1 == n) {
    // This rank's failure mark is in the part's synchronisation: every rank
    // learns of it, and all agree to run the part again.
    EVENSTEP_ASSIGN_OR_RETURN(const bool retry, VoteToRetry(true, false));
    if (!retry) return Abandon(slot, why);
    return Replay(0, n - 1, split);
  }
  // Nothing accumulated yet (in the loss function), or part of this
  // micro-batch's gradient did (in backward): the part again from the start.
  return Replay(backward_started ? 0 : slot, slot, split);
}

std::string BalancedStep::TooLargeAlone(const MicroBatch& piece, const std::string& error) const {
  const int64_t sample = piece.samples.empty() ? -1 : piece.samples[0];
  return absl::StrCat(
      "out of memory with sample ", sample, " (length ", piece.max_length, ") alone on rank ",
      ctx_.rank(), ": it does not fit even by itself",
      released_bytes_ > 0
          ? absl::StrFormat(" (after %.1f MiB the allocator held cached were released)",
                            static_cast<double>(released_bytes_) / (1 << 20))
          : std::string(),
      ": ", error);
}

bool BalancedStep::RetryAfterReleasingCache(size_t slot) {
  // Every failed attempt may leave blocks cached: released before every retry.
  const int64_t released =
      config_.release_cache ? config_.release_cache() : memory_probe_.ReleaseCache();
  if (released <= 0) return false;
  released_bytes_ += released;
  // Retried as it was once per size until it fits (a success forgets it),
  // and at most a few times per micro-batch of the part: the recovery ends.
  const int pieces = slot < slot_pieces_.size() ? slot_pieces_[slot] : 1;
  const bool unsplit = unsplit_retries_ < 2 * static_cast<int>(micro_.size()) + 2 &&
                       released_for_.insert({slot, pieces}).second;
  if (unsplit) ++unsplit_retries_;
  Log(LogLevel::kWarning,
      absl::StrFormat("rank %d, step %d: out of memory in micro-batch %d of %d: released %.1f MiB "
                      "the allocator held cached%s",
                      ctx_.rank(), steps_ + 1, slot + 1, micro_.size(),
                      static_cast<double>(released) / (1 << 20),
                      !unsplit     ? std::string()
                      : pieces > 1 ? absl::StrCat("; retrying it in ", pieces, " pieces")
                                   : std::string("; retrying it whole")));
  return unsplit;
}

absl::Status BalancedStep::Replay(size_t from, size_t until, size_t failed) {
  absl::Cleanup note = [this] { NoteGradients(); };
  Part& part = parts_[part_];
  const size_t n = micro_.size();
  slot_pieces_.resize(n, 1);
  std::vector<size_t> split;  // the micro-batches split in this recovery
  auto split_more = [&](size_t j) {
    slot_pieces_[j] *= 2;
    if (std::find(split.begin(), split.end(), j) == split.end()) split.push_back(j);
  };
  if (failed < n) split_more(failed);
  for (;;) {
    const Sums& at = from == 0 ? part_sums_ : slot_sums_;
    step_sums_ = at.values;
    step_sum_tensors_ = at.tensors;
    loss_on_device_[part_] = at.loss;
    if (from == 0) {
      part.spec.optimizer->zero_grad();
      part.sync->ForgetUse();
    }
    bool again = false;
    int64_t largest = 0;  // padded tokens of the largest split piece that fitted
    for (size_t j = from; j <= until && !again; ++j) {
      Reseed(j);
      const std::vector<MicroBatch> run = slot_pieces_[j] > 1
                                              ? SplitMicroBatch(micro_[j], slot_pieces_[j])
                                              : std::vector<MicroBatch>{micro_[j]};
      for (size_t q = 0; q < run.size() && !again; ++q) {
        const bool sync_now = j + 1 == n && q + 1 == run.size();
        // The piece's peak from here (not the failed attempt's).
        if (memory_budget_ > 0) memory_probe_.Lap();
        try {
          MicroStep(recompute_(run[q]), run[q], sync_now);
          released_for_.erase({j, slot_pieces_[j]});  // it fits now
          if (slot_pieces_[j] > 1) {
            largest = std::max(largest, run[q].padded_tokens());
          }
        } catch (const c10::OutOfMemoryError& e) {
          const bool started = backward_started_;
          backward_started_ = false;
          if (sync_now && started && SyncedDespiteFailure()) continue;  // the gradient is whole
          const bool unsplit = RetryAfterReleasingCache(j);
          if (!unsplit) NoteFailedSize(run[q]);
          if (!unsplit && run[q].samples.size() <= 1) {
            return Abandon(j, TooLargeAlone(run[q], internal::ErrorText(e)));
          }
          if (sync_now && started) {
            EVENSTEP_ASSIGN_OR_RETURN(const bool retry, VoteToRetry(true, false));
            if (!retry) return Abandon(j, internal::ErrorText(e));
          }
          if (!unsplit) split_more(j);
          from = 0;
          again = true;
        } catch (const std::exception& e) {
          backward_started_ = false;
          if (!(sync_now && Bystander(e))) return Abandon(j, internal::ErrorText(e));
          EVENSTEP_ASSIGN_OR_RETURN(const bool retry, VoteToRetry(false, false));
          if (!retry) return Abandon(j, internal::ErrorText(e));
          from = 0;
          again = true;
        }
      }
    }
    if (again) continue;
    if (!split.empty()) {
      // The largest piece known to fit, below the smallest that did not.
      memory_cap_ = std::min(std::max(memory_cap_, largest), memory_failed_min_ - 1);
      for (size_t j : split) {
        const MicroBatch& mb = micro_[j];
        ++report_.oom_splits;
        Log(LogLevel::kWarning,
            absl::StrFormat("rank %d, step %d: out of memory in micro-batch %d of %d (%d "
                            "samples, %d padded tokens): split in %d and retried; this rank's "
                            "micro-batches are now capped at %d padded tokens",
                            ctx_.rank(), steps_ + 1, j + 1, n, mb.samples.size(),
                            mb.padded_tokens(),
                            std::min<size_t>(slot_pieces_[j], mb.samples.size()), MemoryCap()));
      }
      RepackPlanned();
    }
    next_micro_ = until + 1;
    clock_->End();
    data_marked_ = false;
    if (until + 1 == n) {
      const SyncStats stats = part.sync->last_stats();
      report_.arrived = stats.arrived;
      report_.synced = stats.done;
    }
    Reseed(next_micro_);
    return absl::OkStatus();
  }
}

void BalancedStep::NoteFailedSize(const MicroBatch& mb) {
  memory_failed_min_ = std::min(memory_failed_min_, mb.padded_tokens());
  step_failed_max_ = std::max(step_failed_max_, mb.padded_tokens());
}

int64_t BalancedStep::MemoryCap() const {
  if (memory_cap_ <= 0) return predicted_cap_;
  return predicted_cap_ <= 0 ? memory_cap_ : std::min(memory_cap_, predicted_cap_);
}

void BalancedStep::PredictMemoryCap() {
  if (!(memory_budget_ > 0)) return;
  int64_t cap = 0;
  size_t bound = 0;  // the part whose fit gives the cap
  for (size_t k = 0; k < memory_fits_.size(); ++k) {
    const int64_t c = memory_fits_[k].Cap(memory_budget_);
    if (c <= 0) return;  // a part without a prediction yet
    if (cap == 0 || c < cap) {
      cap = c;
      bound = k;
    }
  }
  if (memory_failed_min_ != std::numeric_limits<int64_t>::max()) {
    cap = std::max<int64_t>(1, std::min(cap, memory_failed_min_ - 1));
  }
  // The fit moves a little with every micro-step; the cap only with a
  // change of more than 5 % (each change repacks a step planned ahead).
  if (predicted_cap_ > 0 && std::abs(cap - predicted_cap_) * 20 <= predicted_cap_) return;
  const int64_t before = MemoryCap();
  predicted_cap_ = cap;
  const MemoryFit::Line line = memory_fits_[bound].line();
  constexpr double kMiB = 1 << 20;
  Log(LogLevel::kWarning,
      absl::StrFormat("rank %d, step %d: micro-batches capped at %d padded tokens, "
                      "predicted from this rank's peak memory%s (%.1f MiB + %.3f MiB per padded "
                      "token, within %.0f %% of a %.1f MiB limit)",
                      ctx_.rank(), steps_, cap,
                      parts_.size() > 1 ? absl::StrCat(" in part '", parts_[bound].spec.name, "'")
                                        : std::string(),
                      line.fixed_bytes / kMiB, line.per_token_bytes / kMiB,
                      config_.memory_headroom * 100,
                      memory_budget_ / config_.memory_headroom / kMiB));
  if (before <= 0 || MemoryCap() < before) RepackPlanned();
}

void BalancedStep::RepackPlanned() {
  if (!planned_ || MemoryCap() <= 0) return;
  std::vector<int64_t> samples;
  for (const MicroBatch& mb : planned_->micro) {
    samples.insert(samples.end(), mb.samples.begin(), mb.samples.end());
  }
  std::vector<MicroBatch> micro = sampler_.Pack(std::move(samples), MemoryCap());
  if (micro.size() == planned_->micro.size()) return;  // already within the cap
  CancelPrefetch();                                    // its loads were for the old micro-batches
  Label(planned_->batch, sampler_.options().seed, &micro);
  planned_->micro = std::move(micro);
}

absl::Status BalancedStep::Account() {
  // Blocks until the device has finished the last micro-step (not the
  // optimizer step queued after it).
  internal::MicroStepTimes times;
  try {
    times = clock_->Read();
    for (size_t k = 0; k < parts_.size(); ++k) {
      const at::Tensor& sum = loss_on_device_[k];
      part_loss_sums_[k] = sum.defined() ? sum.item<double>() : 0.0;
    }
    for (size_t k = 0; k < sum_names_.size(); ++k) {
      if (step_sum_tensors_[k].defined()) step_sums_[k] += step_sum_tensors_[k].item<double>();
    }
  } catch (const std::exception& e) {
    return absl::InternalError(
        absl::StrCat("BalancedStep: rank ", ctx_.rank(), ", step ", steps_ + 1,
                     ", reading the micro-step times and losses: ", internal::ErrorText(e)));
  }
  // Micro-step j is micro-batch j % n of part j / n: the cost model learns
  // each micro-batch's time summed over the parts.
  const size_t n = micro_.size();
  std::vector<absl::Duration> data(n), compute(n);
  absl::Time at = clock_->begun();
  for (size_t j = 0; j < times.data.size() && j < n * parts_.size(); ++j) {
    const absl::Time data_end = at + times.data[j];
    const bool last = j + 1 == times.data.size();
    const absl::Time end = data_end + times.compute[j] + (last ? times.sync : absl::ZeroDuration());
    report_.micro.push_back({at, data_end, end, micro_[j % n].cost});
    data[j % n] += times.data[j];
    compute[j % n] += times.compute[j];
    at = end;
  }
  for (size_t k = 0; k < n; ++k) {
    report_.data += data[k];
    report_.compute += compute[k];
    cost_model_.Record(micro_[k].cost, absl::ToDoubleSeconds(data[k]),
                       absl::ToDoubleSeconds(compute[k]));
  }
  if (!micro_.empty()) report_.sync_wait += times.sync;
  report_.busy = report_.data + report_.compute;
  return absl::OkStatus();
}

int64_t BalancedStep::epoch() const {
  if (planned_) return planned_->batch.epoch;
  const SamplerState at = sampler_.state();
  return at.step >= sampler_.steps_per_epoch() ? at.epoch + 1 : at.epoch;
}

int64_t BalancedStep::last_step_epoch() const {
  const SamplerState at = planned_ ? planned_->sampler_before : sampler_.state();
  if (at.step == 0) return std::max<int64_t>(at.epoch - 1, 0);
  return at.epoch;  // also at.step == steps_per_epoch: the epoch's last step was the last
}

std::string BalancedStep::LoadFailure(size_t micro_batch, const absl::Status& error) const {
  const std::vector<int64_t>& samples = micro_[micro_batch].samples;
  constexpr size_t kNamed = 8;
  std::vector<int64_t> named(samples.begin(), samples.begin() + std::min(samples.size(), kNamed));
  return absl::StrCat(
      "loading samples [", absl::StrJoin(named, ", "),
      samples.size() > kNamed ? absl::StrCat(", ... ", samples.size(), " in all") : "",
      "] on a data worker: ", error.message());
}

absl::Status BalancedStep::Abandon(size_t micro_batch, const std::string& what) {
  in_step_ = false;
  GradSync& sync = *parts_[part_].sync;
  sync.set_sync_enabled(false);
  const std::string where = absl::StrCat("BalancedStep: ", Where(), ", micro-batch ",
                                         micro_batch + 1, " of ", micro_.size());
  absl::Status status;
  if (sync.syncs_completed() == syncs_at_begin_) {
    // The peers are (or will be) in this step's synchronisation: join it
    // with a failure mark, so every rank abandons this same step.
    absl::Status joined = sync.AbandonStep(absl::InternalError(absl::StrCat(where, ": ", what)));
    status = absl::Status(joined.ok() ? absl::StatusCode::kAborted : joined.code(),
                          absl::StrCat(where, ": ", what, "; ", joined.message()));
  } else {
    // The failure came from (or after) the synchronisation itself.
    const absl::Status synced = sync.status();
    status = synced.ok() ? absl::InternalError(absl::StrCat(where, ": ", what))
                         : Annotate(synced, where);
  }
  // Every rank whose synchronisation was abandoned agrees on a retry
  // (Backward, Replay, ApplyPart): this rank failed otherwise, so none.
  if (Recovers() && sync.fatal_status().ok() && sync.syncs_completed() != syncs_at_begin_ &&
      voted_at_ != sync.syncs_completed()) {
    VoteToRetry(false, true).IgnoreError();  // the status above says what failed
  }
  // The abandoned step's gradients must never reach an optimizer step.
  try {
    parts_[part_].spec.optimizer->zero_grad();
  } catch (const std::exception&) {
  }
  if (!sync.fatal_status().ok()) abandoned_ = status;
  return status;
}

absl::Status BalancedStep::ApplyPart() {
  if (next_micro_ != micro_.size()) {
    return Abandon(next_micro_,
                   absl::StrCat(part_ + 1 < parts_.size() ? "EndPart" : "FinishStep", " after ",
                                next_micro_, " of ", micro_.size(), " micro-batches"));
  }
  Part& part = parts_[part_];
  part.sync->set_sync_enabled(false);
  if (micro_.empty()) {
    // No work on this rank this step: join the collectives with zeros.
    const absl::Time arrived = absl::Now();
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
      synced = part.sync->SyncNow();
    }
    report_.arrived = arrived;
    report_.synced = absl::Now();
    report_.sync_wait += report_.synced - arrived;
    if (!synced.ok()) in_step_ = false;
    EVENSTEP_RETURN_IF_ERROR(synced, "BalancedStep: ", Where(), " (no micro-batch on this rank)");
  } else if (absl::Status synced = part.sync->status(); !synced.ok()) {
    in_step_ = false;
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
    in_step_ = false;
    return absl::InternalError(
        absl::StrCat("BalancedStep: ", Where(), ", optimizer step: ", internal::ErrorText(e)));
  }
  report_.optimizer = absl::Now() - optimizer_begin;
  return absl::OkStatus();
}

absl::Status BalancedStep::EndPart() {
  if (!in_step_ || part_ + 1 >= parts_.size()) {
    return absl::FailedPreconditionError(
        absl::StrCat("BalancedStep: rank ", ctx_.rank(), ": EndPart ",
                     in_step_ ? "in the last part (call FinishStep)" : "without BeginStep"));
  }
  EVENSTEP_RETURN_IF_ERROR(ApplyPart());
  StartPart(part_ + 1);
  clock_->Resume();  // the optimizer step just taken is no data wait
  return absl::OkStatus();
}

absl::StatusOr<StepReport> BalancedStep::FinishStep() {
  if (!in_step_) {
    return absl::FailedPreconditionError(
        absl::StrCat("BalancedStep: rank ", ctx_.rank(), ": FinishStep without BeginStep"));
  }
  if (part_ + 1 < parts_.size()) {
    return Abandon(next_micro_, absl::StrCat("FinishStep in part ", part_ + 1, " of ",
                                             parts_.size(), " (EndPart moves to the next part)"));
  }
  EVENSTEP_RETURN_IF_ERROR(ApplyPart());
  in_step_ = false;
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
                     late_failure_.empty() ? std::string(" (see their output)")
                                           : absl::StrCat(" (here: ", late_failure_, ")"),
                     "; the gradient was whole, so the step was applied on every rank alike"));
  }
  // Dynamic plans need the exchanged fits: with prefetching across steps the
  // next step is planned now, so that its loads can start.
  if (next_step_loads_ && !planned_) PlanNextStep(steps_);
  report_.end = absl::Now();
  return report_;
}

absl::Status BalancedStep::Exchange() {
  const CostFit fit = cost_model_.total_fit();
  const int sums_at = kPartLosses + static_cast<int>(parts_.size());
  const int fields = sums_at + static_cast<int>(sum_names_.size());
  at::Tensor mine = at::zeros({fields}, at::kDouble);
  double* m = mine.data_ptr<double>();
  m[kFitFixed] = fit.fixed_s;
  m[kFitPerUnit] = fit.per_unit_s;
  m[kFitObservations] = static_cast<double>(fit.observations);
  m[kBusy] = absl::ToDoubleSeconds(report_.busy);
  for (size_t k = 0; k < parts_.size(); ++k) m[kPartLosses + k] = part_loss_sums_[k];
  for (size_t k = 0; k < sum_names_.size(); ++k) m[sums_at + k] = step_sums_[k];
  m[kMicroBatches] = static_cast<double>(micro_.size());
  m[kLateFailure] = late_failure_.empty() ? 0 : 1;
  m[kOomSplits] = report_.oom_splits;
  m[kMemoryCap] = static_cast<double>(MemoryCap());
  m[kOomFailed] = static_cast<double>(step_failed_max_);
  m[kPeakMemory] = static_cast<double>(report_.memory.peak_bytes);
  m[kLargestMicro] = static_cast<double>(report_.largest_micro_batch);
  for (int i = 0; i < kAgreementSlots; ++i) m[kAgreed + i] = shared_[i];
  std::vector<at::Tensor> all;
  EVENSTEP_RETURN_IF_ERROR(ctx_.AllGather(mine, &all), "BalancedStep: step ", steps_,
                           ", exchange of cost fits");
  const int world = ctx_.world_size();
  fits_.assign(world, CostFit{});
  report_.rank_busy_s.assign(world, 0);
  report_.rank_micro_batches.assign(world, 0);
  report_.rank_oom_splits.assign(world, 0);
  report_.rank_memory_caps.assign(world, 0);
  report_.rank_oom_failed.assign(world, 0);
  report_.rank_peak_memory.assign(world, 0);
  report_.rank_largest_micro_batch.assign(world, 0);
  report_.part_losses.assign(parts_.size(), 0.0);
  for (const std::string& name : sum_names_) report_.sums[name] = 0;
  double busy_sum = 0, busy_max = 0;
  report_.agreed.fill(-std::numeric_limits<double>::infinity());
  for (int r = 0; r < world; ++r) {
    const double* v = all[r].data_ptr<double>();
    for (int i = 0; i < kAgreementSlots; ++i) {
      report_.agreed[i] = std::max(report_.agreed[i], v[kAgreed + i]);
    }
    fits_[r].fixed_s = v[kFitFixed];
    fits_[r].per_unit_s = v[kFitPerUnit];
    fits_[r].observations = static_cast<int64_t>(v[kFitObservations]);
    report_.rank_busy_s[r] = v[kBusy];
    report_.rank_micro_batches[r] = static_cast<int>(v[kMicroBatches]);
    if (v[kLateFailure] != 0) report_.late_failures.push_back(r);
    report_.rank_oom_splits[r] = static_cast<int>(v[kOomSplits]);
    report_.rank_memory_caps[r] = static_cast<int64_t>(v[kMemoryCap]);
    report_.rank_oom_failed[r] = static_cast<int64_t>(v[kOomFailed]);
    report_.rank_peak_memory[r] = static_cast<int64_t>(v[kPeakMemory]);
    report_.rank_largest_micro_batch[r] = static_cast<int64_t>(v[kLargestMicro]);
    if (report_.rank_oom_splits[r] > 0) {
      report_.oom_recoveries.push_back(absl::StrFormat(
          "rank %d, step %d: %d micro-batch(es) ran out of memory (the largest %d padded tokens) "
          "and were split and retried within the step; rank %d's micro-batches are now capped at "
          "%d padded tokens",
          r, steps_, report_.rank_oom_splits[r], report_.rank_oom_failed[r], r,
          report_.rank_memory_caps[r]));
    }
    for (size_t k = 0; k < parts_.size(); ++k) report_.part_losses[k] += v[kPartLosses + k];
    for (size_t k = 0; k < sum_names_.size(); ++k) report_.sums[sum_names_[k]] += v[sums_at + k];
    busy_sum += v[kBusy];
    busy_max = std::max(busy_max, v[kBusy]);
  }
  report_.loss = report_.part_losses[0];
  memory_caps_ = report_.rank_memory_caps;
  report_.balance_efficiency = busy_max > 0 ? busy_sum / world / busy_max : 1.0;
  UpdateHealth();
  return absl::OkStatus();
}

void BalancedStep::UpdateHealth() {
  const size_t world = fits_.size();
  report_.rank_health.assign(world, 1.0);
  report_.rank_relative_speed.assign(world, 1.0);
  report_.health_alerts.clear();
  if (best_micro_s_.size() != world) {
    best_micro_s_.assign(world, 0);
    unhealthy_.assign(world, false);
  }
  // A typical micro-batch: the cap's cost units (or the mean global batch's
  // share of one rank when uncapped).
  double units = sampler_.micro_batch_cost_cap();
  if (!std::isfinite(units)) units = batch_.cost / std::max<size_t>(world, 1);
  std::vector<double> time(world, 0), valid;
  for (size_t r = 0; r < world; ++r) {
    if (!fits_[r].valid()) continue;
    time[r] = fits_[r].Predict(1, units);
    if (time[r] > 0) valid.push_back(time[r]);
  }
  if (valid.empty()) return;
  std::sort(valid.begin(), valid.end());
  const double median = valid[(valid.size() - 1) / 2];  // of two, the faster
  for (size_t r = 0; r < world; ++r) {
    if (!(time[r] > 0)) continue;
    report_.rank_relative_speed[r] = median / time[r];
    // A fit of few micro-steps may split fixed and per-unit cost badly: the
    // best counts from kSettled observations on.
    constexpr int64_t kSettled = 32;
    if (fits_[r].observations < kSettled) continue;
    if (best_micro_s_[r] <= 0 || time[r] < best_micro_s_[r]) best_micro_s_[r] = time[r];
    const double health = best_micro_s_[r] / time[r];
    report_.rank_health[r] = health;
    if (config_.health_warn <= 0) continue;
    if (!unhealthy_[r] && health < config_.health_warn) {
      unhealthy_[r] = true;
      report_.health_alerts.push_back(absl::StrFormat(
          "rank %d's micro-steps take %.2fx its own best (%.2fx speed) at step %d, and %.2fx the "
          "median rank's: a slowing device (heat, clocks, a noisy neighbour)?",
          r, 1 / health, health, steps_ + 1, time[r] / median));
    } else if (unhealthy_[r] && health >= config_.health_warn + 0.05) {
      unhealthy_[r] = false;  // recovered: a later fall is named again
    }
  }
}

absl::Status BalancedStep::DeclareSum(const std::string& name) {
  if (began_ || std::count(sum_names_.begin(), sum_names_.end(), name) > 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("BalancedStep::DeclareSum('", name, "'), rank ", ctx_.rank(), ": ",
                     began_ ? "declare sums before the first step" : "declared twice"));
  }
  sum_names_.push_back(name);
  return absl::OkStatus();
}

size_t BalancedStep::SumIndex(const std::string& name) const {
  const auto it = std::find(sum_names_.begin(), sum_names_.end(), name);
  if (it == sum_names_.end() || !in_step_) {
    throw std::invalid_argument(absl::StrCat("AddToSum('", name, "'): ",
                                             it == sum_names_.end()
                                                 ? "not declared (DeclareSum before the first step)"
                                                 : "outside a step"));
  }
  return static_cast<size_t>(it - sum_names_.begin());
}

void BalancedStep::AddToSum(const std::string& name, double value) {
  step_sums_[SumIndex(name)] += value;
}

void BalancedStep::AddToSum(const std::string& name, const at::Tensor& value) {
  at::Tensor& sum = step_sum_tensors_[SumIndex(name)];
  const at::Tensor v = value.detach().to(at::kDouble).sum();
  sum = sum.defined() ? sum + v : v;
}

std::pair<int64_t, int64_t> BalancedStep::owned_streams() const {
  const std::vector<double>& shares = planned_ ? planned_->stream_shares_before : stream_shares_;
  if (sampler_.options().streams <= 0 || shares.empty()) return {0, 0};
  return sampler_.StreamRange(shares, ctx_.rank());
}

BalanceState BalancedStep::state() const {
  BalanceState state;
  state.stream_shares = planned_ ? planned_->stream_shares_before : stream_shares_;
  // A step planned ahead (for prefetching) has not run: the state is the
  // one before it.
  state.sampler = planned_ ? planned_->sampler_before : sampler_.state();
  state.shares = planned_ ? planned_->shares_before : planner_.plan().shares;
  state.steps = steps_;
  if (std::any_of(memory_caps_.begin(), memory_caps_.end(), [](int64_t c) { return c > 0; })) {
    state.memory_caps = memory_caps_;
  }
  return state;
}

absl::Status BalancedStep::CheckRestore(const BalanceState& state) const {
  if (in_step_) return absl::FailedPreconditionError("BalancedStep::Restore: a step is open");
  if (state.steps < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("BalancedStep::Restore: ", state.steps, " steps done"));
  }
  Sampler trial = sampler_;
  EVENSTEP_RETURN_IF_ERROR(trial.Restore(state.sampler), "the sampler's position");
  if (static_cast<int>(state.shares.size()) == ctx_.world_size()) {
    Planner planner = planner_;
    EVENSTEP_RETURN_IF_ERROR(planner.SetShares(state.shares), "the saved shares of the ranks");
  }
  return absl::OkStatus();
}

absl::Status BalancedStep::Restore(const BalanceState& state) {
  EVENSTEP_RETURN_IF_ERROR(CheckRestore(state));
  if (in_step_) {
    return absl::FailedPreconditionError("BalancedStep::Restore: a step is open");
  }
  CancelPrefetch();
  planned_.reset();
  EVENSTEP_RETURN_IF_ERROR(sampler_.Restore(state.sampler));
  if (static_cast<int>(state.shares.size()) == ctx_.world_size()) {
    EVENSTEP_RETURN_IF_ERROR(planner_.SetShares(state.shares));
  }
  steps_ = state.steps;
  // Another world size: the streams are dealt anew (stream state is saved
  // whole, so any rank can take any stream).
  stream_shares_ = static_cast<int>(state.stream_shares.size()) == ctx_.world_size()
                       ? state.stream_shares
                       : planner_.plan().shares;
  fits_.clear();
  cost_model_.Reset();
  // Each rank's learned memory cap, when the world is the same (ranks of
  // another world may sit on other devices).
  memory_caps_ = static_cast<int>(state.memory_caps.size()) == ctx_.world_size()
                     ? state.memory_caps
                     : std::vector<int64_t>();
  memory_cap_ = memory_caps_.empty() ? 0 : memory_caps_[ctx_.rank()];
  return absl::OkStatus();
}

}  // namespace evenstep

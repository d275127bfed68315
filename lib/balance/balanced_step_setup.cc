// BalancedStep: construction and the checks of its parts, optimizers and
// configuration (balanced_step.h).
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
#include "evenstep/balanced_step.h"
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
  // The arrival at the sync splits the last micro-step's compute from its
  // sync wait on the same clock.
  const c10::Device device = ModelDevice(*model_parts[0].module);
  auto clock = std::make_unique<internal::MicroStepClock>(device, config.now);
  std::vector<Part> parts;
  for (ModelPart& spec : model_parts) parts.push_back({std::move(spec), nullptr, nullptr});
  std::unique_ptr<BalancedStep> step(new BalancedStep(ctx, std::move(parts), std::move(sampler),
                                                      std::move(config), std::move(clock)));
  // A process that joined a running job gets its state from the running
  // ranks (HandOver), its parameters among it; the split record, of the
  // world before, ended on them.
  step->lacks_state_ = step->handover_due_ = ctx.joined();
  EVENSTEP_RETURN_IF_ERROR(step->AttachSyncs());
  if (!ctx.joined()) {  // a joiner's initial shares would be of the launch's world
    if (!step->config_.initial_shares.empty()) {
      EVENSTEP_RETURN_IF_ERROR(step->planner_.SetShares(step->config_.initial_shares));
    }
    EVENSTEP_RETURN_IF_ERROR(step->OpenSplitLog());
  }
  // Asked-for workers start now; the default ones with the first Loader.
  if (step->config_.data_workers > 0) step->StartWorkers();
  return step;
}

absl::Status BalancedStep::AttachSyncs() {
  GradSyncOptions options = config_.grad_sync;
  EVENSTEP_ASSIGN_OR_RETURN(const TopologyChoice topology,
                            ApplySyncTopology(ctx_, config_.sync_topology, &options));
  if (topology.say && ctx_.rank() == 0) Log(LogLevel::kInfo, topology.line);
  // A failed gradient bucket names the ranks that never reached the sync.
  DistContext* ctx = &ctx_;
  options.diagnosis.arrive = [ctx] { return ctx->MarkArrival(); };
  options.diagnosis.diagnose = [ctx](int64_t seq, const std::string& what, absl::Duration elapsed,
                                     const std::string& error) {
    return ctx->Diagnose(seq, what, elapsed, error);
  };
  options.on_arrival = [c = clock_.get()] { c->Arrive(); };
  // After an admission the parameters come with the state (HandOver).
  options.broadcast_at_attach = !handover_due_;
  // Going on after a lost rank: a bucket's wait ends once another rank
  // began regrouping (it stopped waiting for a peer that is gone).
  if (ctx_.options().on_rank_loss == DistOptions::OnRankLoss::kContinue) {
    options.diagnosis.abandon = [ctx] { return ctx->RegroupBegun(); };
  }
  for (Part& part : parts_) {
    const std::string what =
        parts_.size() > 1 ? absl::StrCat("model part '", part.spec.name, "'") : std::string();
    part.sync.reset();  // releases its group's claim before the group goes
    // A group of the world before a regroup may still hold a collective
    // that waits for the lost rank: kept, not destroyed (that would wait).
    ctx_.Retire(std::move(part.group));
    EVENSTEP_ASSIGN_OR_RETURN(part.group, ctx_.NewDataGroup(), what);
    EVENSTEP_ASSIGN_OR_RETURN(
        part.sync, GradSync::Attach(*part.spec.module, part.group->process_group(), options), what);
    // Outside its part of a step the hooks only mark gradients as used: a
    // backward through this model outside it (a GAN generator's loss through
    // the discriminator) accumulates locally, as in one process, and starts
    // no collective that the other ranks would not join.
    part.sync->set_sync_enabled(false);
  }
  return absl::OkStatus();
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

}  // namespace evenstep

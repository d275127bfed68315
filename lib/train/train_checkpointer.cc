// TrainCheckpointer: model / optimizer / balancing state <-> sharded checkpoints;
// see train_checkpointer.h.
#include "evenstep/train_checkpointer.h"

#include <torch/nn/module.h>
#include <torch/optim.h>

#include <algorithm>
#include <cstring>
#include <iostream>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <sstream>
#include <type_traits>

#include "absl/flags/flag.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "evenstep/balanced_step.h"
#include "evenstep/dist_context.h"
#include "evenstep/flags.h"
#include "evenstep/internal/choice.h"
#include "evenstep/internal/error_text.h"
#include "evenstep/internal/flag_checks.h"
#include "evenstep/internal/optimizer_state.h"
#include "evenstep/log.h"
#include "evenstep/status_macros.h"
#include "train_checkpointer_internal.h"

namespace evenstep {

using internal::BalanceFromJson;
using internal::OptimizersOf;
using internal::StateKeyIn;
namespace {

std::string BalanceJson(const BalanceState& b) {
  nlohmann::json j = {{"epoch", b.sampler.epoch}, {"step", b.sampler.step},
                      {"seed", b.sampler.seed},   {"num_samples", b.sampler.num_samples},
                      {"steps", b.steps},         {"shares", b.shares}};
  if (!b.stream_shares.empty()) j["stream_shares"] = b.stream_shares;
  if (!b.memory_caps.empty()) j["memory_caps"] = b.memory_caps;
  if (b.sampler.global_batch > 0) {
    j["global_batch"] = b.sampler.global_batch;
    j["batch_unit"] = b.sampler.tokens ? "tokens" : "samples";
  }
  return j.dump();
}

}  // namespace

std::vector<std::string> CheckTrainExtras(const Manifest& manifest, bool require_balance) {
  const nlohmann::json extras = nlohmann::json::parse(manifest.extras_json, nullptr, false);
  if (extras.is_discarded() || !extras.is_object()) return {"extras: not a JSON object"};
  if (!extras.contains("balance")) {
    // A TrainCheckpointer always writes it (null without a BalancedStep);
    // other writers do not write "user" either.
    if (!require_balance || !extras.contains("user")) return {};
    return {"extras: the balancing state (\"balance\") is missing; a resume refuses it"};
  }
  if (extras["balance"].is_null()) return {};
  const absl::StatusOr<BalanceState> balance = BalanceFromJson(extras["balance"]);
  if (!balance.ok()) return {std::string(balance.status().message())};
  return {};
}

namespace {

absl::Status CaptureOptimizer(torch::optim::Optimizer& optimizer, const std::string& prefix,
                              NamedTensors* out) {
  EVENSTEP_ASSIGN_OR_RETURN(const internal::OptimizerKind* kind,
                            internal::OptimizerKindOf(optimizer));
  auto& groups = optimizer.param_groups();
  for (size_t g = 0; g < groups.size(); ++g) {
    out->push_back({absl::StrCat(prefix, "/", g, "/lr"),
                    at::scalar_tensor(groups[g].options().get_lr(), at::kDouble)});
    const auto& params = groups[g].params();
    for (size_t i = 0; i < params.size(); ++i) {
      auto it = optimizer.state().find(StateKeyIn(optimizer.state(), params[i]));
      if (it == optimizer.state().end()) continue;  // no step taken yet
      EVENSTEP_RETURN_IF_ERROR(
          kind->capture(*it->second, out, absl::StrCat(prefix, "/", g, "/", i, "/")));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<NamedTensors> CaptureTensors(torch::nn::Module* model,
                                            torch::optim::Optimizer* optimizer) {
  NamedTensors out;
  if (model != nullptr) {
    for (const auto& p : model->named_parameters(/*recurse=*/true)) {
      out.push_back({"model/" + p.key(), p.value()});
    }
    for (const auto& b : model->named_buffers(/*recurse=*/true)) {
      out.push_back({"model/" + b.key(), b.value()});
    }
  }
  if (optimizer != nullptr)
    EVENSTEP_RETURN_IF_ERROR(CaptureOptimizer(*optimizer, "optimizer", &out));
  return out;
}

absl::StatusOr<CheckpointOptions> CheckpointOptionsFromFlags() {
  CheckpointOptions options;
  options.dir = absl::GetFlag(FLAGS_evenstep_ckpt_dir);
  options.keep = absl::GetFlag(FLAGS_evenstep_ckpt_keep);
  options.max_in_flight = absl::GetFlag(FLAGS_evenstep_ckpt_in_flight);
  EVENSTEP_ASSIGN_OR_RETURN(
      options.when_busy,
      internal::Choose<WhenBusy>("--evenstep_ckpt_when_busy",
                                 absl::GetFlag(FLAGS_evenstep_ckpt_when_busy),
                                 {{"wait", WhenBusy::kWait}, {"skip", WhenBusy::kSkip}}));
  const double slice_mb = absl::GetFlag(FLAGS_evenstep_ckpt_slice_mb);
  EVENSTEP_RETURN_IF_ERROR(
      internal::InRange("evenstep_ckpt_slice_mb", slice_mb, 1.0 / 1024, 1 << 20));
  options.slice_bytes = std::max<int64_t>(1, static_cast<int64_t>(slice_mb * (1 << 20)));
  EVENSTEP_RETURN_IF_ERROR(internal::CheckCheckpointOptions(options));
  return options;
}

absl::Status internal::CheckCheckpointOptions(const CheckpointOptions& options) {
  EVENSTEP_RETURN_IF_ERROR(internal::NotBelow("evenstep_ckpt_keep", options.keep, 1));
  EVENSTEP_RETURN_IF_ERROR(internal::NotBelow("evenstep_ckpt_in_flight", options.max_in_flight, 1));
  // At least 1 KiB: smaller slices only multiply the manifest's entries.
  return internal::InRange("evenstep_ckpt_slice_mb",
                           static_cast<double>(options.slice_bytes) / (1 << 20), 1.0 / 1024,
                           1 << 20);
}

TrainCheckpointer::TrainCheckpointer(DistContext& ctx, CheckpointOptions options,
                                     std::unique_ptr<CommitStore> store,
                                     std::unique_ptr<CheckpointWriter> writer)
    : ctx_(ctx),
      options_(std::move(options)),
      store_(std::move(store)),
      writer_(std::move(writer)) {}

TrainCheckpointer::~TrainCheckpointer() { writer_.reset(); }

namespace {

// The commit store and writer of `ctx`'s current world: each rank makes one
// commit store, in the same order.
absl::Status OpenWriter(DistContext& ctx, const CheckpointOptions& options,
                        std::unique_ptr<CommitStore>* store,
                        std::unique_ptr<CheckpointWriter>* writer) {
  EVENSTEP_ASSIGN_OR_RETURN(*store, ctx.NewCommitStore(), "checkpointer, rank ", ctx.rank(),
                            ": the commit store");
  EVENSTEP_ASSIGN_OR_RETURN(
      *writer, CheckpointWriter::Create(options, store->get(), ctx.rank(), ctx.world_size()));
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<TrainCheckpointer>> TrainCheckpointer::Create(
    DistContext& ctx, CheckpointOptions options) {
  if (options.dir.empty()) {
    return absl::InvalidArgumentError("checkpoint directory not set (--evenstep_ckpt_dir)");
  }
  std::unique_ptr<CommitStore> store;
  std::unique_ptr<CheckpointWriter> writer;
  EVENSTEP_RETURN_IF_ERROR(OpenWriter(ctx, options, &store, &writer));
  return std::unique_ptr<TrainCheckpointer>(
      new TrainCheckpointer(ctx, std::move(options), std::move(store), std::move(writer)));
}

absl::StatusOr<CheckpointContents> internal::CaptureContents(int64_t step,
                                                             const TrainState& state) {
  CheckpointContents ckpt;
  ckpt.step = step;
  EVENSTEP_ASSIGN_OR_RETURN(ckpt.tensors, CaptureTensors(state.model, nullptr),
                            "checkpoint of step ", step);
  ckpt.tensors.insert(ckpt.tensors.end(), state.tensors.begin(), state.tensors.end());
  const auto optimizers = OptimizersOf(state);
  for (const auto& [prefix, optimizer] : optimizers) {
    EVENSTEP_RETURN_IF_ERROR(CaptureOptimizer(*optimizer, prefix, &ckpt.tensors),
                             "checkpoint of step ", step, ", ", prefix);
  }
  if (JsonNestingDepth(state.user_json) > kMaxJsonDepth - 2) {
    return absl::InvalidArgumentError(absl::StrCat("checkpoint of step ", step,
                                                   ": user_json nests deeper than ",
                                                   kMaxJsonDepth - 2, " levels"));
  }
  nlohmann::json extras = {{"user", nlohmann::json::parse(state.user_json, nullptr, false)}};
  if (extras["user"].is_discarded()) {
    return absl::InvalidArgumentError(
        absl::StrCat("checkpoint of step ", step, ": user_json is not valid JSON"));
  }
  // null without a BalancedStep: a missing "balance" is then a dropped one
  // (CheckTrainExtras).
  extras["balance"] = state.balance != nullptr
                          ? nlohmann::json::parse(BalanceJson(state.balance->state()))
                          : nlohmann::json(nullptr);
  for (const auto& [prefix, optimizer] : optimizers) {
    // What the optimizer tensors must add up to, so that a load can tell a
    // fresh optimizer from state that went missing.
    EVENSTEP_ASSIGN_OR_RETURN(const internal::OptimizerKind* kind,
                              internal::OptimizerKindOf(*optimizer));
    std::vector<int64_t> groups;
    for (const auto& g : optimizer->param_groups()) {
      groups.push_back(static_cast<int64_t>(g.params().size()));
    }
    std::set<std::string> with_state;
    for (const auto& [name, tensor] : ckpt.tensors) {
      std::vector<std::string> parts = absl::StrSplit(name, '/');
      if (parts.size() == 4 && parts[0] == prefix) with_state.insert(parts[1] + "/" + parts[2]);
    }
    extras[prefix] = {{"type", kind->name},
                      {"groups", groups},
                      {"states", static_cast<int64_t>(with_state.size())}};
  }
  ckpt.extras_json = extras.dump();
  return ckpt;
}

absl::StatusOr<SaveTicket> TrainCheckpointer::Save(int64_t step, const TrainState& state) {
  EVENSTEP_ASSIGN_OR_RETURN(const CheckpointContents ckpt, internal::CaptureContents(step, state));
  return writer_->Save(ckpt);
}

absl::Status TrainCheckpointer::WaitAll() { return writer_->WaitAll(); }

absl::StatusOr<int> TrainCheckpointer::Regroup(const absl::Status& why) {
  EVENSTEP_ASSIGN_OR_RETURN(const int ended, writer_->Abandon(why), "checkpointer, rank ",
                            ctx_.rank(), ", after a lost rank");
  // The ended saves' outcomes are `why`, read through their tickets.
  writer_->WaitAll().IgnoreError();
  writer_.reset();
  EVENSTEP_RETURN_IF_ERROR(OpenWriter(ctx_, options_, &store_, &writer_), "after a lost rank");
  return ended;
}

}  // namespace evenstep

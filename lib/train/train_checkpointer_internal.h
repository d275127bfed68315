// What TrainCheckpointer's save and load share (not installed).
#pragma once

#include <torch/optim.h>

#include <functional>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "evenstep/balanced_step.h"
#include "evenstep/internal/optimizer_state.h"
#include "evenstep/status_macros.h"
#include "evenstep/train_checkpointer.h"

namespace evenstep::internal {

// The optimizer's state map key of a parameter: the TensorImpl pointer's
// text in libtorch 1.x (std::string keys, as c10::guts::to_string printed it),
// the pointer itself in 2.x (void* keys).
template <typename Map>
typename Map::key_type StateKeyIn(const Map&, const at::Tensor& p) {
  using Key = typename Map::key_type;
  void* impl = p.unsafeGetTensorImpl();
  if constexpr (std::is_same_v<Key, std::string>) {
    std::ostringstream out;
    out << impl;
    return out.str();
  } else {
    return static_cast<Key>(impl);
  }
}

inline absl::StatusOr<BalanceState> BalanceFromJson(const nlohmann::json& j) {
  auto bad = [](const std::string& why) {
    return absl::DataLossError(absl::StrCat("manifest extras: balance state: ", why));
  };
  if (!j.is_object()) return bad("not an object");
  auto integer = [&](const char* key, int64_t* out) {
    if (!j.contains(key) || !j[key].is_number_integer() ||
        (j[key].is_number_unsigned() && j[key].get<uint64_t>() > (uint64_t{1} << 62))) {
      return false;
    }
    *out = j[key].get<int64_t>();
    return true;
  };
  BalanceState b;
  if (!integer("epoch", &b.sampler.epoch) || !integer("step", &b.sampler.step) ||
      !integer("num_samples", &b.sampler.num_samples) || !integer("steps", &b.steps)) {
    return bad("epoch, step, num_samples and steps must be integers");
  }
  if (!j.contains("seed") || !j["seed"].is_number_unsigned()) {
    if (!j.contains("seed") || !j["seed"].is_number_integer() || j["seed"].get<int64_t>() < 0) {
      return bad("seed must be a non-negative integer");
    }
  }
  b.sampler.seed = j["seed"].get<uint64_t>();
  if (j.contains("global_batch")) {  // absent in checkpoints of earlier builds
    if (!integer("global_batch", &b.sampler.global_batch) || b.sampler.global_batch <= 0 ||
        !j.contains("batch_unit") || !j["batch_unit"].is_string() ||
        (j["batch_unit"] != "samples" && j["batch_unit"] != "tokens")) {
      return bad("global_batch must be a positive integer with batch_unit samples or tokens");
    }
    b.sampler.tokens = j["batch_unit"] == "tokens";
  }
  // The ranks' fractions of the work, as the planner saves them: finite,
  // non-negative, summing to 1 (a NaN is saved as null).
  auto fractions = [&](const char* key, std::vector<double>* out) {
    if (!j[key].is_array() || j[key].empty()) return false;
    double total = 0;
    for (const auto& v : j[key]) {
      if (!v.is_number() || !(v.get<double>() >= 0) || !std::isfinite(v.get<double>())) {
        return false;
      }
      out->push_back(v.get<double>());
      total += out->back();
    }
    return std::abs(total - 1) <= 1e-6;
  };
  if (!j.contains("shares") || !fractions("shares", &b.shares)) {
    return bad(absl::StrCat("shares ", j.contains("shares") ? j["shares"].dump() : "missing",
                            ": must be non-negative numbers that sum to 1"));
  }
  if (j.contains("stream_shares") && !fractions("stream_shares", &b.stream_shares)) {
    return bad(absl::StrCat("stream_shares ", j["stream_shares"].dump(),
                            ": must be non-negative numbers that sum to 1"));
  }
  if (j.contains("memory_caps")) {
    if (!j["memory_caps"].is_array()) return bad("memory_caps must be an array");
    for (const auto& v : j["memory_caps"]) {
      if (!v.is_number_integer() || v.get<int64_t>() < 0) {
        return bad("a memory cap is not a non-negative integer");
      }
      b.memory_caps.push_back(v.get<int64_t>());
    }
  }
  return b;
}

// The optimizers of `state`, each with the first segment of its tensors'
// names (and its key in the extras).
inline std::vector<std::pair<std::string, torch::optim::Optimizer*>> OptimizersOf(
    const TrainState& state) {
  std::vector<std::pair<std::string, torch::optim::Optimizer*>> out;
  if (state.optimizer != nullptr) out.emplace_back("optimizer", state.optimizer);
  for (const auto& [name, optimizer] : state.optimizers) {
    if (optimizer != nullptr) out.emplace_back("optimizer-" + name, optimizer);
  }
  return out;
}

// The optimizer state a checkpoint holds, checked against the live optimizer
// (types, shapes, completeness) before anything is written.
struct OptimizerPlan {
  const OptimizerKind* kind = nullptr;
  std::vector<std::pair<size_t, std::string>> lrs;  // group, tensor name
  std::map<std::pair<size_t, size_t>, std::map<std::string, std::string>> fields;  // -> tensor
};

// What step 1 of a load finds: the open checkpoint, validated against the
// live state, and where each of its tensors goes.
struct LoadPlan {
  std::unique_ptr<CheckpointReader> reader;  // a load's (not a handover's)
  // A tensor's value from its stored bytes.
  std::function<absl::StatusOr<at::Tensor>(const std::string&, const at::Tensor&)> from_bytes;
  NamedTensors expected;
  std::map<std::string, at::Tensor> targets;  // the model's and the caller's tensors, by name
  std::set<std::string> seen;                 // those the checkpoint holds
  std::vector<std::pair<std::string, torch::optim::Optimizer*>> optimizers;
  std::vector<OptimizerPlan> opt;  // per optimizer
  std::optional<BalanceState> balance;
  bool mismatch = false;  // the failure is the live state's (FailedPrecondition)
};

// Where each tensor's bytes land: a CPU model tensor directly (read and
// broadcast in place, no staging copy), anything else a byte buffer. A
// checksum failure can leave a model tensor of this rank partly written; the
// load then fails on every rank (and a fallback loads every tensor again).
struct LoadBuffers {
  std::map<std::string, at::Tensor> bytes;
  std::set<std::string> in_place;
};

// What a checkpoint of `state` at `step` holds (TrainCheckpointer::Save's
// snapshot, HandOver's): the model's, the optimizers' and the extra tensors,
// and the extras (the user's JSON, the balancing state, each optimizer's
// record). The tensors are the live ones (or fresh scalars).
absl::StatusOr<CheckpointContents> CaptureContents(int64_t step, const TrainState& state);

// A load's step 1 after the manifest was read (or a handover's header
// received): `manifest` against the live state (tensor names, shapes and
// dtypes; optimizers; the balancing state), each tensor's destination in
// `plan`, the user's JSON into `result`. `path` names the source in errors.
absl::Status PlanLoad(const Manifest& manifest, const std::string& path, const TrainState& state,
                      const LoadOptions& options, LoadPlan* plan, LoadResult* result);
LoadBuffers MakeLoadBuffers(const Manifest& manifest, LoadPlan& plan);
// Every rank's part (reads[rank]: indices into manifest.tensors, whose
// bytes that rank holds in `buffers`) reaches every rank.
absl::Status ShareParts(DistContext& ctx, const Manifest& manifest,
                        const std::vector<std::vector<int>>& reads, LoadBuffers* buffers);
// The bytes shared into the model tensors not written in place, and the
// optimizers' state (validated by PlanLoad).
absl::Status ApplyLoaded(LoadPlan& plan, LoadBuffers& buffers);

}  // namespace evenstep::internal

// TrainCheckpointer::Load: the newest committed checkpoint that every rank
// can read, agreed across ranks, loaded at any world size.
// see train_checkpointer.h.
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
#include "evenstep/train_checkpointer.h"
#include "train_checkpointer_internal.h"

namespace evenstep {

using internal::ApplyLoaded;
using internal::BalanceFromJson;
using internal::LoadBuffers;
using internal::LoadPlan;
using internal::MakeLoadBuffers;
using internal::OptimizerPlan;
using internal::OptimizersOf;
using internal::ShareParts;
using internal::StateKeyIn;

namespace {

// One small agreement among all ranks: each contributes a status and a
// value; every rank gets the same answer (the first failing rank's status,
// naming it) and every rank's value. One all-gather of a fixed-size record,
// so no rank is left waiting for a broadcast that a failed rank never sends.
struct Agreed {
  absl::Status status;
  bool mismatch = false;        // the failure is the live state's, not the checkpoint's
  std::vector<int64_t> values;  // per rank
};

constexpr int64_t kRecordBytes = 512;
constexpr int64_t kMessageBytes = kRecordBytes - 17;

absl::StatusOr<Agreed> Agree(DistContext& ctx, const absl::Status& mine, bool mismatch,
                             int64_t value) {
  at::Tensor record = at::zeros({kRecordBytes}, at::kByte);
  uint8_t* r = record.data_ptr<uint8_t>();
  r[0] = static_cast<uint8_t>(mine.code());
  r[1] = mismatch ? 1 : 0;
  std::memcpy(r + 2, &value, sizeof(value));
  const std::string message(mine.message().substr(0, kMessageBytes - 1));
  std::memcpy(r + 17, message.data(), message.size());
  std::vector<at::Tensor> all;
  if (ctx.world_size() == 1) {
    all.push_back(record);
  } else {
    EVENSTEP_RETURN_IF_ERROR(ctx.AllGather(record, &all));
  }
  Agreed out;
  for (int rank = 0; rank < static_cast<int>(all.size()); ++rank) {
    const uint8_t* v = all[rank].data_ptr<uint8_t>();
    int64_t got = 0;
    std::memcpy(&got, v + 2, sizeof(got));
    out.values.push_back(got);
    if (v[0] != 0 && out.status.ok()) {
      const char* text = reinterpret_cast<const char*>(v + 17);
      out.status = absl::Status(
          static_cast<absl::StatusCode>(std::min<int>(v[0], 16)),
          absl::StrCat("rank ", rank, ": ", std::string(text, strnlen(text, kMessageBytes))));
      out.mismatch = v[1] != 0;
    }
  }
  return out;
}

// The manifest's record of optimizer `prefix` (its type and group sizes)
// against the live optimizer: the number of parameters whose state was
// saved (-1: no record, an older checkpoint). FailedPrecondition when the
// checkpoint does not fit the optimizer.
absl::StatusOr<int64_t> CheckOptimizerRecord(const nlohmann::json& extras,
                                             const std::string& prefix,
                                             torch::optim::Optimizer& optimizer,
                                             const internal::OptimizerKind& kind) {
  if (!extras.contains(prefix)) return -1;
  const nlohmann::json& o = extras[prefix];
  if (!o.is_object() || !o.contains("type") || !o["type"].is_string() || !o.contains("groups") ||
      !o["groups"].is_array() || !o.contains("states") || !o["states"].is_number_integer()) {
    return absl::DataLossError(absl::StrCat("manifest extras: \"", prefix, "\" is malformed"));
  }
  if (o["type"].get<std::string>() != kind.name) {
    return absl::FailedPreconditionError(absl::StrCat("it holds ", o["type"].get<std::string>(),
                                                      " state for ", prefix, "; the optimizer is ",
                                                      kind.name));
  }
  std::vector<int64_t> sizes;
  for (const auto& g : optimizer.param_groups()) {
    sizes.push_back(static_cast<int64_t>(g.params().size()));
  }
  const nlohmann::json& saved = o["groups"];
  bool same = saved.size() == sizes.size();
  for (size_t g = 0; same && g < sizes.size(); ++g) {
    same = saved[g].is_number_integer() && saved[g].get<int64_t>() == sizes[g];
  }
  if (!same) {
    return absl::FailedPreconditionError(absl::StrCat("its ", prefix, " has groups of ",
                                                      saved.dump(), " parameters; this one [",
                                                      absl::StrJoin(sizes, ","), "]"));
  }
  return o["states"].get<int64_t>();
}

// One tensor of optimizer `prefix` (prefix/<group>/lr or
// prefix/<group>/<index>/<field>) checked and entered into `plan`.
absl::Status PlanOptimizerTensor(const TensorInfo& t, const std::vector<std::string>& parts,
                                 const std::string& prefix, torch::optim::Optimizer& optimizer,
                                 OptimizerPlan* plan) {
  auto corrupt = [&](const std::string& what) {
    return absl::DataLossError(absl::StrCat("optimizer tensor ", t.name, ": ", what));
  };
  const std::string shape = absl::StrCat("[", absl::StrJoin(t.shape, ","), "] ", t.dtype);
  auto& groups = optimizer.param_groups();
  size_t g = 0, i = 0;
  if (parts.size() < 3 || !absl::SimpleAtoi(parts[1], &g)) {
    return corrupt(
        absl::StrCat("not ", prefix, "/<group>/lr or ", prefix, "/<group>/<index>/<field>"));
  }
  if (g >= groups.size()) {
    return absl::FailedPreconditionError(
        absl::StrCat("tensor ", t.name, ": the optimizer has ", groups.size(), " groups"));
  }
  if (parts.size() == 3 && parts[2] == "lr") {
    if (t.dtype != "float64" || !t.shape.empty()) {
      return corrupt(absl::StrCat("a learning rate is a 0-d float64, not ", shape));
    }
    plan->lrs.push_back({g, t.name});
    return absl::OkStatus();
  }
  if (parts.size() != 4 || !absl::SimpleAtoi(parts[2], &i)) {
    return corrupt(
        absl::StrCat("not ", prefix, "/<group>/lr or ", prefix, "/<group>/<index>/<field>"));
  }
  if (i >= groups[g].params().size()) {
    return absl::FailedPreconditionError(absl::StrCat("tensor ", t.name, ": group ", g, " has ",
                                                      groups[g].params().size(), " parameters"));
  }
  const at::Tensor& param = groups[g].params()[i];
  const std::string& field = parts[3];
  const internal::OptimizerKind& kind = *plan->kind;
  if (field == "step") {
    if (!kind.has_step || t.dtype != "int64" || !t.shape.empty()) {
      return corrupt(absl::StrCat("a ", kind.name, " step count is ",
                                  kind.has_step ? "a 0-d int64" : "not saved", ", not ", shape));
    }
  } else if (std::find(kind.fields.begin(), kind.fields.end(), field) == kind.fields.end()) {
    return corrupt(absl::StrCat(kind.name, " state has no field \"", field, "\""));
  } else {
    const std::string want = StoredDtypeOf(param);
    if (t.dtype != want || t.shape != param.sizes().vec()) {
      return corrupt(absl::StrCat(shape, "; its parameter is [",
                                  absl::StrJoin(param.sizes().vec(), ","), "] ", want));
    }
  }
  plan->fields[{g, i}][field] = t.name;
  return absl::OkStatus();
}

// Optimizer `prefix`'s state in the checkpoint, checked against the live
// optimizer. FailedPrecondition when the checkpoint does not fit it;
// DataLoss when the state is malformed or incomplete.
absl::StatusOr<OptimizerPlan> PlanOptimizer(const Manifest& manifest, const nlohmann::json& extras,
                                            const std::string& prefix,
                                            torch::optim::Optimizer& optimizer, bool strict) {
  OptimizerPlan plan;
  EVENSTEP_ASSIGN_OR_RETURN(plan.kind, internal::OptimizerKindOf(optimizer));
  EVENSTEP_ASSIGN_OR_RETURN(const int64_t states,
                            CheckOptimizerRecord(extras, prefix, optimizer, *plan.kind));
  for (const TensorInfo& t : manifest.tensors) {
    const std::vector<std::string> parts = absl::StrSplit(t.name, '/');
    if (parts[0] != prefix) continue;
    EVENSTEP_RETURN_IF_ERROR(PlanOptimizerTensor(t, parts, prefix, optimizer, &plan));
  }
  for (const auto& [index, names] : plan.fields) {
    std::vector<std::string> needed = plan.kind->required;
    if (plan.kind->has_step) needed.push_back("step");
    for (const std::string& f : needed) {
      if (!names.count(f)) {
        return absl::DataLossError(absl::StrCat(prefix, " state of group ", index.first,
                                                " parameter ", index.second, " lacks ", f));
      }
    }
  }
  if (states >= 0 && static_cast<int64_t>(plan.fields.size()) != states) {
    return absl::DataLossError(absl::StrCat("the ", prefix, " state of ", states,
                                            " parameters was saved; ", plan.fields.size(),
                                            " are in the checkpoint"));
  }
  const size_t groups = optimizer.param_groups().size();
  if (plan.lrs.size() != groups && (strict || states >= 0)) {
    // A checkpoint without optimizer state would resume with a fresh one.
    return absl::DataLossError(absl::StrCat("learning rates of ", plan.lrs.size(), " of ", groups,
                                            " ", prefix, " groups in the checkpoint"));
  }
  return plan;
}

// The manifest's tensors against the model's and the caller's: shapes and
// dtypes, and (strict) none missing or unexpected.
absl::Status MatchTensors(const Manifest& manifest, const LoadOptions& options, LoadPlan* plan,
                          LoadResult* result) {
  for (const TensorInfo& t : manifest.tensors) {
    auto target = plan->targets.find(t.name);
    if (target == plan->targets.end()) {
      // Other extra tensors are the caller's to ask for (a Session's stream
      // state is registered after the resume).
      if (absl::StartsWith(t.name, "model/")) result->unexpected.push_back(t.name);
      continue;
    }
    plan->seen.insert(t.name);
    const at::Tensor& dst = target->second;
    const std::string want = StoredDtypeOf(dst);
    if (dst.sizes().vec() != t.shape || want != t.dtype) {
      return absl::FailedPreconditionError(absl::StrCat(
          "tensor ", t.name, " has shape [", absl::StrJoin(t.shape, ","), "] ", t.dtype,
          "; the model has [", absl::StrJoin(dst.sizes().vec(), ","), "] ", want));
    }
  }
  for (const auto& [name, tensor] : plan->expected) {
    if (!plan->seen.count(name)) result->missing.push_back(name);
  }
  if (options.strict && (!result->missing.empty() || !result->unexpected.empty())) {
    return absl::FailedPreconditionError(
        absl::StrCat("does not match the model: missing [", absl::StrJoin(result->missing, ", "),
                     "], unexpected [", absl::StrJoin(result->unexpected, ", "), "]"));
  }
  return absl::OkStatus();
}

// The optimizers' and the balancing state in the checkpoint against the live
// ones.
absl::Status MatchOptimizersAndBalance(const Manifest& manifest, const nlohmann::json& extras,
                                       const std::string& path, const TrainState& state,
                                       const LoadOptions& options, LoadPlan* plan) {
  std::set<std::string> live;
  for (const auto& [prefix, optimizer] : plan->optimizers) {
    live.insert(prefix);
    EVENSTEP_ASSIGN_OR_RETURN(OptimizerPlan p,
                              PlanOptimizer(manifest, extras, prefix, *optimizer, options.strict));
    plan->opt.push_back(std::move(p));
  }
  for (const TensorInfo& t : manifest.tensors) {
    const std::string first = t.name.substr(0, t.name.find('/'));
    if (options.strict && absl::StartsWith(first, "optimizer-") && !live.count(first)) {
      return absl::FailedPreconditionError(absl::StrCat(
          "it holds the state of ", first, " (tensor ", t.name, "), which this run does not have"));
    }
  }
  if (state.balance == nullptr) return absl::OkStatus();
  if (extras.contains("balance") && !extras["balance"].is_null()) {
    EVENSTEP_ASSIGN_OR_RETURN(plan->balance, BalanceFromJson(extras["balance"]));
    if (absl::Status s = state.balance->CheckRestore(*plan->balance); !s.ok()) {
      return absl::FailedPreconditionError(absl::StrCat("balancing state: ", s.message()));
    }
  } else if (options.strict) {
    return absl::DataLossError(
        absl::StrCat(path, "/manifest.json: no balancing state in the extras"));
  }
  return absl::OkStatus();
}

// Step 1 of a load, on every rank: open `path` and validate it against the
// live model, optimizers and balancing state, before anything is written.
absl::Status PrepareLoad(Env& env, const std::string& path, const TrainState& state,
                         const LoadOptions& options, LoadPlan* plan, LoadResult* result) {
  EVENSTEP_ASSIGN_OR_RETURN(plan->reader, CheckpointReader::Open(env, path));
  plan->from_bytes = [reader = plan->reader.get()](const std::string& name,
                                                   const at::Tensor& bytes) {
    return reader->FromBytes(name, bytes);
  };
  const Manifest& manifest = plan->reader->manifest();
  result->step = manifest.step;
  // The checks evenstep-ckpt and tools/evenstep_ckpt_reader.py make too.
  const bool balance = state.balance != nullptr && options.strict;
  if (const std::vector<std::string> problems = CheckTrainExtras(manifest, balance);
      !problems.empty()) {
    return absl::DataLossError(absl::StrCat(path, "/manifest.json: ", problems.front()));
  }
  return internal::PlanLoad(manifest, path, state, options, plan, result);
}

}  // namespace

namespace internal {

absl::Status PlanLoad(const Manifest& manifest, const std::string& path, const TrainState& state,
                      const LoadOptions& options, LoadPlan* plan, LoadResult* result) {
  const nlohmann::json extras = nlohmann::json::parse(manifest.extras_json, nullptr, false);
  EVENSTEP_ASSIGN_OR_RETURN(plan->expected, CaptureTensors(state.model, nullptr));
  plan->expected.insert(plan->expected.end(), state.tensors.begin(), state.tensors.end());
  plan->targets = std::map<std::string, at::Tensor>(plan->expected.begin(), plan->expected.end());
  plan->optimizers = OptimizersOf(state);
  absl::Status s = MatchTensors(manifest, options, plan, result);
  if (s.ok()) s = MatchOptimizersAndBalance(manifest, extras, path, state, options, plan);
  plan->mismatch = absl::IsFailedPrecondition(s);
  if (s.ok() && extras.contains("user")) result->user_json = extras["user"].dump();
  return s;
}

LoadBuffers MakeLoadBuffers(const Manifest& manifest, LoadPlan& plan) {
  LoadBuffers out;
  for (const TensorInfo& t : manifest.tensors) {
    const int64_t n = StoredBytes(t);
    auto target = plan.targets.find(t.name);
    if (plan.seen.count(t.name) && target->second.device().is_cpu() &&
        target->second.is_contiguous()) {
      out.bytes[t.name] = at::from_blob(target->second.data_ptr(), {n}, at::kByte);
      out.in_place.insert(t.name);
    } else {
      out.bytes[t.name] = at::empty({n}, at::kByte);
    }
  }
  return out;
}

// Step 4: every rank's part reaches every rank: large tensors one broadcast
// each, in place; small ones packed into one buffer.
absl::Status ShareParts(DistContext& ctx, const Manifest& manifest,
                        const std::vector<std::vector<int>>& reads, LoadBuffers* buffers) {
  constexpr int64_t kBroadcastAlone = 1 << 20;
  const int world = ctx.world_size();
  for (int root = 0; world > 1 && root < world; ++root) {
    auto broadcast = [&](at::Tensor& buffer) {
      return Annotate(ctx.Broadcast(buffer, root),
                      absl::StrCat("broadcast of rank ", root, "'s part"));
    };
    std::vector<at::Tensor> small;  // views of the buffers, sent together
    int64_t small_bytes = 0;
    for (int index : reads[root]) {
      at::Tensor& bytes = buffers->bytes[manifest.tensors[index].name];
      if (bytes.numel() >= kBroadcastAlone) {
        EVENSTEP_RETURN_IF_ERROR(broadcast(bytes));
      } else if (bytes.numel() > 0) {
        small.push_back(bytes);
        small_bytes += bytes.numel();
      }
    }
    if (small.empty()) continue;
    at::Tensor packed = root == ctx.rank() ? at::cat(small) : at::empty({small_bytes}, at::kByte);
    EVENSTEP_RETURN_IF_ERROR(broadcast(packed));
    if (root == ctx.rank()) continue;
    int64_t at_byte = 0;
    for (at::Tensor& bytes : small) {
      bytes.copy_(packed.narrow(0, at_byte, bytes.numel()));
      at_byte += bytes.numel();
    }
  }
  return absl::OkStatus();
}

// Step 5: model tensors that could not be read in place, optimizer state
// (all validated in step 1).
absl::Status ApplyLoaded(LoadPlan& plan, LoadBuffers& buffers) {
  try {
    for (const std::string& name : plan.seen) {
      if (buffers.in_place.count(name)) continue;
      at::Tensor& dst = plan.targets[name];
      at::Tensor cpu = at::empty(dst.sizes(), dst.options().device(at::kCPU));
      std::memcpy(cpu.data_ptr(), buffers.bytes[name].data_ptr(), buffers.bytes[name].numel());
      dst.copy_(cpu);
    }
    for (size_t k = 0; k < plan.optimizers.size(); ++k) {
      torch::optim::Optimizer& optimizer = *plan.optimizers[k].second;
      auto typed = [&](const std::string& name) {
        absl::StatusOr<at::Tensor> value = plan.from_bytes(name, buffers.bytes[name]);
        // Every name was validated against the manifest in step 1.
        if (!value.ok()) throw std::runtime_error(std::string(value.status().message()));
        return *value;
      };
      auto& groups = optimizer.param_groups();
      for (const auto& [g, name] : plan.opt[k].lrs) {
        groups[g].options().set_lr(typed(name).item<double>());
      }
      for (const auto& [index, names] : plan.opt[k].fields) {
        const at::Tensor& param = groups[index.first].params()[index.second];
        std::map<std::string, at::Tensor> values;
        for (const auto& [field, name] : names) {
          at::Tensor value = typed(name);
          if (value.dim() > 0) value = value.to(param.device());
          values[field] = value;
        }
        optimizer.state()[StateKeyIn(optimizer.state(), param)] = plan.opt[k].kind->restore(values);
      }
    }
  } catch (const std::exception& e) {
    return absl::InternalError(absl::StrCat("applying the loaded state: ", internal::ErrorText(e)));
  }
  return absl::OkStatus();
}

}  // namespace internal

absl::StatusOr<LoadResult> TrainCheckpointer::Load(const TrainState& state,
                                                   const LoadOptions& options) {
  Env& env = *(options_.env != nullptr ? options_.env : Env::Default());
  const bool fallback = options.fallback && options.path.empty();
  // The candidates, newest first, as rank 0 sees the directory; every rank
  // learns each candidate's step from rank 0 through the agreement.
  std::vector<int64_t> candidates;
  absl::Status listing_status;
  if (ctx_.rank() == 0 && options.path.empty()) {
    absl::StatusOr<CheckpointListing> listing = ListCheckpoints(env, options_.dir);
    if (!listing.ok() && !absl::IsNotFound(listing.status())) {
      listing_status = listing.status();
    } else if (listing.ok()) {
      candidates.assign(listing->committed.rbegin(), listing->committed.rend());
      const int64_t newest = candidates.empty() ? -1 : candidates.front();
      if (listing->latest && *listing->latest > newest) {
        // `latest` is written after the manifest: it names a checkpoint that
        // was committed and has lost its manifest since.
        candidates.insert(candidates.begin(), *listing->latest);
      } else if (candidates.empty() && listing->has_latest) {
        listing_status = absl::DataLossError(absl::StrCat(
            options_.dir, "/latest exists but no committed checkpoint does",
            listing->latest_problem.empty() ? "" : absl::StrCat(" (", listing->latest_problem, ")"),
            "; remove it to start from scratch"));
      }
    }
  }
  std::vector<std::string> failures;
  for (size_t attempt = 0;; ++attempt) {
    int64_t mine = -1;
    if (!options.path.empty()) {
      mine = attempt == 0 ? 0 : -1;
    } else if (attempt < candidates.size()) {
      mine = candidates[attempt];
    }
    EVENSTEP_ASSIGN_OR_RETURN(
        Agreed chosen, Agree(ctx_, attempt == 0 ? listing_status : absl::OkStatus(), false, mine));
    EVENSTEP_RETURN_IF_ERROR(chosen.status, "resume from ", options_.dir);
    const int64_t step = chosen.values[0];
    if (step < 0) {
      if (attempt == 0) {
        return absl::NotFoundError(absl::StrCat("no committed checkpoint in ", options_.dir));
      }
      return absl::DataLossError(absl::StrCat(
          "resume from ", options_.dir, ": no checkpoint loads: ", absl::StrJoin(failures, "; ")));
    }
    const std::string path =
        options.path.empty() ? CheckpointPath(options_.dir, step) : options.path;
    Attempt tried = LoadFrom(env, path, state, options);
    absl::StatusOr<LoadResult>& loaded = tried.result;
    const bool mismatch = tried.mismatch, agreed = tried.agreed;
    if (loaded.ok()) {
      loaded->skipped = failures;
      return loaded;
    }
    const std::string why(loaded.status().message());
    // Only a failure every rank agreed on may lead to the next candidate
    // (a broadcast that failed may have failed on some ranks only).
    if (!fallback || mismatch || !agreed) {
      std::string hint;
      if (!fallback && !mismatch && options.path.empty()) {
        hint = "; --evenstep_resume=newest_valid falls back to the newest checkpoint that loads";
      }
      // NotFound means "no checkpoint at all" to callers (start from
      // scratch); a missing file of a committed checkpoint is data loss.
      const absl::StatusCode code =
          absl::IsNotFound(loaded.status()) ? absl::StatusCode::kDataLoss : loaded.status().code();
      return absl::Status(code, absl::StrCat("resume from ", path, ": ", why, hint));
    }
    // Fall back: set the unusable checkpoint aside (so that it is neither
    // chosen again nor in the way of a new save of its step) and try the
    // next older one.
    std::string moved;
    if (ctx_.rank() == 0 && options.path.empty() && env.Exists(path + "/manifest.json")) {
      const std::string aside = absl::StrCat(path, ".unusable-", absl::ToUnixSeconds(absl::Now()));
      absl::Status renamed = env.Rename(path, aside);
      if (renamed.ok()) renamed = env.SyncDir(options_.dir);
      moved = renamed.ok() ? absl::StrCat(" (moved to ", aside, ")")
                           : absl::StrCat(" (could not move it aside: ", renamed.message(), ")");
    }
    // The directory's name (step-SSSSSSSSSS); the root is in the message.
    failures.push_back(absl::StrCat(path.substr(path.find_last_of('/') + 1), ": ", why, moved));
  }
}

std::vector<std::string> TrainCheckpointer::StructureProblems(const CheckpointReader& reader,
                                                              const std::string& path) const {
  std::vector<std::string> problems = reader.CheckStructure(ctx_.rank(), ctx_.world_size());
  for (const std::string& p : problems) {
    Log(LogLevel::kWarning,
        absl::StrCat("rank ", ctx_.rank(), ": resumed from ", path,
                     ", whose data checksums hold, but a shard's HDF5 structure is damaged: ", p,
                     ". The training state is right (read by offset); h5py and evenstep-ckpt "
                     "consolidate/export cannot read that shard (evenstep-ckpt verify lists it); "
                     "the next save writes whole shards"));
  }
  return problems;
}

TrainCheckpointer::Attempt TrainCheckpointer::LoadFrom(Env& env, const std::string& path,
                                                       const TrainState& state,
                                                       const LoadOptions& options) {
  LoadResult result;
  result.path = path;
  // 1. Open and validate, on every rank, against the live model, optimizer
  //    and balancing state — before anything is written; the ranks agree
  //    that they read the same manifest.
  LoadPlan plan;
  const absl::Status prepared = PrepareLoad(env, path, state, options, &plan, &result);
  const uint64_t index = plan.reader ? ManifestIndexChecksum(plan.reader->manifest()) : 0;
  absl::StatusOr<Agreed> opened =
      Agree(ctx_, prepared, plan.mismatch, static_cast<int64_t>(index & 0x7fffffffffff));
  if (!opened.ok()) return {opened.status()};
  if (!opened->status.ok()) return {opened->status, opened->mismatch, /*agreed=*/true};
  for (int r = 1; r < ctx_.world_size(); ++r) {
    if (opened->values[r] != opened->values[0]) {  // every rank sees every value
      return {absl::DataLossError(absl::StrCat("rank ", r, " read another manifest than rank 0 (",
                                               "is ", path, " on a shared file system?)")),
              false, /*agreed=*/true};
    }
  }
  const Manifest& manifest = plan.reader->manifest();
  // 2. Balanced reading: whole tensors (no slicing), assigned the way
  //    shards are planned, largest first to the least-loaded rank.
  const std::vector<std::vector<int>> reads = plan.reader->PlanReads(ctx_.world_size());
  torch::NoGradGuard no_grad;
  LoadBuffers buffers = MakeLoadBuffers(manifest, plan);
  // 3. Every rank reads its part (all at once, checksums verified), and the
  //    ranks agree that every part is good before any broadcast.
  absl::Status read;
  for (int i : reads[ctx_.rank()]) {
    const TensorInfo& t = manifest.tensors[i];
    const int64_t n = StoredBytes(t);
    read = plan.reader->ReadInto(t.name, buffers.bytes[t.name].data_ptr(), n);
    if (!read.ok()) break;
    result.bytes_read += n;
  }
  absl::StatusOr<Agreed> parts = Agree(ctx_, read, false, 0);
  if (!parts.ok()) return {parts.status()};
  if (!parts->status.ok()) return {parts->status, false, /*agreed=*/true};
  // 4. Every part reaches every rank; 5. applied, with the balancing state.
  absl::Status applied = ShareParts(ctx_, manifest, reads, &buffers);
  if (applied.ok()) applied = ApplyLoaded(plan, buffers);
  if (applied.ok() && plan.balance) {
    applied = Annotate(state.balance->Restore(*plan.balance), "restoring the balancing state");
  }
  if (!applied.ok()) return {applied};
  result.structure_problems = StructureProblems(*plan.reader, path);
  return {std::move(result)};
}

}  // namespace evenstep

// Checkpointer: model / optimizer / balancing state <-> sharded checkpoints;
// see checkpointer.h.
#include "evenstep/checkpointer.h"

#include <torch/nn/module.h>
#include <torch/optim.h>

#include <algorithm>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
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
#include "evenstep/internal/dtypes.h"
#include "evenstep/internal/error_text.h"
#include "evenstep/internal/flag_checks.h"
#include "evenstep/internal/h5_shard.h"
#include "evenstep/internal/shard_plan.h"
#include "evenstep/status_macros.h"

namespace evenstep {
namespace {

using Named = std::vector<std::pair<std::string, at::Tensor>>;
using torch::optim::OptimizerParamState;

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

at::Tensor StepTensor(int64_t step) { return at::scalar_tensor(step, at::kLong); }

// Capture: emit (field, tensor) of a state object; Restore: build one.
struct OptimizerKind {
  std::string name;
  std::function<bool(const torch::optim::Optimizer&)> is;
  std::function<void(const OptimizerParamState&, Named*, const std::string&)> capture;
  std::function<std::unique_ptr<OptimizerParamState>(const std::map<std::string, at::Tensor>&)>
      restore;
};

template <typename Opt, typename State>
OptimizerKind Kind(const std::string& name, std::vector<const char*> fields, bool has_step) {
  OptimizerKind k;
  k.name = name;
  k.is = [](const torch::optim::Optimizer& o) { return dynamic_cast<const Opt*>(&o) != nullptr; };
  k.capture = [fields, has_step](const OptimizerParamState& base, Named* out,
                                 const std::string& prefix) {
    const auto& s = static_cast<const State&>(base);
    for (const char* f : fields) {
      at::Tensor t = State::Access(const_cast<State&>(s), f, nullptr);
      if (t.defined()) out->push_back({prefix + f, t});
    }
    if (has_step) out->push_back({prefix + "step", StepTensor(State::Step(s))});
  };
  k.restore = [fields, has_step](const std::map<std::string, at::Tensor>& values) {
    auto s = std::make_unique<State>();
    for (const char* f : fields) {
      auto it = values.find(f);
      if (it != values.end()) State::Access(*s, f, &it->second);
    }
    if (has_step) {
      auto it = values.find("step");
      if (it != values.end()) State::SetStep(*s, it->second.item<int64_t>());
    }
    return std::unique_ptr<OptimizerParamState>(std::move(s));
  };
  return k;
}

// Adapters giving every state type the same static interface: Access(state,
// field, set) returns the field, after setting it when `set` is not null;
// Step and SetStep the step count.
#define EVENSTEP_FIELD(name)     \
  if (std::string(f) == #name) { \
    if (set) s.name(*set);       \
    return s.name();             \
  }

template <typename Base>
struct AdamLike : Base {
  static at::Tensor Access(Base& s, const char* f, const at::Tensor* set) {
    EVENSTEP_FIELD(exp_avg)
    EVENSTEP_FIELD(exp_avg_sq)
    EVENSTEP_FIELD(max_exp_avg_sq)
    return {};
  }
  static int64_t Step(const AdamLike& s) { return s.step(); }
  static void SetStep(AdamLike& s, int64_t v) { s.step(v); }
};

struct SgdState : torch::optim::SGDParamState {
  static at::Tensor Access(torch::optim::SGDParamState& s, const char* f, const at::Tensor* set) {
    EVENSTEP_FIELD(momentum_buffer)
    return {};
  }
  static int64_t Step(const SgdState&) { return 0; }
  static void SetStep(SgdState&, int64_t) {}
};

struct RmspropState : torch::optim::RMSpropParamState {
  static at::Tensor Access(torch::optim::RMSpropParamState& s, const char* f,
                           const at::Tensor* set) {
    EVENSTEP_FIELD(square_avg)
    EVENSTEP_FIELD(momentum_buffer)
    EVENSTEP_FIELD(grad_avg)
    return {};
  }
  static int64_t Step(const RmspropState& s) { return s.step(); }
  static void SetStep(RmspropState& s, int64_t v) { s.step(v); }
};

struct AdagradState : torch::optim::AdagradParamState {
  static at::Tensor Access(torch::optim::AdagradParamState& s, const char* f,
                           const at::Tensor* set) {
    EVENSTEP_FIELD(sum)
    return {};
  }
  static int64_t Step(const AdagradState& s) { return s.step(); }
  static void SetStep(AdagradState& s, int64_t v) { s.step(v); }
};
#undef EVENSTEP_FIELD

const std::vector<OptimizerKind>& Kinds() {
  static const std::vector<OptimizerKind> kinds = {
      Kind<torch::optim::SGD, SgdState>("SGD", {"momentum_buffer"}, false),
      Kind<torch::optim::Adam, AdamLike<torch::optim::AdamParamState>>(
          "Adam", {"exp_avg", "exp_avg_sq", "max_exp_avg_sq"}, true),
      Kind<torch::optim::AdamW, AdamLike<torch::optim::AdamWParamState>>(
          "AdamW", {"exp_avg", "exp_avg_sq", "max_exp_avg_sq"}, true),
      Kind<torch::optim::RMSprop, RmspropState>(
          "RMSprop", {"square_avg", "momentum_buffer", "grad_avg"}, true),
      Kind<torch::optim::Adagrad, AdagradState>("Adagrad", {"sum"}, true),
  };
  return kinds;
}

absl::StatusOr<const OptimizerKind*> KindOf(const torch::optim::Optimizer& optimizer) {
  for (const OptimizerKind& k : Kinds()) {
    if (k.is(optimizer)) return &k;
  }
  return absl::InvalidArgumentError(
      "checkpoint: this optimizer type is not supported (SGD, Adam, AdamW, RMSprop, Adagrad are)");
}

std::string BalanceJson(const BalanceState& b) {
  nlohmann::json j = {{"epoch", b.sampler.epoch}, {"step", b.sampler.step},
                      {"seed", b.sampler.seed},   {"num_samples", b.sampler.num_samples},
                      {"steps", b.steps},         {"shares", b.shares}};
  return j.dump();
}

absl::StatusOr<BalanceState> BalanceFromJson(const nlohmann::json& j) {
  try {
    BalanceState b;
    b.sampler.epoch = j.at("epoch").get<int64_t>();
    b.sampler.step = j.at("step").get<int64_t>();
    b.sampler.seed = j.at("seed").get<uint64_t>();
    b.sampler.num_samples = j.at("num_samples").get<int64_t>();
    b.steps = j.at("steps").get<int64_t>();
    b.shares = j.at("shares").get<std::vector<double>>();
    return b;
  } catch (const std::exception& e) {
    return absl::DataLossError(absl::StrCat("checkpoint extras: balance state: ", e.what()));
  }
}

}  // namespace

absl::StatusOr<Named> CaptureTensors(torch::nn::Module* model, torch::optim::Optimizer* optimizer) {
  Named out;
  if (model != nullptr) {
    for (const auto& p : model->named_parameters(/*recurse=*/true)) {
      out.push_back({"model/" + p.key(), p.value()});
    }
    for (const auto& b : model->named_buffers(/*recurse=*/true)) {
      out.push_back({"model/" + b.key(), b.value()});
    }
  }
  if (optimizer != nullptr) {
    EVENSTEP_ASSIGN_OR_RETURN(const OptimizerKind* kind, KindOf(*optimizer));
    auto& groups = optimizer->param_groups();
    for (size_t g = 0; g < groups.size(); ++g) {
      out.push_back({absl::StrCat("optimizer/", g, "/lr"),
                     at::scalar_tensor(groups[g].options().get_lr(), at::kDouble)});
      const auto& params = groups[g].params();
      for (size_t i = 0; i < params.size(); ++i) {
        auto it = optimizer->state().find(StateKeyIn(optimizer->state(), params[i]));
        if (it == optimizer->state().end()) continue;  // no step taken yet
        kind->capture(*it->second, &out, absl::StrCat("optimizer/", g, "/", i, "/"));
      }
    }
  }
  return out;
}

absl::StatusOr<CheckpointOptions> CheckpointOptionsFromFlags() {
  CheckpointOptions options;
  options.dir = absl::GetFlag(FLAGS_evenstep_ckpt_dir);
  options.keep = absl::GetFlag(FLAGS_evenstep_ckpt_keep);
  options.max_in_flight = absl::GetFlag(FLAGS_evenstep_ckpt_in_flight);
  const std::string busy = absl::GetFlag(FLAGS_evenstep_ckpt_when_busy);
  if (busy != "wait" && busy != "skip") {
    return absl::InvalidArgumentError(
        absl::StrCat("--evenstep_ckpt_when_busy=", busy, ": expected wait or skip"));
  }
  options.when_busy = busy == "skip" ? WhenBusy::kSkip : WhenBusy::kWait;
  const double slice_mb = absl::GetFlag(FLAGS_evenstep_ckpt_slice_mb);
  EVENSTEP_RETURN_IF_ERROR(internal::NotBelow("evenstep_ckpt_keep", options.keep, 1));
  EVENSTEP_RETURN_IF_ERROR(internal::NotBelow("evenstep_ckpt_in_flight", options.max_in_flight, 1));
  if (!(slice_mb > 0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--evenstep_ckpt_slice_mb=", slice_mb, ": must be positive"));
  }
  options.slice_bytes = std::max<int64_t>(1, static_cast<int64_t>(slice_mb * (1 << 20)));
  return options;
}

Checkpointer::Checkpointer(DistContext& ctx, CheckpointOptions options,
                           std::unique_ptr<CommitStore> store,
                           std::unique_ptr<CheckpointWriter> writer)
    : ctx_(ctx),
      options_(std::move(options)),
      store_(std::move(store)),
      writer_(std::move(writer)) {}

Checkpointer::~Checkpointer() { writer_.reset(); }

absl::StatusOr<std::unique_ptr<Checkpointer>> Checkpointer::Create(DistContext& ctx,
                                                                   CheckpointOptions options) {
  if (options.dir.empty()) {
    return absl::InvalidArgumentError("checkpoint directory not set (--evenstep_ckpt_dir)");
  }
  EVENSTEP_ASSIGN_OR_RETURN(std::unique_ptr<CommitStore> store, ctx.NewCommitStore());
  EVENSTEP_ASSIGN_OR_RETURN(
      std::unique_ptr<CheckpointWriter> writer,
      CheckpointWriter::Create(options, store.get(), ctx.rank(), ctx.world_size()));
  return std::unique_ptr<Checkpointer>(
      new Checkpointer(ctx, std::move(options), std::move(store), std::move(writer)));
}

absl::StatusOr<SaveTicket> Checkpointer::Save(int64_t step, const TrainState& state) {
  CheckpointState ckpt;
  ckpt.step = step;
  EVENSTEP_ASSIGN_OR_RETURN(ckpt.tensors, CaptureTensors(state.model, state.optimizer));
  nlohmann::json extras = {{"user", nlohmann::json::parse(state.user_json, nullptr, false)}};
  if (extras["user"].is_discarded()) {
    return absl::InvalidArgumentError("checkpoint: user_json is not valid JSON");
  }
  if (state.balance != nullptr) {
    extras["balance"] = nlohmann::json::parse(BalanceJson(state.balance->state()));
  }
  ckpt.extras_json = extras.dump();
  return writer_->Save(ckpt);
}

absl::Status Checkpointer::WaitAll() { return writer_->WaitAll(); }

absl::StatusOr<LoadResult> Checkpointer::Load(const TrainState& state, const LoadOptions& options) {
  Env& env = *(options_.env != nullptr ? options_.env : Env::Default());
  LoadResult result;
  // Every rank must agree on which checkpoint: rank 0 picks, the others
  // learn the step through a broadcast.
  std::string path = options.path;
  at::Tensor chosen = at::full({1}, -1, at::kLong);
  if (ctx_.rank() == 0) {
    if (path.empty()) {
      absl::StatusOr<std::string> latest = LatestCheckpoint(env, options_.dir);
      if (latest.ok()) path = *latest;
    }
    if (!path.empty()) {
      absl::StatusOr<std::unique_ptr<CheckpointReader>> r = CheckpointReader::Open(env, path);
      if (r.ok()) chosen[0] = (*r)->manifest().step;
    }
  }
  EVENSTEP_RETURN_IF_ERROR(ctx_.Broadcast(chosen, 0));
  const int64_t step = chosen[0].item<int64_t>();
  if (step < 0) {
    return absl::NotFoundError(absl::StrCat("no committed checkpoint in ", options_.dir));
  }
  if (options.path.empty()) path = CheckpointPath(options_.dir, step);
  EVENSTEP_ASSIGN_OR_RETURN(std::unique_ptr<CheckpointReader> reader,
                            CheckpointReader::Open(env, path));
  const Manifest& manifest = reader->manifest();
  result.step = manifest.step;
  result.path = path;
  // What the training state expects.
  EVENSTEP_ASSIGN_OR_RETURN(Named expected, CaptureTensors(state.model, nullptr));
  std::map<std::string, at::Tensor> targets(expected.begin(), expected.end());
  // Balanced reading: whole tensors (no slicing), assigned the way shards
  // are planned, largest first to the least-loaded rank.
  const int world = ctx_.world_size();
  std::vector<internal::TensorMeta> metas;
  for (const TensorInfo& t : manifest.tensors) {
    int64_t numel = 1;
    for (int64_t d : t.shape) numel *= d;
    metas.push_back({t.name, t.dtype, t.shape, numel, internal::DtypeSize(t.dtype)});
  }
  const std::vector<std::vector<internal::Piece>> plan =
      internal::PlanShards(metas, world, std::numeric_limits<int64_t>::max());
  auto bytes_of = [](const TensorInfo* t) {
    int64_t b = 0;
    for (const SliceInfo& s : t->slices) b += s.bytes;
    return b;
  };
  // Check the model's tensors against the manifest before anything is
  // written, so a mismatch leaves the model as it was.
  std::set<std::string> seen;
  for (const TensorInfo& t : manifest.tensors) {
    if (!absl::StartsWith(t.name, "model/")) continue;
    auto target = targets.find(t.name);
    if (target == targets.end()) {
      result.unexpected.push_back(t.name);
      continue;
    }
    seen.insert(t.name);
    const at::Tensor& dst = target->second;
    const std::string want = internal::DtypeName(dst.scalar_type()).value_or("unsupported");
    if (dst.sizes().vec() != t.shape || want != t.dtype) {
      return absl::FailedPreconditionError(absl::StrCat(
          "checkpoint ", path, ": tensor ", t.name, " has shape [", absl::StrJoin(t.shape, ","),
          "] ", t.dtype, "; the model has [", absl::StrJoin(dst.sizes().vec(), ","), "] ", want));
    }
  }
  for (const auto& [name, tensor] : expected) {
    if (!seen.count(name)) result.missing.push_back(name);
  }
  if (options.strict && (!result.missing.empty() || !result.unexpected.empty())) {
    return absl::FailedPreconditionError(
        absl::StrCat("checkpoint ", path, " does not match the model: missing [",
                     absl::StrJoin(result.missing, ", "), "], unexpected [",
                     absl::StrJoin(result.unexpected, ", "), "]"));
  }
  // Where each tensor's bytes land: a CPU model tensor directly (read and
  // broadcast in place, no staging copy), anything else a byte buffer.
  torch::NoGradGuard no_grad;
  std::map<std::string, at::Tensor> loaded;
  std::set<std::string> in_place;
  for (const TensorInfo& t : manifest.tensors) {
    const int64_t n = bytes_of(&t);
    auto target = targets.find(t.name);
    if (seen.count(t.name) && target->second.device().is_cpu() && target->second.is_contiguous()) {
      loaded[t.name] = at::from_blob(target->second.data_ptr(), {n}, at::kByte);
      in_place.insert(t.name);
    } else {
      loaded[t.name] = at::empty({n}, at::kByte);
    }
  }
  // Every rank reads its part (all at once); then every part reaches every
  // rank: large tensors one broadcast each, in place; small ones packed into
  // one buffer.
  for (const internal::Piece& p : plan[ctx_.rank()]) {
    const TensorInfo& t = manifest.tensors[p.tensor];
    const int64_t n = bytes_of(&t);
    EVENSTEP_RETURN_IF_ERROR(reader->ReadInto(t.name, loaded[t.name].data_ptr(), n));
    result.bytes_read += n;
  }
  constexpr int64_t kBroadcastAlone = 1 << 20;
  for (int root = 0; world > 1 && root < world; ++root) {
    auto broadcast = [&](at::Tensor& buffer) {
      absl::Status s = ctx_.Broadcast(buffer, root);
      if (s.ok()) return s;
      return absl::Status(s.code(),
                          absl::StrCat("checkpoint load of ", path, ": broadcast of rank ", root,
                                       "'s part: ", s.message()));
    };
    std::vector<at::Tensor> small;  // views of `loaded`, sent together
    int64_t small_bytes = 0;
    for (const internal::Piece& p : plan[root]) {
      at::Tensor& bytes = loaded[manifest.tensors[p.tensor].name];
      if (bytes.numel() >= kBroadcastAlone) {
        EVENSTEP_RETURN_IF_ERROR(broadcast(bytes));
      } else if (bytes.numel() > 0) {
        small.push_back(bytes);
        small_bytes += bytes.numel();
      }
    }
    if (small.empty()) continue;
    at::Tensor packed = root == ctx_.rank() ? at::cat(small) : at::empty({small_bytes}, at::kByte);
    EVENSTEP_RETURN_IF_ERROR(broadcast(packed));
    if (root == ctx_.rank()) continue;
    int64_t at_byte = 0;
    for (at::Tensor& bytes : small) {
      bytes.copy_(packed.narrow(0, at_byte, bytes.numel()));
      at_byte += bytes.numel();
    }
  }
  // Apply the model tensors that could not be read in place.
  for (const std::string& name : seen) {
    if (in_place.count(name)) continue;
    at::Tensor& dst = targets[name];
    at::Tensor cpu = at::empty(dst.sizes(), dst.options().device(at::kCPU));
    std::memcpy(cpu.data_ptr(), loaded[name].data_ptr(), loaded[name].numel());
    dst.copy_(cpu);
  }
  // Optimizer state.
  if (state.optimizer != nullptr) {
    EVENSTEP_ASSIGN_OR_RETURN(const OptimizerKind* kind, KindOf(*state.optimizer));
    auto& groups = state.optimizer->param_groups();
    std::map<std::pair<size_t, size_t>, std::map<std::string, at::Tensor>> fields;
    for (const TensorInfo& t : manifest.tensors) {
      std::vector<std::string> parts = absl::StrSplit(t.name, '/');
      if (parts.size() < 3 || parts[0] != "optimizer") continue;
      size_t g = 0, i = 0;
      if (!absl::SimpleAtoi(parts[1], &g) || g >= groups.size()) {
        return absl::FailedPreconditionError(absl::StrCat(
            "checkpoint ", path, ": ", t.name, ": the optimizer has ", groups.size(), " groups"));
      }
      auto typed = [&] {
        at::Tensor out =
            at::empty(t.shape, at::TensorOptions().dtype(*internal::DtypeFromName(t.dtype)));
        std::memcpy(out.data_ptr(), loaded[t.name].data_ptr(), loaded[t.name].numel());
        return out;
      };
      if (parts.size() == 3 && parts[2] == "lr") {
        groups[g].options().set_lr(typed().item<double>());
        continue;
      }
      if (parts.size() != 4 || !absl::SimpleAtoi(parts[2], &i) || i >= groups[g].params().size()) {
        return absl::FailedPreconditionError(absl::StrCat(
            "checkpoint ", path, ": ", t.name, " does not match the optimizer's parameters"));
      }
      at::Tensor value = typed();
      const at::Tensor& param = groups[g].params()[i];
      if (value.dim() > 0) value = value.to(param.device());
      fields[{g, i}][parts[3]] = value;
    }
    for (auto& [index, values] : fields) {
      const at::Tensor& param = groups[index.first].params()[index.second];
      state.optimizer->state()[StateKeyIn(state.optimizer->state(), param)] = kind->restore(values);
    }
  }
  // Balancing state and user extras.
  const nlohmann::json extras = nlohmann::json::parse(manifest.extras_json, nullptr, false);
  if (!extras.is_discarded() && extras.is_object()) {
    if (extras.contains("user")) result.user_json = extras["user"].dump();
    if (state.balance != nullptr && extras.contains("balance")) {
      EVENSTEP_ASSIGN_OR_RETURN(BalanceState b, BalanceFromJson(extras["balance"]));
      EVENSTEP_RETURN_IF_ERROR(state.balance->Restore(b));
    }
  }
  return result;
}

}  // namespace evenstep

// evenstep::HandOver: the running ranks' state to the ranks that joined
// (handover.h), through the load's own checks and sharing.
#include "evenstep/handover.h"

#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <cstring>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "evenstep/balanced_step.h"
#include "evenstep/dist_context.h"
#include "evenstep/status_macros.h"
#include "train_checkpointer_internal.h"

namespace evenstep {
namespace {

constexpr char kSource[] = "the running ranks' state";

// The header every rank gets from the first sender: each tensor's name,
// dtype and shape, and the extras, as a manifest (one slice per tensor, its
// bytes).
std::string HeaderOf(const CheckpointContents& contents) {
  nlohmann::json tensors = nlohmann::json::array();
  for (const auto& [name, tensor] : contents.tensors) {
    tensors.push_back({name, StoredDtypeOf(tensor), tensor.sizes().vec(),
                       static_cast<int>(tensor.scalar_type()), tensor.element_size()});
  }
  return nlohmann::json{{"step", contents.step},
                        {"tensors", tensors},
                        {"extras", nlohmann::json::parse(contents.extras_json)}}
      .dump();
}

// The manifest (and each tensor's scalar type) the header describes.
absl::StatusOr<Manifest> ManifestOf(const std::string& header, std::vector<at::ScalarType>* types) {
  const nlohmann::json j = nlohmann::json::parse(header, nullptr, false);
  if (j.is_discarded() || !j.is_object()) {
    return absl::DataLossError("the handed-over header is not a JSON object");
  }
  Manifest m;
  try {
    m.step = j["step"].get<int64_t>();
    m.extras_json = j["extras"].dump();
    for (const auto& t : j["tensors"]) {
      TensorInfo info;
      info.name = t[0].get<std::string>();
      info.dtype = t[1].get<std::string>();
      info.shape = t[2].get<std::vector<int64_t>>();
      int64_t numel = 1;
      for (int64_t d : info.shape) numel *= d;
      types->push_back(static_cast<at::ScalarType>(t[3].get<int>()));
      SliceInfo slice;
      slice.end = numel;
      slice.bytes = numel * t[4].get<int64_t>();
      info.slices.push_back(slice);
      m.tensors.push_back(std::move(info));
    }
  } catch (const std::exception& e) {
    return absl::DataLossError(absl::StrCat("the handed-over header: ", e.what()));
  }
  return m;
}

// `text` from rank `root` to every rank (its length, then its bytes).
absl::StatusOr<std::string> BroadcastText(DistContext& ctx, const std::string& text, int root) {
  at::Tensor length = at::full({1}, static_cast<int64_t>(text.size()), at::kLong);
  EVENSTEP_RETURN_IF_ERROR(ctx.Broadcast(length, root));
  at::Tensor bytes = at::empty({length.item<int64_t>()}, at::kByte);
  if (ctx.rank() == root) std::memcpy(bytes.data_ptr(), text.data(), text.size());
  EVENSTEP_RETURN_IF_ERROR(ctx.Broadcast(bytes, root));
  return std::string(static_cast<const char*>(bytes.data_ptr()),
                     static_cast<size_t>(bytes.numel()));
}

// A sender's bytes of each tensor: its own (a CPU copy where needed) for
// the parts it sends, scratch for the parts it receives from the others.
absl::Status SenderBuffers(const Manifest& m, const CheckpointContents& mine,
                           const std::vector<int>& own, internal::LoadBuffers* buffers,
                           std::vector<at::Tensor>* keep, int64_t* bytes_sent) {
  std::map<std::string, at::Tensor> by_name(mine.tensors.begin(), mine.tensors.end());
  std::vector<bool> owned(m.tensors.size(), false);
  for (int i : own) owned[i] = true;
  for (size_t i = 0; i < m.tensors.size(); ++i) {
    const TensorInfo& t = m.tensors[i];
    const int64_t n = StoredBytes(t);
    if (!owned[i]) {
      buffers->bytes[t.name] = at::empty({n}, at::kByte);
      continue;
    }
    auto it = by_name.find(t.name);
    if (it == by_name.end() || it->second.sizes().vec() != t.shape ||
        StoredDtypeOf(it->second) != t.dtype) {
      return absl::FailedPreconditionError(
          absl::StrCat("tensor ", t.name, " is not on this rank as on the first sender"));
    }
    at::Tensor cpu = it->second.detach().to(at::kCPU).contiguous();
    keep->push_back(cpu);
    buffers->bytes[t.name] = at::from_blob(cpu.data_ptr(), {n}, at::kByte);
    *bytes_sent += n;
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<HandOverResult> HandOver(DistContext& ctx, const TrainState& state) {
  const absl::Time begin = absl::Now();
  const std::string where = absl::StrCat("HandOver, rank ", ctx.rank());
  if (state.balance == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat(where,
                     ": TrainState::balance is required (the BalancedStep that admitted, or the "
                     "joiner's): it knows which ranks lack the state"));
  }
  BalancedStep& balance = *state.balance;
  HandOverResult out;
  const bool lacks = balance.LacksState();
  std::vector<at::Tensor> flags;
  EVENSTEP_RETURN_IF_ERROR(ctx.AllGather(at::full({1}, lacks ? 1.0 : 0.0, at::kDouble), &flags),
                           where, ": who lacks the state");
  for (int r = 0; r < static_cast<int>(flags.size()); ++r) {
    (flags[r].item<double>() > 0 ? out.receivers : out.senders).push_back(r);
  }
  out.user_json = state.user_json;
  if (out.receivers.empty()) {  // the joiners were lost before it: nothing to send
    EVENSTEP_RETURN_IF_ERROR(balance.HandedOver(nullptr));
    return out;
  }
  if (out.senders.empty()) {
    return absl::FailedPreconditionError(
        absl::StrCat(where, ": every rank lacks the state (all joined): nothing to hand over"));
  }
  torch::NoGradGuard no_grad;
  // 1. What there is, from the first sender; checked on the receivers as a
  //    resume checks a checkpoint, agreed before any tensor moves.
  CheckpointContents mine;
  std::string header;
  if (!lacks) {
    EVENSTEP_ASSIGN_OR_RETURN(mine, internal::CaptureContents(balance.state().steps, state), where);
    if (ctx.rank() == out.senders[0]) header = HeaderOf(mine);
  }
  EVENSTEP_ASSIGN_OR_RETURN(header, BroadcastText(ctx, header, out.senders[0]), where,
                            ": the state's header");
  std::vector<at::ScalarType> types;
  EVENSTEP_ASSIGN_OR_RETURN(const Manifest m, ManifestOf(header, &types), where);
  out.step = m.step;
  internal::LoadPlan plan;
  LoadResult result;
  absl::Status ready;
  if (lacks) {
    ready = internal::PlanLoad(m, kSource, state, LoadOptions(), &plan, &result);
    std::map<std::string, size_t> index;
    for (size_t i = 0; i < m.tensors.size(); ++i) index[m.tensors[i].name] = i;
    plan.from_bytes = [&m, &types, index = std::move(index)](
                          const std::string& name,
                          const at::Tensor& bytes) -> absl::StatusOr<at::Tensor> {
      const auto it = index.find(name);
      if (it == index.end()) return absl::NotFoundError(absl::StrCat("no tensor ", name));
      const TensorInfo& t = m.tensors[it->second];
      at::Tensor value = at::empty(t.shape, at::TensorOptions().dtype(types[it->second]));
      std::memcpy(value.data_ptr(), bytes.data_ptr(), StoredBytes(t));
      return value;
    };
  }
  // 2. Who sends what: whole tensors dealt to the senders by bytes.
  const std::vector<std::vector<int>> parts =
      PlanWholeReads(m.tensors, static_cast<int>(out.senders.size()));
  std::vector<std::vector<int>> reads(ctx.world_size());
  for (size_t i = 0; i < out.senders.size(); ++i) reads[out.senders[i]] = parts[i];
  internal::LoadBuffers buffers;
  std::vector<at::Tensor> keep;
  if (lacks) {
    if (ready.ok()) buffers = internal::MakeLoadBuffers(m, plan);
  } else {
    ready = SenderBuffers(m, mine, reads[ctx.rank()], &buffers, &keep, &out.bytes_sent);
  }
  EVENSTEP_RETURN_IF_ERROR(ctx.Agree(
      absl::StrCat("handing the state over to rank(s) ", absl::StrJoin(out.receivers, ", ")),
      Annotate(ready, where)));
  // 3. Every sender's part to every rank, then applied where it was lacking.
  EVENSTEP_RETURN_IF_ERROR(internal::ShareParts(ctx, m, reads, &buffers), where);
  absl::Status applied;
  if (lacks) {
    applied = internal::ApplyLoaded(plan, buffers);
    if (applied.ok() && !plan.balance) {
      applied = absl::DataLossError("the handed-over state holds no balancing state");
    }
    if (applied.ok()) applied = balance.HandedOver(&*plan.balance);
    out.user_json = result.user_json;
    out.received = true;
  } else {
    applied = balance.HandedOver(nullptr);
  }
  EVENSTEP_RETURN_IF_ERROR(ctx.Agree("applying the handed-over state", applied), where);
  for (const TensorInfo& t : m.tensors) out.bytes += StoredBytes(t);
  out.seconds = absl::ToDoubleSeconds(absl::Now() - begin);
  return out;
}

}  // namespace evenstep

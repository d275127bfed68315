// Session: stream mode's state and loop (AddStreamState, OwnRows,
// Positions, KeptRows' rows), gathered from their ranks at each checkpoint.
#include <ATen/ATen.h>

#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "evenstep/session.h"
#include "evenstep/status_macros.h"
#include "evenstep/train_checkpointer.h"

namespace evenstep {

namespace {

// OwnRows, Positions or KeptRows outside stream mode.
absl::Status NotInStreamMode(const std::string& where) {
  return absl::FailedPreconditionError(absl::StrCat(
      where, ": not in stream mode (Session::Create with evenstep::StreamsOf(ids, stride))"));
}

}  // namespace

StreamLayout StreamsOf(const at::Tensor& ids, int64_t stride) {
  if (ids.dim() != 2 || stride <= 0) return {};
  return {ids.size(0), ids.size(1) > 1 ? (ids.size(1) - 1) / stride : 0};
}

absl::Status Session::AddStreamState(const std::string& name, at::Tensor* state,
                                     int64_t stream_dim) {
  const std::string where =
      absl::StrCat("Session::AddStreamState('", name, "'), rank ", ctx_.rank());
  const int64_t streams = step_->sampler().options().streams;
  if (streams <= 0) {
    return absl::FailedPreconditionError(
        absl::StrCat(where, ": not in stream mode (--evenstep_streams=0)"));
  }
  if (state == nullptr || !state->defined() || stream_dim < 0 || stream_dim >= state->dim() ||
      state->size(stream_dim) != streams) {
    return absl::InvalidArgumentError(absl::StrCat(
        where, ": expected a tensor whose dimension ", stream_dim, " has the ", streams,
        " streams; got ",
        state != nullptr && state->defined() ? c10::str(state->sizes()) : std::string("none")));
  }
  for (const StreamState& s : stream_states_) {
    if (s.name == name)
      return absl::InvalidArgumentError(absl::StrCat(where, ": registered twice"));
  }
  stream_states_.push_back({name, state, stream_dim});
  if (resumed_path_.empty()) return absl::OkStatus();
  absl::Status loaded = LoadResumedTensor("stream/" + name, state);
  if (absl::IsNotFound(loaded)) {
    return absl::FailedPreconditionError(
        absl::StrCat(where, ": the resumed checkpoint ", resumed_path_,
                     " holds no stream state of that name (the run that saved it did not "
                     "register it)"));
  }
  EVENSTEP_RETURN_IF_ERROR(loaded, where, ": loading it from ", resumed_path_);
  return absl::OkStatus();
}

at::Tensor Session::OwnRows(const at::Tensor& t, int64_t dim) {
  const int64_t streams = step_->sampler().options().streams;
  const std::string where = absl::StrCat("Session::OwnRows, rank ", ctx_.rank());
  if (streams <= 0) {
    KeepError(NotInStreamMode(where));
    return t;
  }
  if (dim < 0 || dim >= t.dim() || t.size(dim) != streams) {
    KeepError(absl::InvalidArgumentError(absl::StrCat(where, ": expected a tensor whose dimension ",
                                                      dim, " has the ", streams, " streams; got ",
                                                      c10::str(t.sizes()))));
    return t;
  }
  if (last_step_ > 0 && first_step_ <= last_step_) {
    KeepError(absl::FailedPreconditionError(
        absl::StrCat(where, ": called after step ", last_step_,
                     "; call it before the first step (it pins each rank's streams)")));
  }
  const auto [first, last] = step_->PinStreams();
  return t.narrow(dim, first, last - first);
}

absl::Status Session::CheckPositions(int64_t begin, int64_t end, int64_t stride) {
  const int64_t streams = step_->sampler().options().streams;
  const std::string where =
      absl::StrCat("Session::Positions(", begin, ", ", end, ", ", stride, "), rank ", ctx_.rank());
  if (streams <= 0) {
    return NotInStreamMode(where);
  }
  const int64_t positions = step_->sampler().num_samples() / streams;
  const int64_t visits = stride > 0 && end > begin ? (end - begin + stride - 1) / stride : 0;
  if (visits != positions) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": visits ", visits, " positions, but each of the ", streams,
                     " streams has ", positions, " (the Session's StreamsOf layout)"));
  }
  return step_->SetWholeShare(
      "a loop over Session::Positions runs each rank's rows of a step as one micro-batch (its "
      "body runs once per step, as the plain loop's does)");
}

void Session::BindRows(const std::string& name, at::Tensor* rows, const at::Tensor& initial,
                       int64_t dim) {
  const std::string where = absl::StrCat("evenstep::KeptRows('", name, "'), rank ", ctx_.rank());
  const int64_t streams = step_->sampler().options().streams;
  auto bind = [&]() -> absl::Status {
    if (streams <= 0) return NotInStreamMode(where);
    if (dim < 0) {
      std::vector<int64_t> candidates;
      for (int64_t d = 0; d < initial.dim(); ++d) {
        if (initial.size(d) == streams) candidates.push_back(d);
      }
      if (candidates.size() != 1) {
        return absl::InvalidArgumentError(absl::StrCat(
            where, ": ", candidates.empty() ? "no" : "more than one", " dimension of ",
            c10::str(initial.sizes()), " has the ", streams,
            " streams' size; give the streams' dimension: KeptRows(session, name, initial, dim)"));
      }
      dim = candidates[0];
    } else if (dim >= initial.dim() || initial.size(dim) != streams) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": dimension ", dim, " of ",
                                                     c10::str(initial.sizes()), " is not the ",
                                                     streams, " streams'"));
    }
    StreamState* entry = nullptr;
    for (StreamState& s : stream_states_) {
      if (s.name == name) entry = &s;
    }
    if (entry != nullptr && (!entry->own_rows || entry->tensor != nullptr)) {
      return absl::FailedPreconditionError(
          absl::StrCat(where, ": declared while another stream state of that name lives"));
    }
    at::Tensor whole = initial;
    if (entry == nullptr && !resumed_path_.empty()) {
      // The first declaration in a resumed run: the checkpoint's rows,
      // unless they had ended (out of scope) when it was taken.
      at::Tensor saved = at::empty_like(initial);
      absl::Status loaded = LoadResumedTensor("stream/" + name, &saved);
      if (loaded.ok()) {
        whole = saved;
      } else if (!absl::IsNotFound(loaded)) {
        return Annotate(loaded, absl::StrCat(where, ": loading it from ", resumed_path_));
      }
    }
    if (entry == nullptr) {
      stream_states_.push_back({name, rows, dim, /*own_rows=*/true});
    } else {
      entry->tensor = rows;
      entry->dim = dim;
    }
    const auto [first, last] = step_->PinStreams();
    *rows = whole.narrow(dim, first, last - first).clone();
    return absl::OkStatus();
  };
  if (absl::Status bound = bind(); !bound.ok()) {
    KeepError(bound);
    *rows = initial;
  }
}

void Session::UnbindRows(const std::string& name) {
  for (StreamState& s : stream_states_) {
    if (s.name == name && s.own_rows) s.tensor = nullptr;
  }
}

absl::Status Session::GatherStreamStates(TrainState* state) {
  // Each rank holds its own streams' rows: one all-reduce of each state with
  // the others' rows zeroed gives every rank the whole tensor.
  const auto [first, last] = step_->owned_streams();
  const int64_t streams = step_->sampler().options().streams;
  for (const StreamState& s : stream_states_) {
    if (s.tensor == nullptr) continue;  // a KeptRows out of scope: ended
    // This rank's rows: a KeptRows holds only them, a registered state all.
    const at::Tensor mine = s.own_rows ? *s.tensor : s.tensor->narrow(s.dim, first, last - first);
    std::vector<int64_t> sizes = mine.sizes().vec();
    sizes[s.dim] = streams;
    at::Tensor whole = at::zeros(sizes, mine.options());
    if (last > first) whole.narrow(s.dim, first, last - first).copy_(mine);
    EVENSTEP_RETURN_IF_ERROR(ctx_.AllReduce(whole), "rank ", ctx_.rank(),
                             ": gathering the stream state '", s.name, "' for step ", last_step_);
    state->tensors.push_back({"stream/" + s.name, whole});
  }
  return absl::OkStatus();
}

}  // namespace evenstep

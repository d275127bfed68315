// BalancedStep: out-of-memory recovery (a micro-batch split and replayed
// inside its step, after every rank agreed to retry), the predicted memory
// cap, and a step abandoned on every rank (balanced_step.h).
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
bool BalancedStep::SyncedDespiteFailure() const {
  const GradSync& sync = *parts_[run_.part].sync;
  return sync.syncs_completed() > oom_.syncs_before_micro && sync.status().ok();
}

bool BalancedStep::Recovers() const {
  return config_.oom == BalanceConfig::OomPolicy::kSplit && recompute_ != nullptr;
}

bool BalancedStep::Bystander(const std::exception& e) const {
  const GradSync& sync = *parts_[run_.part].sync;
  const absl::Status status = sync.status();
  return Recovers() && status.code() == absl::StatusCode::kAborted && sync.fatal_status().ok() &&
         status.ToString() == e.what();
}

absl::StatusOr<bool> BalancedStep::VoteToRetry(bool oom, bool other) {
  oom_.voted_at = parts_[run_.part].sync->syncs_completed();
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
    caps_->NoteFailed(run_.micro[slot].padded_tokens());
    return Abandon(slot, absl::StrCat(why, config_.oom == BalanceConfig::OomPolicy::kFail
                                               ? " (--evenstep_oom=fail)"
                                               : " (not retried: the loop calls Backward itself)"));
  }
  const size_t n = run_.micro.size();
  // With the allocator's cache released the micro-batch may fit as it is.
  const size_t split = RetryAfterReleasingCache(slot) ? n : slot;
  if (split < n) caps_->NoteFailed(run_.micro[slot].padded_tokens());
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
      oom_.released_bytes > 0
          ? absl::StrFormat(" (after %.1f MiB the allocator held cached were released)",
                            static_cast<double>(oom_.released_bytes) / (1 << 20))
          : std::string(),
      ": ", error);
}

bool BalancedStep::RetryAfterReleasingCache(size_t slot) {
  // Every failed attempt may leave blocks cached: released before every retry.
  const int64_t released =
      config_.release_cache ? config_.release_cache() : memory_probe_.ReleaseCache();
  if (released <= 0) return false;
  oom_.released_bytes += released;
  // Retried as it was once per size until it fits (a success forgets it),
  // and at most a few times per micro-batch of the part: the recovery ends.
  const int pieces = slot < oom_.slot_pieces.size() ? oom_.slot_pieces[slot] : 1;
  const bool unsplit = oom_.unsplit_retries < 2 * static_cast<int>(run_.micro.size()) + 2 &&
                       oom_.released_for.insert({slot, pieces}).second;
  if (unsplit) ++oom_.unsplit_retries;
  Log(LogLevel::kWarning,
      absl::StrFormat("rank %d, step %d: out of memory in micro-batch %d of %d: released %.1f MiB "
                      "the allocator held cached%s",
                      ctx_.rank(), steps_ + 1, slot + 1, run_.micro.size(),
                      static_cast<double>(released) / (1 << 20),
                      !unsplit     ? std::string()
                      : pieces > 1 ? absl::StrCat("; retrying it in ", pieces, " pieces")
                                   : std::string("; retrying it whole")));
  return unsplit;
}

absl::Status BalancedStep::Replay(size_t from, size_t until, size_t failed) {
  absl::Cleanup note = [this] { NoteGradients(); };
  Part& part = parts_[run_.part];
  const size_t n = run_.micro.size();
  oom_.slot_pieces.resize(n, 1);
  std::vector<size_t> split;  // the micro-batches split in this recovery
  auto split_more = [&](size_t j) {
    oom_.slot_pieces[j] *= 2;
    if (std::find(split.begin(), split.end(), j) == split.end()) split.push_back(j);
  };
  if (failed < n) split_more(failed);
  for (;;) {
    run_.loss_on_device[run_.part] = sums_->Rewind(/*to_part_start=*/from == 0);
    if (from == 0) {
      part.spec.optimizer->zero_grad();
      part.sync->ForgetUse();
    }
    bool again = false;
    int64_t largest = 0;  // padded tokens of the largest split piece that fitted
    for (size_t j = from; j <= until && !again; ++j) {
      Reseed(j);
      const std::vector<MicroBatch> run = oom_.slot_pieces[j] > 1
                                              ? SplitMicroBatch(run_.micro[j], oom_.slot_pieces[j])
                                              : std::vector<MicroBatch>{run_.micro[j]};
      for (size_t q = 0; q < run.size() && !again; ++q) {
        const bool sync_now = j + 1 == n && q + 1 == run.size();
        // The piece's peak from here (not the failed attempt's).
        if (caps_->predicting()) memory_probe_.Lap();
        try {
          MicroStep(recompute_(run[q]), run[q], sync_now);
          oom_.released_for.erase({j, oom_.slot_pieces[j]});  // it fits now
          if (oom_.slot_pieces[j] > 1) {
            largest = std::max(largest, run[q].padded_tokens());
          }
        } catch (const c10::OutOfMemoryError& e) {
          const bool started = oom_.backward_started;
          oom_.backward_started = false;
          if (sync_now && started && SyncedDespiteFailure()) continue;  // the gradient is whole
          const bool unsplit = RetryAfterReleasingCache(j);
          if (!unsplit) caps_->NoteFailed(run[q].padded_tokens());
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
          oom_.backward_started = false;
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
      caps_->Learn(largest);
      for (size_t j : split) {
        const MicroBatch& mb = run_.micro[j];
        ++report_.oom_splits;
        Log(LogLevel::kWarning,
            absl::StrFormat(
                "rank %d, step %d: out of memory in micro-batch %d of %d (%d "
                "samples, %d padded tokens): split in %d and retried; this rank's "
                "micro-batches are now capped at %d padded tokens",
                ctx_.rank(), steps_ + 1, j + 1, n, mb.samples.size(), mb.padded_tokens(),
                std::min<size_t>(oom_.slot_pieces[j], mb.samples.size()), caps_->cap()));
      }
      RepackPlanned();
    }
    run_.next_micro = until + 1;
    clock_->End();
    run_.data_marked = false;
    if (until + 1 == n) {
      const SyncStats stats = part.sync->last_stats();
      report_.arrived = stats.arrived;
      report_.synced = stats.done;
    }
    Reseed(run_.next_micro);
    return absl::OkStatus();
  }
}

void BalancedStep::PredictMemoryCap() {
  const int64_t before = caps_->cap();
  const std::optional<internal::MemoryCaps::Prediction> p = caps_->Predict();
  if (!p) return;
  constexpr double kMiB = 1 << 20;
  Log(LogLevel::kWarning,
      absl::StrFormat("rank %d, step %d: micro-batches capped at %d padded tokens, "
                      "predicted from this rank's peak memory%s (%.1f MiB + %.3f MiB per padded "
                      "token, within %.0f %% of a %.1f MiB limit)",
                      ctx_.rank(), steps_, p->cap,
                      parts_.size() > 1 ? absl::StrCat(" in part '", parts_[p->part].spec.name, "'")
                                        : std::string(),
                      p->line.fixed_bytes / kMiB, p->line.per_token_bytes / kMiB,
                      config_.memory_headroom * 100,
                      caps_->budget() / config_.memory_headroom / kMiB));
  if (before <= 0 || caps_->cap() < before) RepackPlanned();
}

absl::Status BalancedStep::Abandon(size_t micro_batch, const std::string& what) {
  run_.in_step = false;
  GradSync& sync = *parts_[run_.part].sync;
  sync.set_sync_enabled(false);
  const std::string where = absl::StrCat("BalancedStep: ", Where(), ", micro-batch ",
                                         micro_batch + 1, " of ", run_.micro.size());
  absl::Status status;
  if (sync.syncs_completed() == run_.syncs_at_begin) {
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
  if (Recovers() && sync.fatal_status().ok() && sync.syncs_completed() != run_.syncs_at_begin &&
      oom_.voted_at != sync.syncs_completed()) {
    VoteToRetry(false, true).IgnoreError();  // the status above says what failed
  }
  // The abandoned step's gradients must never reach an optimizer step.
  try {
    parts_[run_.part].spec.optimizer->zero_grad();
  } catch (const std::exception&) {
  }
  if (!sync.fatal_status().ok()) abandoned_ = status;
  return status;
}

}  // namespace evenstep

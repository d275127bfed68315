// CheckpointWriter: snapshot on the training thread, everything else on the
// I/O fibers; the commit protocol is summed up in checkpoint_writer.h.
#include "evenstep/checkpoint_writer.h"

#include <ATen/ATen.h>
#include <c10/core/Event.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "evenstep/checkpoint_manifest.h"
#include "evenstep/internal/device_compat.h"
#include "evenstep/internal/dtypes.h"
#include "evenstep/internal/error_text.h"
#include "evenstep/internal/h5_shard.h"
#include "evenstep/internal/names.h"
#include "evenstep/internal/shard_plan.h"
#include "evenstep/io_runtime.h"
#include "evenstep/status_macros.h"

namespace evenstep {
namespace {

using internal::Piece;
using internal::ShardDataset;
using internal::TensorMeta;

using internal::ShardFileName;
using internal::StepDirName;

// A status through the commit store: "<code>\n<message>".
// The store keys of save number `seq` (its shards' reports, arrivals,
// outcome), under this prefix.
std::string CommitKey(int64_t seq) { return absl::StrCat("evenstep/ckpt/", seq, "/"); }

std::string EncodeStatus(const absl::Status& s) {
  return absl::StrCat(static_cast<int>(s.code()), "\n", s.message());
}

absl::Status DecodeStatus(const std::string& text) {
  const size_t nl = text.find('\n');
  int code = 0;
  if (nl == std::string::npos || !absl::SimpleAtoi(text.substr(0, nl), &code) || code < 0 ||
      code > 16) {
    return absl::InternalError(
        absl::StrCat("checkpoint outcome unreadable: ", text.substr(0, 200)));
  }
  return absl::Status(static_cast<absl::StatusCode>(code), text.substr(nl + 1));
}

// One reusable staging buffer: the shard's HDF5 image for one state layout.
// When some of this rank's tensors live on a device, the image is held in
// page-locked host memory instead, so their bytes arrive by asynchronous
// copies on a side stream (see Save).
struct Staging {
  std::string signature;
  std::string image;  // pageable image (every tensor on the CPU)
  at::Tensor pinned;  // page-locked image (some tensor on a device)
  std::vector<ShardDataset> datasets;
  std::vector<Piece> pieces;
  bool busy = false;
  // The device copies of the last snapshot: done when `copied` is. Their
  // sources are kept until then: a temporary contiguous copy must not go
  // back to the device allocator while the side stream still reads it.
  std::unique_ptr<c10::Event> copied;
  std::vector<at::Tensor> sources;

  char* data() { return pinned.defined() ? static_cast<char*>(pinned.data_ptr()) : image.data(); }
  size_t size() const {
    return pinned.defined() ? static_cast<size_t>(pinned.numel()) : image.size();
  }
  // Blocks until the snapshot's device copies have landed.
  void WaitForCopies() {
    if (!copied) return;
    internal::device_compat::Synchronize(*copied);
    copied.reset();
    sources.clear();
  }
};

}  // namespace

struct CheckpointWriter::Impl {
  CheckpointOptions options;
  CommitStore* store;
  int rank, world;
  Env* env;
  std::unique_ptr<IoRuntime> runtime;
  std::mutex mu;  // guards staging[].busy
  std::condition_variable freed;
  std::vector<Staging> staging;
  struct InFlight {
    int64_t seq;  // the commit key
    std::shared_future<absl::Status> done;
  };
  std::deque<InFlight> in_flight;
  int64_t saves = 0;         // sequence number of Save calls: the commit key
  absl::Status first_error;  // of the saves that left in_flight since the last WaitAll

  // Marks a staging buffer free again and wakes a Save waiting for one.
  void Release(Staging& stage) {
    std::lock_guard<std::mutex> lock(mu);
    stage.busy = false;
    freed.notify_all();
  }
  // Writes this rank's shard; on success `report` is its entry for the
  // manifest (file, bytes, datasets with checksums).
  absl::Status WriteShard(Staging& stage, int64_t step, std::string* report);
  // WriteShard, then the commit protocol's report and outcome (see
  // checkpoint_writer.h); the save's outcome, the same on every rank.
  absl::Status WriteAndCommit(Staging& stage, int64_t seq, int64_t step,
                              const std::vector<TensorMeta>& metas, const std::string& extras);
  absl::Status Commit(int64_t seq, int64_t step, const std::vector<TensorMeta>& metas,
                      const std::string& extras);
  absl::Status Retain(int64_t committed_step);
};

CheckpointWriter::CheckpointWriter(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

CheckpointWriter::~CheckpointWriter() {
  WaitAll().IgnoreError();
  impl_->runtime.reset();
}

absl::StatusOr<std::unique_ptr<CheckpointWriter>> CheckpointWriter::Create(
    CheckpointOptions options, CommitStore* store, int rank, int world_size) {
  if (options.dir.empty()) return absl::InvalidArgumentError("checkpoint directory is empty");
  if (store == nullptr) return absl::InvalidArgumentError("checkpoint writer needs a CommitStore");
  if (rank < 0 || rank >= world_size) {
    return absl::InvalidArgumentError(absl::StrCat("rank ", rank, " of ", world_size));
  }
  if (options.max_in_flight < 1 || options.keep < 1 || options.slice_bytes < 1) {
    return absl::InvalidArgumentError("max_in_flight, keep and slice_bytes must be >= 1");
  }
  auto impl = std::make_unique<Impl>();
  impl->env = options.env != nullptr ? options.env : Env::Default();
  impl->options = std::move(options);
  impl->store = store;
  impl->rank = rank;
  impl->world = world_size;
  impl->runtime = std::make_unique<IoRuntime>(impl->options.io_threads);
  impl->staging.resize(impl->options.max_in_flight);
  EVENSTEP_RETURN_IF_ERROR(CreateDirsDurably(*impl->env, impl->options.dir),
                           "checkpoint writer, rank ", rank);
  // A read-only directory (mount, permissions) is found now, not at the
  // first save after hours of training. On the real file system only: a
  // test's Env has no such directory.
  if (impl->env == Env::Default() && access(impl->options.dir.c_str(), W_OK | X_OK) != 0) {
    return absl::FailedPreconditionError(absl::StrCat("checkpoint writer, rank ", rank, ": ",
                                                      impl->options.dir, " cannot be written to (",
                                                      strerror(errno), ")"));
  }
  return std::unique_ptr<CheckpointWriter>(new CheckpointWriter(std::move(impl)));
}

namespace {

// The state's tensors described (name, dtype, shape), the same on every
// rank, and their signature (a staging buffer planned for it is reused).
struct Described {
  std::vector<TensorMeta> metas;
  std::string signature;
};

absl::StatusOr<Described> Describe(const CheckpointContents& state) {
  Described out;
  for (const auto& [name, tensor] : state.tensors) {
    if (absl::Status s = internal::ValidateTensorName(name); !s.ok()) return s;
    std::optional<std::string> dtype = internal::DtypeName(tensor.scalar_type());
    if (!dtype) {
      return absl::InvalidArgumentError(absl::StrCat("tensor ", name, ": dtype ",
                                                     c10::toString(tensor.scalar_type()),
                                                     " cannot be checkpointed"));
    }
    TensorMeta meta{name, *dtype, tensor.sizes().vec(), tensor.numel(),
                    static_cast<int64_t>(tensor.element_size())};
    absl::StrAppend(&out.signature, name, ":", meta.dtype, ":", absl::StrJoin(meta.shape, "x"),
                    ";");
    out.metas.push_back(std::move(meta));
  }
  return out;
}

// `stage` planned for `described`: this rank's pieces, their datasets and
// the shard's image (HDF5 structure, data to be filled in).
absl::Status PlanStage(const Described& described, int world, int rank, int64_t slice_bytes,
                       Staging* stage) {
  const std::vector<TensorMeta>& metas = described.metas;
  const auto plan = internal::PlanShards(metas, world, slice_bytes);
  stage->pieces = plan[rank];
  stage->datasets.clear();
  for (const Piece& p : stage->pieces) {
    const TensorMeta& t = metas[p.tensor];
    ShardDataset d;
    d.path = internal::DatasetPath(t, p);
    d.dtype = t.dtype;
    d.shape = p.whole ? t.shape : std::vector<int64_t>{p.end - p.begin};
    d.tensor = t.name;
    d.begin = p.begin;
    d.end = p.end;
    stage->datasets.push_back(std::move(d));
  }
  absl::StatusOr<std::string> image = internal::BuildShardImage(&stage->datasets);
  if (!image.ok()) {
    stage->signature.clear();
    return image.status();
  }
  stage->image = *std::move(image);
  stage->pinned = at::Tensor();
  stage->signature = described.signature;
  return absl::OkStatus();
}

// The snapshot: the only part the training thread waits for. CPU tensors
// are copied into the image. Device tensors are copied by the device into
// the page-locked image on a side stream that first waits for the current
// stream (so it sees the finished step), and the current stream then waits
// for those copies before any later kernel can overwrite a parameter; the
// host only queues the copies, and the writer waits for them. Throws what
// the copies throw.
void Snapshot(const CheckpointContents& state, Staging& stage) {
  // The device this rank's share lives on, if any (one per process).
  std::optional<c10::Device> device;
  for (const Piece& p : stage.pieces) {
    const c10::Device d = state.tensors[p.tensor].second.device();
    if (!d.is_cpu()) device = d;
  }
  stage.WaitForCopies();  // a failed write may have left them unread
  if (device && !stage.pinned.defined()) {
    stage.pinned = at::empty({static_cast<int64_t>(stage.image.size())},
                             at::TensorOptions().dtype(at::kByte).pinned_memory(true));
    std::memcpy(stage.pinned.data_ptr(), stage.image.data(), stage.image.size());
    stage.image = std::string();
  }
  // The sources first: making a non-contiguous tensor contiguous queues a
  // copy on the current stream, which the side stream must wait for too.
  // One contiguous flat view per tensor, however many pieces it is cut into.
  std::vector<at::Tensor> flat(state.tensors.size());
  std::vector<at::Tensor> sources(stage.pieces.size());
  for (size_t i = 0; i < stage.pieces.size(); ++i) {
    const Piece& p = stage.pieces[i];
    if (stage.datasets[i].bytes == 0) continue;
    at::Tensor& whole = flat[p.tensor];
    if (!whole.defined()) {
      whole = state.tensors[p.tensor].second.detach().contiguous().reshape({-1});
    }
    sources[i] = whole.slice(0, p.begin, p.end);
  }
  std::optional<c10::Stream> current, side;
  if (device) {
    const c10::impl::VirtualGuardImpl guard(device->type());
    current = guard.getStream(*device);
    side = guard.getStreamFromGlobalPool(*device);
    c10::Event ready(device->type());
    ready.record(*current);
    ready.block(*side);
  }
  for (size_t i = 0; i < stage.pieces.size(); ++i) {
    const ShardDataset& d = stage.datasets[i];
    if (d.bytes == 0) continue;
    const at::Tensor& src = sources[i];
    if (src.device().is_cpu()) {
      std::memcpy(stage.data() + d.offset, src.data_ptr(), static_cast<size_t>(d.bytes));
      continue;
    }
    c10::StreamGuard on_side(*side);
    at::Tensor dst = at::from_blob(stage.data() + d.offset, {src.numel()},
                                   at::TensorOptions().dtype(src.scalar_type()));
    dst.copy_(src, /*non_blocking=*/true);
  }
  if (device) {
    stage.copied = std::make_unique<c10::Event>(device->type());
    stage.copied->record(*side);
    stage.copied->block(*current);
    for (at::Tensor& src : sources) {
      if (src.defined() && !src.device().is_cpu()) stage.sources.push_back(std::move(src));
    }
  }
}

}  // namespace

absl::StatusOr<SaveTicket> CheckpointWriter::Save(const CheckpointContents& state) {
  Impl& m = *impl_;
  const absl::Time begin = absl::Now();
  SaveTicket ticket;
  ticket.step = state.step;
  const int64_t seq = m.saves++;
  EVENSTEP_ASSIGN_OR_RETURN(const Described described, Describe(state));
  // A staging buffer: free, or the oldest save finishes (kWait), or skip.
  int slot = -1;
  {
    std::unique_lock<std::mutex> lock(m.mu);
    auto find_free = [&] {
      for (size_t i = 0; i < m.staging.size(); ++i) {
        if (!m.staging[i].busy) return static_cast<int>(i);
      }
      return -1;
    };
    slot = find_free();
    if (slot < 0 && m.options.when_busy == WhenBusy::kSkip) {
      ticket.skipped = true;
      std::promise<absl::Status> p;
      p.set_value(absl::OkStatus());
      ticket.done = p.get_future().share();
      return ticket;
    }
    m.freed.wait(lock, [&] { return (slot = find_free()) >= 0; });
    m.staging[slot].busy = true;
  }
  Staging& stage = m.staging[slot];
  if (stage.signature != described.signature) {
    if (absl::Status s = PlanStage(described, m.world, m.rank, m.options.slice_bytes, &stage);
        !s.ok()) {
      m.Release(stage);
      return s;
    }
  }
  try {
    Snapshot(state, stage);
  } catch (const std::exception& e) {
    m.Release(stage);
    return absl::InternalError(
        absl::StrCat("checkpoint snapshot of step ", state.step, ": ", internal::ErrorText(e)));
  }
  ticket.snapshot_seconds = absl::ToDoubleSeconds(absl::Now() - begin);
  const int64_t step = state.step;
  const std::string extras = state.extras_json;
  const std::vector<TensorMeta>& metas = described.metas;
  Impl* impl = impl_.get();
  ticket.done = m.runtime
                    ->Spawn([impl, &stage, seq, step, metas, extras] {
                      absl::Status s = impl->WriteAndCommit(stage, seq, step, metas, extras);
                      impl->Release(stage);
                      return s;
                    })
                    .share();
  m.in_flight.push_back({seq, ticket.done});
  // Finished saves leave the list, but a failure is kept for WaitAll: no
  // outcome is dropped unread.
  while (!m.in_flight.empty() &&
         m.in_flight.front().done.wait_for(std::chrono::seconds(0)) == std::future_status::ready) {
    absl::Status s = m.in_flight.front().done.get();
    if (m.first_error.ok() && !s.ok()) m.first_error = s;
    m.in_flight.pop_front();
  }
  return ticket;
}

absl::Status CheckpointWriter::WaitAll() {
  absl::Status first = impl_->first_error;
  impl_->first_error = absl::OkStatus();
  for (auto& f : impl_->in_flight) {
    absl::Status s = f.done.get();
    if (first.ok() && !s.ok()) first = s;
  }
  impl_->in_flight.clear();
  return first;
}

absl::StatusOr<int> CheckpointWriter::Abandon(const absl::Status& why) {
  // Far above any world size: once added, no report makes the count equal
  // the world, so no rank becomes the committer.
  constexpr int64_t kPoison = int64_t{1} << 40;
  // Every survivor holds the same saves in flight (none that the lost rank
  // never reported on can have ended). The first to poison a save decides
  // whether it is ended (not every rank had reported then) and says so under
  // "ended"; the others read that, so every survivor counts the same saves.
  int ended = 0;
  if (impl_->in_flight.empty()) return ended;
  // The saves' own threads may be waiting in Get on the writer's store.
  absl::StatusOr<std::unique_ptr<CommitStore>> own = impl_->store->Reconnect();
  if (!own.ok()) return Annotate(own.status(), "abandoning checkpoint saves");
  CommitStore& store = *own != nullptr ? **own : *impl_->store;
  for (const Impl::InFlight& f : impl_->in_flight) {
    const std::string key = CommitKey(f.seq);
    auto context = [&](const absl::Status& s) {
      return Annotate(s, absl::StrCat("abandoning checkpoint save #", f.seq));
    };
    absl::StatusOr<int64_t> now = store.Add(key + "arrived", kPoison);
    if (!now.ok()) return context(now.status());
    if (*now / kPoison == 1) {
      const bool end = *now % kPoison < impl_->world;
      if (end) {
        if (absl::Status s = store.Set(key + "outcome", EncodeStatus(why)); !s.ok()) {
          return context(s);
        }
      }
      if (absl::Status s = store.Set(key + "ended", end ? "1" : "0"); !s.ok()) {
        return context(s);
      }
      ended += end ? 1 : 0;
    } else {
      absl::StatusOr<std::string> decided = store.Get(key + "ended");
      if (!decided.ok()) return context(decided.status());
      ended += *decided == "1" ? 1 : 0;
    }
  }
  return ended;
}

absl::Status CheckpointWriter::Impl::WriteShard(Staging& stage, int64_t step, std::string* report) {
  const std::string ckpt = CheckpointPath(options.dir, step);
  const std::string final_path = absl::StrCat(ckpt, "/", ShardFileName(rank, world));
  // Never write into a committed checkpoint: its manifest names the shards
  // that are there, and rewriting them would break it.
  if (env->Exists(ckpt + "/manifest.json")) {
    return absl::AlreadyExistsError(
        absl::StrCat(ckpt,
                     " already holds a committed checkpoint; it is not overwritten (this save is "
                     "dropped)"));
  }
  EVENSTEP_RETURN_IF_ERROR(runtime->Blocking([&] { return CreateDirsDurably(*env, ckpt); }));
  // Checksums of the datasets, from the staging buffer (once the device
  // copies of the snapshot, if any, have landed).
  nlohmann::json datasets = nlohmann::json::array();
  absl::Status s = runtime->Blocking([&] {
    stage.WaitForCopies();
    for (const ShardDataset& d : stage.datasets) {
      const uint64_t h =
          d.bytes > 0 ? XXH3_64bits(stage.data() + d.offset, d.bytes) : XXH3_64bits(nullptr, 0);
      datasets.push_back({{"dataset", d.path},
                          {"tensor", d.tensor},
                          {"begin", d.begin},
                          {"end", d.end},
                          {"offset", d.offset},
                          {"bytes", d.bytes},
                          {"xxh3", absl::StrFormat("%016x", h)}});
    }
    return absl::OkStatus();
  });
  EVENSTEP_RETURN_IF_ERROR(s, "checksumming shard ", final_path);
  // The shard: tmp, fsync, rename, fsync directory. On any failure this
  // rank's files are removed (the commit does not happen).
  EVENSTEP_RETURN_IF_ERROR(runtime->Blocking([&] {
    return WriteFileAtomically(*env, final_path, stage.data(), stage.size(),
                               /*remove_if_unsynced=*/true);
  }));
  *report = nlohmann::json({{"file", ShardFileName(rank, world)},
                            {"step", step},
                            {"bytes", static_cast<int64_t>(stage.size())},
                            {"datasets", std::move(datasets)}})
                .dump();
  return absl::OkStatus();
}

absl::Status CheckpointWriter::Impl::WriteAndCommit(Staging& stage, int64_t seq, int64_t step,
                                                    const std::vector<TensorMeta>& metas,
                                                    const std::string& extras) {
  auto context = [&](const absl::Status& s) {
    return Annotate(s, absl::StrCat("checkpoint step ", step, ", rank ", rank));
  };
  std::string report;
  absl::Status mine = WriteShard(stage, step, &report);
  // Every rank reports, failed or not, so that the last one to arrive knows
  // the outcome and every rank learns it: a save succeeds or fails as a whole.
  const std::string key = CommitKey(seq);
  absl::Status s =
      store->Set(absl::StrCat(key, "shard/", rank),
                 mine.ok() ? "ok\n" + report : "error\n" + EncodeStatus(context(mine)));
  if (!s.ok()) return context(s);
  absl::StatusOr<int64_t> arrived = store->Add(key + "arrived", 1);
  if (!arrived.ok()) return context(arrived.status());
  if (*arrived != world) {
    // Wait for the outcome on the blocking pool (other saves' fibers keep
    // running). A store timeout is not the end while ranks keep arriving (a
    // large shard on a slow disk): only a whole timeout without a new
    // arrival is, and the error then says how many ranks arrived.
    int64_t seen = *arrived;
    bool waited_for_commit = false;
    for (;;) {
      absl::StatusOr<std::string> outcome;
      runtime
          ->Blocking([&] {
            outcome = store->Get(key + "outcome");
            return absl::OkStatus();
          })
          .IgnoreError();
      if (outcome.ok()) return DecodeStatus(*outcome);
      absl::StatusOr<int64_t> now = store->Add(key + "arrived", 0);
      if (absl::IsDeadlineExceeded(outcome.status()) && now.ok()) {
        // Progress: wait again. Every rank arrived: the last one is
        // committing; wait once more for it.
        const bool progress = *now > seen;
        seen = *now;
        if (progress && *now < world) continue;
        if (*now == world && !waited_for_commit) {
          waited_for_commit = true;
          continue;
        }
      }
      return context(Annotate(
          outcome.status(), absl::StrCat("waiting for the outcome of the save (",
                                         now.ok() ? *now : -1, " of ", world, " ranks reported)")));
    }
  }
  absl::Status outcome = Commit(seq, step, metas, extras);
  if (!outcome.ok() && !absl::StartsWith(outcome.message(), "checkpoint step ")) {
    outcome = context(outcome);
  }
  s = store->Set(key + "outcome", EncodeStatus(outcome));
  if (outcome.ok() && !s.ok()) return context(s);
  return outcome;
}

absl::Status CheckpointWriter::Impl::Commit(int64_t seq, int64_t step,
                                            const std::vector<TensorMeta>& metas,
                                            const std::string& extras) {
  const std::string key = CommitKey(seq);
  Manifest manifest;
  manifest.step = step;
  manifest.world_size = world;
  manifest.extras_json = extras;
  std::map<std::string, int> index;
  for (const TensorMeta& t : metas) {
    index[t.name] = static_cast<int>(manifest.tensors.size());
    manifest.tensors.push_back({t.name, t.dtype, t.shape, {}});
  }
  const std::string ckpt = CheckpointPath(options.dir, step);
  // A failed save leaves nothing behind: the shards of the ranks that
  // succeeded are removed with the directory (never a committed one).
  auto abandon = [&](absl::Status why) {
    if (!env->Exists(ckpt + "/manifest.json")) {
      runtime
          ->Blocking([&] {
            env->RemoveTree(ckpt).IgnoreError();
            return env->SyncDir(options.dir);
          })
          .IgnoreError();
    }
    return why;
  };
  std::vector<std::string> reports(world);
  for (int r = 0; r < world; ++r) {
    absl::StatusOr<std::string> value = store->Get(absl::StrCat(key, "shard/", r));
    if (!value.ok()) return abandon(value.status());
    if (absl::StartsWith(*value, "error\n")) return abandon(DecodeStatus(value->substr(6)));
    if (!absl::StartsWith(*value, "ok\n")) {
      return abandon(absl::DataLossError(absl::StrCat("shard report of rank ", r, " unreadable")));
    }
    reports[r] = value->substr(3);
  }
  for (int r = 0; r < world; ++r) {
    const nlohmann::json shard = nlohmann::json::parse(reports[r], nullptr, false);
    if (shard.is_discarded()) {
      return abandon(absl::DataLossError(absl::StrCat("shard report of rank ", r)));
    }
    // Every rank's save number k must be the same step: a rank that saved
    // once more or less than the others would otherwise commit a manifest
    // naming its peers' shards of another step.
    if (shard.value("step", step) != step) {
      return abandon(absl::InternalError(
          absl::StrCat("rank ", r, "'s save #", seq, " is of step ", shard.value("step", step),
                       ", this rank's of step ", step,
                       ": the ranks did not call Save alike (the same steps in the same order)")));
    }
    manifest.shards.push_back(shard.at("file").get<std::string>());
    manifest.shard_bytes.push_back(shard.at("bytes").get<int64_t>());
    for (const auto& d : shard.at("datasets")) {
      SliceInfo slice;
      slice.shard = r;
      slice.dataset = d.at("dataset").get<std::string>();
      slice.begin = d.at("begin").get<int64_t>();
      slice.end = d.at("end").get<int64_t>();
      slice.offset = d.at("offset").get<int64_t>();
      slice.bytes = d.at("bytes").get<int64_t>();
      slice.xxh3 = std::stoull(d.at("xxh3").get<std::string>(), nullptr, 16);
      manifest.tensors[index.at(d.at("tensor").get<std::string>())].slices.push_back(slice);
    }
  }
  for (TensorInfo& t : manifest.tensors) {
    std::sort(t.slices.begin(), t.slices.end(),
              [](const SliceInfo& a, const SliceInfo& b) { return a.begin < b.begin; });
  }
  absl::Status s = runtime->Blocking(
      [&] { return WriteFileAtomically(*env, ckpt + "/manifest.json", ManifestToJson(manifest)); });
  if (!s.ok()) return abandon(s);
  // Committed. `latest` is a hint for people (readers go by the manifests),
  // and retention only frees space: their failures are reported as such.
  s = runtime->Blocking(
      [&] { return WriteFileAtomically(*env, options.dir + "/latest", StepDirName(step)); });
  EVENSTEP_RETURN_IF_ERROR(s, "committed ", ckpt, ", but updating ", options.dir, "/latest failed");
  EVENSTEP_RETURN_IF_ERROR(runtime->Blocking([&] { return Retain(step); }), "committed ", ckpt,
                           ", but removing older checkpoints failed");
  return absl::OkStatus();
}

absl::Status CheckpointWriter::Impl::Retain(int64_t committed_step) {
  EVENSTEP_ASSIGN_OR_RETURN(const CheckpointListing listing, ListCheckpoints(*env, options.dir),
                            "retention after step ", committed_step);
  // Saves older than this one that never committed (a crash, a failure not
  // cleaned up). With several saves in flight an older one may still be
  // writing, so they are only removed when saves run one at a time.
  if (options.max_in_flight == 1) {
    for (int64_t step : listing.uncommitted) {
      if (step < committed_step) env->RemoveTree(CheckpointPath(options.dir, step)).IgnoreError();
    }
  }
  // Keep this checkpoint and the newest keep-1 committed ones older than it;
  // newer ones (another run's, in the same directory) are never touched.
  std::vector<int64_t> older;
  for (int64_t step : listing.committed) {
    if (step < committed_step) older.push_back(step);
  }
  const size_t kept_older = static_cast<size_t>(options.keep - 1);
  for (size_t i = 0; i + kept_older < older.size(); ++i) {
    // Manifest first, made durable, so a crash mid-removal cannot leave a
    // "committed" checkpoint with missing shards.
    const std::string path = CheckpointPath(options.dir, older[i]);
    absl::Status s = env->Remove(path + "/manifest.json");
    if (s.ok()) s = env->SyncDir(path);
    if (s.ok()) s = env->RemoveTree(path);
    EVENSTEP_RETURN_IF_ERROR(s, "removing checkpoint ", path, " (retention)");
  }
  return env->SyncDir(options.dir);
}

}  // namespace evenstep

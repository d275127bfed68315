// The split record: one JSON line per step and rank (nlohmann-json, as the
// other records of a run), written with one write(2) each.
#include "evenstep/internal/split_record.h"

#include <fcntl.h>
#include <unistd.h>
#include <xxhash.h>

#include <cerrno>
#include <cstring>
#include <fstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "nlohmann/json.hpp"

namespace evenstep::internal {

using json = nlohmann::json;

SplitRecord RecordOf(int64_t step, const GlobalBatch& batch, const Plan& plan, int64_t memory_cap) {
  SplitRecord r;
  r.step = step;
  r.epoch = batch.epoch;
  r.batch_step = batch.step;
  r.batch_samples = static_cast<int64_t>(batch.samples.size());
  r.batch_hash = XXH64(batch.samples.data(), batch.samples.size() * sizeof(int64_t), 0);
  r.plan = plan;
  r.memory_cap = memory_cap;
  return r;
}

std::string SplitRecordLine(const SplitRecord& r) {
  json fits = json::array();
  for (const CostFit& f : r.plan.fits) fits.push_back({f.fixed_s, f.per_unit_s, f.observations});
  const json line = {{"step", r.step},
                     {"epoch", r.epoch},
                     {"batch_step", r.batch_step},
                     {"batch_samples", r.batch_samples},
                     {"batch_hash", r.batch_hash},
                     {"mode", BalanceModeName(r.plan.mode)},
                     {"shares", r.plan.shares},
                     {"predicted_s", r.plan.predicted_s},
                     {"fits", fits},
                     {"memory_cap", r.memory_cap}};
  return line.dump();
}

namespace {

absl::StatusOr<SplitRecord> ParseLine(const std::string& text, int world_size) {
  SplitRecord r;
  try {
    const json line = json::parse(text);
    r.step = line.at("step").get<int64_t>();
    r.epoch = line.at("epoch").get<int64_t>();
    r.batch_step = line.at("batch_step").get<int64_t>();
    r.batch_samples = line.at("batch_samples").get<int64_t>();
    r.batch_hash = line.at("batch_hash").get<uint64_t>();
    absl::StatusOr<BalanceMode> mode =
        BalanceModeByName(line.at("mode").get<std::string>(), "mode");
    if (!mode.ok()) return mode.status();
    r.plan.mode = *mode;
    r.plan.shares = line.at("shares").get<std::vector<double>>();
    r.plan.predicted_s = line.at("predicted_s").get<std::vector<double>>();
    for (const json& f : line.at("fits")) {
      r.plan.fits.push_back({f.at(0).get<double>(), f.at(1).get<double>(), f.at(2).get<int64_t>()});
    }
    r.memory_cap = line.at("memory_cap").get<int64_t>();
  } catch (const std::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat("not a split record line (", e.what(), ")"));
  }
  const auto world = static_cast<size_t>(world_size);
  if (r.plan.shares.size() != world || (!r.plan.fits.empty() && r.plan.fits.size() != world)) {
    return absl::InvalidArgumentError(
        absl::StrCat("a plan for ", r.plan.shares.size(), " ranks; this run has ", world_size,
                     ": a split record replays only at the world size it was recorded at"));
  }
  return r;
}

}  // namespace

absl::StatusOr<std::map<int64_t, SplitRecord>> ReadSplitRecord(const std::string& path,
                                                               int world_size) {
  std::ifstream in(path);
  if (!in) {
    return absl::NotFoundError(
        absl::StrCat(path, ": no split record (", std::strerror(errno), ")"));
  }
  std::map<int64_t, SplitRecord> steps;
  std::string text;
  for (int n = 1; std::getline(in, text); ++n) {
    if (text.empty()) continue;
    absl::StatusOr<SplitRecord> r = ParseLine(text, world_size);
    if (!r.ok()) {
      // A run killed inside a write leaves a torn last line: the steps
      // before it are whole, and the resumed run records that step again.
      if (in.peek() == std::char_traits<char>::eof() && text.back() != '}') break;
      return absl::InvalidArgumentError(absl::StrCat(path, ":", n, ": ", r.status().message()));
    }
    steps[r->step] = *std::move(r);
  }
  return steps;
}

absl::StatusOr<std::unique_ptr<SplitRecorder>> SplitRecorder::Open(const std::string& path) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0644);
  if (fd < 0) {
    return absl::PermissionDeniedError(absl::StrCat(
        path, ": cannot open the split record for writing (", std::strerror(errno), ")"));
  }
  return std::unique_ptr<SplitRecorder>(new SplitRecorder(path, fd));
}

SplitRecorder::~SplitRecorder() {
  if (fd_ >= 0) ::close(fd_);
}

absl::Status SplitRecorder::Append(const SplitRecord& record) {
  const std::string line = SplitRecordLine(record) + "\n";
  size_t done = 0;
  while (done < line.size()) {
    const ssize_t n = ::write(fd_, line.data() + done, line.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      return absl::DataLossError(absl::StrCat(path_, ": writing the split record of step ",
                                              record.step, " failed (", std::strerror(errno), ")"));
    }
    done += static_cast<size_t>(n);
  }
  return absl::OkStatus();
}

std::string SplitRecordFile(const std::string& dir, int rank) {
  return absl::StrFormat("%s/rank-%05d.jsonl", dir, rank);
}

}  // namespace evenstep::internal

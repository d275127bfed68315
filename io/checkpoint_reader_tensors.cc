// CheckpointReader::Read and the reader's part of a distributed load (read
// planning, tensors from bytes): checkpoint tensors as at::Tensor. The rest
// of the reader (opening, checks) is in checkpoint_reader.cc, free of ATen.
#include <ATen/ATen.h>

#include <cstring>
#include <limits>

#include "absl/strings/str_cat.h"
#include "evenstep/checkpoint_reader.h"
#include "evenstep/internal/dtypes.h"
#include "evenstep/internal/h5_shard.h"
#include "evenstep/internal/shard_plan.h"
#include "evenstep/status_macros.h"

namespace evenstep {

absl::StatusOr<at::Tensor> CheckpointReader::Read(const std::string& name) const {
  const TensorInfo* t = Find(name);
  if (t == nullptr) return absl::NotFoundError(absl::StrCat(path_, ": no tensor ", name));
  at::Tensor out =
      at::empty(t->shape, at::TensorOptions().dtype(*internal::DtypeFromName(t->dtype)));
  EVENSTEP_RETURN_IF_ERROR(ReadInto(name, out.data_ptr(), out.numel() * out.element_size()));
  return out;
}

std::string StoredDtypeOf(const at::Tensor& tensor) {
  return internal::DtypeName(tensor.scalar_type()).value_or("unsupported");
}

std::vector<std::vector<int>> CheckpointReader::PlanReads(int world) const {
  return PlanWholeReads(manifest_.tensors, world);
}

std::vector<std::vector<int>> PlanWholeReads(const std::vector<TensorInfo>& tensors, int world) {
  std::vector<internal::TensorMeta> metas;
  for (const TensorInfo& t : tensors) {
    int64_t numel = 1;
    for (int64_t d : t.shape) numel *= d;
    metas.push_back({t.name, t.dtype, t.shape, numel, internal::DtypeSize(t.dtype)});
  }
  // Slices no larger than "everything": whole tensors only.
  const std::vector<std::vector<internal::Piece>> pieces =
      internal::PlanShards(metas, world, std::numeric_limits<int64_t>::max());
  std::vector<std::vector<int>> plan(pieces.size());
  for (size_t r = 0; r < pieces.size(); ++r) {
    for (const internal::Piece& p : pieces[r]) plan[r].push_back(p.tensor);
  }
  return plan;
}

absl::StatusOr<at::Tensor> CheckpointReader::FromBytes(const std::string& name,
                                                       const at::Tensor& bytes) const {
  const TensorInfo* t = Find(name);
  if (t == nullptr) return absl::NotFoundError(absl::StrCat(path_, ": no tensor ", name));
  const int64_t want = StoredBytes(*t);
  if (bytes.scalar_type() != at::kByte || !bytes.is_contiguous() || bytes.numel() != want ||
      !bytes.device().is_cpu()) {
    return absl::InvalidArgumentError(absl::StrCat("tensor ", name, ": ", want,
                                                   " stored bytes expected as a contiguous CPU "
                                                   "byte tensor, got ",
                                                   bytes.numel(), " elements"));
  }
  at::Tensor out =
      at::empty(t->shape, at::TensorOptions().dtype(*internal::DtypeFromName(t->dtype)));
  std::memcpy(out.data_ptr(), bytes.data_ptr(), want);
  return out;
}

}  // namespace evenstep

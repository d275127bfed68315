// CheckpointReader::Read: a checkpoint tensor as an at::Tensor. The rest of
// the reader (manifest, discovery, checks) is in manifest.cc, free of ATen.
#include <ATen/ATen.h>

#include "absl/strings/str_cat.h"
#include "evenstep/checkpoint.h"
#include "evenstep/internal/dtypes.h"
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

}  // namespace evenstep

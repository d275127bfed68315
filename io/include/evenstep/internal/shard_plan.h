// Which rank writes which bytes of a checkpoint: every rank computes the same
// plan from the tensors' names, dtypes and shapes.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace evenstep::internal {

struct TensorMeta {
  std::string name;
  std::string dtype;
  std::vector<int64_t> shape;
  int64_t numel = 0;
  int64_t element_size = 0;
};

struct Piece {
  int tensor = 0;              // index into the TensorMeta list
  int64_t begin = 0, end = 0;  // flattened element range
  bool whole = true;           // the piece is the whole tensor (keeps its shape)
};

// Tensors over `slice_bytes` are cut into slices of at most that size; the
// pieces go largest first to the rank with the fewest bytes so far (ties to
// the lower rank). Per-rank byte totals differ by at most the largest piece.
std::vector<std::vector<Piece>> PlanShards(const std::vector<TensorMeta>& tensors, int world,
                                           int64_t slice_bytes);

// HDF5 dataset path of a piece: "/" + name for a whole tensor,
// "/" + name + "@" + begin for a slice.
std::string DatasetPath(const TensorMeta& tensor, const Piece& piece);

}  // namespace evenstep::internal

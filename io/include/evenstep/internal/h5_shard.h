// HDF5 layout of one checkpoint shard, built in memory. HDF5 (core driver,
// no backing store) writes the container — superblock, groups, dataset
// headers, attributes — and allocates every dataset contiguously and early,
// without fill values; the image it yields is the staging buffer: snapshots
// copy tensor bytes straight to the datasets' offsets in it, and the Env
// writes it to disk. Any HDF5 reader (h5py, h5dump) then reads the shard.
//
// Types: float32/64, int8/16/32/64, uint8 as the IEEE / two's-complement
// little-endian HDF5 types; float16 as an IEEE half custom float type (h5py
// reads it as float16); bfloat16 as raw uint16 words and bool as uint8, each
// dataset with a "dtype" string attribute naming the torch dtype.
// Thread-safety: BuildShardImage serialises on a process-wide mutex (the
// Debian HDF5 is not built thread-safe).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace evenstep::internal {

struct ShardDataset {
  std::string path;            // "/model/fc.weight" (groups created as needed)
  std::string dtype;           // torch dtype name: "float32", "bfloat16", ...
  std::vector<int64_t> shape;  // dataset shape; {} = scalar
  std::string tensor;          // checkpoint tensor name
  int64_t begin = 0, end = 0;  // element range of the tensor held (flattened)
  int64_t offset = -1;         // filled in: byte offset in the image (-1 when empty)
  int64_t bytes = 0;           // filled in
};

// Bytes per element of a dtype name; 0 when unsupported.
int64_t DtypeSize(const std::string& dtype);

// Builds the image and fills offset/bytes of every dataset. InvalidArgument
// naming the dataset for an unsupported dtype or a bad path; Internal with
// HDF5's message otherwise.
absl::StatusOr<std::string> BuildShardImage(std::vector<ShardDataset>* datasets);

// Opens the shard file at `path` with HDF5 (read-only) and compares each of
// `expected` (path, dtype, shape, offset, bytes) with the dataset the file
// holds: its HDF5 type and "dtype" attribute, its shape, contiguous layout,
// offset and storage size. The problems found, each naming the file and the
// dataset (empty when they agree). The file must be known to be a regular
// file (CheckpointReader::Open checks it); HDF5 opens it by path, in the
// checker program evenstep-h5check started with posix_spawn (libhdf5 is not
// safe on hostile metadata, and a fork of a threaded caller is not safe for
// it): a crash, a hang (120 s) or a runaway allocation there comes back as
// a problem naming the file. The program: $EVENSTEP_H5CHECK, else the one
// installed beside libevenstep (LIB/../libexec/evenstep-h5check), else the
// build tree's.
std::vector<std::string> CheckShardFile(const std::string& path,
                                        const std::vector<ShardDataset>& expected);
// The same check in this process (what evenstep-h5check runs).
std::vector<std::string> CheckShardFileHere(const std::string& path,
                                            const std::vector<ShardDataset>& expected);
// `expected` as the checker reads it on its stdin (JSON), and back.
std::string ShardCheckRequest(const std::vector<ShardDataset>& expected);
absl::StatusOr<std::vector<ShardDataset>> ParseShardCheckRequest(const std::string& text);

}  // namespace evenstep::internal

// evenstep-h5check SHARD: the HDF5 structure check of one checkpoint shard
// (internal::CheckShardFileHere) in a process of its own. Reads the datasets
// the manifest expects (JSON, internal::ShardCheckRequest) on stdin, writes
// each problem found as one line on stdout, exits 0. libevenstep starts it
// with posix_spawn (io/h5_shard.cc): libhdf5 is not hardened against hostile
// metadata, so a crash, a hang or a runaway allocation ends this process,
// not the trainer's. Links HDF5 and no torch.
#include <sys/resource.h>

#include <iostream>
#include <iterator>
#include <string>

#include "evenstep/internal/h5_shard.h"

int main(int argc, char** argv) {
  if (argc != 2) {
    std::cerr << "usage: evenstep-h5check SHARD < expected.json (run by libevenstep)\n";
    return 2;
  }
#if !defined(__SANITIZE_ADDRESS__)
  // 4 GiB of address space for this small process: a runaway allocation
  // inside HDF5 fails here instead of swapping the machine.
  struct rlimit limit = {rlim_t{4} << 30, rlim_t{4} << 30};
  ::setrlimit(RLIMIT_AS, &limit);
#endif
  const std::string request((std::istreambuf_iterator<char>(std::cin)),
                            std::istreambuf_iterator<char>());
  auto expected = evenstep::internal::ParseShardCheckRequest(request);
  if (!expected.ok()) {
    std::cout << argv[1] << ": not checked: " << expected.status().message() << "\n";
    return 0;
  }
  for (const std::string& problem : evenstep::internal::CheckShardFileHere(argv[1], *expected)) {
    std::cout << problem << "\n";
  }
  return 0;
}

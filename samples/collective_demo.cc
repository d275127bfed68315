// The smallest evenstep program: join the job described by the launcher's
// environment, all-reduce one tensor, print the result on every rank.
//   evenstep-run -n 2 -- ./evenstep_collective_demo
#include <ATen/ATen.h>

#include <iostream>

#include "absl/flags/parse.h"
#include "evenstep/dist_context.h"
#include "evenstep/flags.h"

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  auto ctx = evenstep::DistContextFromFlags();
  if (!ctx.ok()) {
    std::cerr << ctx.status() << "\n";
    return 1;
  }
  evenstep::DistContext& dist = **ctx;
  std::cout << dist.env().Describe() << ", backend " << dist.backend_name() << std::endl;
  at::Tensor t = at::arange(4, at::kLong) + dist.rank();
  if (absl::Status s = dist.AllReduce(t); !s.ok()) {
    std::cerr << s << "\n";
    return 1;
  }
  std::cout << "all_reduce(arange(4) + rank) = " << t << std::endl;
  return 0;
}

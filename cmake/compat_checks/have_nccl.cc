#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
int main(int argc, char**) {
  if (argc > 100) {
    // Never runs; referencing the constructor makes the probe fail to link
    // against a libtorch built without NCCL.
    auto pg = c10::make_intrusive<c10d::ProcessGroupNCCL>(nullptr, 0, 1);
    return pg->getSize();
  }
  return 0;
}

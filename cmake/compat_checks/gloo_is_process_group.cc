#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <type_traits>
static_assert(std::is_base_of<c10d::ProcessGroup, c10d::ProcessGroupGloo>::value,
              "ProcessGroupGloo is a Backend, not a ProcessGroup");
int main() { return 0; }

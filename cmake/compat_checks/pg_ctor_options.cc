#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
int main(int argc, char**) {
  if (argc > 100) {
    auto pg = c10::make_intrusive<c10d::ProcessGroup>(
        nullptr, 0, 1, c10::make_intrusive<c10d::ProcessGroup::Options>("gloo"));
    return pg->getSize();
  }
  return 0;
}

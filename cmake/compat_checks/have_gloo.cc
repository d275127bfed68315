#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
int main() {
  auto device = c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1");
  return device ? 0 : 1;
}

#include "bench/relaunch.h"

#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

namespace evenstep::bench {

std::string SelfExecutable() {
  char self[4096];
  const ssize_t n = readlink("/proc/self/exe", self, sizeof(self) - 1);
  return n > 0 ? std::string(self, static_cast<size_t>(n)) : std::string();
}

int RelaunchUnlessLaunched(int ranks, int argc, char** argv) {
  if (std::getenv("RANK") != nullptr) return 0;
  std::string self = SelfExecutable();
  if (self.empty()) {
    perror("readlink /proc/self/exe");
    return 1;
  }
  std::string count = std::to_string(ranks);
  std::vector<char*> args = {const_cast<char*>(EVENSTEP_RUN), const_cast<char*>("-n"), count.data(),
                             const_cast<char*>("--"), self.data()};
  for (int i = 1; i < argc; ++i) args.push_back(argv[i]);
  args.push_back(nullptr);
  execv(args[0], args.data());
  perror("exec evenstep-run");
  return 1;
}

}  // namespace evenstep::bench

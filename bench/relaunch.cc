#include "bench/relaunch.h"

#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

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

int RunLines(const std::string& command, const std::function<void(const std::string&)>& on_line) {
  FILE* p = popen((command + " 2>&1").c_str(), "r");
  if (p == nullptr) return -1;
  std::string line;
  char chunk[4096];
  while (fgets(chunk, sizeof(chunk), p) != nullptr) {
    line += chunk;
    if (line.back() != '\n') continue;  // a longer line: read on
    line.pop_back();
    on_line(line);
    line.clear();
  }
  if (!line.empty()) on_line(line);
  const int status = pclose(p);
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

std::optional<std::map<std::string, std::string>> TaggedFields(const std::string& line,
                                                               const std::string& tag) {
  const size_t at = line.find(tag);
  if (at == std::string::npos) return std::nullopt;
  std::map<std::string, std::string> out;
  for (absl::string_view f :
       absl::StrSplit(absl::string_view(line).substr(at + tag.size()), ' ', absl::SkipEmpty())) {
    std::pair<std::string, std::string> kv = absl::StrSplit(f, absl::MaxSplits('=', 1));
    out[kv.first] = std::string(absl::StripAsciiWhitespace(kv.second));
  }
  return out;
}

std::map<std::string, double> NumericFields(const std::map<std::string, std::string>& fields) {
  std::map<std::string, double> out;
  for (const auto& [k, v] : fields) {
    double x = 0;
    if (absl::SimpleAtod(v, &x)) out[k] = x;
  }
  return out;
}

}  // namespace evenstep::bench

#include "tests/testing/temp_dir.h"

#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <system_error>

namespace evenstep::testing {

TempDir::TempDir(const std::string& prefix, Where where) {
  const bool memory = where == Where::kMemory && std::filesystem::is_directory("/dev/shm") &&
                      access("/dev/shm", W_OK) == 0;
  std::string tmpl = (memory ? "/dev/shm/" : "/tmp/") + prefix + "_XXXXXX";
  if (mkdtemp(tmpl.data()) == nullptr) {
    perror("mkdtemp");
    abort();  // nothing sensible to test without a directory
  }
  path_ = tmpl;
}

TempDir::~TempDir() {
  std::error_code ignored;
  std::filesystem::remove_all(path_, ignored);
}

}  // namespace evenstep::testing

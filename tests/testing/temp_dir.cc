#include "tests/testing/temp_dir.h"

#include <unistd.h>

#include <cstdio>
#include <cstdlib>

#include "evenstep/env.h"

namespace evenstep::testing {

TempDir::TempDir(const std::string& prefix, Where where) {
  const bool memory = where == Where::kMemory && access("/dev/shm", W_OK) == 0;
  std::string tmpl = (memory ? "/dev/shm/" : "/tmp/") + prefix + "_XXXXXX";
  if (mkdtemp(tmpl.data()) == nullptr) {
    perror("mkdtemp");
    abort();  // nothing sensible to test without a directory
  }
  path_ = tmpl;
}

// POSIX removal (evenstep's own): std::filesystem::remove_all may bind to
// the copy the torch wheel's libtorch_cpu.so exports (io/env.cc).
TempDir::~TempDir() { internal::RemoveTree(path_).IgnoreError(); }

}  // namespace evenstep::testing

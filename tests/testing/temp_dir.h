// A fresh directory for one test, removed with everything in it when the
// object goes. The one temp-directory helper of the tests.
#pragma once

#include <string>

namespace evenstep::testing {

class TempDir {
 public:
  enum class Where {
    kTmp,     // /tmp: real disk semantics (what a run directory sees)
    kMemory,  // /dev/shm when writable (fsync is free: for tests of a protocol
              // through the Env, not of the disk), else /tmp
  };
  explicit TempDir(const std::string& prefix = "evenstep", Where where = Where::kTmp);
  ~TempDir();
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;

  const std::string& path() const { return path_; }
  // path() + "/" + name.
  std::string operator/(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

}  // namespace evenstep::testing

// A c10d TCPStore server owned by a launcher (evenstep-run, test drivers):
// ranks then connect as clients with TORCHELASTIC_USE_AGENT_STORE=True, so the
// port can come from the OS (port 0) and no rank has to host it.
// Thread-safety: immutable after Start.
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"

namespace evenstep::internal {

class StoreServer {
 public:
  // Listens on `port` (0: any free port). Unavailable when the port is taken.
  static absl::StatusOr<std::unique_ptr<StoreServer>> Start(int port);
  ~StoreServer();
  int port() const { return port_; }

 private:
  struct Impl;
  StoreServer(std::unique_ptr<Impl> impl, int port);
  std::unique_ptr<Impl> impl_;
  int port_;
};

}  // namespace evenstep::internal

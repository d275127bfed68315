// What DistContext's source files share (not installed): the process
// groups and store of a context, and small helpers.
#pragma once

#include <ATen/ATen.h>
#include <unistd.h>

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "evenstep/dist_context.h"
#include "evenstep/internal/c10d_compat.h"

namespace evenstep {
namespace compat = internal::c10d_compat;

struct DistContext::Groups {
  compat::StorePtr raw_store;  // the job's store (TCPStore, or HashStore for world 1)
  compat::StorePtr store;      // this launch's namespace of it (LaunchEnv::run_namespace)
  std::string launch_prefix;   // that namespace's key prefix ("" for none)
  compat::StorePtr ctx_store;  // "evenstep/ctx/" view of it
  compat::ProcessGroupPtr control;
  compat::ProcessGroupPtr data;
  // Made with the first NewDataGroup: where the syncs over several data
  // groups announce which one and which step they are at
  // (internal::SyncOrder).
  compat::ProcessGroupPtr sync_order;
  // CommitStores made so far: each gets keys of its own.
  int commit_stores = 0;
  // The first collective that timed out or lost a peer: c10d cannot cancel
  // it, so a later collective on these groups would queue behind it or pair
  // with the wrong operation. Every later one fails at once with it.
  absl::Mutex mu;
  absl::Status broken ABSL_GUARDED_BY(mu);
};

namespace internal {

inline std::vector<uint8_t> Bytes(absl::string_view s) {
  return std::vector<uint8_t>(s.begin(), s.end());
}
inline std::string Text(const std::vector<uint8_t>& v) { return std::string(v.begin(), v.end()); }

inline std::string HostName() {
  char host[256] = {};
  gethostname(host, sizeof(host) - 1);
  return host;
}

inline std::string DescribeTensor(const at::Tensor& t) {
  return absl::StrCat(c10::toString(t.scalar_type()), "[", t.numel(), "]");
}

// c10d's collectives work on dense, contiguous buffers only.
inline absl::Status RequireContiguous(const at::Tensor& t, int rank, const std::string& what) {
  if (t.is_contiguous()) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("rank ", rank, ": ", what, " needs a contiguous tensor"));
}

}  // namespace internal
}  // namespace evenstep

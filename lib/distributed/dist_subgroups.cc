// DistContext's subgroups (a collective over some ranks), the node layout
// and the data groups, and the test store server.
#include <ATen/ATen.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <limits>
#include <map>
#include <set>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "dist_context_internal.h"
#include "evenstep/dist_context.h"
#include "evenstep/internal/c10d_compat.h"
#include "evenstep/internal/collective.h"
#include "evenstep/internal/error_text.h"
#include "evenstep/internal/group_registry.h"
#include "evenstep/internal/store_server.h"
#include "evenstep/log.h"
#include "evenstep/status_macros.h"

namespace evenstep {

using internal::DescribeTensor;
using internal::HostName;
using internal::RequireContiguous;

// ---------------------------------------------------------------------------
// Subgroup

struct Subgroup::Impl {
  compat::ProcessGroupPtr group;
};

Subgroup::Subgroup(std::string name, std::vector<int> ranks, int index, int global_rank,
                   absl::Duration timeout, std::unique_ptr<Impl> impl)
    : name_(std::move(name)),
      ranks_(std::move(ranks)),
      index_(index),
      global_rank_(global_rank),
      timeout_(timeout),
      impl_(std::move(impl)) {}

Subgroup::~Subgroup() {
  if (impl_ != nullptr) internal::ForgetGroup(impl_->group.get());
}

template <typename Launch>
absl::Status Subgroup::Run(const std::string& what, Launch&& launch) {
  const internal::CollectiveWait outcome =
      internal::RunCollective(std::forward<Launch>(launch), timeout_);
  if (!outcome.failed) return absl::OkStatus();
  return internal::CollectiveFailed(
      global_rank_,
      absl::StrCat(what, " in group ", name_, " (ranks ", absl::StrJoin(ranks_, ","), ")"), outcome,
      timeout_);
}

absl::Status Subgroup::AllReduce(at::Tensor& tensor) {
  EVENSTEP_RETURN_IF_ERROR(RequireContiguous(tensor, global_rank_, "all_reduce"));
  return Run(absl::StrCat("all_reduce of ", DescribeTensor(tensor)), [&] {
    std::vector<at::Tensor> tensors{tensor};
    return impl_->group->allreduce(tensors);
  });
}

absl::Status Subgroup::Barrier() {
  return Run("barrier", [&] { return impl_->group->barrier(); });
}

c10d::ProcessGroup& Subgroup::process_group() { return *impl_->group; }

absl::StatusOr<double> MeasureBusBandwidth(int n, size_t bytes, int iters,
                                           const std::function<absl::Status(at::Tensor&)>& reduce) {
  at::Tensor t = at::ones({static_cast<int64_t>(bytes / sizeof(float))});
  EVENSTEP_RETURN_IF_ERROR(reduce(t));  // warm-up
  double per = std::numeric_limits<double>::infinity();
  for (int i = 0; i < iters; ++i) {
    const absl::Time begin = absl::Now();
    EVENSTEP_RETURN_IF_ERROR(reduce(t));
    per = std::min(per, absl::ToDoubleSeconds(absl::Now() - begin));
  }
  const double algbw = static_cast<double>(bytes) / per / 1e9;
  return n > 1 ? algbw * 2.0 * (n - 1) / n : algbw;
}

// ---------------------------------------------------------------------------
// Nodes

int NodeLayout::place_of(int rank) const {
  const std::vector<int>& mine = ranks[node_of[rank]];
  return static_cast<int>(std::find(mine.begin(), mine.end(), rank) - mine.begin());
}

bool NodeLayout::even() const {
  for (const auto& members : ranks) {
    if (members.size() != ranks.front().size()) return false;
  }
  return true;
}

std::string NodeLayout::Describe() const {
  std::vector<std::string> parts;
  for (const auto& members : ranks) {
    parts.push_back(absl::StrCat(names[members.front()], ": ", members.size(), " rank",
                                 members.size() == 1 ? "" : "s", " (", absl::StrJoin(members, ","),
                                 ")"));
  }
  return absl::StrJoin(parts, "; ");
}

namespace {

// This rank's node key: the host name, with the launcher's node index when
// it gives one.
std::string NodeKey() {
  const std::string host = HostName();
  for (const char* var : {"GROUP_RANK", "SLURM_NODEID"}) {
    if (const char* v = std::getenv(var); v != nullptr && *v) return absl::StrCat(host, "#", v);
  }
  return host;
}

}  // namespace

absl::StatusOr<NodeLayout> DistContext::Nodes() {
  if (nodes_.has_value()) return *nodes_;
  const int world = env_.world_size;
  std::vector<std::string> keys;
  {
    const std::string key = NodeKey().substr(0, 127);
    at::Tensor in = at::zeros({128}, at::kByte);
    std::memcpy(in.data_ptr<uint8_t>(), key.data(), key.size());
    std::vector<at::Tensor> all;
    EVENSTEP_RETURN_IF_ERROR(AllGather(in, &all), "exchanging node names");
    for (const at::Tensor& t : all) {
      keys.emplace_back(reinterpret_cast<const char*>(t.data_ptr<uint8_t>()));
    }
  }
  std::vector<std::string> in_order;  // distinct keys, by first rank
  for (const std::string& k : keys) {
    if (std::find(in_order.begin(), in_order.end(), k) == in_order.end()) in_order.push_back(k);
  }
  std::set<std::string> hosts;
  for (const std::string& k : in_order) hosts.insert(k.substr(0, k.find('#')));
  NodeLayout layout;
  layout.ranks.resize(in_order.size());
  for (int r = 0; r < world; ++r) {
    const int node =
        static_cast<int>(std::find(in_order.begin(), in_order.end(), keys[r]) - in_order.begin());
    layout.node_of.push_back(node);
    layout.ranks[node].push_back(r);
    layout.names.push_back(hosts.size() == in_order.size() ? keys[r].substr(0, keys[r].find('#'))
                                                           : absl::StrCat("node", node));
  }
  nodes_ = layout;
  return layout;
}

absl::StatusOr<std::unique_ptr<Subgroup>> DistContext::NewSubgroup(const std::string& name,
                                                                   std::vector<int> ranks) {
  std::sort(ranks.begin(), ranks.end());
  const auto me = std::find(ranks.begin(), ranks.end(), env_.rank);
  if (ranks.empty() || ranks.front() < 0 || ranks.back() >= env_.world_size ||
      std::adjacent_find(ranks.begin(), ranks.end()) != ranks.end() || me == ranks.end()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "rank ", env_.rank, ": subgroup ", name, " of ranks [", absl::StrJoin(ranks, ","),
        "]: the ranks must be distinct, below the world size ", env_.world_size,
        " and include this rank"));
  }
  const int index = static_cast<int>(me - ranks.begin());
  auto impl = std::make_unique<Subgroup::Impl>();
  try {
    impl->group = compat::MakeGlooGroup(
        compat::MakePrefixStore(Scoped(absl::StrCat("evenstep/sub/", name)), groups_->store), index,
        static_cast<int>(ranks.size()), internal::ToChronoMillis(options_.collective_timeout),
        gloo_device_);
  } catch (const std::exception& e) {
    return absl::UnavailableError(absl::StrCat("rank ", env_.rank, ": creating subgroup ", name,
                                               " (ranks ", absl::StrJoin(ranks, ","),
                                               "): ", internal::ErrorText(e)));
  }
  return std::unique_ptr<Subgroup>(new Subgroup(name, std::move(ranks), index, env_.rank,
                                                options_.collective_timeout, std::move(impl)));
}

absl::StatusOr<std::unique_ptr<Subgroup>> DistContext::NewDataGroup() {
  EVENSTEP_RETURN_IF_ERROR(Broken("creating a data group"));
  const std::string name = absl::StrCat("data", data_groups_++);
  std::vector<int> ranks(env_.world_size);
  for (int r = 0; r < env_.world_size; ++r) ranks[r] = r;
  auto impl = std::make_unique<Subgroup::Impl>();
  const auto timeout = internal::ToChronoMillis(options_.collective_timeout);
  const std::string backend = backend_name();
  try {
    if (!groups_->sync_order) {
      groups_->sync_order = compat::MakeGlooGroup(
          compat::MakePrefixStore(Scoped("evenstep/sync_order"), groups_->store), env_.rank,
          env_.world_size, timeout, gloo_device_);
      internal::ShareSyncOrder(groups_->data.get(), groups_->sync_order.get(), 1);
    }
    auto store = compat::MakePrefixStore(Scoped(absl::StrCat("evenstep/", name)), groups_->store);
#if EVENSTEP_HAVE_NCCL
    if (backend == "nccl") {
      impl->group = compat::MakeNcclGroup(store, env_.rank, env_.world_size, timeout);
    }
#endif
    if (!impl->group) {
      impl->group = compat::MakeGlooGroup(store, env_.rank, env_.world_size, timeout, gloo_device_);
    }
  } catch (const std::exception& e) {
    return absl::UnavailableError(absl::StrCat("rank ", env_.rank, ": creating ", backend,
                                               " data group ", name, ": ", internal::ErrorText(e)));
  }
  internal::ShareSyncOrder(impl->group.get(), groups_->sync_order.get(), data_groups_ + 1);
  return std::unique_ptr<Subgroup>(new Subgroup(name, std::move(ranks), env_.rank, env_.rank,
                                                options_.collective_timeout, std::move(impl)));
}

// ---------------------------------------------------------------------------
// StoreServer

namespace internal {

struct StoreServer::Impl {
  compat::StorePtr store;
};

StoreServer::StoreServer(std::unique_ptr<Impl> impl, int port)
    : impl_(std::move(impl)), port_(port) {}
StoreServer::~StoreServer() = default;

absl::StatusOr<std::unique_ptr<StoreServer>> StoreServer::Start(int port) {
  auto impl = std::make_unique<Impl>();
  try {
    impl->store = compat::MakeTcpStore("127.0.0.1", port, /*is_server=*/true,
                                       std::chrono::milliseconds(30000));
  } catch (const std::exception& e) {
    return absl::UnavailableError(
        absl::StrCat("cannot host a c10d TCPStore on port ", port, ": ", ErrorText(e)));
  }
  const int actual = compat::TcpStorePort(*impl->store);
  return std::unique_ptr<StoreServer>(new StoreServer(std::move(impl), actual));
}

}  // namespace internal

std::string DistContext::NextPrefix(const std::string& family) {
  absl::MutexLock lock(&groups_->mu);
  return absl::StrCat(family, "/", groups_->prefixes[family]++, "/");
}

bool DistContext::Claim(const std::string& owner) {
  absl::MutexLock lock(&groups_->mu);
  return groups_->claimed.insert(owner).second;
}

void DistContext::Release(const std::string& owner) {
  absl::MutexLock lock(&groups_->mu);
  groups_->claimed.erase(owner);
}

}  // namespace evenstep

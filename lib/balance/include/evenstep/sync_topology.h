// The shape of the gradient all-reduce across nodes (--evenstep_sync_topology).
//
//   flat          one all-reduce over every rank (a ring: 2(n-1)/n of each
//                 bucket's bytes cross the link between two nodes)
//   hierarchical  within each node a reduce-scatter, across nodes an
//                 all-reduce of each rank's part, within the node an
//                 all-gather (HierarchicalHook): only the bucket's bytes
//                 cross the link, once each way
//   auto          hierarchical when there is more than one node and the
//                 cross-node bus bandwidth, measured once at start-up, is
//                 below half the within-node one; flat otherwise
//
// Hierarchical needs the same number of ranks on every node, the Gloo data
// group (NCCL routes inside the node itself) and an element-wise comm hook
// (sum, avg, fp16, bf16). Asked for explicitly where one is missing, it is
// an error naming the flag and the reason; `auto` then stays flat and says
// why.
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace evenstep {

class DistContext;
struct GradSyncOptions;

enum class SyncTopology { kAuto, kFlat, kHierarchical };

// "auto", "flat", "hierarchical"; InvalidArgument naming
// --evenstep_sync_topology otherwise.
absl::StatusOr<SyncTopology> SyncTopologyByName(absl::string_view name);
const char* SyncTopologyName(SyncTopology topology);

struct TopologyChoice {
  bool hierarchical = false;
  // One line: what was chosen and why (the nodes, the measured bandwidths).
  std::string line;
  // The line is worth printing (rank 0): more than one node, or
  // hierarchical asked for.
  bool say = false;
  // The measured bus bandwidths in GB/s (the slowest group of each kind);
  // 0 when not measured.
  double within_node_gbps = 0;
  double cross_node_gbps = 0;
};

// Chooses the topology for `ctx` and, for hierarchical, replaces
// options->comm_hook with a HierarchicalHook over new subgroups (within each
// node, across nodes) whose cross-node part is the hook it had. Collective:
// every rank calls it at the same point, with the same `topology`.
absl::StatusOr<TopologyChoice> ApplySyncTopology(DistContext& ctx, SyncTopology topology,
                                                 GradSyncOptions* options);

}  // namespace evenstep

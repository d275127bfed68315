// --evenstep_sync_topology: see sync_topology.h.
#include "evenstep/sync_topology.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "evenstep/comm_hook.h"
#include "evenstep/dist_context.h"
#include "evenstep/grad_sync.h"
#include "evenstep/internal/choice.h"
#include "evenstep/status_macros.h"

namespace evenstep {

namespace {
constexpr internal::Choices<SyncTopology> kSyncTopologies = {
    {"auto", SyncTopology::kAuto},
    {"flat", SyncTopology::kFlat},
    {"hierarchical", SyncTopology::kHierarchical}};
}  // namespace

absl::StatusOr<SyncTopology> SyncTopologyByName(absl::string_view name) {
  return internal::Choose("--evenstep_sync_topology", name, kSyncTopologies);
}

const char* SyncTopologyName(SyncTopology topology) {
  return internal::NameOf(topology, kSyncTopologies);
}

namespace {

// The subgroups a HierarchicalHook runs on; shared by every copy of it.
struct TopologyGroups {
  std::unique_ptr<Subgroup> scatter, gather, across;
};

// Why hierarchical cannot run here, or "".
std::string Obstacle(DistContext& ctx, const NodeLayout& nodes, const GradSyncOptions& options) {
  if (ctx.backend_name() != "gloo") {
    return absl::StrCat("the data group is ", ctx.backend_name(),
                        ", which routes within the node itself");
  }
  if (!nodes.even()) {
    return absl::StrCat("the nodes hold different numbers of ranks (", nodes.Describe(),
                        "), and the cross-node groups pair ranks by their place in the node: "
                        "start the same number of ranks on every node");
  }
  if (!internal::IsElementwiseHook(options.comm_hook)) {
    return "the comm hook is powersgd or a user hook, which needs whole gradients, not a rank's "
           "part of a bucket";
  }
  return "";
}

std::string Layout(const NodeLayout& nodes) {
  return absl::StrCat(nodes.nodes(), " node", nodes.nodes() == 1 ? "" : "s", " x ",
                      nodes.ranks.front().size(), " rank",
                      nodes.ranks.front().size() == 1 ? "" : "s");
}

// The subgroups of the hierarchical sync: within this rank's node
// (scatter, gather) and across nodes (the ranks of its place). Names unique
// per context and call (every rank makes the same calls in the same order).
absl::StatusOr<std::shared_ptr<TopologyGroups>> MakeGroups(DistContext& ctx,
                                                           const NodeLayout& nodes) {
  const std::string prefix = ctx.NextPrefix("evenstep/sync_topology");
  const int node = nodes.node_of[ctx.rank()];
  const std::vector<int>& mine = nodes.ranks[node];
  const int place = nodes.place_of(ctx.rank());
  auto groups = std::make_shared<TopologyGroups>();
  if (mine.size() > 1) {
    EVENSTEP_ASSIGN_OR_RETURN(
        groups->scatter, ctx.NewSubgroup(absl::StrCat(prefix, "node", node, "/scatter"), mine));
    EVENSTEP_ASSIGN_OR_RETURN(groups->gather,
                              ctx.NewSubgroup(absl::StrCat(prefix, "node", node, "/gather"), mine));
  }
  if (nodes.nodes() > 1) {
    std::vector<int> across;
    for (const auto& members : nodes.ranks) across.push_back(members[place]);
    EVENSTEP_ASSIGN_OR_RETURN(groups->across,
                              ctx.NewSubgroup(absl::StrCat(prefix, "across", place), across));
  }
  return groups;
}

// Bus bandwidths within and across nodes into `choice` (all such groups at
// once; the slowest of each kind counts, the same figures on every rank; 0
// for a kind that has no group).
absl::Status MeasureBandwidths(DistContext& ctx, const TopologyGroups& groups,
                               TopologyChoice* choice) {
  constexpr size_t kProbeBytes = size_t{4} << 20;
  constexpr double kUnmeasured = std::numeric_limits<double>::infinity();
  at::Tensor measured = at::full({2}, kUnmeasured, at::kDouble);
  const std::pair<Subgroup*, const char*> probes[2] = {{groups.scatter.get(), "within the node"},
                                                       {groups.across.get(), "across nodes"}};
  for (int k = 0; k < 2; ++k) {
    Subgroup* g = probes[k].first;
    if (g == nullptr) continue;
    EVENSTEP_ASSIGN_OR_RETURN(double bw,
                              MeasureBusBandwidth(g->size(), kProbeBytes, 3,
                                                  [g](at::Tensor& t) { return g->AllReduce(t); }),
                              "--evenstep_sync_topology: measuring ", probes[k].second);
    measured[k] = bw;
  }
  EVENSTEP_RETURN_IF_ERROR(ctx.AllReduce(measured, ReduceOp::kMin),
                           "--evenstep_sync_topology: exchanging the measurements");
  const double within = measured[0].item<double>(), cross = measured[1].item<double>();
  choice->within_node_gbps = std::isfinite(within) ? within : 0;
  choice->cross_node_gbps = std::isfinite(cross) ? cross : 0;
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<TopologyChoice> ApplySyncTopology(DistContext& ctx, SyncTopology topology,
                                                 GradSyncOptions* options) {
  TopologyChoice choice;
  if (topology == SyncTopology::kFlat || ctx.world_size() == 1) {
    choice.line = "gradient sync: flat";
    return choice;
  }
  EVENSTEP_ASSIGN_OR_RETURN(const NodeLayout nodes, ctx.Nodes(), "--evenstep_sync_topology");
  choice.say = nodes.nodes() > 1 || topology == SyncTopology::kHierarchical;
  const std::string obstacle = Obstacle(ctx, nodes, *options);
  if (!obstacle.empty()) {
    if (topology == SyncTopology::kHierarchical) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--evenstep_sync_topology=hierarchical: ", obstacle,
          "; or use --evenstep_sync_topology=flat (or auto, which falls back to flat)"));
    }
    choice.line = absl::StrCat("gradient sync: flat (hierarchical cannot run: ", obstacle, ")");
    return choice;
  }
  const int local_size = static_cast<int>(nodes.ranks.front().size());
  if (topology == SyncTopology::kAuto && (nodes.nodes() == 1 || local_size == 1)) {
    choice.line = absl::StrCat(
        "gradient sync: flat (", Layout(nodes),
        nodes.nodes() == 1 ? ": nothing crosses a node" : ": hierarchical would be the same ring",
        ")");
    return choice;
  }

  const int node = nodes.node_of[ctx.rank()];
  const int place = nodes.place_of(ctx.rank());
  EVENSTEP_ASSIGN_OR_RETURN(std::shared_ptr<TopologyGroups> groups, MakeGroups(ctx, nodes));
  EVENSTEP_RETURN_IF_ERROR(MeasureBandwidths(ctx, *groups, &choice));
  const double within = choice.within_node_gbps, cross = choice.cross_node_gbps;
  std::string figures = Layout(nodes);
  if (choice.cross_node_gbps > 0) {
    absl::StrAppendFormat(&figures, "; all-reduce bus bandwidth across nodes %.3g GB/s",
                          choice.cross_node_gbps);
  }
  if (choice.within_node_gbps > 0) {
    absl::StrAppendFormat(&figures, "%s within nodes %.3g GB/s",
                          choice.cross_node_gbps > 0 ? "," : "; all-reduce bus bandwidth",
                          choice.within_node_gbps);
  }
  // (Auto gets here only with both kinds of group, so both were measured.)
  choice.hierarchical = topology == SyncTopology::kHierarchical || cross < 0.5 * within;
  if (!choice.hierarchical) {
    choice.line = absl::StrCat("gradient sync: flat (", figures,
                               ": the link between nodes is not the bottleneck)");
    return choice;
  }
  HierarchicalGroups h;
  if (groups->scatter != nullptr) {
    h.scatter = &groups->scatter->process_group();
    h.gather = &groups->gather->process_group();
    h.local_rank = place;
    h.local_size = local_size;
  }
  if (groups->across != nullptr) {
    h.across = &groups->across->process_group();
    h.node = node;
    h.nodes = nodes.nodes();
  }
  h.timeout = options->timeout;
  h.owner = groups;
  EVENSTEP_ASSIGN_OR_RETURN(options->comm_hook, HierarchicalHook(std::move(h), options->comm_hook),
                            "--evenstep_sync_topology=hierarchical");
  choice.line = absl::StrCat("gradient sync: hierarchical (", figures, ")");
  return choice;
}

}  // namespace evenstep

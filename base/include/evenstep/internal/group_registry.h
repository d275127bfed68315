// Which evenstep component synchronises gradients over which c10d process
// group, and the first failure that left a group unusable, shared by the
// layers that cannot see each other (hooks/'s GradSync, distributed/'s
// DistContext). Keys are the groups' addresses; nothing here owns a group.
//
// Why: c10d pairs collectives by their order on a group. Two gradient syncs
// on one group pair one's buckets with the other's whenever their launch
// points differ between ranks (Gloo then aborts the process on a size
// mismatch, or sums unrelated gradients on a match); and after a collective
// timed out, the late peer's message pairs with whatever is issued next.
// So a group carries at most one GradSync, and a group a GradSync found
// broken is refused by every later collective of any component.
//
// Several GradSyncs of one program (a GAN's two models, model parts) each
// have a group of their own, so none can pair with another's buckets; but a
// rank that left a step between two of them (an exception caught without
// GradSync::AbandonStep) would wait in one group while its peers wait in the
// other, until the collective timeout. So the data groups of one DistContext
// share a sync-order group: every synchronisation of a GradSync over one of
// them first exchanges which data group and step each rank is at, and ranks
// at different ones all fail at once, before any gradient is exchanged.
#pragma once

#include <string>

#include "absl/status/status.h"

namespace c10d {
class ProcessGroup;
}  // namespace c10d

namespace evenstep::internal {

// Records that `owner` (a description: "GradSync over 12 parameters
// ('fc.weight', ...)") synchronises over `group`. FailedPrecondition naming
// both owners when another already does.
absl::Status ClaimGroupForSync(const void* group, const std::string& owner);
// The claim ends (the GradSync is destroyed). When it was the last claim on
// its sync order's data groups, an out-of-order verdict on that order group
// (FailedPrecondition) is forgotten: GradSyncs attached afterwards start over.
void ReleaseGroupForSync(const void* group);

// A collective on `group` failed or timed out (or was found mispaired):
// every later user of the group should fail at once with `why`. The first
// reason is kept until ForgetGroup.
void MarkGroupBroken(const void* group, const absl::Status& why);
// OK, or the reason `group` was marked broken.
absl::Status GroupBroken(const void* group);
// The group is destroyed: forget its claim, its failure and its sync order
// (and, for a sync-order group, every data group's reference to it).
void ForgetGroup(const void* group);

// Where a gradient sync over a data group announces itself: the group its
// order exchange runs on (none: the context has one data group) and the data
// group's number among its context's (1 for data_group(), 2.. for
// NewDataGroup()'s, in creation order: the same on every rank).
struct SyncOrder {
  c10d::ProcessGroup* group = nullptr;
  int id = 0;
};
// Records that synchronisations over `data_group` announce themselves on
// `order` as data group number `id`.
void ShareSyncOrder(const void* data_group, c10d::ProcessGroup* order, int id);
SyncOrder SyncOrderOf(const void* data_group);
// How many GradSyncs are attached to data groups that announce themselves
// on `order` (the exchange is needed only from two on).
int SyncsSharingOrder(const c10d::ProcessGroup* order);

}  // namespace evenstep::internal

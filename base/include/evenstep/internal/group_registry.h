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
#pragma once

#include <string>

#include "absl/status/status.h"

namespace evenstep::internal {

// Records that `owner` (a description: "GradSync over 12 parameters
// ('fc.weight', ...)") synchronises over `group`. FailedPrecondition naming
// both owners when another already does.
absl::Status ClaimGroupForSync(const void* group, const std::string& owner);
// The claim ends (the GradSync is destroyed).
void ReleaseGroupForSync(const void* group);

// A collective on `group` failed or timed out (or was found mispaired):
// every later user of the group should fail at once with `why`. The first
// reason is kept until ForgetGroup.
void MarkGroupBroken(const void* group, const absl::Status& why);
// OK, or the reason `group` was marked broken.
absl::Status GroupBroken(const void* group);
// The group is destroyed: forget its claim and its failure.
void ForgetGroup(const void* group);

}  // namespace evenstep::internal

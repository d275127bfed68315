#include "evenstep/internal/group_registry.h"

#include <map>
#include <mutex>

#include "absl/strings/str_cat.h"

namespace evenstep::internal {
namespace {

struct Entry {
  std::string owner;  // empty: no GradSync claims it
  absl::Status broken;
  SyncOrder order;
};

std::mutex& Mu() {
  static std::mutex mu;
  return mu;
}

std::map<const void*, Entry>& Groups() {
  static auto* groups = new std::map<const void*, Entry>();  // never destroyed: no exit order
  return *groups;
}

}  // namespace

absl::Status ClaimGroupForSync(const void* group, const std::string& owner) {
  std::lock_guard<std::mutex> lock(Mu());
  Entry& e = Groups()[group];
  if (!e.owner.empty()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "this process group already carries a gradient sync (", e.owner, "), and ", owner,
        " would share it: c10d pairs collectives by their order on a group, so the two syncs' "
        "buckets would be reduced with each other's whenever they are launched at different "
        "points on different ranks. Give each GradSync its own group "
        "(DistContext::NewDataGroup(), then GradSync::Attach(model, group->process_group())), or "
        "put both models into one module and one GradSync"));
  }
  e.owner = owner;
  return absl::OkStatus();
}

void ReleaseGroupForSync(const void* group) {
  std::lock_guard<std::mutex> lock(Mu());
  auto it = Groups().find(group);
  if (it == Groups().end()) return;
  it->second.owner.clear();
  // The last GradSync of a sync order is gone: an out-of-order verdict
  // (FailedPrecondition; every rank reached it in the same exchange, so the
  // order group's own collectives still pair) ends with them. A failed or
  // timed-out exchange (any other code) keeps the group unusable.
  const c10d::ProcessGroup* order = it->second.order.group;
  if (order == nullptr) return;
  for (const auto& [key, entry] : Groups()) {
    if (entry.order.group == order && !entry.owner.empty()) return;
  }
  auto o = Groups().find(order);
  if (o != Groups().end() && o->second.broken.code() == absl::StatusCode::kFailedPrecondition) {
    o->second.broken = absl::OkStatus();
  }
}

void MarkGroupBroken(const void* group, const absl::Status& why) {
  if (why.ok()) return;
  std::lock_guard<std::mutex> lock(Mu());
  Entry& e = Groups()[group];
  if (e.broken.ok()) e.broken = why;
}

absl::Status GroupBroken(const void* group) {
  std::lock_guard<std::mutex> lock(Mu());
  auto it = Groups().find(group);
  return it == Groups().end() ? absl::OkStatus() : it->second.broken;
}

void ForgetGroup(const void* group) {
  std::lock_guard<std::mutex> lock(Mu());
  Groups().erase(group);
  for (auto& [key, entry] : Groups()) {
    if (entry.order.group == group) entry.order = SyncOrder();
  }
}

void ShareSyncOrder(const void* data_group, c10d::ProcessGroup* order, int id) {
  std::lock_guard<std::mutex> lock(Mu());
  Groups()[data_group].order = SyncOrder{order, id};
}

int SyncsSharingOrder(const c10d::ProcessGroup* order) {
  std::lock_guard<std::mutex> lock(Mu());
  int n = 0;
  for (const auto& [key, entry] : Groups()) n += entry.order.group == order && !entry.owner.empty();
  return n;
}

SyncOrder SyncOrderOf(const void* data_group) {
  std::lock_guard<std::mutex> lock(Mu());
  auto it = Groups().find(data_group);
  return it == Groups().end() ? SyncOrder() : it->second.order;
}

}  // namespace evenstep::internal

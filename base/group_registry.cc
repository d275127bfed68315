#include "evenstep/internal/group_registry.h"

#include <map>
#include <mutex>

#include "absl/strings/str_cat.h"

namespace evenstep::internal {
namespace {

struct Entry {
  std::string owner;  // empty: no GradSync claims it
  absl::Status broken;
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
}

}  // namespace evenstep::internal

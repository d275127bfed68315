// The launch generation of a torchrun job; see internal/launch_generation.h.
#include "evenstep/internal/launch_generation.h"

#include <algorithm>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace evenstep::internal {
namespace {

std::vector<uint8_t> Bytes(const std::string& s) { return {s.begin(), s.end()}; }

std::vector<std::string> Keys(int64_t g, const char* what, int world) {
  std::vector<std::string> keys;
  for (int r = 0; r < world; ++r) keys.push_back(absl::StrCat("gen/", g, "/", what, "/", r));
  return keys;
}

int64_t Newest(::c10d::Store& store) {
  if (!store.check({"gen"})) return 0;
  const std::vector<uint8_t> v = store.get("gen");
  int64_t g = 0;
  return absl::SimpleAtoi(std::string(v.begin(), v.end()), &g) ? g : 0;
}

}  // namespace

absl::StatusOr<int64_t> JoinLaunchGeneration(::c10d::Store& store, int rank, int world,
                                             absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  int64_t g = Newest(store);
  int taken = 0;  // claims of this rank found taken
  while (true) {
    if (store.add(absl::StrCat("gen/", g, "/claim/", rank), 1) != 1) {
      // An earlier launch's process of this rank claimed g: on to g + 1. A
      // launch moves on at most twice (past the last launch, and once more
      // when it read "gen" while another rank moved it); more means a live
      // process claims this rank too.
      if (++taken > 3) {
        return absl::AlreadyExistsError(
            absl::StrCat("two processes claim rank ", rank,
                         " in this launch (their claims pushed the launch generation to ", g,
                         "): check RANK of the job"));
      }
      store.compareSet(absl::StrCat("gen/", g, "/state"), {}, Bytes("abandoned"));
      store.compareSet("gen", g == 0 ? std::vector<uint8_t>() : Bytes(std::to_string(g)),
                       Bytes(std::to_string(g + 1)));
      g = std::max(g + 1, Newest(store));
      continue;
    }
    const std::vector<std::string> claims = Keys(g, "claim", world);
    const std::vector<std::string> ready = Keys(g, "ready", world);
    // g's fate, decided once: "done" (every rank ready: each of them takes
    // g) or "abandoned" (a rank found g stale first: each of them follows).
    const std::string state = absl::StrCat("gen/", g, "/state");
    auto decide = [&](const char* fate) {
      const std::vector<uint8_t> now = store.compareSet(state, {}, Bytes(fate));
      return std::string(now.begin(), now.end());
    };
    bool claimed_by_all = false;
    absl::Duration pause = absl::Milliseconds(1);
    bool follow = false;
    while (!follow) {
      if (!claimed_by_all && store.check(claims)) {
        claimed_by_all = true;
        store.set(ready[rank], Bytes("1"));
      }
      if (claimed_by_all && store.check(ready) && decide("done") == "done") return g;
      if (Newest(store) > g) {  // another rank found g stale
        if (decide("abandoned") == "done") return g;
        g = Newest(store);
        follow = true;
        continue;
      }
      if (absl::Now() >= deadline) {
        const std::vector<std::string>& phase = claimed_by_all ? ready : claims;
        std::vector<int> missing;
        for (int r = 0; r < world; ++r) {
          if (!store.check({phase[r]})) missing.push_back(r);
        }
        return absl::DeadlineExceededError(absl::StrCat(
            "timed out after ", absl::FormatDuration(timeout), " in launch generation ", g,
            " with ", world - static_cast<int>(missing.size()), " of ", world,
            " ranks joined; missing rank(s) ", absl::StrJoin(missing, ", ")));
      }
      absl::SleepFor(pause);
      pause = std::min(pause * 2, absl::Milliseconds(50));
    }
  }
}

}  // namespace evenstep::internal

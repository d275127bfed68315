// evenstep-run: exact all-reduce over 3 ranks, rank failure propagation, no
// orphans, signal forwarding, usage errors.
#include <signal.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/subprocess.h"
#include "tests/testing/temp_dir.h"

namespace evenstep {
namespace {

using ::evenstep::testing::ProcessAlive;
using ::evenstep::testing::ProcessResult;
using ::evenstep::testing::ProcessSpec;
using ::evenstep::testing::Subprocess;
using ::testing::HasSubstr;
using ::testing::Not;

const absl::Duration kHangBound = evenstep::testing::HangBound();

// Where ranks write their pids ($EVENSTEP_TEST_PID_DIR/rank<R>.pid).
class PidDir {
 public:
  const std::string& path() const { return dir_.path(); }
  // The pid rank `r` wrote, or -1 before it did.
  pid_t Pid(int r) const {
    std::ifstream in(path() + "/rank" + std::to_string(r) + ".pid");
    pid_t pid = -1;
    in >> pid;
    return in ? pid : -1;
  }
  // Waits until `n` ranks wrote their pid; false after `timeout`.
  bool WaitForAll(int n, absl::Duration timeout) const {
    const absl::Time deadline = absl::Now() + timeout;
    while (absl::Now() < deadline) {
      int ready = 0;
      for (int r = 0; r < n; ++r) ready += Pid(r) > 0;
      if (ready == n) return true;
      usleep(10000);
    }
    return false;
  }

 private:
  evenstep::testing::TempDir dir_{"evenstep_pids"};
};

std::vector<std::string> Launch(int n, std::vector<std::string> rest) {
  std::vector<std::string> argv = {EVENSTEP_RUN, "-n", std::to_string(n), "--"};
  argv.insert(argv.end(), rest.begin(), rest.end());
  return argv;
}

TEST(LauncherTest, ThreeRanksAllReduceExactly) {
  Subprocess run(ProcessSpec{Launch(3, {EVENSTEP_RANK_HELPER, "collectives"}), {}});
  ProcessResult result = run.Wait(kHangBound);
  ASSERT_FALSE(result.timed_out) << result.output;
  EXPECT_EQ(result.exit_code, 0) << result.output;
  for (int r = 0; r < 3; ++r) {
    EXPECT_THAT(result.output,
                HasSubstr(absl::StrCat("[", r, "] collectives ok: rank ", r, " of 3")));
    EXPECT_THAT(result.output, HasSubstr(absl::StrCat("[", r, "] init ok: rank ", r, "/3 (local ",
                                                      r, "/3) via torchrun")));
  }
}

TEST(LauncherTest, FailingRankStopsTheOthersAndSetsTheExitCode) {
  PidDir pids;
  Subprocess run(ProcessSpec{Launch(3, {EVENSTEP_RANK_HELPER, "exit_code", "1", "7"}),
                             {{"EVENSTEP_TEST_PID_DIR", pids.path()}}});
  ProcessResult result = run.Wait(kHangBound);
  ASSERT_FALSE(result.timed_out) << result.output;
  EXPECT_EQ(result.exit_code, 7) << result.output;
  EXPECT_THAT(result.output, HasSubstr("evenstep-run: rank 1 exited with status 7"));
  for (int r = 0; r < 3; ++r) {
    ASSERT_GT(pids.Pid(r), 0) << "rank " << r << " never started\n" << result.output;
    EXPECT_FALSE(ProcessAlive(pids.Pid(r))) << "rank " << r << " left behind";
  }
}

// Under --evenstep_on_rank_loss=continue (the program's flag) a failed rank
// is lost to the others, not the end of them: they get no SIGTERM, and the
// launcher exits 0 when they finish. --on-rank-loss stop overrides it.
TEST(LauncherTest, UnderContinueAFailedRankLeavesTheOthersRunning) {
  const std::vector<std::string> program = {
      "/bin/sh", "-c",
      "trap 'echo got TERM; exit 9' TERM; if [ $RANK = 1 ]; then exit 5; fi; sleep 2; echo done",
      "sh", "--evenstep_on_rank_loss=continue"};
  Subprocess run(ProcessSpec{Launch(3, program), {}});
  ProcessResult result = run.Wait(kHangBound);
  ASSERT_FALSE(result.timed_out) << result.output;
  EXPECT_EQ(result.exit_code, 0) << result.output;
  EXPECT_THAT(result.output,
              HasSubstr("evenstep-run: rank 1 exited with status 5; the other 2 rank(s) go on "
                        "without it (--on-rank-loss continue)"));
  EXPECT_THAT(result.output, HasSubstr("[0] done"));
  EXPECT_THAT(result.output, HasSubstr("[2] done"));
  EXPECT_THAT(result.output, HasSubstr("1 rank(s) lost; the others finished"));
  EXPECT_THAT(result.output, Not(HasSubstr("got TERM")));

  std::vector<std::string> stop = {EVENSTEP_RUN, "-n", "3", "--on-rank-loss", "stop", "--"};
  stop.insert(stop.end(), program.begin(), program.end());
  Subprocess stopped(ProcessSpec{stop, {}});
  result = stopped.Wait(kHangBound);
  ASSERT_FALSE(result.timed_out) << result.output;
  EXPECT_EQ(result.exit_code, 5) << result.output;
  EXPECT_THAT(result.output, HasSubstr("rank 1 exited with status 5; stopping the other"));
}

// --respawn: a lost rank's replacement (EVENSTEP_JOIN=1) joins the ranks
// that went on; after their admission every rank of the launch is in one
// world again and all-reduces exactly.
TEST(LauncherTest, RespawnStartsAReplacementThatJoinsTheRunningRanks) {
  std::vector<std::string> launch = {EVENSTEP_RUN, "-n", "3", "--respawn", "1", "--"};
  for (const char* arg : {EVENSTEP_RANK_HELPER, "--evenstep_on_rank_loss=continue",
                          "--evenstep_lost_after=2s", "--evenstep_timeout=20s", "rejoin", "1"}) {
    launch.push_back(arg);
  }
  Subprocess run(ProcessSpec{launch, {}});
  ProcessResult result = run.Wait(kHangBound);
  ASSERT_FALSE(result.timed_out) << result.output;
  EXPECT_EQ(result.exit_code, 0) << result.output;
  EXPECT_THAT(result.output, HasSubstr("evenstep-run: rank 1 exited with status 9"));
  EXPECT_THAT(result.output, HasSubstr("started a replacement for rank 1 (EVENSTEP_JOIN=1"));
  EXPECT_THAT(result.output, HasSubstr("[0] admitted: rank(s) 2 joined; 3 rank(s) go on"));
  EXPECT_THAT(result.output, HasSubstr("[1] joined: rank 2 of 3, sum 6"));
  EXPECT_THAT(result.output, HasSubstr("[0] after the admission: rank 0 of 3, sum 6"));

  Subprocess refused(ProcessSpec{{EVENSTEP_RUN, "-n", "2", "--respawn", "1", "--", "true"}, {}});
  result = refused.Wait(kHangBound);
  EXPECT_EQ(result.exit_code, 2) << result.output;
  EXPECT_THAT(result.output, HasSubstr("--respawn needs --on-rank-loss continue"));
}

TEST(LauncherTest, KilledRankMakesTheLauncherFailWithNoOrphans) {
  PidDir pids;
  Subprocess run(ProcessSpec{Launch(3, {EVENSTEP_RANK_HELPER, "hang"}),
                             {{"EVENSTEP_TEST_PID_DIR", pids.path()}}});
  ASSERT_TRUE(pids.WaitForAll(3, kHangBound));
  ASSERT_EQ(kill(pids.Pid(1), SIGKILL), 0);
  // The acceptance bound is 10 s; a hang beyond it fails here.
  ProcessResult result = run.Wait(absl::Seconds(10));
  ASSERT_FALSE(result.timed_out) << result.output;
  EXPECT_EQ(result.exit_code, 128 + SIGKILL) << result.output;
  EXPECT_THAT(result.output, HasSubstr("rank 1 was killed by signal 9"));
  for (int r = 0; r < 3; ++r) EXPECT_FALSE(ProcessAlive(pids.Pid(r))) << "rank " << r;
}

TEST(LauncherTest, KilledLauncherLeavesNoProcessOfTheJob) {
  // The rank starts a child of its own (it writes the child's pid); SIGKILL
  // to the launcher must take the rank and that child with it.
  PidDir pids;
  Subprocess run(ProcessSpec{
      Launch(1, {"/bin/sh", "-c", "sleep 1000 & echo $! > $EVENSTEP_TEST_PID_DIR/rank0.pid; wait"}),
      {{"EVENSTEP_TEST_PID_DIR", pids.path()}}});
  ASSERT_TRUE(pids.WaitForAll(1, kHangBound));
  const pid_t child = pids.Pid(0);
  ASSERT_TRUE(ProcessAlive(child));
  ASSERT_EQ(kill(run.pid(), SIGKILL), 0);
  run.Wait(kHangBound);
  // Bounded wait for the kernel to deliver the kills (not a timing check).
  const absl::Time deadline = absl::Now() + kHangBound;
  while (ProcessAlive(child) && absl::Now() < deadline) usleep(10000);
  EXPECT_FALSE(ProcessAlive(child)) << "the rank's child " << child << " survived the launcher";
}

TEST(LauncherTest, ForwardsSigtermToEveryRank) {
  PidDir pids;
  Subprocess run(ProcessSpec{Launch(2, {EVENSTEP_RANK_HELPER, "wait_for_sigterm"}),
                             {{"EVENSTEP_TEST_PID_DIR", pids.path()}}});
  ASSERT_TRUE(pids.WaitForAll(2, kHangBound));
  ASSERT_EQ(kill(run.pid(), SIGTERM), 0);
  ProcessResult result = run.Wait(kHangBound);
  ASSERT_FALSE(result.timed_out) << result.output;
  EXPECT_EQ(result.exit_code, 128 + SIGTERM) << result.output;
  EXPECT_THAT(result.output, HasSubstr("[0] got SIGTERM"));
  EXPECT_THAT(result.output, HasSubstr("[1] got SIGTERM"));
}

// A rank of a program linked with evenstep that gets the preemption signal
// before any Session exists (here: before its rendezvous) has no step of
// this run to save: it says so and exits 83 at once, and so does the
// launcher (not 128 + SIGTERM: the scheduler sees a preemption to requeue).
TEST(LauncherTest, APreemptionBeforeTheSessionExitsAt83WithNothingToSave) {
  for (int sig : {SIGTERM, SIGUSR1}) {
    PidDir pids;
    Subprocess run(ProcessSpec{Launch(2, {EVENSTEP_RANK_HELPER, "hang"}),
                               {{"EVENSTEP_TEST_PID_DIR", pids.path()}}});
    ASSERT_TRUE(pids.WaitForAll(2, kHangBound));
    ASSERT_EQ(kill(run.pid(), sig), 0);
    ProcessResult result = run.Wait(kHangBound);
    ASSERT_FALSE(result.timed_out) << result.output;
    EXPECT_EQ(result.exit_code, 83) << "signal " << sig << "\n" << result.output;
    for (const char* rank : {"[0] ", "[1] "}) {
      EXPECT_THAT(result.output,
                  HasSubstr(absl::StrCat(rank, "[evenstep] signal ", sig,
                                         " outside a Session: no step of this run in progress")))
          << result.output;
    }
  }
}

TEST(LauncherTest, ForwardedSignalGivesTheRanksTheGraceToSaveThenExits83) {
  // Each rank takes 4 s to "save" after SIGTERM (beyond the old fixed 3 s)
  // and exits with kPreemptedExitCode; the launcher waits (--grace 60s) and
  // exits 83 itself, which a job script can requeue on. Ctrl-C (SIGINT to
  // the launcher) reaches the ranks as SIGTERM, the signal a Session saves
  // on (SIGINT used to end them with nothing saved, rc 130).
  for (int sig : {SIGTERM, SIGINT}) {
    SCOPED_TRACE(strsignal(sig));
    PidDir pids;
    Subprocess run(ProcessSpec{{EVENSTEP_RUN, "-n", "2", "--grace", "60s", "--", "/bin/sh", "-c",
                                "trap 'sleep 4; echo saved; exit 83' TERM; echo $$ > "
                                "$EVENSTEP_TEST_PID_DIR/rank$RANK.pid;"
                                " while :; do sleep 0.05; done"},
                               {{"EVENSTEP_TEST_PID_DIR", pids.path()}}});
    ASSERT_TRUE(pids.WaitForAll(2, kHangBound));
    ASSERT_EQ(kill(run.pid(), sig), 0);
    ProcessResult result = run.Wait(kHangBound);
    ASSERT_FALSE(result.timed_out) << result.output;
    EXPECT_EQ(result.exit_code, 83) << result.output;
    EXPECT_THAT(result.output, HasSubstr("[0] saved"));
    EXPECT_THAT(result.output, HasSubstr("[1] saved"));
    EXPECT_THAT(result.output, Not(HasSubstr("after the grace period")));
    if (sig == SIGINT) EXPECT_THAT(result.output, HasSubstr("sending SIGTERM to 2 rank(s)"));
  }
}

TEST(LauncherTest, ASecondSignalKillsAtOnce) {
  PidDir pids;
  Subprocess run(
      ProcessSpec{{EVENSTEP_RUN, "-n", "2", "--grace", "600s", "--", "/bin/sh", "-c",
                   "trap 'echo stopping' TERM; echo $$ > $EVENSTEP_TEST_PID_DIR/rank$RANK.pid;"
                   " while :; do sleep 0.05; done"},
                  {{"EVENSTEP_TEST_PID_DIR", pids.path()}}});
  ASSERT_TRUE(pids.WaitForAll(2, kHangBound));
  ASSERT_EQ(kill(run.pid(), SIGTERM), 0);
  ASSERT_TRUE(run.WaitForOutput("[1] stopping", kHangBound)) << run.OutputSoFar();
  ASSERT_TRUE(run.WaitForOutput("[0] stopping", kHangBound)) << run.OutputSoFar();
  ASSERT_EQ(kill(run.pid(), SIGTERM), 0);
  // Far within the 600 s grace: a launcher that waited for it times out here.
  ProcessResult result = run.Wait(kHangBound);
  ASSERT_FALSE(result.timed_out) << result.output;
  EXPECT_EQ(result.exit_code, 128 + SIGTERM) << result.output;
  EXPECT_THAT(result.output, HasSubstr("second signal"));
  for (int r = 0; r < 2; ++r) EXPECT_FALSE(ProcessAlive(pids.Pid(r))) << "rank " << r;
}

TEST(LauncherTest, ARanksPreemptionExitIsNotAFailure) {
  // Rank 0 exits 83 first (it got the preemption notice straight from the
  // scheduler, as Slurm signals every task); rank 1 is still saving. The
  // launcher must not SIGTERM it as the survivor of a failure.
  Subprocess run(ProcessSpec{
      Launch(2, {"/bin/sh", "-c",
                 "trap 'echo got TERM' TERM; if [ $RANK = 0 ]; then exit 83; fi; sleep 2;"
                 " echo saved; exit 83"}),
      {}});
  ProcessResult result = run.Wait(kHangBound);
  ASSERT_FALSE(result.timed_out) << result.output;
  EXPECT_EQ(result.exit_code, 83) << result.output;
  EXPECT_THAT(result.output, HasSubstr("rank 0 stopped for preemption"));
  EXPECT_THAT(result.output, HasSubstr("[1] saved"));
  EXPECT_THAT(result.output, Not(HasSubstr("got TERM")));
  EXPECT_THAT(result.output, Not(HasSubstr("stopping the other")));
}

TEST(LauncherTest, PartialLinesArePrefixed) {
  Subprocess run(ProcessSpec{Launch(2, {"/bin/sh", "-c", "printf 'a\\nb'; printf 'c' >&2"}), {}});
  ProcessResult result = run.Wait(kHangBound);
  EXPECT_EQ(result.exit_code, 0) << result.output;
  EXPECT_THAT(result.output, HasSubstr("[0] a\n"));
  EXPECT_THAT(result.output, HasSubstr("[1] b\n"));
  EXPECT_THAT(result.output, HasSubstr("[1] c\n"));
}

TEST(LauncherTest, MissingProgramFailsWith127) {
  Subprocess run(ProcessSpec{Launch(2, {"/nonexistent/program"}), {}});
  ProcessResult result = run.Wait(kHangBound);
  EXPECT_EQ(result.exit_code, 127) << result.output;
  EXPECT_THAT(result.output, HasSubstr("cannot execute /nonexistent/program"));
}

TEST(LauncherTest, UsageErrors) {
  for (const auto& argv : std::vector<std::vector<std::string>>{
           {EVENSTEP_RUN, "--", "true"},
           {EVENSTEP_RUN, "-n", "0", "--", "true"},
           {EVENSTEP_RUN, "-n", "2"},
           {EVENSTEP_RUN, "-n", "2", "--bogus", "--", "true"},
           {EVENSTEP_RUN, "-n", "2", "--on-rank-loss", "maybe", "--", "true"}}) {
    Subprocess run(ProcessSpec{argv, {}});
    ProcessResult result = run.Wait(kHangBound);
    EXPECT_EQ(result.exit_code, 2) << result.output;
    EXPECT_THAT(result.output, HasSubstr("usage: evenstep-run"));
  }
}

}  // namespace
}  // namespace evenstep

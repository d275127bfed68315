// base/'s status macros: errors pass through unchanged without a context,
// gain "<context>: " at each hop with one, and keep their code and payloads;
// the context is built only on the error path.
#include "evenstep/status_macros.h"

#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/cord.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace evenstep {
namespace {

int g_context_built = 0;
std::string Step(int step) {
  ++g_context_built;
  return "step " + std::to_string(step);
}

absl::Status Fail() {
  absl::Status s = absl::DataLossError("shard-00001-of-00002.h5: checksum mismatch");
  s.SetPayload("evenstep/rank", absl::Cord("1"));
  return s;
}

absl::StatusOr<int> Value(bool ok) {
  if (ok) return 7;
  return Fail();
}

absl::Status Plain() {
  EVENSTEP_RETURN_IF_ERROR(Fail());
  return absl::OkStatus();
}

absl::Status Reader() {
  EVENSTEP_RETURN_IF_ERROR(Fail(), "reading checkpoint ", Step(12));
  return absl::OkStatus();
}

absl::Status Loader() {
  EVENSTEP_RETURN_IF_ERROR(Reader(), "rank ", 1, ": resume");
  return absl::OkStatus();
}

absl::StatusOr<int> Assign(bool ok) {
  EVENSTEP_ASSIGN_OR_RETURN(const int v, Value(ok), "the value of ", Step(3));
  EVENSTEP_ASSIGN_OR_RETURN(int w, Value(true));
  return v + w;
}

TEST(StatusMacrosTest, WithoutContextTheStatusPassesUnchanged) { EXPECT_EQ(Plain(), Fail()); }

TEST(StatusMacrosTest, EachHopAddsItsContextAndKeepsCodeAndPayload) {
  const absl::Status s = Loader();
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(s.message(),
            "rank 1: resume: reading checkpoint step 12: shard-00001-of-00002.h5: checksum "
            "mismatch");
  ASSERT_TRUE(s.GetPayload("evenstep/rank").has_value());
  EXPECT_EQ(*s.GetPayload("evenstep/rank"), "1");
}

TEST(StatusMacrosTest, AssignOrReturnAnnotatesAndAssigns) {
  const absl::StatusOr<int> bad = Assign(false);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(std::string(bad.status().message()), ::testing::StartsWith("the value of step 3: "));
  const absl::StatusOr<int> good = Assign(true);
  ASSERT_TRUE(good.ok()) << good.status();
  EXPECT_EQ(*good, 14);
}

TEST(StatusMacrosTest, TheContextIsBuiltOnlyOnError) {
  g_context_built = 0;
  ASSERT_TRUE(Assign(true).ok());
  EXPECT_EQ(g_context_built, 0);
  Assign(false).IgnoreError();
  EXPECT_EQ(g_context_built, 1);
}

TEST(StatusMacrosTest, AnnotateLeavesOkAndEmptyContextAlone) {
  EXPECT_TRUE(Annotate(absl::OkStatus(), "context").ok());
  EXPECT_EQ(Annotate(Fail(), ""), Fail());
}

}  // namespace
}  // namespace evenstep

// PosixEnv's directory work without std::filesystem (io/env.cc): paths
// normalised as std::filesystem's lexically_normal would (its path
// arithmetic is the reference here; the tree walks are what this project
// no longer calls), and trees listed, made and removed with POSIX calls,
// links removed and never followed.
#include "evenstep/env.h"

#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/temp_dir.h"

namespace evenstep {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

// std::filesystem's answer, as NormalPath documents it.
std::string Reference(const std::string& path) {
  std::filesystem::path p = std::filesystem::path(path).lexically_normal();
  if (!p.has_filename() && p.has_parent_path() && p != p.root_path()) p = p.parent_path();
  return p.empty() ? "." : p.string();
}

// ("//" alone differs: std::filesystem keeps it, as POSIX lets an
// implementation give it a meaning of its own; NormalPath says "/".)
TEST(EnvPathTest, NormalPathAndParentDirAgreeWithStdFilesystem) {
  for (const std::string path :
       {"", ".", "./", "/", "a", "a/", "a/b", "a//b/", "./a/./b/.", "a/../b", "a/..", "../a",
        "../../a/..", "/..", "/../a", "/a/b/../../..", "a/b/c/../../d", "..", "../.."}) {
    EXPECT_EQ(NormalPath(path), Reference(path)) << "'" << path << "'";
    const std::filesystem::path normal(Reference(path));
    const std::string parent = normal.has_parent_path() ? normal.parent_path().string() : ".";
    EXPECT_EQ(ParentDir(path), parent) << "'" << path << "'";
  }
  EXPECT_EQ(BaseName("runs/a/trace-00001.json"), "trace-00001.json");
  EXPECT_EQ(BaseName("x"), "x");
}

void Touch(const std::string& path) { std::ofstream(path) << "x"; }

TEST(EnvDirTest, MakeListAndRemoveATreeWithoutFollowingLinks) {
  testing::TempDir tmp("env_test");
  const std::string root = tmp.path() + "/tree";
  ASSERT_TRUE(internal::MakeDirs(root + "/a/b/c").ok());
  ASSERT_TRUE(internal::MakeDirs(root + "/a/b/c").ok()) << "existing directories are fine";
  Touch(root + "/a/file");
  Touch(root + "/a/b/c/deep");
  // Links into a directory and a file outside the tree: removed, not followed.
  ASSERT_TRUE(internal::MakeDirs(tmp.path() + "/outside").ok());
  Touch(tmp.path() + "/outside/keep");
  ASSERT_EQ(::symlink((tmp.path() + "/outside").c_str(), (root + "/a/dirlink").c_str()), 0);
  ASSERT_EQ(::symlink((tmp.path() + "/outside/keep").c_str(), (root + "/filelink").c_str()), 0);
  auto names = internal::ListDir(root + "/a");
  ASSERT_TRUE(names.ok()) << names.status();
  EXPECT_THAT(*names, ElementsAre("b", "dirlink", "file"));

  ASSERT_TRUE(internal::RemoveTree(root).ok());
  EXPECT_NE(::access(root.c_str(), F_OK), 0);
  EXPECT_EQ(::access((tmp.path() + "/outside/keep").c_str(), F_OK), 0) << "a link was followed";
  EXPECT_TRUE(internal::RemoveTree(root).ok()) << "a missing tree is already removed";

  const absl::StatusOr<std::vector<std::string>> missing = internal::ListDir(root);
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound) << missing.status();
  // A file where a directory should be: named.
  Touch(tmp.path() + "/plain");
  const absl::Status blocked = internal::MakeDirs(tmp.path() + "/plain/sub");
  EXPECT_FALSE(blocked.ok());
  EXPECT_THAT(std::string(blocked.message()), HasSubstr("plain"));
  // The Env is the same code.
  ASSERT_TRUE(Env::Default()->CreateDirs(root + "/x/y").ok());
  EXPECT_THAT(*Env::Default()->List(root), ElementsAre("x"));
  ASSERT_TRUE(Env::Default()->RemoveTree(root).ok());
  EXPECT_FALSE(Env::Default()->Exists(root));
}

}  // namespace
}  // namespace evenstep

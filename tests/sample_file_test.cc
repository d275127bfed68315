// SampleFile: the file-backed dataset the benchmarks read with pread. What a
// reader gets back, and what it is told when the file is not what it should
// be (each error names the file and what is wrong).
#include "samples/sample_file.h"

#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/temp_dir.h"

namespace {

using evenstep::samples::SampleFile;
using evenstep::samples::WriteSampleFile;
using ::testing::HasSubstr;

std::vector<std::string> RandomSamples(int n) {
  std::mt19937 rng(7);
  std::vector<std::string> out;
  for (int i = 0; i < n; ++i) {
    std::string s(rng() % 3000, '\0');  // 0 to 2999 bytes, empty ones included
    for (char& c : s) c = static_cast<char>(rng());
    out.push_back(std::move(s));
  }
  return out;
}

TEST(SampleFileTest, EverySampleReadsBackExactlyAlsoColdAndFromManyThreads) {
  evenstep::testing::TempDir dir("evenstep_samples");
  const std::vector<std::string> samples = RandomSamples(500);
  ASSERT_TRUE(WriteSampleFile(dir / "s.samples", samples).ok());
  EXPECT_FALSE(std::filesystem::exists(dir / "s.samples.tmp"));
  auto file = SampleFile::Open(dir / "s.samples");
  ASSERT_TRUE(file.ok()) << file.status();
  ASSERT_EQ((*file)->size(), 500);
  std::vector<int64_t> lengths;
  for (const std::string& s : samples) lengths.push_back(static_cast<int64_t>(s.size()));
  EXPECT_EQ((*file)->lengths(), lengths);
  ASSERT_TRUE((*file)->DropCache().ok());
  const double resident = (*file)->ResidentFraction();
  EXPECT_GE(resident, 0.0);
  EXPECT_LE(resident, 1.0);
  // Four threads read every sample, in different orders, at once.
  std::vector<int> wrong(4, 0);
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int k = 0; k < 500; ++k) {
        const int i = (k * (2 * t + 1) + t) % 500;
        auto got = (*file)->Read(i);
        if (!got.ok() || *got != samples[i]) ++wrong[t];
      }
    });
  }
  for (std::thread& th : threads) th.join();
  EXPECT_EQ(wrong, (std::vector<int>{0, 0, 0, 0}));
  auto missing = (*file)->Read(500);
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kOutOfRange);
  EXPECT_THAT(missing.status().message(), HasSubstr("sample 500 does not exist (500 samples)"));
}

// Writes `bytes` as the file and returns Open's error message.
std::string OpenError(const evenstep::testing::TempDir& dir, const std::string& bytes) {
  {
    std::ofstream out(dir / "bad.samples", std::ios::binary | std::ios::trunc);
    out << bytes;
  }
  auto file = SampleFile::Open(dir / "bad.samples");
  EXPECT_FALSE(file.ok());
  return file.ok() ? "" : std::string(file.status().message());
}

TEST(SampleFileTest, ADamagedFileIsRefusedNamingItAndWhatIsWrong) {
  evenstep::testing::TempDir dir("evenstep_samples");
  ASSERT_TRUE(WriteSampleFile(dir / "good.samples", RandomSamples(20)).ok());
  std::string good;
  {
    std::ifstream in(dir / "good.samples", std::ios::binary);
    good.assign(std::istreambuf_iterator<char>(in), {});
  }
  const std::string path = dir / "bad.samples";
  EXPECT_THAT(OpenError(dir, "hello"), HasSubstr(path + ": not an evenstep sample file"));
  EXPECT_THAT(OpenError(dir, std::string(good.size(), 'x')), HasSubstr("not an evenstep sample"));
  // Cut short: the last sample's bytes are missing.
  EXPECT_THAT(OpenError(dir, good.substr(0, good.size() - 5)), HasSubstr("should end at byte"));
  // Cut inside the offsets.
  EXPECT_THAT(OpenError(dir, good.substr(0, 40)), HasSubstr("truncated"));
  // Offsets out of order (sample 3's end before its start).
  std::string swapped = good;
  const size_t at = 16 + 4 * 8;  // offsets[4]
  swapped.replace(at, 8, std::string(8, '\0'));
  EXPECT_THAT(OpenError(dir, swapped), HasSubstr("offsets out of order at sample 3"));
  // A count that would need more bytes than the file has.
  std::string huge = good;
  huge.replace(8, 8, std::string(7, '\xff') + '\x7f');
  EXPECT_THAT(OpenError(dir, huge), HasSubstr("truncated"));
  auto none = SampleFile::Open(dir / "absent.samples");
  EXPECT_EQ(none.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(none.status().message(), HasSubstr(dir / "absent.samples"));
  // A file that cannot be written is reported naming it; nothing is left.
  absl::Status s = WriteSampleFile(dir / "no/such/dir/x.samples", {"a"});
  EXPECT_FALSE(s.ok());
  EXPECT_THAT(s.message(), HasSubstr("no/such/dir/x.samples"));
}

}  // namespace

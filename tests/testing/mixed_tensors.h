// Tensors of several dtypes and layouts for the DeviceFeeder tests
// (device_feed_test.cc on the CPU, cuda_test.cc on a GPU), and the check that
// a feed delivered exact copies of them.
#pragma once

#include <ATen/ATen.h>

#include <vector>

#include "gtest/gtest.h"

namespace evenstep::testing {

// Tensors of several dtypes and layouts, their values kept to compare.
inline std::vector<at::Tensor> Mixed(int seed) {
  at::manual_seed(seed);
  return {at::randn({3, 5}),
          at::randint(0, 1000, {7}, at::kLong),
          at::randn({4, 6}).t(),  // not contiguous
          at::rand({9}) > 0.5,    // bool, 9 bytes: the next offset is aligned
          at::randn({2, 3}).to(at::kHalf),
          at::empty({0, 4}),  // no bytes
          at::Tensor()};      // undefined: left alone
}

inline void ExpectFedCopies(const std::vector<at::Tensor>& before,
                            const std::vector<at::Tensor>& after, const c10::Device& device) {
  ASSERT_EQ(before.size(), after.size());
  for (size_t i = 0; i < before.size(); ++i) {
    if (!before[i].defined()) {
      EXPECT_FALSE(after[i].defined()) << i;
      continue;
    }
    EXPECT_EQ(after[i].device(), device) << i;
    EXPECT_EQ(after[i].scalar_type(), before[i].scalar_type()) << i;
    EXPECT_EQ(after[i].sizes(), before[i].sizes()) << i;
    EXPECT_TRUE(at::equal(after[i].cpu(), before[i])) << i;
    if (before[i].numel() > 0) {
      // Its own memory: neither the loaded tensor's nor the staging buffer's.
      EXPECT_NE(after[i].data_ptr(), before[i].data_ptr()) << i;
    }
  }
}

}  // namespace evenstep::testing

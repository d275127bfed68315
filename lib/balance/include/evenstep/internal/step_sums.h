// The sums over all ranks that every step reports (BalancedStep::DeclareSum
// and AddToSum, StepReport::sums): the declared names and this rank's sums
// in the running step, doubles and tensors (summed on their device, read
// once after the micro-steps). A micro-batch replayed after an
// out-of-memory error adds again, so the sums are marked as each part and
// each micro-batch begins, and rewound to a mark before a replay.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstddef>
#include <string>
#include <vector>

#include "absl/status/status.h"

namespace evenstep::internal {

class StepSums {
 public:
  // Before the first step only, each name once (FailedPrecondition naming
  // the rank otherwise).
  absl::Status Declare(const std::string& name, int rank);
  const std::vector<std::string>& names() const { return names_; }
  size_t size() const { return names_.size(); }

  // A step begins: every sum zero, no more declarations.
  void BeginStep();
  // Throws std::invalid_argument for an undeclared name or outside a step.
  void Add(const std::string& name, double value, bool in_step);
  void Add(const std::string& name, const at::Tensor& value, bool in_step);
  // The tensors' sums added into the doubles (a device sync; may throw).
  void Collect();
  double value(size_t k) const { return values_[k]; }

  // The sums, and `loss` (the running part's loss so far), as the running
  // part or micro-batch begins; Rewind restores a mark and returns its loss.
  void MarkPart(const at::Tensor& loss) { part_ = {values_, tensors_, loss}; }
  void MarkMicroBatch(const at::Tensor& loss) { micro_batch_ = {values_, tensors_, loss}; }
  at::Tensor Rewind(bool to_part_start);

 private:
  size_t Index(const std::string& name, bool in_step) const;
  struct Mark {
    std::vector<double> values;
    std::vector<at::Tensor> tensors;
    at::Tensor loss;
  };
  std::vector<std::string> names_;
  bool began_ = false;  // a step has begun (no more Declare)
  std::vector<double> values_;
  std::vector<at::Tensor> tensors_;
  Mark part_, micro_batch_;
};

}  // namespace evenstep::internal

// The loop's own variables that a Session keeps across a resume
// (Session::Keep): numbers, counters, strings, vectors of numbers and
// tensors, each registered by name with a pointer to the loop's variable.
// Read when a checkpoint is taken and written back, exactly, when a resumed
// run registers the same name.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <string>
#include <variant>
#include <vector>

#include "absl/status/status.h"
#include "evenstep/named_tensor.h"

namespace evenstep::internal {

class KeptValues {
 public:
  using Pointer = std::variant<double*, float*, int64_t*, int*, size_t*, bool*, std::string*,
                               std::vector<double>*, std::vector<int64_t>*, at::Tensor*>;
  // Loads the tensor saved as `name` into `*tensor` (same shape and dtype).
  using TensorLoader = std::function<absl::Status(const std::string& name, at::Tensor* tensor)>;

  // Registers `value` under `name`. With `saved` (the "kept" object of the
  // resumed checkpoint's JSON, "" when the run did not resume) the value is
  // restored from it first: numbers exactly (doubles round-trip, NaN and
  // infinities included), a tensor through `load` (as "loop/<name>").
  // InvalidArgument for an empty or repeated name, a null pointer, or a
  // saved value of another type; FailedPrecondition when `saved` lacks it.
  // A saved null (the variable's scope had ended when the checkpoint was
  // taken, see Unbind) leaves `*value` as it is.
  absl::Status Add(const std::string& name, Pointer value, const std::string& saved,
                   const TensorLoader& load);
  // `name` (registered, now unbound) bound to the new variable `value`
  // (evenstep::Kept declared again, e.g. in the next epoch): NotFound for a
  // name never registered, InvalidArgument for another type or a name whose
  // variable is still bound (two live variables of one name).
  absl::Status Rebind(const std::string& name, Pointer value);
  // `name`'s variable went out of scope: checkpoints save it as null until
  // it is bound again.
  void Unbind(const std::string& name);
  bool Has(const std::string& name) const;
  // The values as they are now: a JSON object (a tensor's entry says
  // whether it was defined; an unbound variable is null) and the defined
  // tensors, as "loop/<name>".
  std::string Json() const;
  void AddTensors(NamedTensors* out) const;
  bool empty() const { return kept_.empty(); }

 private:
  struct Entry {
    std::string name;
    Pointer value;
    bool bound = true;
  };
  std::vector<Entry> kept_;
};

}  // namespace evenstep::internal

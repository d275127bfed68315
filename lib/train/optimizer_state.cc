// Optimizer state <-> named tensors; see internal/optimizer_state.h.
#include "evenstep/internal/optimizer_state.h"

#include <type_traits>

#include "absl/strings/str_cat.h"

namespace evenstep::internal {
namespace {

using torch::optim::OptimizerParamState;

// One tensor field of a state class S: its name and libtorch's accessors.
template <typename S>
struct Field {
  const char* name;
  at::Tensor (*get)(const S&);
  void (*set)(S&, const at::Tensor&);
};

template <typename S>
std::vector<Field<S>> AdamFields() {
  return {{"exp_avg", [](const S& s) { return s.exp_avg(); },
           [](S& s, const at::Tensor& t) { s.exp_avg(t); }},
          {"exp_avg_sq", [](const S& s) { return s.exp_avg_sq(); },
           [](S& s, const at::Tensor& t) { s.exp_avg_sq(t); }},
          {"max_exp_avg_sq", [](const S& s) { return s.max_exp_avg_sq(); },
           [](S& s, const at::Tensor& t) { s.max_exp_avg_sq(t); }}};
}

std::vector<Field<torch::optim::SGDParamState>> SgdFields() {
  using S = torch::optim::SGDParamState;
  return {{"momentum_buffer", [](const S& s) { return s.momentum_buffer(); },
           [](S& s, const at::Tensor& t) { s.momentum_buffer(t); }}};
}

std::vector<Field<torch::optim::RMSpropParamState>> RmspropFields() {
  using S = torch::optim::RMSpropParamState;
  return {{"square_avg", [](const S& s) { return s.square_avg(); },
           [](S& s, const at::Tensor& t) { s.square_avg(t); }},
          {"momentum_buffer", [](const S& s) { return s.momentum_buffer(); },
           [](S& s, const at::Tensor& t) { s.momentum_buffer(t); }},
          {"grad_avg", [](const S& s) { return s.grad_avg(); },
           [](S& s, const at::Tensor& t) { s.grad_avg(t); }}};
}

std::vector<Field<torch::optim::AdagradParamState>> AdagradFields() {
  using S = torch::optim::AdagradParamState;
  return {{"sum", [](const S& s) { return s.sum(); }, [](S& s, const at::Tensor& t) { s.sum(t); }}};
}

// The step count of state classes that have one.
template <typename S>
constexpr bool kHasStep = !std::is_same_v<S, torch::optim::SGDParamState>;

// `required`: how many of `fields` (from the front) every state holds.
template <typename Opt, typename S>
OptimizerKind Kind(const std::string& name, std::vector<Field<S>> fields, size_t required) {
  OptimizerKind k;
  k.name = name;
  for (const Field<S>& f : fields) k.fields.push_back(f.name);
  k.required.assign(k.fields.begin(), k.fields.begin() + required);
  k.has_step = kHasStep<S>;
  k.is = [](const torch::optim::Optimizer& o) { return dynamic_cast<const Opt*>(&o) != nullptr; };
  k.capture = [fields, name](const OptimizerParamState& base, NamedTensors* out,
                             const std::string& prefix) -> absl::Status {
    const S* s = dynamic_cast<const S*>(&base);
    if (s == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat(prefix, ": the optimizer holds a state that is not ", name, "'s"));
    }
    for (const Field<S>& f : fields) {
      at::Tensor t = f.get(*s);
      if (t.defined()) out->push_back({prefix + f.name, t});
    }
    if constexpr (kHasStep<S>) {
      out->push_back({prefix + "step", at::scalar_tensor(s->step(), at::kLong)});
    }
    return absl::OkStatus();
  };
  k.restore = [fields](const std::map<std::string, at::Tensor>& values) {
    auto s = std::make_unique<S>();
    for (const Field<S>& f : fields) {
      if (auto it = values.find(f.name); it != values.end()) f.set(*s, it->second);
    }
    if constexpr (kHasStep<S>) {
      if (auto it = values.find("step"); it != values.end()) s->step(it->second.item<int64_t>());
    }
    return std::unique_ptr<OptimizerParamState>(std::move(s));
  };
  return k;
}

const std::vector<OptimizerKind>& Kinds() {
  static const std::vector<OptimizerKind> kinds = {
      Kind<torch::optim::SGD>("SGD", SgdFields(), 0),
      Kind<torch::optim::Adam>("Adam", AdamFields<torch::optim::AdamParamState>(), 2),
      Kind<torch::optim::AdamW>("AdamW", AdamFields<torch::optim::AdamWParamState>(), 2),
      Kind<torch::optim::RMSprop>("RMSprop", RmspropFields(), 1),
      Kind<torch::optim::Adagrad>("Adagrad", AdagradFields(), 1),
  };
  return kinds;
}

}  // namespace

absl::StatusOr<const OptimizerKind*> OptimizerKindOf(const torch::optim::Optimizer& optimizer) {
  for (const OptimizerKind& k : Kinds()) {
    if (k.is(optimizer)) return &k;
  }
  return absl::InvalidArgumentError(
      "checkpoint: this optimizer type is not supported (SGD, Adam, AdamW, RMSprop, Adagrad are)");
}

}  // namespace evenstep::internal

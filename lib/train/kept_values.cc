// The loop's own variables across a resume (Session::Keep).
#include "evenstep/internal/kept_values.h"

#include <ATen/ATen.h>

#include <cmath>
#include <limits>
#include <type_traits>

#include "absl/strings/str_cat.h"
#include "evenstep/status_macros.h"
#include "nlohmann/json.hpp"

namespace evenstep::internal {
namespace {

using nlohmann::json;

template <typename T>
constexpr const char* TypeName() {
  if constexpr (std::is_same_v<T, double>) return "double";
  if constexpr (std::is_same_v<T, float>) return "float";
  if constexpr (std::is_same_v<T, int64_t>) return "int64_t";
  if constexpr (std::is_same_v<T, int>) return "int";
  if constexpr (std::is_same_v<T, size_t>) return "size_t";
  if constexpr (std::is_same_v<T, bool>) return "bool";
  if constexpr (std::is_same_v<T, std::string>) return "string";
  if constexpr (std::is_same_v<T, std::vector<double>>) return "vector<double>";
  if constexpr (std::is_same_v<T, std::vector<int64_t>>) return "vector<int64_t>";
  return "tensor";
}

// JSON has no NaN or infinity: those are kept as strings.
json EncodeReal(double v) {
  if (std::isfinite(v)) return v;
  if (std::isnan(v)) return "nan";
  return v > 0 ? "inf" : "-inf";
}

bool DecodeReal(const json& j, double* out) {
  if (j.is_number()) {
    *out = j.get<double>();
    return true;
  }
  if (!j.is_string()) return false;
  const std::string s = j.get<std::string>();
  if (s == "nan") *out = std::numeric_limits<double>::quiet_NaN();
  if (s == "inf") *out = std::numeric_limits<double>::infinity();
  if (s == "-inf") *out = -std::numeric_limits<double>::infinity();
  return s == "nan" || s == "inf" || s == "-inf";
}

template <typename T>
json Encode(const T& v) {
  if constexpr (std::is_floating_point_v<T>) {
    return EncodeReal(v);
  } else if constexpr (std::is_same_v<T, std::vector<double>>) {
    json out = json::array();
    for (double x : v) out.push_back(EncodeReal(x));
    return out;
  } else if constexpr (std::is_same_v<T, at::Tensor>) {
    return json{{"tensor", v.defined()}};
  } else {
    return v;
  }
}

template <typename I>
bool DecodeInteger(const json& j, I* out) {
  if (j.is_number_unsigned()) {
    const uint64_t u = j.get<uint64_t>();
    if (u > static_cast<uint64_t>(std::numeric_limits<I>::max())) return false;
    *out = static_cast<I>(u);
    return true;
  }
  if (!j.is_number_integer()) return false;
  const int64_t s = j.get<int64_t>();
  if constexpr (std::is_unsigned_v<I>) {
    if (s < 0) return false;
  } else if (s < std::numeric_limits<I>::min() || s > std::numeric_limits<I>::max()) {
    return false;
  }
  *out = static_cast<I>(s);
  return true;
}

// `j` into `*out` when it holds a T; false otherwise (nothing written).
template <typename T>
bool Decode(const json& j, T* out) {
  if constexpr (std::is_floating_point_v<T>) {
    double v = 0;
    if (!DecodeReal(j, &v)) return false;
    *out = static_cast<T>(v);  // a float was saved as its exact double
    return true;
  } else if constexpr (std::is_same_v<T, bool>) {
    if (!j.is_boolean()) return false;
    *out = j.get<bool>();
    return true;
  } else if constexpr (std::is_integral_v<T>) {
    return DecodeInteger(j, out);
  } else if constexpr (std::is_same_v<T, std::string>) {
    if (!j.is_string()) return false;
    *out = j.get<std::string>();
    return true;
  } else {
    if (!j.is_array()) return false;
    T values(j.size());
    for (size_t i = 0; i < j.size(); ++i) {
      if (!Decode(j[i], &values[i])) return false;
    }
    *out = std::move(values);
    return true;
  }
}

// A kept tensor: defined or not as saved; a defined one loaded in place.
absl::Status RestoreTensor(const std::string& name, const json& saved, at::Tensor* out,
                           const KeptValues::TensorLoader& load, const std::string& where) {
  if (!saved.is_object() || !saved.contains("tensor") || !saved["tensor"].is_boolean()) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": the checkpoint holds a ", saved.type_name(), ", not a tensor"));
  }
  if (!saved["tensor"].get<bool>()) {
    *out = at::Tensor();
    return absl::OkStatus();
  }
  if (!out->defined()) {
    return absl::InvalidArgumentError(
        absl::StrCat(where,
                     ": the tensor is undefined; make it with the saved shape and dtype (a zeros "
                     "tensor) before Keep, which loads the saved values into it"));
  }
  absl::Status s = load("loop/" + name, out);
  if (!s.ok()) return absl::Status(s.code(), absl::StrCat(where, ": ", s.message()));
  return absl::OkStatus();
}

}  // namespace

absl::Status KeptValues::Add(const std::string& name, Pointer value, const std::string& saved,
                             const TensorLoader& load) {
  const std::string where = absl::StrCat("Session::Keep('", name, "')");
  if (name.empty()) return absl::InvalidArgumentError(absl::StrCat(where, ": an empty name"));
  if (std::visit([](auto* p) { return p == nullptr; }, value)) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": a null pointer"));
  }
  for (const Entry& kept : kept_) {
    if (kept.name == name) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": registered twice; every kept variable needs its own name"));
    }
  }
  // Null: the variable's scope had ended when the checkpoint was taken.
  if (!saved.empty()) {
    const json all = json::parse(saved, nullptr, false);
    if (!all.is_object() || !all.contains(name)) {
      return absl::FailedPreconditionError(absl::StrCat(
          where,
          ": the resumed checkpoint holds no kept value of that name (the run that saved "
          "it did not Keep it; keep the same names in every run of a run directory)"));
    }
    const json& entry = all[name];
    if (entry.is_null()) {
      kept_.push_back({name, value});
      return absl::OkStatus();
    }
    EVENSTEP_RETURN_IF_ERROR(std::visit(
        [&](auto* p) -> absl::Status {
          using T = std::remove_pointer_t<decltype(p)>;
          if constexpr (std::is_same_v<T, at::Tensor>) {
            return RestoreTensor(name, entry, p, load, where);
          } else {
            if (Decode(entry, p)) return absl::OkStatus();
            return absl::InvalidArgumentError(absl::StrCat(
                where, ": the resumed checkpoint holds ", entry.dump(), ", which is not a ",
                TypeName<T>(), " (was it kept as another type?)"));
          }
        },
        value));
  }
  kept_.push_back({name, value});
  return absl::OkStatus();
}

absl::Status KeptValues::Rebind(const std::string& name, Pointer value) {
  const std::string where = absl::StrCat("evenstep::Kept('", name, "')");
  for (Entry& kept : kept_) {
    if (kept.name != name) continue;
    if (kept.value.index() != value.index()) {
      return absl::InvalidArgumentError(absl::StrCat(
          where, ": declared again with another type; every kept variable keeps its type"));
    }
    if (kept.bound) {
      return absl::InvalidArgumentError(absl::StrCat(
          where,
          ": declared again while the variable of that name is still in scope; two live "
          "kept variables need two names"));
    }
    kept.value = value;
    kept.bound = true;
    return absl::OkStatus();
  }
  return absl::NotFoundError(absl::StrCat(where, ": never registered"));
}

void KeptValues::Unbind(const std::string& name) {
  for (Entry& kept : kept_) {
    if (kept.name == name) kept.bound = false;
  }
}

bool KeptValues::Has(const std::string& name) const {
  for (const Entry& kept : kept_) {
    if (kept.name == name) return true;
  }
  return false;
}

std::string KeptValues::Json() const {
  json out = json::object();
  for (const Entry& kept : kept_) {
    out[kept.name] =
        kept.bound ? std::visit([](auto* p) { return Encode(*p); }, kept.value) : json();
  }
  return out.dump();
}

void KeptValues::AddTensors(NamedTensors* out) const {
  for (const Entry& kept : kept_) {
    if (auto* const* t = std::get_if<at::Tensor*>(&kept.value);
        kept.bound && t != nullptr && (*t)->defined()) {
      out->emplace_back("loop/" + kept.name, **t);
    }
  }
}

}  // namespace evenstep::internal

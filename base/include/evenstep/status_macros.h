// Early-return helpers for absl::Status / absl::StatusOr, with an optional
// context that the error gains at each hop (tensorstore's
// RETURN_IF_ERROR(expr, _.Format(...)) in absl::StrCat form):
//
//   EVENSTEP_RETURN_IF_ERROR(WriteShard(...));                       // as is
//   EVENSTEP_RETURN_IF_ERROR(WriteShard(...), "checkpoint of step ", step);
//   EVENSTEP_ASSIGN_OR_RETURN(auto file, env.OpenForRead(path), "manifest of ", dir);
//
// With a context, the returned status keeps the code and every payload and
// reads "<context>: <message>". Header-only; no state.
#pragma once

#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace evenstep {

// `status` with "<context>: " before its message, the same code and the same
// payloads; `status` itself when it is OK or `context` is empty.
inline absl::Status Annotate(absl::Status status, absl::string_view context) {
  if (status.ok() || context.empty()) return status;
  absl::Status annotated(status.code(), absl::StrCat(context, ": ", status.message()));
  status.ForEachPayload([&](absl::string_view type_url, const absl::Cord& payload) {
    annotated.SetPayload(type_url, payload);
  });
  return annotated;
}

}  // namespace evenstep

#define EVENSTEP_STATUS_CONCAT_INNER_(a, b) a##b
#define EVENSTEP_STATUS_CONCAT_(a, b) EVENSTEP_STATUS_CONCAT_INNER_(a, b)

// EVENSTEP_RETURN_IF_ERROR(expr [, context...]): evaluates `expr` (an
// absl::Status) and returns it, annotated with absl::StrCat(context...),
// from the enclosing function when it is not OK. The context is evaluated
// only on error.
#define EVENSTEP_RETURN_IF_ERROR(...) EVENSTEP_RETURN_IF_ERROR_IMPL_(__VA_ARGS__, "")
#define EVENSTEP_RETURN_IF_ERROR_IMPL_(expr, ...)                                            \
  do {                                                                                       \
    ::absl::Status evenstep_status_ = (expr);                                                \
    if (!evenstep_status_.ok()) {                                                            \
      return ::evenstep::Annotate(std::move(evenstep_status_), ::absl::StrCat(__VA_ARGS__)); \
    }                                                                                        \
  } while (0)

// EVENSTEP_ASSIGN_OR_RETURN(lhs, expr [, context...]): `lhs = value of expr`
// (an absl::StatusOr<T>), or returns its status annotated as above.
#define EVENSTEP_ASSIGN_OR_RETURN(lhs, ...)                                                   \
  EVENSTEP_ASSIGN_OR_RETURN_IMPL_(EVENSTEP_STATUS_CONCAT_(evenstep_statusor_, __LINE__), lhs, \
                                  __VA_ARGS__, "")
#define EVENSTEP_ASSIGN_OR_RETURN_IMPL_(tmp, lhs, expr, ...)                             \
  auto tmp = (expr);                                                                     \
  if (!tmp.ok()) return ::evenstep::Annotate(tmp.status(), ::absl::StrCat(__VA_ARGS__)); \
  lhs = std::move(tmp).value()

// Early-return helpers for absl::Status / absl::StatusOr, as used across
// evenstep. Header-only; no state.
#pragma once

#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define EVENSTEP_STATUS_CONCAT_INNER_(a, b) a##b
#define EVENSTEP_STATUS_CONCAT_(a, b) EVENSTEP_STATUS_CONCAT_INNER_(a, b)

// Evaluates `expr` (an absl::Status) and returns it from the enclosing
// function when it is not OK.
#define EVENSTEP_RETURN_IF_ERROR(expr)                   \
  do {                                                   \
    ::absl::Status evenstep_status_ = (expr);            \
    if (!evenstep_status_.ok()) return evenstep_status_; \
  } while (0)

// `lhs = value of expr` (an absl::StatusOr<T>), or returns its status.
#define EVENSTEP_ASSIGN_OR_RETURN(lhs, expr) \
  EVENSTEP_ASSIGN_OR_RETURN_IMPL_(EVENSTEP_STATUS_CONCAT_(evenstep_statusor_, __LINE__), lhs, expr)
#define EVENSTEP_ASSIGN_OR_RETURN_IMPL_(tmp, lhs, expr) \
  auto tmp = (expr);                                    \
  if (!tmp.ok()) return tmp.status();                   \
  lhs = std::move(tmp).value()

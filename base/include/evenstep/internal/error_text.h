// Turns exceptions from libtorch / c10d into one readable line for a status
// message (c10::Error without its backtrace). Stateless. In base/, so that
// every layer turns exceptions into statuses the same way.
#pragma once

#include <exception>
#include <string>

namespace evenstep::internal {

// The first line of the exception's message; for c10::Error, the message
// without the C++ backtrace.
std::string ErrorText(const std::exception& e);

}  // namespace evenstep::internal

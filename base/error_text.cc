#include "evenstep/internal/error_text.h"

#include <c10/util/Exception.h>

#include "absl/strings/ascii.h"

namespace evenstep::internal {

std::string ErrorText(const std::exception& e) {
  std::string text;
  if (const auto* c10_error = dynamic_cast<const c10::Error*>(&e)) {
    text = c10_error->what_without_backtrace();
  } else {
    text = e.what();
  }
  const size_t newline = text.find('\n');
  if (newline != std::string::npos) text.resize(newline);
  return std::string(absl::StripAsciiWhitespace(text));
}

}  // namespace evenstep::internal

// Parses --evenstep_* flags given as strings, the way a program's command
// line would be (flags_test, balance_trainer, balanced_step_test).
#pragma once

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "evenstep/flags.h"

namespace evenstep::testing {

// ParseEvenstepFlags over `args` (after a program name): sets the flags and,
// when `rest` is given, returns there what is not an evenstep flag.
inline absl::Status ParseEvenstepArgs(std::vector<std::string> args,
                                      std::vector<std::string>* rest = nullptr) {
  args.insert(args.begin(), "trainer");
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  int argc = static_cast<int>(args.size());
  const absl::Status status = ParseEvenstepFlags(&argc, argv.data());
  if (rest != nullptr) rest->assign(argv.begin() + 1, argv.begin() + argc);
  return status;
}

}  // namespace evenstep::testing

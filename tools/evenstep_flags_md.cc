// Prints the --evenstep_* flags as a Markdown table. docs/flags.md's table
// is this output (scripts/update_docs_flags.sh writes it; the ctest
// docs_flags_current checks it is current).
#include <iostream>

#include "evenstep/flags.h"

int main() {
  std::cout << evenstep::FlagsMarkdownTable();
  return 0;
}

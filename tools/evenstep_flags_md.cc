// Prints the --evenstep_* flags as a Markdown table. The README's flag table
// is this output (scripts/update_readme_flags.sh writes it; the ctest
// readme_flags_current checks it is current).
#include <iostream>

#include "evenstep/flags.h"

int main() {
  std::cout << evenstep::FlagsMarkdownTable();
  return 0;
}

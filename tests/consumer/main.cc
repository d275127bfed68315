// Links the installed evenstep::evenstep and joins a world of one.
#include <iostream>

#include "evenstep/dist_context.h"

int main() {
  auto ctx = evenstep::DistContext::Create(evenstep::DistOptions{});
  if (!ctx.ok()) {
    std::cerr << ctx.status() << "\n";
    return 1;
  }
  std::cout << "consumer: " << (*ctx)->env().Describe() << ", backend " << (*ctx)->backend_name()
            << std::endl;
  return 0;
}

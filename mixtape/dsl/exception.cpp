// mixtape/dsl/exception.cpp -- short_location, for mt::Error's messages.
#include "mixtape/dsl/exception.h"

namespace mixtape {

std::string short_location(const std::source_location& loc) {
  std::string file = loc.file_name();
  auto slash = file.find_last_of('/');
  if (slash != std::string::npos) file = file.substr(slash + 1);
  return file + ":" + std::to_string(loc.line());
}

}  // namespace mixtape

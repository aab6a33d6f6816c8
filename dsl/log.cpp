// dsl/log.cpp -- reads MIXTAPE_LOG once.
#include "dsl/log.h"

#include <cstdlib>
#include <string>

namespace mixtape {

bool log_enabled(std::string_view topic) {
  static const std::string topics = [] {
    const char* env = std::getenv("MIXTAPE_LOG");
    return std::string(",") + (env ? env : "") + ",";
  }();
  if (topics.find(",all,") != std::string::npos) return true;
  return topics.find(fmt::format(",{},", topic)) != std::string::npos;
}

}  // namespace mixtape

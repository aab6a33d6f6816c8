// mixtape/dsl/log.cpp -- reads MIXTAPE_LOG once, and warns about words that name no topic.
#include "mixtape/dsl/log.h"

#include <algorithm>
#include <array>
#include <cstdlib>
#include <string>

#include <fmt/ranges.h>

#include "mixtape/dsl/error.h"

namespace mixtape {
namespace {

// Every topic the library logs under; log_enabled refuses any other, so this list is complete.
constexpr std::array<std::string_view, 8> kTopics = {"compile", "fusion", "jit",     "kernels",
                                                     "llvm",    "nvrtc",  "profile", "all"};

bool known(std::string_view word) {
  return std::find(kTopics.begin(), kTopics.end(), word) != kTopics.end();
}

std::string read_setting() {
  const char* env = std::getenv("MIXTAPE_LOG");
  std::string setting = env ? env : "";
  std::vector<std::string> unknown = unknown_log_topics(setting);
  if (!unknown.empty())
    std::fprintf(stderr, "mixtape: MIXTAPE_LOG names no topic \"%s\" (valid: %s)\n",
                 fmt::format("{}", fmt::join(unknown, "\", \"")).c_str(),
                 fmt::format("{}", fmt::join(kTopics, ", ")).c_str());
  return "," + setting + ",";
}

}  // namespace

std::vector<std::string> unknown_log_topics(std::string_view setting) {
  std::vector<std::string> unknown;
  size_t start = 0;
  while (start <= setting.size()) {
    size_t end = std::min(setting.find(',', start), setting.size());
    std::string_view word = setting.substr(start, end - start);
    if (!word.empty() && !known(word)) unknown.emplace_back(word);
    start = end + 1;
  }
  return unknown;
}

bool log_enabled(std::string_view topic) {
  if (!known(topic)) fail("log_enabled: \"{}\" is not a MIXTAPE_LOG topic (dsl/log.cpp)", topic);
  static const std::string topics = read_setting();
  if (topics.find(",all,") != std::string::npos) return true;
  return topics.find(fmt::format(",{},", topic)) != std::string::npos;
}

}  // namespace mixtape

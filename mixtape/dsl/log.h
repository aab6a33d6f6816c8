// mixtape/dsl/log.h -- MIXTAPE_LOG=topic[,topic...] (or "all"): diagnostic lines on stderr by
// topic.
#pragma once

#include <cstdio>
#include <string>
#include <string_view>
#include <vector>

#include <fmt/format.h>

namespace mixtape {

/// Whether MIXTAPE_LOG names `topic` (read once per process; a word that names no topic is
/// warned about on stderr, with the valid ones).
bool log_enabled(std::string_view topic);

/// The comma-separated words of a MIXTAPE_LOG setting that name no topic.
std::vector<std::string> unknown_log_topics(std::string_view setting);

template <typename... Args>
void log_line(std::string_view topic, fmt::format_string<Args...> format, Args&&... args) {
  std::string line = fmt::format(format, std::forward<Args>(args)...);
  std::fprintf(stderr, "mixtape[%.*s]: %s\n", static_cast<int>(topic.size()), topic.data(),
               line.c_str());
}

}  // namespace mixtape

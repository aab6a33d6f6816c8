// mixtape/dsl/error.h -- mt::Error, the one exception type every mixtape failure is reported with.
#pragma once

#include <source_location>
#include <stdexcept>
#include <string>

#include <fmt/format.h>

namespace mixtape {

/// Thrown for every user-visible failure: bad shapes or dtypes, corrupt files, missing devices.
class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(what) {}
};

/// Formats a message and throws mt::Error.
template <typename... Args>
[[noreturn]] void fail(fmt::format_string<Args...> format, Args&&... args) {
  throw Error(fmt::format(format, std::forward<Args>(args)...));
}

/// "file.cpp:42" for a source location, without the directory part.
inline std::string short_location(const std::source_location& loc) {
  std::string file = loc.file_name();
  auto slash = file.find_last_of('/');
  if (slash != std::string::npos) file = file.substr(slash + 1);
  return fmt::format("{}:{}", file, loc.line());
}

}  // namespace mixtape

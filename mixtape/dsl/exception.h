// mixtape/dsl/exception.h -- mt::Error, the one exception type every mixtape failure is reported
// with.
#pragma once

#include <source_location>
#include <stdexcept>
#include <string>

namespace mixtape {

/// Thrown for every user-visible failure: bad shapes or dtypes, corrupt files, missing devices.
class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(what) {}
};

/// "file.cpp:42" for a source location, without the directory part.
std::string short_location(const std::source_location& loc);

}  // namespace mixtape

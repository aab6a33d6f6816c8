// mixtape/dsl/error.h -- mt::fail and op_fail: throw mt::Error (dsl/exception.h) with a message
// formatted by fmt. Not in the umbrella header, so that a user's file that only calls the library
// never parses fmt; the library's sources, and programs that want these, include it by name.
#pragma once

#include <fmt/format.h>

#include <source_location>
#include <string>
#include <utility>

#include "mixtape/dsl/exception.h"

namespace mixtape {

/// Formats a message and throws mt::Error.
template <typename... Args>
[[noreturn]] void fail(fmt::format_string<Args...> format, Args&&... args) {
  throw Error(fmt::format(format, std::forward<Args>(args)...));
}

/// Throws mt::Error "op: detail [module 'path', at file:line]" with the user's call site.
[[noreturn]] void op_error(const char* op, const std::source_location& loc,
                           const std::string& detail);

template <typename... Args>
[[noreturn]] void op_fail(const char* op, const std::source_location& loc,
                          fmt::format_string<Args...> format, Args&&... args) {
  op_error(op, loc, fmt::format(format, std::forward<Args>(args)...));
}

}  // namespace mixtape

// mixtape/dsl/byte_count.cpp -- byte counts given as text, for the settings that take sizes.
#include "mixtape/dsl/byte_count.h"

#include <charconv>
#include <cstdint>
#include <cstdio>
#include <cstdlib>

#include <fmt/format.h>

namespace mixtape {

std::optional<int64_t> parse_byte_count(std::string_view text) {
  int64_t value = 0;
  auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (error != std::errc() || value < 0) return std::nullopt;
  std::string_view suffix(end, text.data() + text.size() - end);
  int shift = 0;
  if (suffix == "K" || suffix == "KiB")
    shift = 10;
  else if (suffix == "M" || suffix == "MiB")
    shift = 20;
  else if (suffix == "G" || suffix == "GiB")
    shift = 30;
  else if (suffix == "T" || suffix == "TiB")
    shift = 40;
  else if (!suffix.empty())
    return std::nullopt;
  if (value > (INT64_MAX >> shift)) return std::nullopt;
  return value << shift;
}

int64_t byte_count_from_environment(const char* name, int64_t fallback) {
  const char* text = std::getenv(name);
  if (text == nullptr || *text == '\0') return fallback;
  if (std::optional<int64_t> bytes = parse_byte_count(text)) return *bytes;
  fmt::print(stderr,
             "mixtape: warning: {}={} is not a byte count (digits, optionally followed by K, M, "
             "G or T); using {}\n",
             name, text, fallback);
  return fallback;
}

}  // namespace mixtape

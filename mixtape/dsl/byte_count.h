// mixtape/dsl/byte_count.h -- byte counts given as text ("1073741824", "512M", "1G"), as the memory
// limit and the cache size settings take them.
#pragma once

#include <cstdint>
#include <optional>
#include <string_view>

namespace mixtape {

/// Digits, optionally followed by K, M, G or T (or KiB, MiB, GiB, TiB): powers of 1024. nullopt for
/// anything else, a negative number or an overflow.
std::optional<int64_t> parse_byte_count(std::string_view text);

/// The byte count in environment variable `name`; `fallback` when it is unset or empty, and
/// when it is not a byte count (with a warning on stderr naming the variable).
int64_t byte_count_from_environment(const char* name, int64_t fallback);

}  // namespace mixtape

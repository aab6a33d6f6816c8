// codegen/lru_cache.cpp -- the in-memory caches' byte budget, and byte counts read from the
// environment.
#include "codegen/lru_cache.h"

#include <atomic>
#include <charconv>
#include <cstdio>
#include <cstdlib>
#include <string_view>

#include <fmt/format.h>

#include "codegen/byte_count.h"

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
             "mixtape: warning: {}={} is not a byte count (digits, optionally followed by K, M "
             "or G); using {}\n",
             name, text, fallback);
  return fallback;
}

namespace {
// 64 MiB holds thousands of programs or kernel objects (a few KiB each), far more than a training
// loop alternates between, and stays small beside the tensors.
constexpr int64_t default_memory_cache_bytes = int64_t{64} << 20;

std::atomic<int64_t>& memory_budget() {
  static std::atomic<int64_t> budget{
      byte_count_from_environment("MIXTAPE_MEMORY_CACHE_BYTES", default_memory_cache_bytes)};
  return budget;
}
}  // namespace

int64_t memory_cache_bytes() { return memory_budget().load(std::memory_order_relaxed); }

void set_memory_cache_bytes(int64_t bytes) {
  memory_budget().store(bytes < 0 ? 0 : bytes, std::memory_order_relaxed);
}

}  // namespace mixtape

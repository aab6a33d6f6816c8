// mixtape/codegen/lru_cache.cpp -- the in-memory caches' byte budget.
#include "mixtape/codegen/lru_cache.h"

#include <atomic>

#include "mixtape/dsl/byte_count.h"

namespace mixtape {
namespace {
// 16 MiB holds about a thousand programs or kernel objects (a few KiB each), far more than a
// training loop alternates between. Measured over a sweep of new shapes on the cpu device, the
// process's RSS levels off at about 45 MB above its start with this budget (180 MB with 64 MiB).
constexpr int64_t default_memory_cache_bytes = int64_t{16} << 20;

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

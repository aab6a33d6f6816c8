// mixtape/dsl/host_memory.cpp -- the cache of freed host blocks behind every Storage.
#include "mixtape/dsl/host_memory.h"

#include <algorithm>
#include <atomic>
#include <bit>
#include <cerrno>
#include <cstdlib>
#include <limits>
#include <mutex>
#include <new>
#include <string>
#include <unordered_map>
#include <vector>

#include <sys/sysinfo.h>

#include "mixtape/dsl/byte_count.h"
#include "mixtape/dsl/error.h"

namespace mixtape {
namespace {

// Every block is kept for reuse, small ones too: a step's mid-sized buffers would otherwise keep
// malloc consolidating free chunks, and small aligned ones take malloc's slow memalign path
// (a batch-1 forward pass makes a dozen of them per call).
constexpr size_t alignment = 64;
// Freed blocks kept at most; past it a freed block goes back to the OS.
constexpr int64_t max_cached_bytes = int64_t{1} << 30;

// Sizes round up to a multiple of 1/8 of their power of two (of the alignment at least), so
// that nearby sizes (one batch shape against another) share blocks while at most 12.5% is
// wasted.
size_t size_class(size_t bytes) {
  size_t step = std::max(alignment, std::bit_floor(bytes) / 8);
  return (bytes + step - 1) / step * step;
}

struct Cache {
  std::mutex mutex;
  std::unordered_map<size_t, std::vector<void*>> free_blocks;
  HostMemoryStats stats;  // live_bytes is kept in `live` instead
  // Atomic: a fresh block is counted, and a released one uncounted, outside the lock.
  std::atomic<int64_t> live{0};
  std::atomic<int64_t> peak{0};  // the most `live` has been since start or the last reset

  // Counts `bytes` more as live and raises the high-water mark to the new total.
  void add_live(int64_t bytes) {
    raise_peak(live.fetch_add(bytes, std::memory_order_relaxed) + bytes);
  }
  void raise_peak(int64_t now) {
    int64_t seen = peak.load(std::memory_order_relaxed);
    while (now > seen && !peak.compare_exchange_weak(seen, now, std::memory_order_relaxed)) {
    }
  }
};

Cache& cache() {
  static Cache* c = new Cache;  // never destroyed: Storage may be released during exit
  return *c;
}

std::atomic<int64_t>& limit() {
  static std::atomic<int64_t> bytes = [] {
    return byte_count_from_environment("MIXTAPE_MAX_MEMORY", 0);
  }();
  return bytes;
}

std::string human_bytes(double bytes) {
  const char* units[] = {"bytes", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  int unit = 0;
  while (bytes >= 1024 && unit < 6) {
    bytes /= 1024;
    ++unit;
  }
  return unit == 0 ? fmt::format("{} bytes", bytes) : fmt::format("{:.1f} {}", bytes, units[unit]);
}

// The machine's memory and swap. A block larger than both is refused before the allocator is
// asked: an allocator that maps with MAP_NORESERVE (jemalloc does, on Linux) would hand it out,
// and the process would be killed when it touched the pages.
uint64_t machine_bytes() {
  static const uint64_t total = [] {
    struct sysinfo info {};
    if (sysinfo(&info) != 0) return std::numeric_limits<uint64_t>::max();
    return (static_cast<uint64_t>(info.totalram) + info.totalswap) * info.mem_unit;
  }();
  return total;
}

void free_cached(Cache& c) {
  for (auto& [size, blocks] : c.free_blocks)
    for (void* block : blocks) std::free(block);
  c.free_blocks.clear();
  c.stats.cached_bytes = 0;
}

// Under the cache's lock: room for `size` more bytes within the limit, giving the cached
// blocks back first if that makes room.
void reserve(Cache& c, double size, double asked, const std::string& what = "") {
  int64_t cap = limit().load(std::memory_order_relaxed);
  if (cap <= 0) return;
  auto fits = [&] {
    return static_cast<double>(c.live.load()) + static_cast<double>(c.stats.cached_bytes) + size <=
           static_cast<double>(cap);
  };
  if (!fits()) free_cached(c);
  if (!fits())
    fail(
        "out of memory: {}{} asked for, but values already hold {} of the {} memory limit "
        "(MIXTAPE_MAX_MEMORY / mt::set_memory_limit)",
        what.empty() ? "" : what + ": ", human_bytes(asked),
        human_bytes(static_cast<double>(c.live.load())), human_bytes(static_cast<double>(cap)));
}

}  // namespace

void check_memory_request(uint64_t bytes, const std::string& what) {
  if (bytes > machine_bytes())
    fail("out of memory: {}{} asked for, more than this machine's {} of memory and swap",
         what.empty() ? "" : what + ": ", human_bytes(static_cast<double>(bytes)),
         human_bytes(static_cast<double>(machine_bytes())));
  Cache& c = cache();
  std::lock_guard<std::mutex> lock(c.mutex);
  reserve(c, static_cast<double>(bytes), static_cast<double>(bytes), what);
}

void set_memory_limit(int64_t bytes) {
  if (bytes < 0) fail("set_memory_limit: the limit must be >= 0 (0: none), got {}", bytes);
  limit().store(bytes, std::memory_order_relaxed);
}

int64_t memory_limit() { return limit().load(std::memory_order_relaxed); }

void* host_allocate(size_t bytes) {
  // Sizes this large cannot be rounded to a size class without overflowing; no machine has them.
  constexpr size_t largest = size_t{1} << 62;
  if (bytes > largest)
    fail("out of memory: {} asked for, more than any machine holds",
         human_bytes(static_cast<double>(bytes)));
  size_t size = size_class(bytes == 0 ? 1 : bytes);
  auto counted = static_cast<int64_t>(size);
  Cache& c = cache();
  {
    std::lock_guard<std::mutex> lock(c.mutex);
    auto found = c.free_blocks.find(size);
    if (found != c.free_blocks.end() && !found->second.empty()) {
      void* block = found->second.back();
      found->second.pop_back();
      c.stats.cached_bytes -= counted;
      c.add_live(counted);
      ++c.stats.hits;
      return block;
    }
    ++c.stats.misses;
    reserve(c, static_cast<double>(size), static_cast<double>(bytes));
    // Counted under the lock, so that two misses cannot both pass the limit; the high-water
    // mark only once the block is there (a refused block is no peak).
    c.live += counted;
  }
  if (size > machine_bytes()) {
    c.live -= counted;
    fail("out of memory: the system could not provide {} ({} bytes): it has {} of memory and swap",
         human_bytes(static_cast<double>(bytes)), bytes,
         human_bytes(static_cast<double>(machine_bytes())));
  }
  void* block = std::aligned_alloc(alignment, size);
  if (!block) {
    // Freed blocks of other sizes may be what the OS lacks: give them back and try once more.
    std::lock_guard<std::mutex> lock(c.mutex);
    free_cached(c);
    block = std::aligned_alloc(alignment, size);
    if (!block) {
      c.live -= counted;
      fail("out of memory: the system could not provide {} ({} bytes)",
           human_bytes(static_cast<double>(bytes)), bytes);
    }
  }
  c.raise_peak(c.live.load(std::memory_order_relaxed));
  return block;
}

void host_release(void* block, size_t bytes) noexcept {
  if (!block) return;
  size_t size = size_class(bytes == 0 ? 1 : bytes);
  auto counted = static_cast<int64_t>(size);
  Cache& c = cache();
  c.live -= counted;
  std::lock_guard<std::mutex> lock(c.mutex);
  int64_t cap = limit().load(std::memory_order_relaxed);
  if (c.stats.cached_bytes + counted <= max_cached_bytes &&
      (cap <= 0 || c.live.load() + c.stats.cached_bytes + counted <= cap)) {
    try {
      c.free_blocks[size].push_back(block);
      c.stats.cached_bytes += counted;
      return;
    } catch (...) {  // no memory to remember it: give it back instead
    }
  }
  std::free(block);
}

HostMemoryStats host_memory_stats() {
  Cache& c = cache();
  std::lock_guard<std::mutex> lock(c.mutex);
  HostMemoryStats stats = c.stats;
  stats.live_bytes = c.live.load();
  stats.peak_bytes = std::max(c.peak.load(), stats.live_bytes);
  return stats;
}

void reset_host_memory_peak() {
  Cache& c = cache();
  c.peak.store(c.live.load());
}

}  // namespace mixtape

// dsl/host_memory.cpp -- the cache of freed host blocks behind every Storage.
#include "dsl/host_memory.h"

#include <bit>
#include <cstdlib>
#include <mutex>
#include <new>
#include <unordered_map>
#include <vector>

namespace mixtape {
namespace {

constexpr size_t alignment = 64;
// Blocks below this go straight to malloc's own free lists. Above it, a step's many mid-sized
// buffers (activations of small batches) would otherwise keep malloc consolidating free chunks.
constexpr size_t smallest_cached = size_t{1} << 10;
// Freed blocks kept at most; past it a freed block goes back to the OS.
constexpr int64_t max_cached_bytes = int64_t{1} << 30;

// Large sizes round up to a multiple of 1/8 of their power of two, so that nearby sizes (one
// batch shape against another) share blocks while at most 12.5% is wasted.
size_t size_class(size_t bytes) {
  if (bytes < smallest_cached) return (bytes + alignment - 1) / alignment * alignment;
  size_t step = std::bit_floor(bytes) / 8;
  return (bytes + step - 1) / step * step;
}

struct Cache {
  std::mutex mutex;
  std::unordered_map<size_t, std::vector<void*>> free_blocks;
  HostMemoryStats stats;
};

Cache& cache() {
  static Cache* c = new Cache;  // never destroyed: Storage may be released during exit
  return *c;
}

}  // namespace

void* host_allocate(size_t bytes) {
  size_t size = size_class(bytes == 0 ? 1 : bytes);
  Cache& c = cache();
  if (size >= smallest_cached) {
    std::lock_guard<std::mutex> lock(c.mutex);
    auto found = c.free_blocks.find(size);
    if (found != c.free_blocks.end() && !found->second.empty()) {
      void* block = found->second.back();
      found->second.pop_back();
      c.stats.cached_bytes -= static_cast<int64_t>(size);
      ++c.stats.hits;
      return block;
    }
    ++c.stats.misses;
  }
  void* block = std::aligned_alloc(alignment, size);
  if (!block) throw std::bad_alloc();
  return block;
}

void host_release(void* block, size_t bytes) noexcept {
  if (!block) return;
  size_t size = size_class(bytes == 0 ? 1 : bytes);
  if (size >= smallest_cached) {
    Cache& c = cache();
    std::lock_guard<std::mutex> lock(c.mutex);
    if (c.stats.cached_bytes + static_cast<int64_t>(size) <= max_cached_bytes) {
      try {
        c.free_blocks[size].push_back(block);
        c.stats.cached_bytes += static_cast<int64_t>(size);
        return;
      } catch (...) {  // no memory to remember it: give it back instead
      }
    }
  }
  std::free(block);
}

HostMemoryStats host_memory_stats() {
  Cache& c = cache();
  std::lock_guard<std::mutex> lock(c.mutex);
  return c.stats;
}

void host_memory_trim() {
  Cache& c = cache();
  std::lock_guard<std::mutex> lock(c.mutex);
  for (auto& [size, blocks] : c.free_blocks)
    for (void* block : blocks) std::free(block);
  c.free_blocks.clear();
  c.stats.cached_bytes = 0;
}

}  // namespace mixtape

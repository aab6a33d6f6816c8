// mixtape/dsl/host_memory.h -- host memory for values: 64-byte aligned, optionally uninitialized,
// and reused from a cache of freed blocks.
#pragma once

#include <cstddef>
#include <cstdint>
#include <new>
#include <string>
#include <utility>

namespace mixtape {

/// Every value's bytes (parameters, gradients, optimizer state, activations, batches) and the
/// library calls' workspace (runtime/scratch_buffer.h) come from here, so its high-water mark
/// (HostMemoryStats::peak_bytes) is the host memory a training step needs.
///
/// A block of at least `bytes`, 64-byte aligned, from the cache of freed blocks of its size
/// class when one is there. A training step frees and allocates the same sizes every step;
/// handing them back to the OS would make every step fault its pages in and zero them again.
/// mt::Error (with the bytes asked for) when the OS has no memory for it or it would take the
/// values past the memory limit; never std::bad_alloc.
void* host_allocate(size_t bytes);
/// Returns a block from host_allocate(bytes) to the cache (or to the OS, past the cache's cap).
void host_release(void* block, size_t bytes) noexcept;

/// The most host memory that values (every Storage's bytes, freed blocks kept for reuse
/// included) may hold at once; 0, the default, for no limit. Set from MIXTAPE_MAX_MEMORY at
/// start ("8G", "512M", "64K" or bytes; powers of 1024; a value that is not a byte count is
/// ignored with a warning). An allocation that would pass it first
/// gives the cached blocks back, then fails with an mt::Error saying what asked for how much, so
/// a job stops cleanly instead of being killed by the OS. Devices' memory is not counted.
void set_memory_limit(int64_t bytes);
int64_t memory_limit();
/// mt::Error, as an allocation past the limit would be, when `bytes` more would not fit within
/// the memory limit, or more than the machine's memory and swap (with no limit set too: an
/// allocator that maps lazily would hand it out, and the OS kill the process while it is filled):
/// for readers that know the total they are about to allocate (a checkpoint's tensors) and
/// refuse it whole, before allocating any of it. `what` names the asker.
void check_memory_request(uint64_t bytes, const std::string& what);

struct HostMemoryStats {
  int64_t live_bytes = 0;    // blocks handed out (by size class) and not yet released
  int64_t peak_bytes = 0;    // the most live_bytes at once since start or reset_host_memory_peak()
  int64_t cached_bytes = 0;  // freed blocks kept for reuse
  int64_t hits = 0;          // allocations served from the cache
  int64_t misses = 0;        // allocations that went to the OS
};
HostMemoryStats host_memory_stats();
/// Starts the high-water mark over at the bytes live now (reset_execution_stats() calls it).
void reset_host_memory_peak();

/// A std::allocator for Storage bytes over host_allocate. Elements made without a value are left
/// uninitialized (default-initialized), so a buffer a kernel is about to overwrite costs no
/// zeroing pass; ask for zeros by constructing with a value.
template <typename T>
struct HostAllocator {
  using value_type = T;
  HostAllocator() = default;
  template <typename U>
  HostAllocator(const HostAllocator<U>&) noexcept {}  // NOLINT: allocators convert implicitly
  T* allocate(size_t n) { return static_cast<T*>(host_allocate(n * sizeof(T))); }
  void deallocate(T* p, size_t n) noexcept { host_release(p, n * sizeof(T)); }
  template <typename U>
  void construct(U* p) noexcept {
    ::new (static_cast<void*>(p)) U;
  }
  template <typename U, typename... Args>
  void construct(U* p, Args&&... args) {
    ::new (static_cast<void*>(p)) U(std::forward<Args>(args)...);
  }
  template <typename U>
  bool operator==(const HostAllocator<U>&) const noexcept {
    return true;
  }
};

}  // namespace mixtape

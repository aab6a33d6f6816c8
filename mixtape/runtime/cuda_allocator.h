// mixtape/runtime/cuda_allocator.h -- the caching device allocator and the pinned host staging
// buffers.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <tuple>
#include <unordered_map>

#include "mixtape/runtime/cuda_driver.h"

namespace mixtape::cuda {

/// Where the caching allocator gets raw memory. The CUDA backend is cuMemAlloc/cuMemFree; tests
/// drive the bookkeeping with a host-memory backend.
class MemoryBackend {
 public:
  virtual ~MemoryBackend() = default;
  /// `bytes` of fresh memory, or nullptr when the device is out of memory (the allocator then
  /// frees its cache and retries). Other failures throw mt::Error.
  virtual void* allocate(size_t bytes) = 0;
  virtual void release(void* ptr) = 0;
  /// Waits until queued work can no longer touch cached blocks; called before they are released.
  virtual void synchronize() {}
  /// Appended to the out-of-memory error, e.g. the device's free and total memory.
  virtual std::string describe() const { return {}; }
};

/// The queue that uses a block; a freed block is reused without synchronization only by work on
/// the same stream, which runs after everything queued before it.
using StreamId = uintptr_t;

struct AllocatorStats {
  size_t allocated = 0;  // bytes of blocks handed out and not yet freed (rounded sizes)
  size_t reserved = 0;   // bytes held from the backend: allocated + cached
  size_t peak_allocated = 0;
  size_t peak_reserved = 0;
  int64_t alloc_count = 0;     // allocate() calls
  int64_t cache_hits = 0;      // of those, served by a cached block
  int64_t backend_allocs = 0;  // blocks obtained from the backend
};

/// A caching allocator in the manner of PyTorch's: freed blocks stay cached and are reused for
/// requests of similar size on the same stream, so steady-state training never calls cuMemAlloc.
/// Requests up to 1 MiB are rounded up to 512 B, larger ones to 2 MiB; a request takes the
/// smallest cached block of its class that fits and is at most twice its rounded size. Blocks are
/// not split or merged. Thread-safe.
class CachingAllocator {
 public:
  static constexpr size_t kSmallLimit = size_t{1} << 20;
  static constexpr size_t kSmallRound = 512;
  static constexpr size_t kLargeRound = size_t{2} << 20;

  explicit CachingAllocator(std::unique_ptr<MemoryBackend> backend);
  ~CachingAllocator();
  CachingAllocator(const CachingAllocator&) = delete;
  CachingAllocator& operator=(const CachingAllocator&) = delete;

  /// The size class a request is served from (zero bytes still get a 512-byte block).
  static size_t round_size(size_t bytes);

  /// A block of at least `bytes`, 512-byte aligned if the backend's memory is. When the backend
  /// is out of memory the cache is released and the request retried once; then throws mt::Error
  /// naming the sizes.
  void* allocate(size_t bytes, StreamId stream = 0);
  /// Returns a block to the cache; throws mt::Error for a pointer it did not hand out.
  void deallocate(void* ptr);
  /// Releases every cached (free) block to the backend.
  void empty_cache();
  AllocatorStats stats() const;
  void reset_peak_stats();
  /// The size of the block `ptr` was served from (0 if unknown).
  size_t block_size(const void* ptr) const;

 private:
  struct Block {
    void* ptr;
    size_t size;
    StreamId stream;
  };
  void release_cached_locked();

  std::unique_ptr<MemoryBackend> backend_;
  mutable std::mutex mutex_;
  // Free blocks by (stream, size, address): lower_bound gives the best fit on a stream.
  std::set<std::tuple<StreamId, size_t, uintptr_t>> free_;
  std::unordered_map<uintptr_t, Block> blocks_;  // every block held, free or in use
  AllocatorStats stats_;
};

/// The process's device allocator over cuMemAlloc, for the compute stream. Throws like
/// require_available() without CUDA.
CachingAllocator& device_allocator();
/// Its statistics, zeros while it has not been made; never starts CUDA (execution_stats() asks).
AllocatorStats device_allocator_stats();
/// Starts its high-water marks over, if it has been made.
void reset_device_allocator_peak();
StreamId compute_stream_id();

/// Device memory owned by the device allocator, freed (back to its cache) on destruction.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(size_t bytes);
  ~DeviceBuffer();
  DeviceBuffer(DeviceBuffer&& other) noexcept;
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept;
  void* data() const { return ptr_; }
  CUdeviceptr address() const { return device_ptr(ptr_); }
  size_t size() const { return bytes_; }

 private:
  void reset();
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

/// Copies between pageable host memory and the device through a small ring of pinned
/// (cuMemAllocHost) chunks, so the DMA runs asynchronously and the host-side memcpy of one chunk
/// overlaps the transfer of the previous one. upload() returns once `src` has been read (the
/// device copy finishes in stream order); download() returns with `dst` filled.
void upload(CUdeviceptr dst, const void* src, size_t bytes);
void download(void* dst, CUdeviceptr src, size_t bytes);

}  // namespace mixtape::cuda

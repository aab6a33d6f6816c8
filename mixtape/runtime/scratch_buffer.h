// mixtape/runtime/scratch_buffer.h -- a 64-byte aligned buffer that only grows: per-thread scratch
// of the library calls (matmuls, convolutions), allocated once and reused by every later call.
// It comes from the values' host allocator where that allows, so that the measured peak counts
// the workspace too.
#pragma once

#include <cstddef>
#include <cstdint>
#include <new>

#include "mixtape/dsl/host_memory.h"

namespace mixtape {

/// The workspace a library call keeps between calls: small calls (an MLP's products) reuse
/// theirs without asking the allocator each time; larger ones trim theirs when they return.
constexpr size_t kScratchKeptBytes = size_t{4} << 20;

class ScratchBuffer {
 public:
  ScratchBuffer() = default;
  ScratchBuffer(const ScratchBuffer&) = delete;
  ScratchBuffer& operator=(const ScratchBuffer&) = delete;
  ~ScratchBuffer() { release(); }

  template <typename T>
  T* get(int64_t count) {
    const size_t bytes = static_cast<size_t>(count) * sizeof(T);
    if (bytes > capacity_) {
      release();
      // From the values' allocator, so that the measured peak counts the workspace. Past the
      // memory limit that is an mt::Error, which must not leave the OpenMP regions that ask
      // here: the workspace then comes from the system, uncounted, as it always did.
      try {
        data_ = host_allocate(bytes);
        counted_ = true;
      } catch (...) {
        data_ = ::operator new (bytes, std::align_val_t{64});
        counted_ = false;
      }
      capacity_ = bytes;
    }
    return static_cast<T*>(data_);
  }
  /// Hands the buffer back when it holds more than `keep_bytes`: a large call's workspace is then
  /// live only while that call runs, instead of from the largest call on, where it added to every
  /// later peak (a GPT's widened bf16 logits products kept about 0.2 GiB that way). The values'
  /// allocator keeps the freed block, so the next call of that size gets it back unfaulted.
  void trim(size_t keep_bytes = kScratchKeptBytes) {
    if (capacity_ > keep_bytes) release();
  }
  void release() {
    if (data_ != nullptr && counted_) host_release(data_, capacity_);
    if (data_ != nullptr && !counted_) ::operator delete (data_, std::align_val_t{64});
    data_ = nullptr;
    capacity_ = 0;
  }

 private:
  void* data_ = nullptr;
  size_t capacity_ = 0;
  bool counted_ = false;  // data_ came from host_allocate
};

}  // namespace mixtape

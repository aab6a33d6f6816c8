// mixtape/runtime/scratch_buffer.h -- a 64-byte aligned buffer that only grows: per-thread scratch
// of the library calls (matmuls, convolutions), allocated once and reused by every later call.
// It comes from the values' host allocator, so that the measured peak (and the memory limit)
// counts the workspace too.
#pragma once

#include <cstddef>
#include <cstdint>

#include "mixtape/dsl/host_memory.h"

namespace mixtape {

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
      data_ = host_allocate(bytes);
      capacity_ = bytes;
    }
    return static_cast<T*>(data_);
  }
  void release() {
    if (data_ != nullptr) host_release(data_, capacity_);
    data_ = nullptr;
    capacity_ = 0;
  }

 private:
  void* data_ = nullptr;
  size_t capacity_ = 0;
};

}  // namespace mixtape

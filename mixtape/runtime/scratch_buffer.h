// mixtape/runtime/scratch_buffer.h -- a 64-byte aligned buffer that only grows: per-thread scratch
// of the library calls (matmuls, convolutions), allocated once and reused by every later call.
#pragma once

#include <cstddef>
#include <cstdint>
#include <new>

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
      data_ = ::operator new (bytes, std::align_val_t{64});
      capacity_ = bytes;
    }
    return static_cast<T*>(data_);
  }
  void release() {
    if (data_ != nullptr) ::operator delete (data_, std::align_val_t{64});
    data_ = nullptr;
    capacity_ = 0;
  }

 private:
  void* data_ = nullptr;
  size_t capacity_ = 0;
};

}  // namespace mixtape

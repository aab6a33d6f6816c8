// mixtape/dsl/pool_allocator.h -- PoolAllocator: per-thread free lists for the small objects the
// traced loop makes and frees by the hundred every step (graph nodes and tensor handles).
#pragma once

#include <cstddef>
#include <new>

namespace mixtape {

namespace pool_detail {

// Blocks of one size and alignment that a thread freed, kept for its next allocations. Plain
// data, so that it outlives every thread_local destructor (one of which may free a node): the
// Drain below empties it when its thread ends, and frees that come later go to the heap.
template <size_t Size, size_t Align>
struct FreeList {
  struct Block {
    Block* next;
  };
  // Enough for a large step's nodes; blocks past it go back to the heap, so a thread that only
  // frees what others made holds no more than this.
  static constexpr size_t kMaxBlocks = 4096;
  Block* head = nullptr;
  size_t count = 0;
  bool closed = false;  // its thread is ending

  static void* heap_allocate() { return ::operator new (Size, std::align_val_t{Align}); }
  static void heap_free(void* p) { ::operator delete (p, Size, std::align_val_t{Align}); }
};

template <size_t Size, size_t Align>
struct Drain {
  FreeList<Size, Align>* list;
  ~Drain() {
    list->closed = true;
    while (list->head) {
      auto* next = list->head->next;
      FreeList<Size, Align>::heap_free(list->head);
      list->head = next;
    }
    list->count = 0;
  }
};

template <size_t Size, size_t Align>
FreeList<Size, Align>& free_list() {
  thread_local FreeList<Size, Align> list;
  return list;
}

template <size_t Size, size_t Align>
void* allocate_block() {
  FreeList<Size, Align>& list = free_list<Size, Align>();
  if (auto* block = list.head) {
    list.head = block->next;
    --list.count;
    return block;
  }
  return FreeList<Size, Align>::heap_allocate();
}

template <size_t Size, size_t Align>
void free_block(void* p) {
  FreeList<Size, Align>& list = free_list<Size, Align>();
  if (list.closed || list.count >= FreeList<Size, Align>::kMaxBlocks) {
    FreeList<Size, Align>::heap_free(p);
    return;
  }
  if (list.count == 0) {
    // A thread that keeps blocks registers the drain that hands them back when it ends.
    thread_local Drain<Size, Align> drain{&list};
    (void)drain;
  }
  auto* block = static_cast<typename FreeList<Size, Align>::Block*>(p);
  block->next = list.head;
  list.head = block;
  ++list.count;
}

}  // namespace pool_detail

/// An allocator for std::allocate_shared: single objects come from a per-thread free list of
/// blocks of their size (jemalloc's per-thread cache does the same, with more work per call),
/// anything else from the heap. Blocks may be freed on another thread than the one that made
/// them. Under the sanitizers every object comes from the heap, so that a use after free is
/// still caught.
template <typename T>
struct PoolAllocator {
  using value_type = T;
  PoolAllocator() = default;
  template <typename U>
  PoolAllocator(const PoolAllocator<U>&) {}  // NOLINT(google-explicit-constructor)

  T* allocate(size_t n) {
    if (kPooled && n == 1) return static_cast<T*>(pool_detail::allocate_block<kSize, kAlign>());
    return std::allocator<T>().allocate(n);
  }
  void deallocate(T* p, size_t n) {
    if (kPooled && n == 1) return pool_detail::free_block<kSize, kAlign>(p);
    std::allocator<T>().deallocate(p, n);
  }
  template <typename U>
  bool operator==(const PoolAllocator<U>&) const {
    return true;
  }

 private:
  static constexpr size_t kAlign = alignof(T) > alignof(void*) ? alignof(T) : alignof(void*);
  static constexpr size_t kSize = (sizeof(T) + kAlign - 1) / kAlign * kAlign;
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
  static constexpr bool kPooled = false;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
  static constexpr bool kPooled = false;
#else
  static constexpr bool kPooled = true;
#endif
#else
  static constexpr bool kPooled = true;
#endif
};

}  // namespace mixtape

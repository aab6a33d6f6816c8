// mixtape/runtime/cuda_allocator.cpp -- caching allocator bookkeeping, cuMemAlloc backend, staging
// ring.
#include "mixtape/runtime/cuda_allocator.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <cstring>

#include "mixtape/dsl/error.h"

namespace mixtape::cuda {

namespace {

bool is_small(size_t rounded) { return rounded <= CachingAllocator::kSmallLimit; }

std::string mib(size_t bytes) { return fmt::format("{:.2f} MiB", bytes / 1048576.0); }

}  // namespace

CachingAllocator::CachingAllocator(std::unique_ptr<MemoryBackend> backend)
    : backend_(std::move(backend)) {}

CachingAllocator::~CachingAllocator() {
  // Blocks still in use are the owner's leak; the cached ones go back.
  try {
    std::lock_guard lock(mutex_);
    release_cached_locked();
  } catch (const std::exception&) {
    // A destructor must not throw; the memory is reclaimed with the process.
  }
}

size_t CachingAllocator::round_size(size_t bytes) {
  if (bytes <= kSmallLimit)
    return std::max(kSmallRound, (bytes + kSmallRound - 1) / kSmallRound * kSmallRound);
  return (bytes + kLargeRound - 1) / kLargeRound * kLargeRound;
}

void* CachingAllocator::allocate(size_t bytes, StreamId stream) {
  const size_t rounded = round_size(bytes);
  std::lock_guard lock(mutex_);
  ++stats_.alloc_count;
  // Best fit on this stream, within the request's class and at most twice its size, so a small
  // request never pins a big block.
  auto it = free_.lower_bound({stream, rounded, 0});
  if (it != free_.end() && std::get<0>(*it) == stream && std::get<1>(*it) <= 2 * rounded &&
      is_small(std::get<1>(*it)) == is_small(rounded)) {
    void* ptr = reinterpret_cast<void*>(std::get<2>(*it));
    stats_.allocated += std::get<1>(*it);
    free_.erase(it);
    ++stats_.cache_hits;
    stats_.peak_allocated = std::max(stats_.peak_allocated, stats_.allocated);
    return ptr;
  }
  void* ptr = backend_->allocate(rounded);
  if (ptr == nullptr && !free_.empty()) {
    release_cached_locked();
    ptr = backend_->allocate(rounded);
  }
  if (ptr == nullptr) {
    std::string extra = backend_->describe();
    fail(
        "out of device memory: tried to allocate {} ({} bytes requested) with {} allocated and "
        "{} reserved by mixtape{}{}",
        mib(rounded), bytes, mib(stats_.allocated), mib(stats_.reserved), extra.empty() ? "" : "; ",
        extra);
  }
  blocks_.emplace(reinterpret_cast<uintptr_t>(ptr), Block{ptr, rounded, stream});
  ++stats_.backend_allocs;
  stats_.allocated += rounded;
  stats_.reserved += rounded;
  stats_.peak_allocated = std::max(stats_.peak_allocated, stats_.allocated);
  stats_.peak_reserved = std::max(stats_.peak_reserved, stats_.reserved);
  return ptr;
}

void CachingAllocator::deallocate(void* ptr) {
  if (ptr == nullptr) return;
  std::lock_guard lock(mutex_);
  auto it = blocks_.find(reinterpret_cast<uintptr_t>(ptr));
  if (it == blocks_.end()) fail("deallocate: {} was not allocated by this allocator", ptr);
  const Block& block = it->second;
  auto key = std::make_tuple(block.stream, block.size, it->first);
  if (free_.count(key)) fail("deallocate: {} was freed twice", ptr);
  free_.insert(key);
  stats_.allocated -= block.size;
}

void CachingAllocator::release_cached_locked() {
  if (free_.empty()) return;
  // Work queued before the free may still read or write the blocks.
  backend_->synchronize();
  for (const auto& [stream, size, address] : free_) {
    backend_->release(reinterpret_cast<void*>(address));
    blocks_.erase(address);
    stats_.reserved -= size;
  }
  free_.clear();
}

void CachingAllocator::empty_cache() {
  std::lock_guard lock(mutex_);
  release_cached_locked();
}

AllocatorStats CachingAllocator::stats() const {
  std::lock_guard lock(mutex_);
  return stats_;
}

void CachingAllocator::reset_peak_stats() {
  std::lock_guard lock(mutex_);
  stats_.peak_allocated = stats_.allocated;
  stats_.peak_reserved = stats_.reserved;
}

size_t CachingAllocator::block_size(const void* ptr) const {
  std::lock_guard lock(mutex_);
  auto it = blocks_.find(reinterpret_cast<uintptr_t>(ptr));
  return it == blocks_.end() ? 0 : it->second.size;
}

namespace {

class DeviceMemoryBackend : public MemoryBackend {
 public:
  void* allocate(size_t bytes) override {
    CUdeviceptr ptr = 0;
    CUresult result = driver().cuMemAlloc_v2(&ptr, bytes);
    if (result == driver_abi::kErrorOutOfMemory) return nullptr;
    check(result, "cuMemAlloc_v2");
    return reinterpret_cast<void*>(static_cast<uintptr_t>(ptr));
  }
  void release(void* ptr) override {
    check(driver().cuMemFree_v2(device_ptr(ptr)), "cuMemFree_v2");
  }
  void synchronize() override { compute_stream().synchronize(); }
  std::string describe() const override {
    MemoryInfo info = memory_info();
    return fmt::format("{} free of {} on {}", mib(info.free), mib(info.total), device_name());
  }
};

}  // namespace

namespace {
// The device allocator once made: read by the memory statistics, which must not start CUDA.
std::atomic<CachingAllocator*> made_device_allocator{nullptr};
}  // namespace

CachingAllocator& device_allocator() {
  require_available();
  // Never destroyed: buffers in static objects may be freed after main returns.
  static CachingAllocator* allocator = [] {
    auto* made = new CachingAllocator(std::make_unique<DeviceMemoryBackend>());
    made_device_allocator.store(made, std::memory_order_release);
    return made;
  }();
  return *allocator;
}

AllocatorStats device_allocator_stats() {
  CachingAllocator* allocator = made_device_allocator.load(std::memory_order_acquire);
  return allocator ? allocator->stats() : AllocatorStats{};
}

void reset_device_allocator_peak() {
  if (CachingAllocator* allocator = made_device_allocator.load(std::memory_order_acquire))
    allocator->reset_peak_stats();
}

StreamId compute_stream_id() { return reinterpret_cast<StreamId>(compute_stream().handle()); }

DeviceBuffer::DeviceBuffer(size_t bytes)
    : ptr_(device_allocator().allocate(bytes, compute_stream_id())), bytes_(bytes) {}

DeviceBuffer::~DeviceBuffer() { reset(); }

DeviceBuffer::DeviceBuffer(DeviceBuffer&& other) noexcept : ptr_(other.ptr_), bytes_(other.bytes_) {
  other.ptr_ = nullptr;
  other.bytes_ = 0;
}

DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& other) noexcept {
  if (this != &other) {
    reset();
    std::swap(ptr_, other.ptr_);
    std::swap(bytes_, other.bytes_);
  }
  return *this;
}

void DeviceBuffer::reset() {
  if (ptr_ != nullptr) device_allocator().deallocate(ptr_);
  ptr_ = nullptr;
  bytes_ = 0;
}

namespace {

// Four 4 MiB pinned chunks: enough in flight to keep the copy engine busy while the host copies
// the next chunk, small enough to pin once and keep.
constexpr size_t kStagingChunk = size_t{4} << 20;
constexpr size_t kStagingSlots = 4;

struct StagingSlot {
  void* pinned = nullptr;
  std::unique_ptr<Event> copied;  // recorded after the slot's last DMA
  bool pending = false;
  void* copy_out = nullptr;  // download destination waiting for the DMA, or null
  size_t copy_out_bytes = 0;
};

struct StagingRing {
  std::mutex mutex;
  std::array<StagingSlot, kStagingSlots> slots;
  size_t next = 0;

  StagingSlot& take() {
    StagingSlot& slot = slots[next++ % kStagingSlots];
    if (slot.pinned == nullptr) {
      check(driver().cuMemAllocHost_v2(&slot.pinned, kStagingChunk), "cuMemAllocHost_v2");
      slot.copied = std::make_unique<Event>(false);
    }
    finish(slot);
    return slot;
  }
  static void finish(StagingSlot& slot) {
    if (!slot.pending) return;
    slot.copied->synchronize();
    if (slot.copy_out != nullptr) std::memcpy(slot.copy_out, slot.pinned, slot.copy_out_bytes);
    slot.pending = false;
    slot.copy_out = nullptr;
  }
};

StagingRing& staging() {
  static StagingRing* ring = new StagingRing;  // pinned memory lives as long as the process
  return *ring;
}

}  // namespace

void upload(CUdeviceptr dst, const void* src, size_t bytes) {
  StagingRing& ring = staging();
  std::lock_guard lock(ring.mutex);
  for (size_t offset = 0; offset < bytes; offset += kStagingChunk) {
    size_t length = std::min(kStagingChunk, bytes - offset);
    StagingSlot& slot = ring.take();
    std::memcpy(slot.pinned, static_cast<const char*>(src) + offset, length);
    copy_to_device_async(dst + offset, slot.pinned, length);
    slot.copied->record();
    slot.pending = true;
  }
}

void download(void* dst, CUdeviceptr src, size_t bytes) {
  StagingRing& ring = staging();
  std::lock_guard lock(ring.mutex);
  for (size_t offset = 0; offset < bytes; offset += kStagingChunk) {
    size_t length = std::min(kStagingChunk, bytes - offset);
    StagingSlot& slot = ring.take();
    copy_to_host_async(slot.pinned, src + offset, length);
    slot.copied->record();
    slot.pending = true;
    slot.copy_out = static_cast<char*>(dst) + offset;
    slot.copy_out_bytes = length;
  }
  for (StagingSlot& slot : ring.slots) StagingRing::finish(slot);
}

}  // namespace mixtape::cuda

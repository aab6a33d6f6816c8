// mixtape/codegen/lru_cache.h -- a least-recently-used map bounded by a byte budget, for the
// in-memory caches (compiled kernel objects, programs).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <list>
#include <unordered_map>
#include <utility>

namespace mixtape {

/// The byte budget of each in-memory cache (the kernel cache's objects, each back end's
/// programs): $MIXTAPE_MEMORY_CACHE_BYTES if set to a number, else 16 MiB. A long run over many
/// shapes then holds what its recent shapes need instead of growing without end.
int64_t memory_cache_bytes();
/// Replaces the budget for every in-memory cache (tests sweep shapes under a small one); the
/// caches shrink to it at their next insertion.
void set_memory_cache_bytes(int64_t bytes);

/// Entries by key, each with the bytes it costs; put() evicts the least recently used (found or
/// put) until the total fits the budget (memory_cache_bytes() unless one is given). An entry
/// larger than the whole budget is not kept. Not thread-safe: the owner locks. Values are usually
/// shared_ptrs, so that an evicted value lives on while someone still uses it. The index holds
/// a View of each key (std::string_view for std::string keys: long keys are not stored twice),
/// hashed with Hash and compared with Equal.
template <typename Key, typename Value, typename View = Key, typename Hash = std::hash<View>,
          typename Equal = std::equal_to<View>>
class LruCache {
 public:
  /// budget < 0: follow memory_cache_bytes().
  explicit LruCache(int64_t budget = -1) : budget_(budget) {}
  LruCache(const LruCache&) = delete;
  LruCache& operator=(const LruCache&) = delete;

  /// The value under key, made the most recently used; null when absent.
  template <typename K>
  const Value* find(const K& key) {
    auto found = index_.find(key);
    if (found == index_.end()) return nullptr;
    order_.splice(order_.begin(), order_, found->second);
    return &found->second->value;
  }

  /// Stores value under key (replacing any), most recently used, then evicts to the budget.
  void put(Key key, Value value, int64_t bytes) {
    erase(key);
    // Larger than the whole budget: not kept, and the others stay (evicting from the back first
    // emptied the cache and then dropped this one too).
    if (bytes > budget()) {
      ++evictions_;
      return;
    }
    order_.push_front({std::move(key), std::move(value), bytes});
    index_.emplace(View(order_.front().key), order_.begin());
    bytes_ += bytes;
    int64_t budget = this->budget();
    while (bytes_ > budget && !order_.empty()) {
      index_.erase(order_.back().key);
      bytes_ -= order_.back().bytes;
      order_.pop_back();
      ++evictions_;
    }
  }

  template <typename K>
  void erase(const K& key) {
    auto found = index_.find(key);
    if (found == index_.end()) return;
    bytes_ -= found->second->bytes;
    order_.erase(found->second);
    index_.erase(found);
  }

  void clear() {
    index_.clear();
    order_.clear();
    bytes_ = 0;
  }

  size_t size() const { return order_.size(); }
  /// The sum of the held entries' bytes: never above budget() after a put.
  int64_t bytes() const { return bytes_; }
  int64_t budget() const { return budget_ >= 0 ? budget_ : memory_cache_bytes(); }
  /// Entries dropped to make room, over the cache's life.
  int64_t evictions() const { return evictions_; }

 private:
  struct Entry {
    Key key;
    Value value;
    int64_t bytes;
  };
  int64_t budget_;
  std::list<Entry> order_;  // most recently used first; list nodes never move, so views stay valid
  std::unordered_map<View, typename std::list<Entry>::iterator, Hash, Equal> index_;
  int64_t bytes_ = 0;
  int64_t evictions_ = 0;
};

}  // namespace mixtape

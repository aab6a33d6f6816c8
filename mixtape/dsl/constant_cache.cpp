// mixtape/dsl/constant_cache.cpp -- tables that composites make on the host, kept by what makes
// them.
#include "mixtape/dsl/constant_cache.h"

#include <deque>
#include <map>
#include <mutex>

namespace mixtape {
namespace {

// The tables' bytes in all, beyond which the oldest are let go, and of one table, beyond which
// it is made afresh each time (an interpolation to a long axis: its tables cost more than a
// trace).
constexpr size_t kMaxBytes = size_t{64} << 20;
constexpr size_t kMaxTableBytes = size_t{4} << 20;

size_t bytes_of(const Tensor& t) { return static_cast<size_t>(t.numel()) * size_of(t.dtype()); }

}  // namespace

Tensor cached_constant(const std::string& key, const std::function<Tensor()>& make) {
  static std::mutex mutex;
  // Never destroyed: a kept tensor must not outlive the host block cache its storage came from,
  // which static destruction would not guarantee.
  static auto* tables = new std::map<std::string, Tensor>();
  static auto* order = new std::deque<std::map<std::string, Tensor>::iterator>();
  static size_t bytes = 0;
  std::lock_guard<std::mutex> lock(mutex);
  if (auto found = tables->find(key); found != tables->end()) return found->second;
  Tensor table = make();
  if (bytes_of(table) > kMaxTableBytes) return table;
  auto it = tables->emplace(key, table).first;
  order->push_back(it);
  bytes += bytes_of(table);
  while (bytes > kMaxBytes && order->size() > 1) {
    bytes -= bytes_of(order->front()->second);
    tables->erase(order->front());
    order->pop_front();
  }
  return table;
}

}  // namespace mixtape

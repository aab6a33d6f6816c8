// mixtape/dsl/constant_cache.cpp -- tables that composites make on the host, kept by value.
#include "mixtape/dsl/constant_cache.h"

#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <string>

#include <fmt/format.h>

namespace mixtape {
namespace {

// The values' bytes in all, beyond which the oldest tables are let go, and of one table, beyond
// which it is made afresh each time (an interpolation to a long axis: its tables cost more than
// a trace).
constexpr size_t kMaxBytes = size_t{64} << 20;
constexpr size_t kMaxTableBytes = size_t{4} << 20;

template <typename T>
Tensor cached(const std::vector<T>& values, const Shape& shape, DType dtype) {
  if (values.size() * sizeof(T) > kMaxTableBytes) return tensor(values, shape, dtype);
  std::string key(reinterpret_cast<const char*>(values.data()), values.size() * sizeof(T));
  key += fmt::format("|{}|{}|{}", sizeof(T), name(dtype), to_string(shape));
  static std::mutex mutex;
  // Never destroyed: a kept tensor must not outlive the host block cache its storage came from,
  // which static destruction would not guarantee.
  static auto* tables = new std::map<std::string, Tensor>();
  static auto* order = new std::deque<std::map<std::string, Tensor>::iterator>();
  static size_t bytes = 0;
  std::lock_guard<std::mutex> lock(mutex);
  auto [it, made] = tables->try_emplace(std::move(key));
  if (!made) return it->second;
  it->second = tensor(values, shape, dtype);
  order->push_back(it);
  bytes += it->first.size();
  while (bytes > kMaxBytes && order->size() > 1) {
    bytes -= order->front()->first.size();
    tables->erase(order->front());
    order->pop_front();
  }
  return it->second;
}

}  // namespace

Tensor cached_constant(const std::vector<double>& values, const Shape& shape, DType dtype) {
  return cached(values, shape, dtype);
}

Tensor cached_constant(const std::vector<int64_t>& values, const Shape& shape, DType dtype) {
  return cached(values, shape, dtype);
}

}  // namespace mixtape

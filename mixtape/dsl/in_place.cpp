// mixtape/dsl/in_place.cpp -- the process's count of buffers that replay plans update in place.
#include "mixtape/dsl/in_place.h"

#include <atomic>
#include <mutex>
#include <unordered_map>

namespace mixtape {
namespace {

struct Held {
  std::mutex mutex;
  std::unordered_map<const Storage*, int> plans;  // buffer -> plans updating it
  std::atomic<size_t> count{0};                   // plans.size(): the traced loop's fast path
};

// Never destroyed: a plan kept in a static (a compiled step in a global) may release its buffers
// during static destruction, after a function-local static here would be gone.
Held& held() {
  static Held* instance = new Held;
  return *instance;
}

}  // namespace

void hold_in_place(const Storage* buffer) {
  Held& h = held();
  std::lock_guard<std::mutex> lock(h.mutex);
  ++h.plans[buffer];
  h.count.store(h.plans.size(), std::memory_order_release);
}

void release_in_place(const Storage* buffer) {
  Held& h = held();
  std::lock_guard<std::mutex> lock(h.mutex);
  auto found = h.plans.find(buffer);
  if (found != h.plans.end() && --found->second == 0) h.plans.erase(found);
  h.count.store(h.plans.size(), std::memory_order_release);
}

bool written_in_place(const Storage* buffer) {
  Held& h = held();
  if (h.count.load(std::memory_order_acquire) == 0) return false;  // no plan: nothing to copy
  std::lock_guard<std::mutex> lock(h.mutex);
  return h.plans.count(buffer) > 0;
}

}  // namespace mixtape

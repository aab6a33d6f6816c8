// mixtape/dsl/in_place.cpp -- the process's count of buffers that replay plans update in place.
#include "mixtape/dsl/in_place.h"

#include <mutex>
#include <unordered_map>

namespace mixtape {
namespace {

struct Held {
  std::mutex mutex;
  std::unordered_map<const Storage*, int> plans;  // buffer -> plans updating it
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
}

void release_in_place(const Storage* buffer) {
  Held& h = held();
  std::lock_guard<std::mutex> lock(h.mutex);
  auto found = h.plans.find(buffer);
  if (found != h.plans.end() && --found->second == 0) h.plans.erase(found);
}

bool written_in_place(const Storage* buffer) {
  Held& h = held();
  std::lock_guard<std::mutex> lock(h.mutex);
  return h.plans.count(buffer) > 0;
}

}  // namespace mixtape

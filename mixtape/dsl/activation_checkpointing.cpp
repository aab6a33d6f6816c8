// mixtape/dsl/activation_checkpointing.cpp -- the process-wide list of checkpointed module globs.
#include "mixtape/dsl/activation_checkpointing.h"

#include <algorithm>
#include <atomic>
#include <mutex>

#include "mixtape/dsl/error.h"
#include "mixtape/dsl/graph.h"

namespace mixtape {
namespace {

struct Registry {
  std::mutex mutex;
  std::shared_ptr<const std::vector<std::string>> globs;  // under the mutex
  std::atomic<bool> any{false};                           // read unlocked by every backward pass
  std::atomic<uint64_t> edits{0};
};
Registry& registry() {
  static Registry* r = new Registry;  // never destroyed: backward passes may run until exit
  return *r;
}

// Publishes `globs` (null when empty) for the backward passes that start from now on.
void publish(Registry& r, std::vector<std::string> globs) {
  // A compiled step's trace would record a graph this change makes different from a replay's.
  note_side_effect("changes which modules are checkpointed");
  std::shared_ptr<const std::vector<std::string>> list;
  if (!globs.empty()) list = std::make_shared<const std::vector<std::string>>(std::move(globs));
  r.any.store(list != nullptr, std::memory_order_release);
  r.globs = std::move(list);
  r.edits.fetch_add(1, std::memory_order_release);
}

}  // namespace

void checkpoint(const std::string& glob) {
  if (glob.empty())
    fail(
        "checkpoint: an empty pattern selects no module (the root module has no path; "
        "checkpoint its children, e.g. \"blocks.*\")");
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  std::vector<std::string> globs = r.globs ? *r.globs : std::vector<std::string>();
  if (std::find(globs.begin(), globs.end(), glob) != globs.end()) return;
  globs.push_back(glob);
  publish(r, std::move(globs));
}

bool remove_checkpoint(const std::string& glob) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  std::vector<std::string> globs = r.globs ? *r.globs : std::vector<std::string>();
  auto found = std::find(globs.begin(), globs.end(), glob);
  if (found == globs.end()) return false;
  globs.erase(found);
  publish(r, std::move(globs));
  return true;
}

uint64_t checkpoint_edits() { return registry().edits.load(std::memory_order_acquire); }

void clear_checkpoints() {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  if (r.globs) publish(r, {});
}

std::vector<std::string> checkpoints() {
  std::shared_ptr<const std::vector<std::string>> globs = checkpoint_globs();
  return globs ? *globs : std::vector<std::string>();
}

std::shared_ptr<const std::vector<std::string>> checkpoint_globs() {
  Registry& r = registry();
  if (!r.any.load(std::memory_order_acquire)) return nullptr;
  std::lock_guard<std::mutex> lock(r.mutex);
  return r.globs;
}

}  // namespace mixtape

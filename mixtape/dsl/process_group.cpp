// mixtape/dsl/process_group.cpp -- the installed process group (none: one process), and the
// parameters whose gradients ZeRO shards, and no_sync's holds.
#include "mixtape/dsl/process_group.h"

#include <mutex>
#include <unordered_set>
#include <utility>

namespace mixtape {
namespace {

// Installed once by dist::init before any step runs, and kept to exit: steps read it unlocked.
std::shared_ptr<ProcessGroup>& installed() {
  static std::shared_ptr<ProcessGroup>* group = new std::shared_ptr<ProcessGroup>;
  return *group;
}

struct ShardedGradients {
  std::mutex mutex;
  std::unordered_set<const TensorImpl*> parameters;
};
ShardedGradients& sharded_gradients() {
  static ShardedGradients* set = new ShardedGradients;  // never destroyed: used until exit
  return *set;
}

// Steps are built, traced and run by one thread at a time, as the gradient hooks run.
int sync_holds = 0;
int pending_local_gradients = 0;

}  // namespace

void set_gradient_sharded(const TensorImpl* parameter, bool sharded) {
  ShardedGradients& set = sharded_gradients();
  std::lock_guard<std::mutex> lock(set.mutex);
  if (sharded)
    set.parameters.insert(parameter);
  else
    set.parameters.erase(parameter);
}

bool gradient_sharded(const TensorImpl* parameter) {
  ShardedGradients& set = sharded_gradients();
  std::lock_guard<std::mutex> lock(set.mutex);
  return parameter && set.parameters.count(parameter) > 0;
}

bool gradient_held_as_shards(const TensorImpl* parameter) {
  return *gradient_sync_variant() == '\0' && gradient_sharded(parameter);
}

void hold_gradient_sync() { ++sync_holds; }
void release_gradient_sync() { --sync_holds; }
bool gradient_sync_held() { return sync_holds > 0; }
void add_pending_local_gradients(int delta) { pending_local_gradients += delta; }

const char* gradient_sync_variant() {
  if (sync_holds > 0) return "no_sync";
  return pending_local_gradients > 0 ? "unsynced" : "";
}

namespace {
thread_local const Node* current_collective_node = nullptr;
}  // namespace

CollectiveNodeScope::CollectiveNodeScope(const Node& node)
    : previous_(std::exchange(current_collective_node, &node)) {}
CollectiveNodeScope::~CollectiveNodeScope() { current_collective_node = previous_; }
const Node* collective_node() { return current_collective_node; }

ProcessGroup* process_group() { return installed().get(); }
void set_process_group(std::shared_ptr<ProcessGroup> group) { installed() = std::move(group); }
std::shared_ptr<ProcessGroup> exchange_process_group(std::shared_ptr<ProcessGroup> group) {
  return std::exchange(installed(), std::move(group));
}
int process_rank() { return installed() ? installed()->rank() : 0; }
int process_count() { return installed() ? installed()->size() : 1; }

}  // namespace mixtape

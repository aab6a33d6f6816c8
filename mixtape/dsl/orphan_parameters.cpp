// mixtape/dsl/orphan_parameters.cpp -- tracks module parameters, the parameters optimizers hold and
// the leaves that got gradients, to warn once about parameters that train nowhere.
#include "mixtape/dsl/orphan_parameters.h"

#include <cstdio>
#include <mutex>
#include <unordered_map>
#include <unordered_set>

#include "mixtape/dsl/error.h"

namespace mixtape {
namespace {

struct ParameterInfo {
  std::weak_ptr<TensorImpl> alive;  // the entry is stale once the tensor is gone
  std::string name;
};

struct Registry {
  std::mutex mutex;
  std::unordered_map<const TensorImpl*, ParameterInfo> parameters;
  std::unordered_map<const TensorImpl*, int> held;  // by how many optimizers
  std::vector<std::weak_ptr<TensorImpl>> with_gradients;
  std::unordered_set<const TensorImpl*> recent, warned;
  size_t prune_at = 1024;
};

Registry& registry() {
  static Registry* r = new Registry;  // never destroyed: tensors may die during exit
  return *r;
}

const TensorImpl* impl_of(const Tensor& t) { return t.impl().get(); }

}  // namespace

void note_module_parameter(const Tensor& param, const std::string& name) {
  // Frozen ones too: unfrozen later, they get gradients.
  const std::shared_ptr<TensorImpl>& impl = param.impl();
  if (!impl) return;
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  // Parameters of models long gone would pile up: drop dead entries now and then.
  if (r.parameters.size() >= r.prune_at) {
    std::erase_if(r.parameters, [](const auto& entry) { return entry.second.alive.expired(); });
    r.prune_at = std::max<size_t>(1024, 2 * r.parameters.size());
  }
  r.parameters[impl.get()] = {impl, name};
}

bool is_module_parameter(const Tensor& t) {
  const std::shared_ptr<TensorImpl>& impl = t.impl();
  if (!impl) return false;
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  auto found = r.parameters.find(impl.get());
  return found != r.parameters.end() && found->second.alive.lock() == impl;
}

void note_optimizer_parameters(const std::vector<Tensor>& params, bool add) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  for (const Tensor& p : params) {
    const TensorImpl* impl = impl_of(p);
    if (!impl) continue;
    if (add) {
      ++r.held[impl];
    } else if (auto found = r.held.find(impl); found != r.held.end() && --found->second == 0) {
      r.held.erase(found);
    }
  }
}

void note_gradient(const std::shared_ptr<TensorImpl>& leaf) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  // Only module parameters can be orphans: inputs that take gradients (adversarial examples,
  // saliency maps) are not remembered, so loops without an optimizer step do not grow this.
  auto param = r.parameters.find(leaf.get());
  if (param == r.parameters.end() || param->second.alive.lock() != leaf) return;
  if (r.recent.insert(leaf.get()).second) r.with_gradients.push_back(leaf);
}

int warn_about_orphan_parameters() {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  int warned = 0;
  for (const std::weak_ptr<TensorImpl>& weak : r.with_gradients) {
    std::shared_ptr<TensorImpl> impl = weak.lock();
    if (!impl || r.held.count(impl.get()) || r.warned.count(impl.get())) continue;
    auto param = r.parameters.find(impl.get());
    if (param == r.parameters.end() || param->second.alive.lock() != impl) continue;
    r.warned.insert(impl.get());
    ++warned;
    const Node& node = *impl->node;
    std::string module = node.origin.module_path.empty()
                             ? ""
                             : fmt::format(" in module '{}'", node.origin.module_path);
    std::fprintf(stderr,
                 "mixtape: warning: parameter '%s' %s%s (made at %s) gets gradients, but no "
                 "optimizer updates it: is its module registered with register_module()?\n",
                 param->second.name.c_str(), to_string(node.shape).c_str(), module.c_str(),
                 short_location(node.origin.location).c_str());
  }
  r.with_gradients.clear();
  r.recent.clear();
  return warned;
}

}  // namespace mixtape

// mixtape/dsl/ema.cpp -- AveragedModel: averages updated as one evaluated program, in torch's
// arithmetic (decay * average + (1 - decay) * weight; average + (weight - average) / (n + 1)).
#include "mixtape/dsl/ema.h"

#include <cmath>
#include <memory>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "mixtape/dsl/convert.h"
#include "mixtape/dsl/error.h"
#include "mixtape/dsl/graph.h"
#include "mixtape/dsl/ops.h"

namespace mixtape {
namespace {

// Where an average of `weight` is kept: f32 for half weights, else the weight's own type.
DType average_dtype(DType weight) { return is_half(weight) ? f32 : weight; }

Tensor stored_copy(const Tensor& value, DType dtype) {
  Tensor copy = cast(value, dtype) * 1;  // computed here: a value of its own
  eval({copy});
  return from_storage(copy.node()->value, copy.shape());
}

}  // namespace

AveragedModel::AveragedModel(const Module& module, AveragedModelOptions options)
    : module_(module), options_(options) {
  if (options_.decay && !(*options_.decay >= 0 && *options_.decay <= 1))
    fail("AveragedModel: decay must be in [0, 1], got {}", *options_.decay);
  NoGradGuard no_grad;
  const NamedTensors parameters = module.named_parameters();
  std::unordered_set<std::string_view> parameter_names;
  for (const auto& [name, value] : parameters) parameter_names.insert(name);
  for (const auto& [name, value] : module.state_dict()) {
    averages_.emplace_back(name, stored_copy(value, average_dtype(value.dtype())));
    folded_.push_back(is_floating(value.dtype()) &&
                      (parameter_names.count(name) > 0 || options_.average_buffers));
  }
  if (averages_.empty()) fail("AveragedModel: the module has no parameters or buffers");
  count_ = stored_copy(zeros({}, f64), f64);
}

void AveragedModel::update() {
  NoGradGuard no_grad;
  NoPolicyScope no_policy;
  NamedTensors now = module_.state_dict();
  if (now.size() != averages_.size())
    fail("AveragedModel: the module now has {} parameters and buffers, {} when it was made",
         now.size(), averages_.size());
  const Tensor first = count_ == 0.0;
  std::vector<Tensor> next;
  next.reserve(averages_.size() + 1);
  for (size_t i = 0; i < averages_.size(); ++i) {
    const auto& [name, average] = averages_[i];
    if (now[i].first != name || now[i].second.shape() != average.shape())
      fail("AveragedModel: the module's '{}' is not the '{}' it was made with", now[i].first, name);
    Tensor weight = cast(now[i].second, average.dtype());
    if (!folded_[i]) {
      next.push_back(weight * 1);  // copied: integer buffers, or buffers not averaged
      continue;
    }
    Tensor folded = options_.decay
                        ? average * *options_.decay + weight * (1 - *options_.decay)
                        : average + (weight - average) / cast(count_ + 1.0, average.dtype());
    next.push_back(where(first, weight, folded));
  }
  next.push_back(count_ + 1.0);
  eval(next);
  for (size_t i = 0; i < averages_.size(); ++i) averages_[i].second.assign(next[i]);
  count_.assign(next.back());
}

int64_t AveragedModel::updates() const { return static_cast<int64_t>(count_.item()); }

NamedTensors AveragedModel::copy_to(Module& module) const {
  NamedTensors previous;
  for (const auto& [name, value] : module.state_dict()) previous.emplace_back(name, value.detach());
  module.load_state_dict(averages_);
  return previous;
}

NamedTensors AveragedModel::state_dict() const {
  NamedTensors out;
  out.emplace_back("n_averaged", cast(count_, i64));
  for (const auto& [name, average] : averages_)
    out.emplace_back("module." + name, average.detach());
  return out;
}

void AveragedModel::load_state_dict(const NamedTensors& state) {
  std::unordered_map<std::string_view, const Tensor*> by_name;
  for (const auto& [name, value] : state)
    if (!by_name.emplace(name, &value).second)
      fail("AveragedModel::load_state_dict: '{}' is given twice", name);
  if (state.size() != averages_.size() + 1)
    fail("AveragedModel::load_state_dict: {} entries, expected n_averaged and {} averages",
         state.size(), averages_.size());
  auto entry = [&](const std::string& name) -> const Tensor& {
    auto found = by_name.find(name);
    if (found == by_name.end() || !found->second->defined())
      fail("AveragedModel::load_state_dict: no '{}'", name);
    return *found->second;
  };
  const Tensor& count = entry("n_averaged");
  if (count.numel() != 1) fail("AveragedModel::load_state_dict: n_averaged is not one number");
  const double updates = cast(count, f64).item();
  if (!(updates >= 0) || updates != std::floor(updates) || updates > 0x1p53)
    fail("AveragedModel::load_state_dict: n_averaged = {} is not a count", updates);
  std::vector<Tensor> loaded;
  for (const auto& [name, average] : averages_) {
    const Tensor& value = entry("module." + name);
    if (value.shape() != average.shape())
      fail("AveragedModel::load_state_dict: 'module.{}' has shape {}, expected {}", name,
           to_string(value.shape()), to_string(average.shape()));
    if (is_floating(value.dtype()) != is_floating(average.dtype()))
      fail("AveragedModel::load_state_dict: 'module.{}' is {}, expected {}", name,
           mixtape::name(value.dtype()), mixtape::name(average.dtype()));
    Tensor kept = stored_copy(value, average.dtype());
    if (is_floating(kept.dtype()) && first_nonfinite(*kept.node()->value) >= 0)
      fail("AveragedModel::load_state_dict: 'module.{}' holds a non-finite value", name);
    loaded.push_back(kept);
  }
  for (size_t i = 0; i < averages_.size(); ++i) averages_[i].second.assign(loaded[i]);
  count_.assign(stored_copy(scalar(updates, f64), f64));
}

}  // namespace mixtape

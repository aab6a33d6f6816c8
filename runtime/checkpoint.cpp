// runtime/checkpoint.cpp -- maps modules and optimizers onto safetensors entries.
#include "runtime/checkpoint.h"

#include <charconv>
#include <cstring>

#include "precision_policy/grad_scaler.h"
#include "runtime/safetensors.h"

namespace mixtape {
namespace {

constexpr const char* kOptimizerPrefix = "optimizer.";
constexpr const char* kScalerPrefix = "scaler.";

// The scaler's state tensors; its other entries (hyperparameters) travel as metadata.
bool is_scaler_tensor(const std::string& name) {
  return name == "scaler.scale" || name == "scaler.growth_tracker";
}

// The scaler state a file holds: its two tensors plus the "scaler." metadata as 0-d f64 values.
NamedTensors scaler_state(const std::string& path, const NamedTensors& entries,
                          const Metadata& metadata) {
  NamedTensors state;
  for (const auto& [key, value] : entries)
    if (is_scaler_tensor(key)) state.emplace_back(key.substr(std::strlen(kScalerPrefix)), value);
  for (const auto& [key, text] : metadata) {
    if (key.rfind(kScalerPrefix, 0) != 0) continue;
    double value = 0;
    auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
    if (text.empty() || ec != std::errc() || end != text.data() + text.size())
      fail("load_checkpoint {}: metadata '{}' = '{}' is not a number", path, key, text);
    state.emplace_back(key.substr(std::strlen(kScalerPrefix)), full({}, value, f64));
  }
  return state;
}

// The module path of each optimizer parameter, found by handle identity.
std::vector<std::string> optimizer_param_names(const Module& module, const Optimizer& optimizer,
                                               const std::string& path) {
  NamedTensors named = module.named_parameters();
  std::vector<std::string> names;
  for (const Tensor& p : optimizer.params()) {
    auto found =
        std::find_if(named.begin(), named.end(), [&](auto& e) { return e.second.same(p); });
    if (found == named.end())
      fail("checkpoint {}: the optimizer holds a parameter that is not part of the module", path);
    names.push_back(found->first);
  }
  return names;
}

std::string metadata_value(const Metadata& metadata, const std::string& key) {
  for (const auto& [k, v] : metadata)
    if (k == key) return v;
  return "";
}

}  // namespace

void save_tensors(const std::string& path, const NamedTensors& tensors, const Metadata& metadata) {
  std::vector<Tensor> all;
  for (const auto& [name, tensor] : tensors) {
    if (!tensor.defined()) fail("save_tensors {}: tensor '{}' is undefined", path, name);
    all.push_back(tensor);
  }
  eval(all);
  safetensors::File file;
  for (const auto& [name, tensor] : tensors) {
    const Storage& storage = *tensor.node()->value;
    safetensors::TensorData data;
    data.name = name;
    data.dtype = tensor.dtype();
    data.shape = tensor.shape();
    const std::byte* host = storage.host_data();
    data.bytes.assign(host, host + storage.size_bytes());
    file.tensors.push_back(std::move(data));
  }
  file.metadata = metadata;
  safetensors::write(path, file);
}

NamedTensors load_tensors(const std::string& path, Metadata* metadata) {
  safetensors::File file = safetensors::read(path);
  NamedTensors out;
  for (safetensors::TensorData& data : file.tensors) {
    auto storage =
        std::make_shared<Storage>(data.dtype, numel(data.shape), Storage::Uninitialized{});
    storage->bytes.assign(data.bytes.begin(), data.bytes.end());
    out.emplace_back(data.name, from_storage(std::move(storage), data.shape));
  }
  if (metadata) *metadata = std::move(file.metadata);
  return out;
}

void save_checkpoint(const std::string& path, const Module& module, const Optimizer* optimizer,
                     const Metadata& metadata, const GradScaler* scaler) {
  NamedTensors tensors = module.state_dict();
  Metadata meta = metadata;
  meta.emplace_back("format", "mixtape-checkpoint-1");
  if (optimizer) {
    std::vector<std::string> names = optimizer_param_names(module, *optimizer, path);
    for (size_t i = 0; i < names.size(); ++i)
      for (const auto& [state_name, value] : optimizer->state(i))
        tensors.emplace_back(kOptimizerPrefix + names[i] + "." + state_name, value);
    meta.emplace_back("optimizer.steps", std::to_string(optimizer->steps_taken()));
    meta.emplace_back("optimizer.kind", optimizer->kind());
  }
  if (scaler)
    for (const auto& [name, value] : scaler->state_dict()) {
      std::string key = kScalerPrefix + name;
      if (is_scaler_tensor(key))
        tensors.emplace_back(key, value);
      else
        meta.emplace_back(key, fmt::format("{}", value.item()));  // shortest exact text
    }
  save_tensors(path, tensors, meta);
}

void load_checkpoint(const std::string& path, Module& module, Optimizer* optimizer,
                     Metadata* metadata, GradScaler* scaler) {
  Metadata meta;
  NamedTensors all = load_tensors(path, &meta);
  NamedTensors model, optimizer_entries;
  for (auto& entry : all)
    if (!is_scaler_tensor(entry.first))
      (entry.first.rfind(kOptimizerPrefix, 0) == 0 ? optimizer_entries : model).push_back(entry);
  NamedTensors scaler_entries;
  if (scaler && scaler->is_enabled()) {
    scaler_entries = scaler_state(path, all, meta);
    if (scaler_entries.empty()) fail("load_checkpoint {}: the file holds no scaler state", path);
    try {  // validated on a copy before anything changes
      GradScaler(scaler->options()).load_state_dict(scaler_entries);
    } catch (const Error& e) {
      fail("load_checkpoint {}: {}", path, e.what());
    }
  }
  std::vector<NamedTensors> states;
  std::vector<std::string> names;
  int64_t steps = 0;
  if (optimizer) {
    names = optimizer_param_names(module, *optimizer, path);
    std::string kind = metadata_value(meta, "optimizer.kind");
    if (!kind.empty() && kind != optimizer->kind())
      fail("load_checkpoint {}: the file holds {} state, the optimizer is {}", path, kind,
           optimizer->kind());
    std::string steps_text = metadata_value(meta, "optimizer.steps");
    auto [end, ec] =
        std::from_chars(steps_text.data(), steps_text.data() + steps_text.size(), steps);
    if (steps_text.empty() || ec != std::errc() || end != steps_text.data() + steps_text.size() ||
        steps < 0)
      fail("load_checkpoint {}: no valid optimizer step count in the metadata", path);
    for (const std::string& name : names) {
      std::string prefix = kOptimizerPrefix + name + ".";
      NamedTensors state;
      for (const auto& [key, value] : optimizer_entries)
        if (key.rfind(prefix, 0) == 0 && key.find('.', prefix.size()) == std::string::npos)
          state.emplace_back(key.substr(prefix.size()), value);
      states.push_back(std::move(state));
    }
  }
  for (size_t i = 0; i < states.size(); ++i)  // validated before anything changes
    for (const auto& [state_name, value] : states[i])
      if (value.shape() != optimizer->params()[i].shape())
        fail("load_checkpoint {}: optimizer state '{}{}.{}' has shape {}, expected {}", path,
             kOptimizerPrefix, names[i], state_name, to_string(value.shape()),
             to_string(optimizer->params()[i].shape()));
  try {
    module.load_state_dict(model, true);
  } catch (const Error& e) {
    fail("load_checkpoint {}: {}", path, e.what());
  }
  if (optimizer) {
    for (size_t i = 0; i < states.size(); ++i) optimizer->load_state(i, states[i]);
    optimizer->set_steps_taken(steps);
  }
  if (!scaler_entries.empty()) scaler->load_state_dict(scaler_entries);
  if (metadata) *metadata = std::move(meta);
}

}  // namespace mixtape

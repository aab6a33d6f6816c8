// mixtape/runtime/checkpoint.cpp -- maps modules, optimizers, scalers, generators and data loaders
// onto safetensors entries, and checks what a load would restore before it changes anything.
#include "mixtape/runtime/checkpoint.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstring>
#include <memory>
#include <optional>
#include <set>
#include <string_view>
#include <unordered_map>

#include "mixtape/dsl/convert.h"
#include "mixtape/dsl/error.h"
#include "mixtape/dsl/json.h"
#include "mixtape/precision_policy/grad_scaler.h"
#include "mixtape/runtime/safetensors.h"

namespace mixtape {
namespace {

constexpr const char* kParamGroupsKey = "optimizer.param_groups";
// Each group's options but the rate, as Optimizer::named_options() gives them: a JSON list of
// objects, one per group.
constexpr const char* kOptionsKey = "optimizer.options";

constexpr const char* kOptimizerPrefix = "optimizer.";
constexpr const char* kScalerPrefix = "scaler.";
constexpr const char* kGeneratorPrefix = "generator.";

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
  // The first name of each tensor (a tied weight has several), by identity.
  std::unordered_map<const void*, std::string> first_name;
  for (const auto& [name, p] : module.named_parameters())
    first_name.try_emplace(p.identity(), name);
  std::vector<std::string> names;
  for (const Tensor& p : optimizer.params()) {
    auto found = first_name.find(p.identity());
    if (found == first_name.end())
      fail("checkpoint {}: the optimizer holds a parameter that is not part of the module", path);
    names.push_back(found->second);
  }
  return names;
}

}  // namespace

std::optional<OptimizerEntryName> optimizer_entry_name(std::string_view name) {
  const std::string_view prefix = kOptimizerPrefix;
  const size_t last = name.rfind('.');
  if (!name.starts_with(prefix) || last == std::string_view::npos || last <= prefix.size())
    return std::nullopt;
  return OptimizerEntryName{name.substr(prefix.size(), last - prefix.size()),
                            name.substr(last + 1)};
}

// An option's value as JSON: a number, a flag, null for an optional one unset, and Python's
// spellings "Infinity", "-Infinity" and "NaN" as strings for what JSON has no number for.
json::Value option_json(const OptionValue& value) {
  if (const bool* flag = std::get_if<bool>(&value)) return *flag;
  const double* number = std::get_if<double>(&value);
  if (!number) number = std::get<std::optional<double>>(value) ? &*std::get<1>(value) : nullptr;
  if (!number) return nullptr;  // an optional option unset
  const double v = *number;
  if (std::isnan(v)) return "NaN";
  if (std::isinf(v)) return v > 0 ? "Infinity" : "-Infinity";
  return v;
}

// The JSON list a metadata entry `key` holds; mt::Error starting with `context` for text that is
// none (`what` says what the list should hold).
json::Value metadata_list(const std::string& context, const char* key, std::string_view text,
                          const char* what) {
  json::Value doc;
  try {
    doc = json::parse(text, text.size() + 16);  // a value takes at least a byte
  } catch (const Error& e) {
    fail("{}: metadata '{}': {}", context, key, e.what());
  }
  if (!doc.is_array()) fail("{}: metadata '{}' is not a list of {}", context, key, what);
  return doc;
}

Metadata optimizer_metadata(const Optimizer& optimizer, const std::vector<std::string>& names) {
  Metadata meta;
  meta.emplace_back("optimizer.kind", optimizer.kind());
  json::Value options = json::Value::array();
  bool named = false;
  for (size_t g = 0; g < optimizer.group_count(); ++g) {
    json::Value group = json::Value::object();
    for (const auto& [name, value] : optimizer.named_options(g)) {
      named = true;
      json::append(group, name, option_json(value));
    }
    options.push_back(std::move(group));
  }
  if (named) meta.emplace_back(kOptionsKey, json::dump(options));
  // Each group's parameters and the rate set_lr() set (a schedule's follows the steps), as
  // torch's param_groups, also for one group: a load checks them, so that a file of an optimizer
  // over other parameters is refused (it loaded, giving the others the file's step count).
  const bool rates = !optimizer.computes_own_rate();
  json::Value groups = json::Value::array();
  for (size_t g = 0; g < optimizer.group_count(); ++g) {
    json::Value group = json::Value::object();
    json::append(group, "params", json::Value::array());
    if (rates) json::append(group, "lr", optimizer.lr(g));
    groups.push_back(std::move(group));
  }
  for (size_t i = 0; i < names.size(); ++i)
    groups[optimizer.group_of(i)]["params"].push_back(names[i]);
  meta.emplace_back(kParamGroupsKey, json::dump(groups));
  return meta;
}

std::vector<SavedParamGroup> parse_param_groups(const std::string& context, std::string_view text) {
  const json::Value doc = metadata_list(context, kParamGroupsKey, text, "parameter groups");
  std::vector<SavedParamGroup> groups;
  for (size_t g = 0; g < doc.size(); ++g) {
    const json::Value* params = json::find(doc[g], "params");
    if (!params || !params->is_array())
      fail("{}: group {} of metadata '{}' has no \"params\" list", context, g, kParamGroupsKey);
    SavedParamGroup& group = groups.emplace_back();
    for (const json::Value& name : *params) {
      const std::string* path = name.get_ptr<const std::string*>();
      if (!path)
        fail("{}: group {} of the file lists {}, not a parameter this optimizer updates", context,
             g, name.dump());
      group.params.push_back(*path);
    }
    if (const json::Value* lr = json::find(doc[g], "lr")) {
      if (!lr->is_number())
        fail("{}: group {}'s \"lr\" is {}, not a number", context, g, lr->dump());
      group.lr = lr->get<double>();
    }
  }
  return groups;
}

namespace {

// The metadata key of a parameter's own step count, where it differs from the optimizer's.
std::string param_steps_key(const std::string& param_name) {
  return kOptimizerPrefix + param_name + ".steps";
}

std::string metadata_value(const Metadata& metadata, const std::string& key) {
  for (const auto& [k, v] : metadata)
    if (k == key) return v;
  return "";
}

bool has_metadata(const Metadata& metadata, const std::string& key) {
  return std::any_of(metadata.begin(), metadata.end(), [&](auto& e) { return e.first == key; });
}

// A whole decimal number from the metadata (an integer for an integral T); an absent or
// malformed value is an mt::Error starting with `context` that names the key.
template <typename T>
T metadata_number_in(const std::string& context, const Metadata& metadata, const std::string& key) {
  if (!has_metadata(metadata, key)) fail("{}: the file has no '{}'", context, key);
  std::string text = metadata_value(metadata, key);
  T value{};
  auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (text.empty() || ec != std::errc() || end != text.data() + text.size())
    fail("{}: metadata '{}' = '{}' is not a number in range", context, key, text);
  return value;
}
template <typename T>
T metadata_number(const std::string& path, const Metadata& metadata, const std::string& key) {
  return metadata_number_in<T>("load_checkpoint " + path, metadata, key);
}

// The groups' options the file saved (kOptionsKey), as option_json wrote them; nullopt where
// it has no such metadata.
std::optional<std::vector<NamedOptions>> saved_options(const std::string& path,
                                                       const Metadata& meta) {
  if (!has_metadata(meta, kOptionsKey)) return std::nullopt;
  const json::Value doc =
      metadata_list("load_checkpoint " + path, kOptionsKey, metadata_value(meta, kOptionsKey),
                    "parameter groups' options");
  std::vector<NamedOptions> groups;
  for (size_t g = 0; g < doc.size(); ++g) {
    if (!doc[g].is_object())
      fail("load_checkpoint {}: group {} of metadata '{}' is not an object", path, g, kOptionsKey);
    NamedOptions& group = groups.emplace_back();
    for (const auto& [name, value] : doc[g].items()) {
      if (value.is_boolean())
        group.emplace_back(name, value.get<bool>());
      else if (value.is_number())
        group.emplace_back(name, value.get<double>());
      else if (value.is_null())  // an optional option left unset
        group.emplace_back(name, std::optional<double>());
      else if (value == "Infinity" || value == "-Infinity" || value == "NaN")
        group.emplace_back(name, value == "NaN"        ? std::nan("")
                                 : value == "Infinity" ? HUGE_VAL
                                                       : -HUGE_VAL);
      else
        fail("load_checkpoint {}: group {}'s option '{}' is {}, not a number or a flag", path, g,
             name, value.dump());
    }
  }
  return groups;
}

bool metadata_bool(const std::string& path, const Metadata& metadata, const std::string& key) {
  std::string text = metadata_value(metadata, key);
  if (text != "true" && text != "false")
    fail("load_checkpoint {}: metadata '{}' = '{}' is not true or false", path, key, text);
  return text == "true";
}

std::string loader_key(size_t index, const char* field) {
  return fmt::format("loader.{}.{}", index, field);
}

// "loader.<digits>.order": only that exact form is the loaders', so a submodule called "loader"
// keeps its tensors.
bool is_loader_tensor(const std::string& name) {
  constexpr std::string_view prefix = "loader.", suffix = ".order";
  if (!name.starts_with(prefix) || !name.ends_with(suffix)) return false;
  std::string_view index(name.data() + prefix.size(), name.size() - prefix.size() - suffix.size());
  return !index.empty() &&
         std::all_of(index.begin(), index.end(), [](char c) { return c >= '0' && c <= '9'; });
}

const Tensor* find_entry(const NamedTensors& entries, const std::string& name) {
  for (const auto& [key, value] : entries)
    if (key == name) return &value;
  return nullptr;
}

// Each group's rate as the file has it (none where the rule computes its own, or where a file
// has none), once the file's parameter groups are found to be the optimizer's: state loaded
// into other groups would go on under other options, as torch refuses groups that differ.
std::vector<std::optional<double>> saved_rates(const std::string& path, const Metadata& meta,
                                               const Optimizer& optimizer,
                                               const std::vector<std::string>& names) {
  const size_t groups = optimizer.group_count();
  if (!has_metadata(meta, kParamGroupsKey)) {
    if (groups > 1)
      fail("load_checkpoint {}: the file's optimizer has one parameter group, this one has {}",
           path, groups);
  } else {
    const std::vector<SavedParamGroup> saved =
        parse_param_groups("load_checkpoint " + path, metadata_value(meta, kParamGroupsKey));
    if (saved.size() != groups)
      fail("load_checkpoint {}: the file's optimizer has {}, this one has {}", path,
           saved.size() == 1 ? std::string("one parameter group")
                             : fmt::format("{} parameter groups", saved.size()),
           groups);
    std::unordered_map<std::string_view, size_t> index_of;
    std::vector<size_t> sizes(groups);
    for (size_t i = 0; i < names.size(); ++i) {
      index_of.emplace(names[i], i);
      ++sizes[optimizer.group_of(i)];
    }
    std::vector<bool> listed(names.size());
    for (size_t g = 0; g < groups; ++g) {
      if (saved[g].params.size() != sizes[g])
        fail("load_checkpoint {}: group {} of the file has {} parameters, the optimizer's has {}",
             path, g, saved[g].params.size(), sizes[g]);
      for (const std::string& name : saved[g].params) {
        auto found = index_of.find(name);
        if (found == index_of.end())
          fail(
              "load_checkpoint {}: group {} of the file lists '{}', not a parameter this "
              "optimizer updates",
              path, g, name);
        if (optimizer.group_of(found->second) != g || listed[found->second])
          fail("load_checkpoint {}: group {} of the file lists '{}', which is {} of the optimizer",
               path, g, name,
               listed[found->second]
                   ? std::string("listed twice")
                   : fmt::format("in group {}", optimizer.group_of(found->second)));
        listed[found->second] = true;
      }
    }
  }
  if (optimizer.computes_own_rate()) return std::vector<std::optional<double>>(groups);
  return metadata_rates("load_checkpoint " + path, meta);
}

void check_options(const std::string& path, const CheckpointOptions& options) {
  std::set<std::string> names;
  for (const auto& [name, generator] : options.generators) {
    if (name.empty()) fail("checkpoint {}: a generator has an empty name", path);
    if (!generator) fail("checkpoint {}: generator '{}' is null", path, name);
    if (!names.insert(name).second)
      fail("checkpoint {}: two generators are called '{}'", path, name);
  }
  for (size_t i = 0; i < options.loaders.size(); ++i)
    if (!options.loaders[i]) fail("checkpoint {}: loader {} is null", path, i);
}

// The saved state of loader `index`, checked against `loader` (which is not changed).
DataLoader::State loader_state(const std::string& path, const NamedTensors& entries,
                               const Metadata& metadata, size_t index, const DataLoader& loader) {
  std::string order_name = loader_key(index, "order");
  const Tensor* order = find_entry(entries, order_name);
  if (!order) fail("load_checkpoint {}: the file holds no state for loader {}", path, index);
  if (order->dtype() != i64 || order->dim() != 1)
    fail("load_checkpoint {}: '{}' is {} {}, expected a 1-d i64 tensor", path, order_name,
         name(order->dtype()), to_string(order->shape()));
  DataLoader::State state{
      .epoch = metadata_number<int64_t>(path, metadata, loader_key(index, "epoch")),
      .position = metadata_number<int64_t>(path, metadata, loader_key(index, "position")),
      .order = order->to_vector<int64_t>(),
      .batch_size = metadata_number<int64_t>(path, metadata, loader_key(index, "batch_size")),
      .shuffle = metadata_bool(path, metadata, loader_key(index, "shuffle")),
      .seed = metadata_number<uint64_t>(path, metadata, loader_key(index, "seed")),
      .drop_last = metadata_bool(path, metadata, loader_key(index, "drop_last"))};
  // Files from before the count was saved: taken at this loader's world size.
  std::string shards = loader_key(index, "shards");
  state.shards = has_metadata(metadata, shards) ? metadata_number<int64_t>(path, metadata, shards)
                                                : loader.shard().count;
  try {
    loader.check_state(state);
  } catch (const Error& e) {
    fail("load_checkpoint {}: loader {}: {}", path, index, e.what());
  }
  return state;
}

}  // namespace

std::vector<std::optional<double>> metadata_rates(const std::string& context,
                                                  const Metadata& meta) {
  auto rate = [&](double lr, const std::string& what) {
    if (!std::isfinite(lr) || lr < 0) fail("{}: {} = {} is not a learning rate", context, what, lr);
    return lr;
  };
  if (has_metadata(meta, kParamGroupsKey)) {
    std::vector<std::optional<double>> rates;
    for (const SavedParamGroup& group :
         parse_param_groups(context, metadata_value(meta, kParamGroupsKey))) {
      rates.emplace_back();
      if (group.lr)
        rates.back() = rate(*group.lr, fmt::format("group {}'s rate", rates.size() - 1));
    }
    return rates;
  }
  std::vector<std::optional<double>> rates(1);
  if (has_metadata(meta, "optimizer.lr"))
    rates[0] =
        rate(metadata_number_in<double>(context, meta, "optimizer.lr"), "metadata 'optimizer.lr'");
  return rates;
}

void save_tensors(const std::string& path, const NamedTensors& tensors, const Metadata& metadata) {
  std::vector<Tensor> all;
  for (const auto& [name, tensor] : tensors) {
    if (!tensor.defined()) fail("save_tensors {}: tensor '{}' is undefined", path, name);
    all.push_back(tensor);
  }
  eval(all);
  // Written from the values' own bytes: a copy of them all would hold the checkpoint twice.
  safetensors::FileView file;
  std::vector<std::shared_ptr<Storage>> held;
  for (const auto& [name, tensor] : tensors) {
    // In the tensor's type: a value assigned under a policy may be stored in another one (batch
    // norm's running statistics of a bf16 model, computed in f32 under autocast).
    std::shared_ptr<Storage> storage = tensor.node()->value;
    if (storage->dtype != tensor.dtype()) storage = converted(*storage, tensor.dtype());
    const std::byte* host = storage->host_data();
    file.tensors.push_back(
        {name, tensor.dtype(), tensor.shape(), {host, static_cast<size_t>(storage->size_bytes())}});
    held.push_back(std::move(storage));
  }
  file.metadata = metadata;
  // Hugging Face's loaders take a safetensors file only with a "format" they know; these are
  // PyTorch-layout tensors, as safetensors.torch.save_file's callers mark them.
  if (!has_metadata(metadata, "format")) file.metadata.emplace_back("format", "pt");
  safetensors::write(path, file);
}

NamedTensors load_tensors(const std::string& path, Metadata* metadata) {
  safetensors::File file = safetensors::read(path);
  NamedTensors out;
  for (safetensors::TensorData& data : file.tensors) {
    auto storage =
        std::make_shared<Storage>(data.dtype, numel(data.shape), Storage::Uninitialized{});
    storage->bytes.assign(data.bytes.begin(), data.bytes.end());
    // Freed as it is copied: the file's bytes and the tensors' would otherwise be held at once,
    // twice the checkpoint's size.
    std::vector<std::byte>().swap(data.bytes);
    out.emplace_back(data.name, from_storage(std::move(storage), data.shape));
  }
  if (metadata) *metadata = std::move(file.metadata);
  return out;
}

std::pair<NamedTensors, Metadata> checkpoint_entries(const std::string& path, const Module& module,
                                                     const Optimizer* optimizer,
                                                     const Metadata& metadata,
                                                     const GradScaler* scaler,
                                                     const CheckpointOptions& options) {
  check_options(path, options);
  NamedTensors tensors = module.state_dict();
  // Names the loader would read as the checkpoint's own entries: refused here, not after the
  // file is written (it would never load).
  for (const auto& [name, value] : tensors)
    if (name.starts_with(kOptimizerPrefix) || is_scaler_tensor(name) || is_loader_tensor(name))
      fail(
          "save_checkpoint {}: the module's entry '{}' has a name the checkpoint keeps for its "
          "optimizer, scaler or loader state; rename the submodule",
          path, name);
  for (const auto& [key, value] : metadata)
    if (key == "format" || key.starts_with(kOptimizerPrefix) || key.starts_with(kScalerPrefix) ||
        key.starts_with(kGeneratorPrefix) || key.starts_with("loader."))
      fail(
          "save_checkpoint {}: metadata key '{}' is the checkpoint's own (format, optimizer.*, "
          "scaler.*, generator.*, loader.*)",
          path, key);
  Metadata meta = metadata;
  meta.emplace_back("format", "mixtape-checkpoint-1");
  if (optimizer) {
    std::vector<std::string> names = optimizer_param_names(module, *optimizer, path);
    for (size_t i = 0; i < names.size(); ++i)
      for (const auto& [state_name, value] : optimizer->state(i))
        tensors.emplace_back(kOptimizerPrefix + names[i] + "." + state_name, value);
    const int64_t steps = optimizer->steps_taken();
    meta.emplace_back("optimizer.steps", std::to_string(steps));
    // A parameter that skipped steps (no gradient) counts its own, as torch's "step" entries.
    for (size_t i = 0; i < names.size(); ++i)
      if (!optimizer->step_count(i).same(optimizer->step_count()))
        if (int64_t own = optimizer->steps_taken(i); own != steps)
          meta.emplace_back(param_steps_key(names[i]), std::to_string(own));
    for (auto& entry : optimizer_metadata(*optimizer, names)) meta.push_back(std::move(entry));
  }
  if (scaler)
    for (const auto& [name, value] : scaler->state_dict()) {
      std::string key = kScalerPrefix + name;
      if (is_scaler_tensor(key))
        tensors.emplace_back(key, value);
      else
        meta.emplace_back(key, fmt::format("{}", value.item()));  // shortest exact text
    }
  for (const auto& [name, generator] : options.generators) {
    meta.emplace_back(kGeneratorPrefix + name + ".seed", std::to_string(generator->seed()));
    meta.emplace_back(kGeneratorPrefix + name + ".offset", std::to_string(generator->offset()));
  }
  for (size_t i = 0; i < options.loaders.size(); ++i) {
    DataLoader::State state = options.loaders[i]->state();
    auto size = static_cast<int64_t>(state.order.size());
    tensors.emplace_back(loader_key(i, "order"), tensor(state.order, {size}, i64));
    meta.emplace_back(loader_key(i, "epoch"), std::to_string(state.epoch));
    meta.emplace_back(loader_key(i, "position"), std::to_string(state.position));
    meta.emplace_back(loader_key(i, "batch_size"), std::to_string(state.batch_size));
    meta.emplace_back(loader_key(i, "shuffle"), state.shuffle ? "true" : "false");
    meta.emplace_back(loader_key(i, "seed"), std::to_string(state.seed));
    meta.emplace_back(loader_key(i, "drop_last"), state.drop_last ? "true" : "false");
    meta.emplace_back(loader_key(i, "shards"), std::to_string(state.shards));
  }
  return {std::move(tensors), std::move(meta)};
}

void save_checkpoint(const std::string& path, const Module& module, const Optimizer* optimizer,
                     const Metadata& metadata, const GradScaler* scaler,
                     const CheckpointOptions& options) {
  auto [tensors, meta] = checkpoint_entries(path, module, optimizer, metadata, scaler, options);
  save_tensors(path, tensors, meta);
}

void load_checkpoint(const std::string& path, Module& module, Optimizer* optimizer,
                     Metadata* metadata, GradScaler* scaler, const CheckpointOptions& options) {
  check_options(path, options);
  Metadata meta;
  NamedTensors all = load_tensors(path, &meta);
  restore_checkpoint(path, all, std::move(meta), module, optimizer, metadata, scaler, options);
}

void restore_checkpoint(const std::string& path, const NamedTensors& all, Metadata meta,
                        Module& module, Optimizer* optimizer, Metadata* metadata,
                        GradScaler* scaler, const CheckpointOptions& options) {
  check_options(path, options);
  {  // the entries' values, computed (a caller's may be expressions not yet evaluated)
    std::vector<Tensor> values;
    for (const auto& [name, value] : all) {
      if (!value.defined()) fail("load_checkpoint {}: entry '{}' is undefined", path, name);
      values.push_back(value);
    }
    eval(values);
  }
  NamedTensors model, optimizer_entries;
  for (auto& entry : all)
    if (!is_scaler_tensor(entry.first) && !is_loader_tensor(entry.first))
      (entry.first.rfind(kOptimizerPrefix, 0) == 0 ? optimizer_entries : model).push_back(entry);

  // Everything is read and checked first; nothing changes until all of it has passed.
  NamedTensors scaler_entries;
  if (scaler && scaler->is_enabled()) {
    scaler_entries = scaler_state(path, all, meta);
    if (scaler_entries.empty()) fail("load_checkpoint {}: the file holds no scaler state", path);
    try {  // validated on a copy
      GradScaler(scaler->options()).load_state_dict(scaler_entries);
    } catch (const Error& e) {
      fail("load_checkpoint {}: {}", path, e.what());
    }
  }
  std::vector<NamedTensors> states;
  int64_t steps = 0;
  std::vector<std::optional<int64_t>> param_steps;         // where a parameter's count differs
  std::vector<std::optional<double>> rates;                // each group's, where the file has it
  std::optional<std::vector<NamedOptions>> group_options;  // each group's, where the file has them
  if (optimizer) {
    std::vector<std::string> names = optimizer_param_names(module, *optimizer, path);
    std::string kind = metadata_value(meta, "optimizer.kind");
    if (!kind.empty() && kind != optimizer->kind())
      fail("load_checkpoint {}: the file holds {} state, the optimizer is {}", path, kind,
           optimizer->kind());
    std::string steps_text = metadata_value(meta, "optimizer.steps");
    auto [end, ec] =
        std::from_chars(steps_text.data(), steps_text.data() + steps_text.size(), steps);
    // At most 2^53: the count is kept as an f64 graph value, which holds every integer to there.
    if (steps_text.empty() || ec != std::errc() || end != steps_text.data() + steps_text.size() ||
        steps < 0 || steps > (int64_t{1} << 53))
      fail("load_checkpoint {}: no valid optimizer step count in the metadata", path);
    rates = saved_rates(path, meta, *optimizer, names);
    std::unordered_map<std::string_view, size_t> index_of;
    for (size_t i = 0; i < names.size(); ++i) index_of.emplace(names[i], i);
    // A parameter's own count where the file has one; else the optimizer's (every file from
    // before counts were per parameter).
    param_steps.resize(names.size());
    for (const auto& [key, value] : meta) {
      std::optional<OptimizerEntryName> name = optimizer_entry_name(key);
      if (!name || name->entry != "steps") continue;
      auto found = index_of.find(name->parameter);
      if (found == index_of.end())
        fail(
            "load_checkpoint {}: metadata '{}' is a step count for a parameter this optimizer "
            "does not update",
            path, key);
      int64_t own = metadata_number<int64_t>(path, meta, key);
      if (own < 0 || own > steps)
        fail(
            "load_checkpoint {}: metadata '{}' = {} is not a step count between 0 and the "
            "optimizer's {}",
            path, key, own, steps);
      param_steps[found->second] = own;
    }
    // Each state entry by its parameter, so that matching them is linear in the entries.
    std::vector<NamedTensors> state_of(names.size());
    std::vector<bool> taken(optimizer_entries.size());
    for (size_t e = 0; e < optimizer_entries.size(); ++e)
      if (std::optional<OptimizerEntryName> name = optimizer_entry_name(optimizer_entries[e].first))
        if (auto found = index_of.find(name->parameter); found != index_of.end()) {
          state_of[found->second].emplace_back(std::string(name->entry),
                                               optimizer_entries[e].second);
          taken[e] = true;
        }
    auto check_states = [&] {
      for (size_t i = 0; i < names.size(); ++i) {
        std::string prefix = kOptimizerPrefix + names[i] + ".";
        NamedTensors& state = state_of[i];
        try {
          optimizer->check_state(i, state, options.allow_nonfinite, prefix);
        } catch (const Error& e) {
          fail("load_checkpoint {}: {}", path, e.what());
        }
        // A parameter whose every step so far was skipped (its first gradient came in a step
        // the loss scaler skipped) holds the state those steps made, the rule's initial one,
        // beside a count of 0: the load leaves it to the first update, which makes the same.
        // (Refusing it made files mixtape wrote fail to load.)
        if (param_steps[i] == 0) state.clear();
        states.push_back(std::move(state));
      }
    };
    // The state is checked under the options the file restores (a momentum buffer is state
    // only with momentum), which are checked first.
    group_options = saved_options(path, meta);
    if (!group_options) {
      check_states();
    } else {
      try {
        optimizer->with_named_options(*group_options, [] {});
      } catch (const Error& e) {
        fail("load_checkpoint {}: metadata '{}': {}", path, kOptionsKey, e.what());
      }
      optimizer->with_named_options(*group_options, check_states);
    }
    // State for a parameter this optimizer does not update would be dropped without a word (a
    // checkpoint of an optimizer over more parameters), as PyTorch refuses it.
    for (size_t e = 0; e < optimizer_entries.size(); ++e)
      if (!taken[e])
        fail(
            "load_checkpoint {}: '{}' is optimizer state for a parameter this optimizer does not "
            "update (load the module alone, without the optimizer, to take only the weights)",
            path, optimizer_entries[e].first);
  }
  if (!options.allow_nonfinite) {
    // Only the module's own entries: others are reported as unexpected by load_state_dict.
    NamedTensors own = module.state_dict();
    std::unordered_map<std::string_view, const Tensor*> own_by_name;
    for (const auto& [name, value] : own) own_by_name.emplace(name, &value);
    for (const auto& [name, value] : model) {
      auto found = own_by_name.find(name);
      if (found == own_by_name.end()) continue;
      const Tensor* mine = found->second;
      // As the module will hold it: an f32 1e6 loaded into an f16 parameter is inf there.
      std::shared_ptr<Storage> values = value.node()->value;
      if (is_floating(mine->dtype()) && values->dtype != mine->dtype())
        values = converted(*values, mine->dtype());
      int64_t bad = first_nonfinite(*values);
      if (bad >= 0)
        fail(
            "load_checkpoint {}: '{}' holds {} at element {}{} (pass allow_nonfinite to load "
            "non-finite values)",
            path, name, load_element<double>(*value.node()->value, bad), bad,
            values == value.node()->value
                ? ""
                : fmt::format(", which is {} as the module's {}",
                              load_element<double>(*values, bad), mixtape::name(mine->dtype())));
    }
  }
  std::vector<std::pair<uint64_t, uint64_t>> generator_states;
  for (const auto& [name, generator] : options.generators) {
    std::string seed_key = kGeneratorPrefix + name + ".seed";
    if (!has_metadata(meta, seed_key))
      fail("load_checkpoint {}: the file holds no state for generator '{}'", path, name);
    generator_states.emplace_back(
        metadata_number<uint64_t>(path, meta, seed_key),
        metadata_number<uint64_t>(path, meta, kGeneratorPrefix + name + ".offset"));
  }
  std::vector<DataLoader::State> loader_states;
  for (size_t i = 0; i < options.loaders.size(); ++i)
    loader_states.push_back(loader_state(path, all, meta, i, *options.loaders[i]));

  try {
    module.load_state_dict(model, true);  // checks names, shapes and dtypes before it assigns
  } catch (const Error& e) {
    fail("load_checkpoint {}: {}", path, e.what());
  }
  if (optimizer) {
    if (group_options) optimizer->set_named_options(*group_options);
    for (size_t i = 0; i < states.size(); ++i)
      optimizer->load_state(i, states[i], options.allow_nonfinite);
    optimizer->set_steps_taken(steps);
    for (size_t i = 0; i < param_steps.size(); ++i)
      if (param_steps[i]) optimizer->set_steps_taken(i, *param_steps[i]);
    // A schedule attached to a group decides its rate; else the saved one is restored.
    for (size_t g = 0; g < rates.size(); ++g)
      if (rates[g] && !optimizer->schedule(g)) optimizer->set_lr(g, *rates[g]);
  }
  if (!scaler_entries.empty()) scaler->load_state_dict(scaler_entries);
  for (size_t i = 0; i < generator_states.size(); ++i)
    options.generators[i].second->set_state(generator_states[i].first, generator_states[i].second);
  for (size_t i = 0; i < loader_states.size(); ++i)
    options.loaders[i]->load_state(loader_states[i]);
  if (metadata) *metadata = std::move(meta);
}

}  // namespace mixtape

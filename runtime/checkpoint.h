// runtime/checkpoint.h -- tensors, modules and optimizer state to and from safetensors files.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "dsl/module.h"
#include "dsl/optim.h"

namespace mixtape {

using Metadata = std::vector<std::pair<std::string, std::string>>;

/// Writes named tensors (evaluated first) to a safetensors file, atomically.
void save_tensors(const std::string& path, const NamedTensors& tensors,
                  const Metadata& metadata = {});
/// Reads every tensor of a safetensors file; the file is validated completely first.
NamedTensors load_tensors(const std::string& path, Metadata* metadata = nullptr);

/// Saves a module's parameters and buffers by module path ("fc1.weight") and, if given, the
/// optimizer's state as "optimizer.<param path>.<state>" plus its step count and kind in the
/// metadata.
void save_checkpoint(const std::string& path, const Module& module,
                     const Optimizer* optimizer = nullptr, const Metadata& metadata = {});
/// Restores what save_checkpoint wrote. Every name, shape and dtype is checked before anything
/// is changed; a mismatch is an mt::Error that names the file and the entries.
void load_checkpoint(const std::string& path, Module& module, Optimizer* optimizer = nullptr,
                     Metadata* metadata = nullptr);

}  // namespace mixtape

// runtime/checkpoint.h -- tensors, modules and optimizer state to and from safetensors files.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "dsl/module.h"
#include "dsl/optim.h"

namespace mixtape {

class GradScaler;

using Metadata = std::vector<std::pair<std::string, std::string>>;

/// Writes named tensors (evaluated first) to a safetensors file, atomically.
void save_tensors(const std::string& path, const NamedTensors& tensors,
                  const Metadata& metadata = {});
/// Reads every tensor of a safetensors file; the file is validated completely first.
NamedTensors load_tensors(const std::string& path, Metadata* metadata = nullptr);

/// Saves a module's parameters and buffers by module path ("fc1.weight") and, if given, the
/// optimizer's state as "optimizer.<param path>.<state>" plus its step count and kind in the
/// metadata, and an enabled scaler's state as tensors "scaler.scale" and "scaler.growth_tracker"
/// plus its hyperparameters as metadata "scaler.<name>" (so metadata keys starting with
/// "scaler." are reserved).
void save_checkpoint(const std::string& path, const Module& module,
                     const Optimizer* optimizer = nullptr, const Metadata& metadata = {},
                     const GradScaler* scaler = nullptr);
/// Restores what save_checkpoint wrote. Every name, shape and dtype is checked before anything
/// is changed; a mismatch is an mt::Error that names the file and the entries. An enabled
/// scaler requires scaler state in the file; a disabled one is left alone.
void load_checkpoint(const std::string& path, Module& module, Optimizer* optimizer = nullptr,
                     Metadata* metadata = nullptr, GradScaler* scaler = nullptr);

}  // namespace mixtape

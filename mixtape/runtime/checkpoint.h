// mixtape/runtime/checkpoint.h -- tensors, modules, optimizer and scaler state, generators and data
// loaders to and from safetensors files.
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "mixtape/dsl/data.h"
#include "mixtape/dsl/module.h"
#include "mixtape/dsl/optim.h"

namespace mixtape {

class GradScaler;

using Metadata = std::vector<std::pair<std::string, std::string>>;

/// Writes named tensors (evaluated first) to a safetensors file, atomically.
void save_tensors(const std::string& path, const NamedTensors& tensors,
                  const Metadata& metadata = {});
/// Reads every tensor of a safetensors file; the file is validated completely first.
NamedTensors load_tensors(const std::string& path, Metadata* metadata = nullptr);

/// The parts of a checkpoint's optimizer name "optimizer.<parameter path>.<entry>": a state
/// tensor's ("exp_avg"), or the metadata key of a parameter's own step count ("steps"); nullopt
/// for other names (the optimizer's own keys, "optimizer.steps", have no parameter).
struct OptimizerEntryName {
  std::string_view parameter, entry;
};
std::optional<OptimizerEntryName> optimizer_entry_name(std::string_view name);

/// A checkpoint's metadata of `optimizer`, whose parameters have the paths `names`: its kind,
/// and each group's parameters and the rate set_lr() set as "optimizer.param_groups", JSON as
/// torch's param_groups hold them: [{"params": ["fc.weight", ...], "lr": 0.001}, ...] (no rate
/// where the rule computes its own). Files from before hold one group's rate as "optimizer.lr".
Metadata optimizer_metadata(const Optimizer& optimizer, const std::vector<std::string>& names);

/// One group of a checkpoint's "optimizer.param_groups" (optimizer_metadata's JSON).
struct SavedParamGroup {
  std::vector<std::string> params;  // parameter paths, in the file's order
  std::optional<double> lr;         // the group's rate, where the file gives one
};
/// Parses "optimizer.param_groups" metadata; mt::Error starting with `context` for text that is
/// not such a list (malformed JSON, a group without a "params" list, a path that is no string,
/// a rate that is no number). load_checkpoint and the AOT runtime's NAME_load read it so.
std::vector<SavedParamGroup> parse_param_groups(const std::string& context, std::string_view text);
/// Each parameter group's rate as checkpoint metadata holds it: each group's "lr" of
/// "optimizer.param_groups" (that many entries), or "optimizer.lr" of an older file of one group;
/// none where the file gives none. mt::Error starting with `context` for a rate that is not a
/// number, negative or not finite. load_checkpoint and the AOT runtime's NAME_load read it so.
std::vector<std::optional<double>> metadata_rates(const std::string& context, const Metadata& meta);

/// What a checkpoint carries besides the module, optimizer and scaler, so that a run resumed
/// from it goes on exactly as the saved one would have (the same dropout masks, noise and
/// batches); and how strictly a load checks values. Pass the same options to save and load:
///   mt::CheckpointOptions extras{.generators = {{"default", &mt::default_generator()}},
///                                .loaders = {&loader}};
///   mt::save_checkpoint(path, model, &opt, {}, nullptr, extras);
struct CheckpointOptions {
  /// Random streams by name (not empty, unique): each one's (seed, offset) is saved as metadata
  /// "generator.<name>.seed" and "generator.<name>.offset", and restored with set_state().
  std::vector<std::pair<std::string, Generator*>> generators{};
  /// Data loaders by their index in this list: the current epoch's order as the i64 tensor
  /// "loader.<i>.order", and epoch, position, batch_size, shuffle, seed and drop_last as metadata
  /// "loader.<i>.<field>". A load checks them with DataLoader::check_state().
  std::vector<DataLoader*> loaders{};
  /// Load only: accept NaN and infinite values in the module's tensors and the optimizer state
  /// (to look into a run that diverged). By default they are an mt::Error naming the tensor.
  bool allow_nonfinite = false;
};

/// Saves a module's parameters and buffers by module path ("fc1.weight") and, if given, the
/// optimizer's state as "optimizer.<param path>.<state>" plus its step count and kind in the
/// metadata, an enabled scaler's state as tensors "scaler.scale" and "scaler.growth_tracker"
/// plus its hyperparameters as metadata "scaler.<name>", and the generators and loaders of
/// `options`. Metadata keys "format" and those starting with "optimizer.", "scaler.",
/// "generator." and "loader." are reserved for the checkpoint's own entries.
void save_checkpoint(const std::string& path, const Module& module,
                     const Optimizer* optimizer = nullptr, const Metadata& metadata = {},
                     const GradScaler* scaler = nullptr, const CheckpointOptions& options = {});
/// Restores what save_checkpoint wrote. Everything is checked before anything is changed, and a
/// problem is an mt::Error that names the file and the entry: every name, shape and dtype; values
/// that cannot be right (a negative Adam exp_avg_sq, a scaler state GradScaler rejects, a loader
/// order that is not a permutation of its dataset); and NaN or infinity in the module's tensors
/// or the optimizer state unless options.allow_nonfinite. An enabled scaler requires scaler state
/// in the file, a disabled one is left alone; every generator and loader of `options` requires
/// its state in the file, and state in the file that nothing asks for is ignored.
void load_checkpoint(const std::string& path, Module& module, Optimizer* optimizer = nullptr,
                     Metadata* metadata = nullptr, GradScaler* scaler = nullptr,
                     const CheckpointOptions& options = {});

/// What save_checkpoint writes to `path` (named in errors), as tensors and metadata in memory:
/// for writers that place the entries themselves (dist::save_checkpoint_sharded).
std::pair<NamedTensors, Metadata> checkpoint_entries(const std::string& path, const Module& module,
                                                     const Optimizer* optimizer = nullptr,
                                                     const Metadata& metadata = {},
                                                     const GradScaler* scaler = nullptr,
                                                     const CheckpointOptions& options = {});
/// load_checkpoint from entries in memory (`origin` names them in errors), with its checks: an
/// optimizer's state entries are checked against its local_shape()s, so a ZeRO optimizer takes
/// its own shards' state.
void restore_checkpoint(const std::string& origin, const NamedTensors& entries, Metadata metadata,
                        Module& module, Optimizer* optimizer = nullptr,
                        Metadata* metadata_out = nullptr, GradScaler* scaler = nullptr,
                        const CheckpointOptions& options = {});

}  // namespace mixtape

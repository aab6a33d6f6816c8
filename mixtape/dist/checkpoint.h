// mixtape/dist/checkpoint.h -- checkpoints of a data-parallel run: rank 0 writes an ordinary
// checkpoint (ZeRO shards gathered), which every process loads, at any world size.
#pragma once

#include <string>

#include "mixtape/runtime/checkpoint.h"

namespace mixtape::dist {

/// mt::save_checkpoint for a run of several processes, called by every process with the same
/// arguments: a ZeRO optimizer's (dist::Zero) state shards are gathered (collectives) into the
/// plain rule's state, and rank 0 alone writes the file, an ordinary checkpoint that
/// mt::load_checkpoint loads into one process and dist::load_checkpoint into any number. Returns
/// on every process once the file is written; an error writing it is an mt::Error on every
/// process.
void save_checkpoint(const std::string& path, const Module& module,
                     const Optimizer* optimizer = nullptr, const Metadata& metadata = {},
                     const GradScaler* scaler = nullptr, const CheckpointOptions& options = {});
/// mt::load_checkpoint on every process, from one file all of them read (saved at any world
/// size, or by one process): a ZeRO optimizer takes its shards of the state for this run's
/// world size. Everything is checked before anything changes, and a problem on any process (a
/// checkpoint of another model, another optimizer kind, an unreadable file) is an mt::Error on
/// every process, which then all keep their state.
void load_checkpoint(const std::string& path, Module& module, Optimizer* optimizer = nullptr,
                     Metadata* metadata = nullptr, GradScaler* scaler = nullptr,
                     const CheckpointOptions& options = {});

}  // namespace mixtape::dist

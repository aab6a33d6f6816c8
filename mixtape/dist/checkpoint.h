// mixtape/dist/checkpoint.h -- checkpoints of a data-parallel run: rank 0 writes an ordinary
// checkpoint (ZeRO shards gathered), which every process loads, at any world size; or, for large
// models, every process writes its own file plus rank 0 an index (sharded).
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

/// The sharded checkpoint, for models whose state is too large to gather on one process: called
/// by every process with the same arguments, each writes its own safetensors file
/// `dir`/checkpoint-<save id>-<r+1, 5 digits>-of-<N, 5 digits>.safetensors (atomically, as
/// mt::save_checkpoint does):
/// a ZeRO optimizer's (dist::Zero) state shards as this process holds them, and an equal share by
/// bytes of the replicated entries (parameters, buffers, a plain optimizer's state, the scaler
/// and loader tensors), each whole in one file. Rank 0 then writes the index
/// `dir`/checkpoint.safetensors.index.json, as Hugging Face's model.safetensors.index.json: its
/// "weight_map" names the file of each whole entry, "pieces" the files and element ranges of each
/// sharded optimizer state, and it holds the world size, the model's entries (name, shape,
/// dtype), the checkpoint's metadata (optimizer kind and steps, scaler, generators, loaders,
/// `metadata`) and an id that every shard file repeats. The index is written last, so a save
/// interrupted before it leaves a directory whose index does not match its files. Returns on
/// every process once all is written; an error on any is an mt::Error on every process.
void save_checkpoint_sharded(const std::string& dir, const Module& module,
                             const Optimizer* optimizer = nullptr, const Metadata& metadata = {},
                             const GradScaler* scaler = nullptr,
                             const CheckpointOptions& options = {});
/// Loads what save_checkpoint_sharded wrote, on every process, with mt::load_checkpoint's checks.
/// At the world size it was saved at, and cut as this run's optimizer cuts it, each process reads
/// only its own file and the processes exchange the replicated entries. At any other (1
/// included), or cut otherwise, a ZeRO optimizer reads the files in turn and keeps of the
/// sharded state only the elements its shards hold, so that no process holds the whole state; a
/// plain optimizer reads every file and takes the state whole. Another model (its entries are
/// named in the error), an index and shard files of different saves, a missing or corrupt file:
/// an mt::Error on every process, never a hang.
void load_checkpoint_sharded(const std::string& dir, Module& module, Optimizer* optimizer = nullptr,
                             Metadata* metadata = nullptr, GradScaler* scaler = nullptr,
                             const CheckpointOptions& options = {});

}  // namespace mixtape::dist

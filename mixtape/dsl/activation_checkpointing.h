// mixtape/dsl/activation_checkpointing.h -- which modules' activations backward() recomputes
// instead of keeping (the registry; autograd/recompute.h does the recomputing).
#pragma once

#include <memory>
#include <string>
#include <vector>

namespace mixtape {

/// Activation checkpointing by module, selected as precision overrides select modules: the
/// forward nodes made inside a module whose path matches `glob` ("blocks.*", "blocks.3",
/// "**.mlp") are not kept for the backward pass. Each backward() reads clones of them instead,
/// made just before the gradient nodes of that module and fed from the module's inputs, with the
/// same op, attributes, precision, policy and random counters, so the gradients are the same
/// bits and the forward values die during the forward pass (DESIGN.md decision 14). Applies to
/// backward() and mt::grad() walks that start after the call; a step mt::compile has traced
/// replays what its trace recorded, so set it before the first call. Adding a glob twice keeps
/// one.
void checkpoint(const std::string& glob);
/// Stops checkpointing the modules `glob` (exactly as it was added) selected; false if it was
/// not there.
bool remove_checkpoint(const std::string& glob);
void clear_checkpoints();
/// The globs in force, in the order added.
std::vector<std::string> checkpoints();

/// How many times the globs in force have changed: mt::compile's plans are keyed on it, as on
/// policy_edits().
uint64_t checkpoint_edits();

/// The globs in force, shared (one per change): what a backward pass reads once when it starts;
/// null when there are none (then without taking a lock).
std::shared_ptr<const std::vector<std::string>> checkpoint_globs();

}  // namespace mixtape

// mixtape/dsl/module_path.h -- module-path globs ("blocks.*.attn"), as precision overrides and
// activation checkpointing select modules.
#pragma once

#include <cstddef>
#include <optional>
#include <string>

namespace mixtape {

/// True when `path` is a module matched by `glob` or inside one ("blocks.*.attn" matches
/// "blocks.3.attn" and "blocks.3.attn.qkv"). `*` matches within one path component, `**` across
/// any number of them; an empty glob matches nothing.
bool module_path_matches(const std::string& glob, const std::string& path);

/// The length of the shortest prefix of `path` that names a module `glob` matches ("blocks.3"
/// in "blocks.3.attn.qkv" for "blocks.*"), ending where a component ends; nullopt when `path`
/// is in no such module.
std::optional<size_t> matched_module_prefix(const std::string& glob, const std::string& path);

}  // namespace mixtape

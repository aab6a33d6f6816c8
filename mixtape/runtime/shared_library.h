// mixtape/runtime/shared_library.h -- the optional libraries opened with dlopen (the CUDA driver,
// cuBLASLt, cuDNN, NCCL): the first of several names that loads, and its symbols bound into a
// table of function pointers, each failure a reason in words rather than an error.
#pragma once

#include <dlfcn.h>

#include <string>
#include <vector>

#include <fmt/format.h>

namespace mixtape {

/// The first of `paths` that dlopen (RTLD_NOW | RTLD_LOCAL) loads; null when none does, with
/// `reason` set to "cannot load <what> (tried <paths>)".
inline void* open_first_library(const std::vector<std::string>& paths, const char* what,
                                std::string& reason) {
  std::string tried;
  for (const std::string& path : paths) {
    if (void* library = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL)) return library;
    tried += (tried.empty() ? "" : ", ") + path;
  }
  reason = fmt::format("cannot load {} (tried {})", what, tried);
  return nullptr;
}

/// Points `slot` at `symbol` of `library`; false where the library lacks it, and then, unless
/// `reason` already holds an earlier failure, reason = "<what> lacks <symbol><hint>".
template <typename Fn>
bool bind_symbol(void* library, Fn*& slot, const char* symbol, const char* what,
                 std::string& reason, const char* hint = "") {
  slot = reinterpret_cast<Fn*>(dlsym(library, symbol));
  if (slot == nullptr && reason.empty()) reason = fmt::format("{} lacks {}{}", what, symbol, hint);
  return slot != nullptr;
}

}  // namespace mixtape

// mixtape/dsl/module_path.cpp -- matching module paths against globs.
#include "mixtape/dsl/module_path.h"

namespace mixtape {
namespace {

// Whether `glob` matches `path` up to its end or up to a '.' that ends a component of it.
bool glob_match(const char* glob, const char* path) {
  // Components are separated by '.'; '*' matches within one component, '**' across them.
  if (*glob == '\0') return *path == '\0' || *path == '.';
  if (glob[0] == '*' && glob[1] == '*') {
    // "**." also stands for no components at all: "**.qkv" matches a top-level "qkv".
    if (glob[2] == '.' && glob_match(glob + 3, path)) return true;
    for (const char* p = path;; ++p) {
      if (glob_match(glob + 2, p)) return true;
      if (*p == '\0') return false;
    }
  }
  // ".**" also stands for no components at all: "a.**" matches "a" itself.
  if (glob[0] == '.' && glob[1] == '*' && glob[2] == '*' && (glob[3] == '\0' || glob[3] == '.') &&
      glob_match(glob + 3, path))
    return true;
  if (*glob == '*') {
    for (const char* p = path;; ++p) {
      if (glob_match(glob + 1, p)) return true;
      if (*p == '\0' || *p == '.') return false;
    }
  }
  return *path != '\0' && *glob == *path && glob_match(glob + 1, path + 1);
}

}  // namespace

bool module_path_matches(const std::string& glob, const std::string& path) {
  if (glob.empty()) return false;
  // The root (nodes made outside every module) has no components: only "**" (any number of
  // components, none included) matches it, not "*" (one component).
  if (path.empty()) {
    for (size_t begin = 0;; begin += 3) {
      if (glob.compare(begin, 2, "**") != 0 || (begin + 2 < glob.size() && glob[begin + 2] != '.'))
        return false;
      if (begin + 2 >= glob.size()) return true;
    }
  }
  return glob_match(glob.c_str(), path.c_str());
}

std::optional<size_t> matched_module_prefix(const std::string& glob, const std::string& path) {
  if (!module_path_matches(glob, path)) return std::nullopt;
  // The outermost module: the first prefix, ending at a component's end, that the glob matches
  // whole (so "blocks.*" gives "blocks.3", never "blocks.3.attn").
  for (size_t end = path.find('.');; end = path.find('.', end + 1)) {
    std::string prefix = path.substr(0, end);
    if (module_path_matches(glob, prefix)) return prefix.size();
    if (end == std::string::npos) return path.size();
  }
}

}  // namespace mixtape

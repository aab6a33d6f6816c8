// mixtape/jit/aot_package_files.h -- the text of an artifact's generated files: C header, C glue,
// pkg-config file, CMake package config.
#pragma once

#include <string>
#include <vector>

#include "mixtape/jit/aot_package.h"

namespace mixtape::aot {

/// Checks what the generated C code relies on: name, argument names and kernel symbols are C
/// identifiers and no C or C++ keyword, argument names are distinct and not `m` or `batch` (the
/// other parameters of NAME_run), kernel symbols and keys are distinct, dimensions are not
/// negative. mt::Error naming the offending field otherwise.
void check_package_spec(const PackageSpec& spec);

/// NAME.h: the C11 API (usable from C++), with comments giving every argument's shape and dtype.
std::string package_header(const PackageSpec& spec);

/// NAME_glue.c: NAME_* defined as thin casts onto the runtime's mixtape_aot_* C functions, with
/// the table mapping each kernel's key to its symbol. Includes "NAME.h".
std::string package_glue(const PackageSpec& spec);

/// NAME.pc, relocatable (every path relative to ${pcfiledir}). link_libraries: the flags the
/// runtime archive needs (Libs.private); extra_link_flags: flags every program linking the
/// artifact needs (the sanitizers' under a sanitized build; usually none).
std::string package_pkg_config(const PackageSpec& spec,
                               const std::vector<std::string>& link_libraries,
                               const std::vector<std::string>& extra_link_flags);

/// NAMEConfig.cmake: imported targets NAME::NAME (libNAME.so) and NAME::NAME_static
/// (libNAME.a with the runtime's libraries), located relative to the file itself.
std::string package_cmake_config(const PackageSpec& spec,
                                 const std::vector<std::string>& link_libraries,
                                 const std::vector<std::string>& extra_link_flags);

/// The C type an argument of dtype is passed as ("float", "uint16_t" for f16 and bf16, ...).
const char* c_type(DType dtype);

}  // namespace mixtape::aot

// mixtape/jit/aot_package.h -- writes an exported artifact's C header, libraries and build files.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "mixtape/dsl/dtype.h"
#include "mixtape/dsl/shape.h"

namespace mixtape::aot {

/// An input or output of the exported function, as the C API passes it: a dense row-major
/// buffer of `shape` (shape[0] is the batch dimension when the batch is dynamic).
struct PackageArgument {
  std::string name;  // a C identifier, the parameter's name in NAME_run
  DType dtype = f32;
  Shape shape;
};

/// One CPU kernel: `llvm_ir` (codegen/emit_llvm.h) defines the function `symbol`, which the
/// artifact's runtime finds under `key` (the lead's plan names kernels by key).
struct PackageKernel {
  std::string symbol;  // a C identifier
  std::string key;
  std::string llvm_ir;
};

/// One build of the kernels: for the host CPU (cpu empty) or an LLVM CPU name, used on CPUs
/// that have every feature listed. The runtime takes the first variant the CPU can run.
struct PackageVariant {
  std::string target;  // its name at NAME_open ("cpu:TARGET"): "native", "x86-64-v3", ...
  std::string cpu;     // what LLVM compiles for; empty: the host CPU with all its features
  std::vector<std::string> features;
};

struct PackageSpec {
  std::string dir;    // the export directory (created when missing)
  std::string name;   // a C identifier ([A-Za-z_][A-Za-z0-9_]*, no C or C++ keyword)
  bool step = false;  // a training step: adds NAME_save and NAME_load
  bool cuda = false;  // the artifact has CUDA kernels: adds NAME_run_device
  /// > 0: dim 0 of every argument (of rank 1 or more) varies at run time, 1..max_batch. 0: the
  /// shapes are fixed, and the batch passed to NAME_run must equal the first input's dim 0.
  int64_t max_batch = 0;
  std::vector<PackageArgument> inputs, outputs;
  std::vector<PackageKernel> kernels;
  /// Best first; at least one. Variant v > 0 names its kernels' functions symbol + "_v<v>".
  std::vector<PackageVariant> variants;
  /// The XXH3-64 (16 hex digits) of the NAME.json the library opens (mixtape_aot_open).
  std::string manifest_xxh3;
};

/// The function name of `kernel` in variant `v` of a package.
std::string variant_symbol(const PackageKernel& kernel, size_t v);

/// Writes DIR/NAME.h, DIR/libNAME.a, DIR/libNAME.so, DIR/NAME.pc and DIR/NAMEConfig.cmake, each
/// atomically (runtime/atomic_file.h), and returns their names relative to DIR, for the manifest.
///
/// The kernels are compiled to optimized object code for the host CPU exactly as the JIT compiles
/// them (through the kernel cache, so kernels the training run compiled are not compiled again);
/// the generated glue, NAME_glue.c, is compiled with $CC (default cc). The objects, the glue and
/// the whole LLVM-free runtime archive (MIXTAPE_RUNTIME_ARCHIVE) are prelinked with `ld -r` into
/// one object whose only global symbols are NAME_* (objcopy), so that two artifacts link into
/// one program and nothing clashes with the program's own symbols. libNAME.a holds that object;
/// libNAME.so is it linked with the runtime's libraries (oneDNN, libgomp, ...: never LLVM or
/// NVRTC). Tools ($CC, $LD, $OBJCOPY, $AR or cc, ld, objcopy, ar) run without a shell, so DIR may
/// hold any characters. Throws mt::Error for a bad spec (naming the field), a missing tool
/// (naming it and its Debian package), a failing tool (with its output) or a file that cannot be
/// written; files already in DIR are then either the old ones or new ones, never partial.
std::vector<std::string> write_package(const PackageSpec& spec);

}  // namespace mixtape::aot

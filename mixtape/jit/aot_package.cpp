// mixtape/jit/aot_package.cpp -- builds an artifact's libraries from its kernels, the generated
// glue and the runtime archive, with the system's C compiler and binutils.
#include "mixtape/jit/aot_package.h"

#include <stdlib.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <system_error>

#include "mixtape/dsl/data.h"
#include "mixtape/dsl/error.h"
#include "mixtape/jit/aot_package_files.h"
#include "mixtape/jit/llvm_jit.h"
#include "mixtape/jit/run_program.h"
#include "mixtape/runtime/atomic_file.h"

#if !defined(MIXTAPE_RUNTIME_ARCHIVE) || !defined(MIXTAPE_RUNTIME_INSTALLED_ARCHIVE) || \
    !defined(MIXTAPE_RUNTIME_LINK_LIBS) || !defined(MIXTAPE_AOT_LINK_FLAGS)
#error "the build must define where the runtime archive is and what it links"
#endif

namespace mixtape::aot {
namespace {

namespace fs = std::filesystem;

const Tool c_compiler{"CC", "cc", "Debian: apt-get install gcc"};
const Tool linker{"LD", "ld", "Debian: apt-get install binutils"};
const Tool objcopy{"OBJCOPY", "objcopy", "Debian: apt-get install binutils"};
const Tool archiver{"AR", "ar", "Debian: apt-get install binutils"};
const Tool symbol_lister{"NM", "nm", "Debian: apt-get install binutils"};

std::vector<std::string> words(const std::string& text) {
  std::vector<std::string> list;
  size_t at = 0;
  while ((at = text.find_first_not_of(' ', at)) != std::string::npos) {
    size_t end = text.find(' ', at);
    list.push_back(text.substr(at, end - at));
    at = end;
  }
  return list;
}

// The LLVM-free runtime every artifact carries: $MIXTAPE_RUNTIME_ARCHIVE, else this build's, else
// the installed one.
std::string runtime_archive() {
  if (const char* chosen = std::getenv("MIXTAPE_RUNTIME_ARCHIVE"); chosen && *chosen) {
    if (!fs::is_regular_file(chosen))
      fail("AOT export: $MIXTAPE_RUNTIME_ARCHIVE is {}, which is not a file", chosen);
    return chosen;
  }
  for (const char* path : {MIXTAPE_RUNTIME_ARCHIVE, MIXTAPE_RUNTIME_INSTALLED_ARCHIVE})
    if (fs::is_regular_file(path)) return path;
  fail(
      "AOT export: the mixtape runtime archive is neither at {} (the build tree) nor at {} "
      "(installed); set $MIXTAPE_RUNTIME_ARCHIVE to its path",
      MIXTAPE_RUNTIME_ARCHIVE, MIXTAPE_RUNTIME_INSTALLED_ARCHIVE);
}

// A private directory for the intermediate files, removed with everything in it at the end.
class WorkDirectory {
 public:
  explicit WorkDirectory(const std::string& name) {
    std::error_code error;
    fs::path base = fs::temp_directory_path(error);
    if (error) base = "/tmp";
    std::string pattern = (base / ("mixtape-aot-" + name + "-XXXXXX")).string();
    if (!::mkdtemp(pattern.data()))
      fail("AOT export of {}: cannot make a temporary directory {}: {}", name, pattern,
           std::strerror(errno));
    path_ = pattern;
  }
  ~WorkDirectory() {
    std::error_code ignored;  // a leftover temporary file is not worth failing the export for
    fs::remove_all(path_, ignored);
  }
  WorkDirectory(const WorkDirectory&) = delete;
  WorkDirectory& operator=(const WorkDirectory&) = delete;
  std::string file(const std::string& name) const { return (path_ / name).string(); }

 private:
  fs::path path_;
};

void write_bytes(const std::string& path, const void* data, size_t size) {
  write_file_atomically(path, [&](int fd) { write_all(fd, data, size, path); });
}

void write_text(const std::string& path, const std::string& text) {
  write_bytes(path, text.data(), text.size());
}

// The prelinked object keeps exactly the C API global. objcopy cannot make GNU unique symbols
// (an inline function's static locals under GCC's default) local, hence the runtime's
// -fno-gnu-unique; this check catches an archive built without it.
void check_globals(const std::string& object, const std::vector<std::string>& api,
                   const std::string& name) {
  // -P: one "symbol type value size" line per symbol.
  std::string listing = run_tool(symbol_lister, {"-g", "--defined-only", "-P", object});
  for (size_t at = 0, end; at < listing.size(); at = end + 1) {
    end = listing.find('\n', at);
    if (end == std::string::npos) end = listing.size();
    std::string line = listing.substr(at, end - at);
    std::string symbol = line.substr(0, line.find(' '));
    if (symbol.empty() || std::find(api.begin(), api.end(), symbol) != api.end()) continue;
    fail(
        "AOT export of {}: the prelinked object still exports {} ({}); the runtime archive "
        "must be compiled with -fno-gnu-unique",
        name, symbol, line);
  }
}

}  // namespace

std::vector<std::string> write_package(const PackageSpec& spec) {
  check_package_spec(spec);
  const std::string& name = spec.name;
  if (spec.dir.empty()) fail("AOT export of {}: no directory to write to", name);
  std::string archive = runtime_archive();
  std::error_code error;
  fs::create_directories(spec.dir, error);
  if (error) fail("AOT export of {}: cannot create {}: {}", name, spec.dir, error.message());

  WorkDirectory work(name);
  std::string header = package_header(spec);
  write_text(work.file(name + ".h"), header);
  static constexpr const char* runtime_header =
#include "aot_runtime_header.inc"
      ;
  write_text(work.file("mixtape_aot_runtime.h"), runtime_header);
  write_text(work.file(name + "_glue.c"), package_glue(spec));
  std::string glue_object = work.file(name + "_glue.o");
  run_tool(c_compiler, {"-std=c11", "-O2", "-fPIC", "-c", work.file(name + "_glue.c"), "-I",
                        work.file(""), "-o", glue_object});

  // Each variant's kernels, compiled for its CPU, their functions renamed for it.
  std::vector<std::vector<std::byte>> objects;
  for (size_t v = 0; v < spec.variants.size(); ++v) {
    std::vector<LlvmJit::KernelSource> sources;
    for (const PackageKernel& kernel : spec.kernels) {
      std::string symbol = variant_symbol(kernel, v), ir = kernel.llvm_ir;
      if (symbol != kernel.symbol)
        for (size_t at = 0; (at = ir.find("@" + kernel.symbol + "(", at)) != std::string::npos;
             at += symbol.size() + 1)
          ir.replace(at, kernel.symbol.size() + 1, "@" + symbol);
      sources.push_back({symbol, std::move(ir)});
    }
    for (auto& object : LlvmJit::instance().objects(sources, spec.variants[v].cpu))
      objects.push_back(std::move(object));
  }
  // -S: no debug information. A deployed artifact is shipped for size (a debug build's runtime
  // archive carries ~150 MB of it).
  std::vector<std::string> link = {"-r", "-S", "-o", work.file(name + ".prelink.o"), glue_object};
  for (size_t i = 0; i < objects.size(); ++i) {
    std::string path = work.file("kernel" + std::to_string(i) + ".o");
    write_bytes(path, objects[i].data(), objects[i].size());
    link.push_back(path);
  }
  link.insert(link.end(), {"--whole-archive", archive, "--no-whole-archive"});
  run_tool(linker, link);

  // Only the C API stays global. The COMDAT groups go too: a linker keeps one group per
  // signature across all its inputs, and two artifacts (or an artifact and the program) share
  // signatures (std::vector<float>'s members, say) that here name local copies.
  std::vector<std::string> api = {name + "_open_interface", name + "_run", name + "_error",
                                  name + "_close"};
  if (spec.step) api.insert(api.end(), {name + "_save", name + "_load"});
  std::string object = work.file(name + ".o");
  std::vector<std::string> localize = {"--remove-section=.group"};
  for (const std::string& symbol : api) localize.insert(localize.end(), {"-G", symbol});
  localize.insert(localize.end(), {work.file(name + ".prelink.o"), object});
  run_tool(objcopy, localize);
  check_globals(object, api, name);

  std::string static_library = work.file("lib" + name + ".a");
  run_tool(archiver, {"rcsD", static_library, object});
  std::string shared_library = work.file("lib" + name + ".so");
  std::vector<std::string> link_libraries = words(MIXTAPE_RUNTIME_LINK_LIBS);
  std::vector<std::string> extra_link_flags = words(MIXTAPE_AOT_LINK_FLAGS);
  // -z defs: an unresolved symbol is an export error, not a surprise when a program links it.
  std::vector<std::string> shared = {
      "-shared", "-o", shared_library, "-Wl,-soname,lib" + name + ".so", "-Wl,-z,defs", object};
  shared.insert(shared.end(), link_libraries.begin(), link_libraries.end());
  shared.insert(shared.end(), extra_link_flags.begin(), extra_link_flags.end());
  run_tool(c_compiler, shared);

  std::vector<std::string> written = {name + ".h", "lib" + name + ".a", "lib" + name + ".so",
                                      name + ".pc", name + "Config.cmake"};
  fs::path dir = spec.dir;
  write_text((dir / written[0]).string(), header);
  for (const std::string& library : {static_library, shared_library}) {
    std::string bytes = read_file(library);
    write_bytes((dir / fs::path(library).filename()).string(), bytes.data(), bytes.size());
  }
  write_text((dir / written[3]).string(),
             package_pkg_config(spec, link_libraries, extra_link_flags));
  write_text((dir / written[4]).string(),
             package_cmake_config(spec, link_libraries, extra_link_flags));
  return written;
}

}  // namespace mixtape::aot

// mixtape/jit/aot_package_files.cpp -- generates the C header, C glue, pkg-config and CMake files
// of an artifact.
#include "mixtape/jit/aot_package_files.h"

#include <algorithm>
#include <set>

#include "mixtape/dsl/error.h"

#ifndef MIXTAPE_VERSION
#error "MIXTAPE_VERSION must be defined by the build"
#endif

namespace mixtape::aot {
namespace {

// Words a C11 or C++20 compiler reserves: a parameter or type of that name breaks one of them.
const std::set<std::string>& keywords() {
  static const std::set<std::string> words = {"_Alignas",
                                              "_Alignof",
                                              "_Atomic",
                                              "_Bool",
                                              "_Complex",
                                              "_Generic",
                                              "_Imaginary",
                                              "_Noreturn",
                                              "_Static_assert",
                                              "_Thread_local",
                                              "alignas",
                                              "alignof",
                                              "and",
                                              "and_eq",
                                              "asm",
                                              "auto",
                                              "bitand",
                                              "bitor",
                                              "bool",
                                              "break",
                                              "case",
                                              "catch",
                                              "char",
                                              "char16_t",
                                              "char32_t",
                                              "char8_t",
                                              "class",
                                              "co_await",
                                              "co_return",
                                              "co_yield",
                                              "compl",
                                              "concept",
                                              "const",
                                              "const_cast",
                                              "consteval",
                                              "constexpr",
                                              "constinit",
                                              "continue",
                                              "decltype",
                                              "default",
                                              "delete",
                                              "do",
                                              "double",
                                              "dynamic_cast",
                                              "else",
                                              "enum",
                                              "explicit",
                                              "export",
                                              "extern",
                                              "false",
                                              "float",
                                              "for",
                                              "friend",
                                              "goto",
                                              "if",
                                              "inline",
                                              "int",
                                              "long",
                                              "mutable",
                                              "namespace",
                                              "new",
                                              "noexcept",
                                              "not",
                                              "not_eq",
                                              "nullptr",
                                              "operator",
                                              "or",
                                              "or_eq",
                                              "private",
                                              "protected",
                                              "public",
                                              "register",
                                              "reinterpret_cast",
                                              "requires",
                                              "restrict",
                                              "return",
                                              "short",
                                              "signed",
                                              "sizeof",
                                              "static",
                                              "static_assert",
                                              "static_cast",
                                              "struct",
                                              "switch",
                                              "template",
                                              "this",
                                              "thread_local",
                                              "throw",
                                              "true",
                                              "try",
                                              "typedef",
                                              "typeid",
                                              "typename",
                                              "union",
                                              "unsigned",
                                              "using",
                                              "virtual",
                                              "void",
                                              "volatile",
                                              "wchar_t",
                                              "while",
                                              "xor",
                                              "xor_eq"};
  return words;
}

bool is_identifier(const std::string& text) {
  auto letter = [](char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_'; };
  if (text.empty() || !letter(text[0])) return false;
  return std::all_of(text.begin(), text.end(),
                     [&](char c) { return letter(c) || (c >= '0' && c <= '9'); });
}

void check_identifier(const std::string& text, const std::string& what) {
  if (!is_identifier(text))
    fail("AOT export: {} \"{}\" is not a C identifier ([A-Za-z_][A-Za-z0-9_]*)", what, text);
  if (keywords().contains(text))
    fail("AOT export: {} \"{}\" is a C or C++ keyword; choose another", what, text);
}

// "[batch, 64]" or "[32, 64]": dim 0 of a rank >= 1 argument is "batch" when it varies.
std::string shape_text(const Shape& shape, bool dynamic) {
  std::string text = "[";
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i) text += ", ";
    text += dynamic && i == 0 ? std::string("batch") : std::to_string(shape[i]);
  }
  return text + "]";
}

std::string dtype_text(DType dtype) {
  std::string text(name(dtype));
  if (dtype == f16 || dtype == bf16) text += " (as uint16_t bit patterns)";
  if (dtype == boolean) text += " (0 or 1 per uint8_t)";
  return text;
}

// The batch NAME_run accepts when shapes are fixed: the first input's dim 0 (else the first
// output's; 1 for a function of scalars only).
int64_t fixed_batch(const PackageSpec& spec) {
  for (const auto* list : {&spec.inputs, &spec.outputs})
    for (const PackageArgument& argument : *list)
      if (!argument.shape.empty()) return argument.shape[0];
  return 1;
}

std::string run_parameters(const PackageSpec& spec) {
  std::string text = fmt::format("{}* m, int64_t batch", spec.name);
  for (const PackageArgument& input : spec.inputs)
    text += fmt::format(", const {}* {}", c_type(input.dtype), input.name);
  for (const PackageArgument& output : spec.outputs)
    text += fmt::format(", {}* {}", c_type(output.dtype), output.name);
  return text;
}

// A C string literal holding text exactly: octal escapes (always three digits, so a following
// digit cannot join them) for everything but printable ASCII.
std::string c_string(const std::string& text) {
  std::string literal = "\"";
  for (unsigned char c : text) {
    if (c == '"' || c == '\\') {
      literal += '\\';
      literal += static_cast<char>(c);
    } else if (c >= 0x20 && c < 0x7f && c != '?') {  // '?': no trigraphs
      literal += static_cast<char>(c);
    } else {
      literal += fmt::format("\\{:03o}", c);
    }
  }
  return literal + "\"";
}

std::string join(const std::vector<std::string>& words, const char* separator) {
  std::string text;
  for (const std::string& word : words) {
    if (!text.empty()) text += separator;
    text += word;
  }
  return text;
}

// CMake wants each library once, without "-l" ("dnnl"), and flags ("-pthread") as they are.
std::vector<std::string> cmake_link_items(const std::vector<std::string>& link_libraries) {
  std::vector<std::string> items;
  for (const std::string& flag : link_libraries)
    items.push_back(flag.rfind("-l", 0) == 0 ? flag.substr(2) : flag);
  return items;
}

// A CMake quoted argument: backslashes, quotes and dollars escaped.
std::string cmake_quoted(const std::string& text) {
  std::string quoted = "\"";
  for (char c : text) {
    if (c == '\\' || c == '"' || c == '$') quoted += '\\';
    quoted += c;
  }
  return quoted + "\"";
}

}  // namespace

const char* c_type(DType dtype) {
  switch (dtype) {
    case DType::f32:
      return "float";
    case DType::f64:
      return "double";
    case DType::i32:
      return "int32_t";
    case DType::i64:
      return "int64_t";
    case DType::f16:
    case DType::bf16:
      return "uint16_t";
    case DType::boolean:
      return "uint8_t";
  }
  fail("AOT export: dtype {} has no C type", static_cast<int>(dtype));
}

void check_package_spec(const PackageSpec& spec) {
  check_identifier(spec.name, "the artifact name");
  // Its C API is NAME_...: "mt" would take the prefix of every kernel symbol (mt_<hash>), and a
  // name from mixtape_aot on that of the runtime's own C API (mixtape_aot_run, ...).
  if (spec.name == "mt" || spec.name.starts_with("mixtape_aot"))
    fail(
        "AOT export: the artifact name \"{}\" is reserved (\"mt\" and names from \"mixtape_aot\" "
        "prefix mixtape's own symbols); choose another",
        spec.name);
  if (spec.max_batch < 0)
    fail("AOT export of {}: max_batch {} is negative", spec.name, spec.max_batch);
  std::set<std::string> names;
  for (const auto* list : {&spec.inputs, &spec.outputs}) {
    const char* kind = list == &spec.inputs ? "input" : "output";
    for (const PackageArgument& argument : *list) {
      check_identifier(argument.name, fmt::format("the {} name", kind));
      if (argument.name == "m" || argument.name == "batch")
        fail("AOT export of {}: the {} name \"{}\" is taken by {}_run's own parameter; rename it",
             spec.name, kind, argument.name, spec.name);
      if (!names.insert(argument.name).second)
        fail("AOT export of {}: two inputs or outputs are named \"{}\"", spec.name, argument.name);
      for (int64_t dim : argument.shape)
        if (dim < 0)
          fail("AOT export of {}: {} {} has a negative dimension in shape {}", spec.name, kind,
               argument.name, to_string(argument.shape));
      c_type(argument.dtype);
    }
  }
  std::set<std::string> symbols, keys;
  for (const PackageKernel& kernel : spec.kernels) {
    check_identifier(kernel.symbol, "the kernel symbol");
    if (kernel.symbol.rfind(spec.name + "_", 0) == 0)
      fail(
          "AOT export of {}: kernel symbol {} starts with the artifact's prefix {}_, which is "
          "kept for its C API",
          spec.name, kernel.symbol, spec.name);
    if (!symbols.insert(kernel.symbol).second)
      fail("AOT export of {}: two kernels define the symbol {}", spec.name, kernel.symbol);
    if (!keys.insert(kernel.key).second)
      fail("AOT export of {}: two kernels have the key \"{}\"", spec.name, kernel.key);
  }
  if (spec.variants.empty()) fail("AOT export of {}: no kernel variant to build", spec.name);
  std::set<std::string> targets;
  for (const PackageVariant& variant : spec.variants) {
    bool plain =
        !variant.target.empty() &&
        std::all_of(variant.target.begin(), variant.target.end(), [](char c) {
          return std::isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '_' || c == '.';
        });
    if (!plain)
      fail(
          "AOT export of {}: the cpu target \"{}\" is not a name of letters, digits, '-', '_' "
          "and '.'",
          spec.name, variant.target);
    if (!targets.insert(variant.target).second)
      fail("AOT export of {}: two kernel variants are called {}", spec.name, variant.target);
  }
}

std::string variant_symbol(const PackageKernel& kernel, size_t v) {
  return v == 0 ? kernel.symbol : fmt::format("{}_v{}", kernel.symbol, v);
}

namespace {
std::string variant_targets(const PackageSpec& spec) {
  std::vector<std::string> targets;
  for (const PackageVariant& variant : spec.variants) targets.push_back(variant.target);
  return join(targets, ", ");
}
}  // namespace

namespace {
// What a program built against the header relies on: the names, dtypes and shapes of the
// arguments and the batches NAME_run takes. NAME_open hands the header's to the library, which
// refuses another export's rather than run buffers sized for other shapes.
std::string interface_text(const PackageSpec& spec) {
  std::string text = fmt::format("{} {}, batch {}", spec.name, spec.step ? "step" : "function",
                                 spec.max_batch > 0 ? fmt::format("1..{}", spec.max_batch)
                                                    : std::to_string(fixed_batch(spec)));
  for (const auto* list : {&spec.inputs, &spec.outputs})
    for (const PackageArgument& argument : *list)
      text += fmt::format("; {} {} {} {}", list == &spec.inputs ? "in" : "out", argument.name,
                          name(argument.dtype), shape_text(argument.shape, spec.max_batch > 0));
  return text;
}
}  // namespace

namespace {
// "#define NAME_ARG_RANK r" and "#define NAME_ARG_SHAPE {d0, ...}" for every argument.
std::string shape_macros(const PackageSpec& spec) {
  std::string text;
  for (const auto* list : {&spec.inputs, &spec.outputs})
    for (const PackageArgument& argument : *list) {
      Shape shape = argument.shape;
      if (spec.max_batch > 0 && !shape.empty()) shape[0] = spec.max_batch;
      text += fmt::format("#define {0}_{1}_RANK {2}\n#define {0}_{1}_SHAPE {{{3}}}\n", spec.name,
                          argument.name, shape.size(), fmt::join(shape, ", "));
    }
  return text;
}
}  // namespace

std::string package_header(const PackageSpec& spec) {
  const std::string& n = spec.name;
  std::string batch_line =
      spec.max_batch > 0
          ? fmt::format(" *   batch: 1..{}, dim 0 of every argument below that has one\n",
                        spec.max_batch)
          : fmt::format(" *   batch: must be {} (the shapes are fixed)\n", fixed_batch(spec));
  std::string arguments;
  for (const auto* list : {&spec.inputs, &spec.outputs})
    for (const PackageArgument& argument : *list)
      arguments += fmt::format(
          " *   {}: {} {}, {}\n", argument.name, shape_text(argument.shape, spec.max_batch > 0),
          dtype_text(argument.dtype), list == &spec.inputs ? "input (read)" : "output (written)");
  std::string text = fmt::format(
      R"(/* {0}.h -- generated by mixtape {1} (ahead-of-time export); do not edit.
 *
 * The C API of the exported {2} "{0}". Link lib{0}.so or lib{0}.a, next to this
 * header: pkg-config {0}, or find_package({0} CONFIG) in CMake. Every function that
 * returns int returns {0}_OK (0) or one of the {0}_ERROR_* codes, and {0}_error
 * then says what is wrong. */
#ifndef MIXTAPE_AOT_{0}_H_INCLUDED
#define MIXTAPE_AOT_{0}_H_INCLUDED

#include <stdint.h>

#ifdef __cplusplus
extern "C" {{
#endif

enum {{
  {0}_OK = 0,
  /* a NULL pointer, or a batch out of range */
  {0}_ERROR_ARGUMENT = 1,
  /* a file of the artifact is missing or corrupt (checksum, parse) */
  {0}_ERROR_FILE = 2,
  /* the artifact is from another mixtape version or format */
  {0}_ERROR_VERSION = 3,
  /* the device is unavailable, or this CPU lacks features the kernels were compiled for */
  {0}_ERROR_DEVICE = 4,
  /* any other failure */
  {0}_ERROR_RUN = 5
}};

/* An opened artifact: its weights, kernels and working memory{3}. */
typedef struct {0} {0};

/* The arguments this header was generated for. {0}_open hands it to the library, which
 * refuses to open ({0}_ERROR_VERSION) when it is another export's: a program built against one
 * export never runs another's library on buffers sized for other shapes. */
#define {0}_INTERFACE {9}

/* Each argument's rank and shape{10}, to size buffers with:
 *   static const int64_t shape[] = {0}_<argument>_SHAPE; */
{11}
int {0}_open_interface(const char* dir, const char* device, {0}** out,
                       const char* header_interface);

/* Opens the artifact in dir (the export directory: {0}.json, its weights and kernels are
 * read from there). device: "cpu" (the best of the kernel builds this CPU runs), "cpu:TARGET"
 * (that build: {8}), "cuda", or NULL for the best available. On success *out is the model
 * (close it with {0}_close); on failure *out is NULL and {0}_error(NULL) says why. */
static inline int {0}_open(const char* dir, const char* device, {0}** out) {{
  return {0}_open_interface(dir, device, out, {0}_INTERFACE);
}}

/* {4}
{5}{6} * Buffers are host memory, dense and row-major, and must not overlap. */
int {0}_run({7});

/* The last error of m, in words ("" when there was none); m NULL: this thread's last error (a
 * failed {0}_open). Valid until the next call with m. Calls with one m from several threads
 * take turns; read this thread's own error there with NULL. */
const char* {0}_error(const {0}* m);

/* Frees m and everything it holds. NULL is fine. */
void {0}_close({0}* m);
)",
      n, MIXTAPE_VERSION, spec.step ? "training step" : "function",
      spec.step ? ", and the training state\n * (parameters, optimizer and loss scaler state, "
                  "random generators' offsets)"
                : "",
      spec.step ? "Runs one training step on the batch, updating the state kept in m. Arguments:"
                : "Runs the function on the batch. Arguments:",
      batch_line, arguments, run_parameters(spec), variant_targets(spec),
      c_string(interface_text(spec)),
      spec.max_batch > 0 ? " (dim 0 at the largest batch, where an argument has the batch)" : "",
      shape_macros(spec));
  if (spec.cuda)
    text += fmt::format(R"(
/* {0}_run on a model opened on "cuda", with device pointers (CUdeviceptr, as from cudaMalloc)
 * of device 0, in the primary context the CUDA runtime uses, in place of host buffers. The
 * inputs must be ready (their stream synchronized); {0}_run_device returns once the outputs
 * are written. */
int {0}_run_device({1});
)",
                        n, run_parameters(spec));
  if (spec.step)
    text += fmt::format(R"(
/* Saves the training state of m to path as a safetensors checkpoint, in mt::save_checkpoint's
 * layout (so C++ can load_checkpoint it). The file is replaced atomically. */
int {0}_save({0}* m, const char* path);

/* Loads the training state in path (written by {0}_save or mt::save_checkpoint of the same
 * model) into m. The seeds of the random generators the step draws from are compiled in: a
 * checkpoint with another seed is refused ({0}_ERROR_FILE), and m is left as it was. */
int {0}_load({0}* m, const char* path);
)",
                        n);
  text += R"(
#ifdef __cplusplus
}
#endif

#endif
)";
  return text;
}

std::string package_glue(const PackageSpec& spec) {
  const std::string& n = spec.name;
  std::string text =
      fmt::format(R"(/* {0}_glue.c -- generated by mixtape {1}: {0}.h's functions as calls into the
 * artifact runtime (mixtape_aot_*), with the table of the artifact's CPU kernels. */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "{0}.h"

#include "mixtape_aot_runtime.h"

)",
                  n, MIXTAPE_VERSION);
  for (size_t v = 0; v < spec.variants.size(); ++v) {
    const PackageVariant& variant = spec.variants[v];
    text += fmt::format("\n/* Kernels for {} */\n", variant.target);
    for (const PackageKernel& kernel : spec.kernels)
      text += fmt::format("void {}(void* const* params, int64_t begin, int64_t end);\n",
                          variant_symbol(kernel, v));
    if (!spec.kernels.empty()) {
      text += fmt::format("static const mixtape_aot_kernel {}_kernels_{}[] = {{\n", n, v);
      for (const PackageKernel& kernel : spec.kernels)
        text += fmt::format("    {{{}, {}}},\n", c_string(kernel.key), variant_symbol(kernel, v));
      text += "};\n";
    }
    if (!variant.features.empty()) {
      text += fmt::format("static const char* const {}_features_{}[] = {{", n, v);
      for (size_t f = 0; f < variant.features.size(); ++f)
        text += (f ? ", " : "") + c_string(variant.features[f]);
      text += "};\n";
    }
  }
  text += fmt::format("\nstatic const mixtape_aot_variant {}_variants[] = {{\n", n);
  for (size_t v = 0; v < spec.variants.size(); ++v)
    text += fmt::format(
        "    {{{}, {}, {}, {}, {}}},\n", c_string(spec.variants[v].target),
        spec.variants[v].features.empty() ? "NULL" : fmt::format("{}_features_{}", n, v),
        spec.variants[v].features.size(),
        spec.kernels.empty() ? "NULL" : fmt::format("{}_kernels_{}", n, v), spec.kernels.size());
  text += "};\n";
  std::string table = n + "_variants";
  std::string inputs = "NULL", outputs = "NULL", arrays;
  if (!spec.inputs.empty()) {
    std::vector<std::string> names;
    for (const PackageArgument& a : spec.inputs) names.push_back(a.name);
    arrays += fmt::format("  const void* const inputs[] = {{{}}};\n", join(names, ", "));
    inputs = "inputs";
  }
  if (!spec.outputs.empty()) {
    std::vector<std::string> names;
    for (const PackageArgument& a : spec.outputs) names.push_back(a.name);
    arrays += fmt::format("  void* const outputs[] = {{{}}};\n", join(names, ", "));
    outputs = "outputs";
  }
  text += fmt::format(R"(
int {0}_open_interface(const char* dir, const char* device, {0}** out,
                       const char* header_interface) {{
  mixtape_aot_model* model = NULL;
  int code;
  if (!header_interface || strcmp(header_interface, {0}_INTERFACE) != 0) {{
    if (out) *out = NULL;
    return mixtape_aot_refuse_interface({1}, header_interface, {0}_INTERFACE);
  }}
  code = mixtape_aot_open(dir, {1}, {8}, device, {2}, {3}, out ? &model : NULL);
  if (out) *out = ({0}*)model;
  return code;
}}

int {0}_run({4}) {{
{5}  return mixtape_aot_run((mixtape_aot_model*)m, batch, {6}, {7});
}}

const char* {0}_error(const {0}* m) {{
  return mixtape_aot_error((const mixtape_aot_model*)m);
}}

void {0}_close({0}* m) {{
  mixtape_aot_close((mixtape_aot_model*)m);
}}
)",
                      n, c_string(n), table, spec.variants.size(), run_parameters(spec), arrays,
                      inputs, outputs, c_string(spec.manifest_xxh3));
  if (spec.cuda)
    text += fmt::format(R"(
int {0}_run_device({1}) {{
{2}  return mixtape_aot_run_device((mixtape_aot_model*)m, batch, {3}, {4});
}}
)",
                        n, run_parameters(spec), arrays, inputs, outputs);
  if (spec.step)
    text += fmt::format(R"(
int {0}_save({0}* m, const char* path) {{
  return mixtape_aot_save((mixtape_aot_model*)m, path);
}}

int {0}_load({0}* m, const char* path) {{
  return mixtape_aot_load((mixtape_aot_model*)m, path);
}}
)",
                        n);
  return text;
}

std::string package_pkg_config(const PackageSpec& spec,
                               const std::vector<std::string>& link_libraries,
                               const std::vector<std::string>& extra_link_flags) {
  std::string extra;
  for (const std::string& flag : extra_link_flags) extra += " " + flag;
  return fmt::format(
      R"(# {0}.pc -- generated by mixtape {1}: the artifact {0} for pkg-config. Every path is
# relative to this file's directory, so the artifact may be moved (keep PKG_CONFIG_PATH
# absolute: the run-time path below is what pkg-config makes of it).
prefix=${{pcfiledir}}
libdir=${{prefix}}
includedir=${{prefix}}

Name: {0}
Description: {2} exported ahead of time by mixtape
Version: {1}
Cflags: -I${{includedir}}
Libs: -L${{libdir}} -Wl,-rpath,${{libdir}} -l{0}{3}
Libs.private: {4}
)",
      spec.name, MIXTAPE_VERSION, spec.step ? "The training step" : "The inference function", extra,
      join(link_libraries, " "));
}

std::string package_cmake_config(const PackageSpec& spec,
                                 const std::vector<std::string>& link_libraries,
                                 const std::vector<std::string>& extra_link_flags) {
  std::vector<std::string> libraries, options;
  for (const std::string& item : cmake_link_items(link_libraries))
    libraries.push_back(cmake_quoted(item));
  for (const std::string& flag : extra_link_flags) options.push_back(cmake_quoted(flag));
  std::string options_line = options.empty()
                                 ? ""
                                 : fmt::format("\n    INTERFACE_LINK_OPTIONS {}",
                                               cmake_quoted(join(extra_link_flags, ";")));
  return fmt::format(R"(# {0}Config.cmake -- generated by mixtape {1}: the artifact {0} for CMake's
# find_package({0} CONFIG PATHS <dir>). Imported targets, located relative to this file:
#   {0}::{0}         lib{0}.so (its run-time path is the artifact's directory)
#   {0}::{0}_static  lib{0}.a, with the libraries its runtime needs
cmake_minimum_required(VERSION 3.13)
get_filename_component(_{0}_dir "${{CMAKE_CURRENT_LIST_DIR}}" ABSOLUTE)
if(NOT TARGET {0}::{0})
  add_library({0}::{0} SHARED IMPORTED)
  set_target_properties({0}::{0} PROPERTIES
    IMPORTED_LOCATION "${{_{0}_dir}}/lib{0}.so"
    IMPORTED_SONAME "lib{0}.so"
    INTERFACE_INCLUDE_DIRECTORIES "${{_{0}_dir}}"{2})
endif()
if(NOT TARGET {0}::{0}_static)
  add_library({0}::{0}_static STATIC IMPORTED)
  set_target_properties({0}::{0}_static PROPERTIES
    IMPORTED_LOCATION "${{_{0}_dir}}/lib{0}.a"
    IMPORTED_LINK_INTERFACE_LANGUAGES "C"
    INTERFACE_INCLUDE_DIRECTORIES "${{_{0}_dir}}"
    INTERFACE_LINK_LIBRARIES {3}{2})
endif()
unset(_{0}_dir)
set({0}_FOUND TRUE)
)",
                     spec.name, MIXTAPE_VERSION, options_line,
                     cmake_quoted(join(cmake_link_items(link_libraries), ";")));
}

}  // namespace mixtape::aot

// tests/test_aot_package.cpp -- an artifact's generated files and libraries: the C API compiles
// from C and C++, only NAME_* is exported, nothing links LLVM, pkg-config and CMake build against
// it, and its kernels compute what the JIT's do.
#include <gtest/gtest.h>
#include <stdlib.h>

#include <bit>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <set>
#include <sstream>

#include <fmt/format.h>

#include "examples/digits_model.h"
#include "mixtape/codegen/emit_llvm.h"
#include "mixtape/codegen/fusion.h"
#include "mixtape/codegen/lower.h"
#include "mixtape/dsl/graph.h"
#include "mixtape/dsl/ops.h"
#include "mixtape/dsl/tensor.h"
#include "mixtape/jit/aot_export.h"
#include "mixtape/jit/aot_package.h"
#include "mixtape/jit/aot_package_files.h"
#include "mixtape/jit/llvm_jit.h"
#include "mixtape/jit/run_program.h"
#include "test_util.h"

namespace mt = mixtape;
namespace fs = std::filesystem;

namespace {

std::string run(const std::string& program, const std::vector<std::string>& arguments) {
  return mt::run_tool({"", program, "the test's tools"}, arguments);
}

void write(const fs::path& path, const std::string& text) {
  std::ofstream(path, std::ios::binary) << text;
}

std::string read(const fs::path& path) {
  std::ifstream file(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(file), {});
}

std::vector<std::string> split(const std::string& text) {
  std::istringstream words(text);
  std::vector<std::string> list;
  for (std::string word; words >> word;) list.push_back(word);
  return list;
}

// A fresh directory under the system's temporary one, removed at the end.
struct TempDir {
  fs::path path;
  explicit TempDir(const std::string& name) {
    std::string pattern = (fs::temp_directory_path() / (name + "XXXXXX")).string();
    EXPECT_NE(::mkdtemp(pattern.data()), nullptr);
    path = pattern;
  }
  ~TempDir() { fs::remove_all(path); }
};

// Sets an environment variable for a scope.
struct ScopedEnv {
  std::string name;
  std::optional<std::string> old;
  ScopedEnv(std::string n, const std::string& value) : name(std::move(n)) {
    if (const char* v = std::getenv(name.c_str())) old = v;
    ::setenv(name.c_str(), value.c_str(), 1);
  }
  ~ScopedEnv() {
    if (old)
      ::setenv(name.c_str(), old->c_str(), 1);
    else
      ::unsetenv(name.c_str());
  }
};

mt::aot::PackageSpec digits_like_spec(bool step) {
  mt::aot::PackageSpec spec;
  spec.name = step ? "digits_train" : "digits";
  spec.step = step;
  spec.max_batch = step ? 0 : 1024;
  spec.inputs = {{"x", mt::f32, {step ? 32 : 1024, 64}}};
  if (step) spec.inputs.push_back({"y", mt::i64, {32}});
  spec.outputs = {step ? mt::aot::PackageArgument{"loss", mt::f32, {1}}
                       : mt::aot::PackageArgument{"logits", mt::f32, {1024, 10}}};
  spec.variants = {{"native", "", {}}};
  spec.manifest_xxh3 = "0123456789abcdef";
  return spec;
}

// C and C++ sources that include the header and take each function's address with the type the
// issue gives it: a wrong prototype does not compile.
const char* digits_prototypes = R"(
#include "digits.h"
int (*open_fn)(const char*, const char*, digits**) = digits_open;
int (*run_fn)(digits*, int64_t, const float*, float*) = digits_run;
const char* (*error_fn)(const digits*) = digits_error;
void (*close_fn)(digits*) = digits_close;
int codes[] = {digits_OK, digits_ERROR_ARGUMENT, digits_ERROR_FILE, digits_ERROR_VERSION,
               digits_ERROR_DEVICE, digits_ERROR_RUN};
)";
const char* step_prototypes = R"(
#include "digits_train.h"
int (*run_fn)(digits_train*, int64_t, const float*, const int64_t*, float*) = digits_train_run;
int (*save_fn)(digits_train*, const char*) = digits_train_save;
int (*load_fn)(digits_train*, const char*) = digits_train_load;
)";

// Compiles source (which includes a header in dir) as C11 and as C++ with every warning an error.
void expect_compiles_as_c_and_cxx(const fs::path& dir, const std::string& source) {
  write(dir / "use.c", source);
  write(dir / "use.cpp", source);
  for (auto [compiler, standard, file] :
       {std::tuple{"cc", "-std=c11", "use.c"}, std::tuple{"c++", "-std=c++17", "use.cpp"}}) {
    try {
      run(compiler, {standard, "-Wall", "-Wextra", "-Wpedantic", "-Werror", "-fsyntax-only", "-I",
                     dir.string(), (dir / file).string()});
    } catch (const mt::Error& e) {
      ADD_FAILURE() << compiler << ": " << e.what();
    }
  }
}

}  // namespace

TEST(AotPackageFiles, HeaderIsC11AndCxxWithTheIssuesPrototypes) {
  TempDir dir("mixtape-aot-header-");
  write(dir.path / "digits.h", mt::aot::package_header(digits_like_spec(false)));
  expect_compiles_as_c_and_cxx(dir.path, digits_prototypes);
  write(dir.path / "digits_train.h", mt::aot::package_header(digits_like_spec(true)));
  expect_compiles_as_c_and_cxx(dir.path, step_prototypes);
  // Included twice, and next to another artifact's header.
  expect_compiles_as_c_and_cxx(
      dir.path, "#include \"digits.h\"\n#include \"digits.h\"\n#include \"digits_train.h\"\n");
}

TEST(AotPackageFiles, HeaderCommentsGiveShapesDtypesAndBatch) {
  std::string dynamic = mt::aot::package_header(digits_like_spec(false));
  EXPECT_NE(dynamic.find("batch: 1..1024"), std::string::npos) << dynamic;
  EXPECT_NE(dynamic.find("x: [batch, 64] f32, input"), std::string::npos) << dynamic;
  EXPECT_NE(dynamic.find("logits: [batch, 10] f32, output"), std::string::npos) << dynamic;
  EXPECT_EQ(dynamic.find("_save"), std::string::npos) << "a function has no state to save";
  std::string fixed = mt::aot::package_header(digits_like_spec(true));
  EXPECT_NE(fixed.find("batch: must be 32"), std::string::npos) << fixed;
  EXPECT_NE(fixed.find("x: [32, 64] f32, input"), std::string::npos) << fixed;
  EXPECT_NE(fixed.find("y: [32] i64, input"), std::string::npos) << fixed;
  EXPECT_NE(fixed.find("loss: [1] f32, output"), std::string::npos) << fixed;
  EXPECT_NE(fixed.find("int digits_train_save(digits_train* m, const char* path);"),
            std::string::npos);
}

TEST(AotPackageFiles, EachDtypeHasItsCType) {
  mt::aot::PackageSpec spec;
  spec.name = "types";
  spec.inputs = {{"a", mt::f32, {2}}, {"b", mt::f64, {2}}, {"c", mt::i32, {2}},
                 {"d", mt::i64, {2}}, {"e", mt::f16, {2}}, {"f", mt::bf16, {2}}};
  spec.outputs = {{"g", mt::boolean, {2}}, {"h", mt::bf16, {}}};
  TempDir dir("mixtape-aot-types-");
  write(dir.path / "types.h", mt::aot::package_header(spec));
  expect_compiles_as_c_and_cxx(dir.path, R"(
#include "types.h"
int (*run_fn)(types*, int64_t, const float*, const double*, const int32_t*, const int64_t*,
              const uint16_t*, const uint16_t*, uint8_t*, uint16_t*) = types_run;
)");
  std::string header = mt::aot::package_header(spec);
  EXPECT_NE(header.find("e: [2] f16 (as uint16_t bit patterns)"), std::string::npos) << header;
  EXPECT_NE(header.find("h: [] bf16"), std::string::npos) << header;
}

TEST(AotPackageFiles, BadSpecsAreClearErrors) {
  auto with_name = [](std::string name) {
    mt::aot::PackageSpec spec = digits_like_spec(false);
    spec.name = std::move(name);
    return spec;
  };
  EXPECT_MT_ERROR(mt::aot::check_package_spec(with_name("")), "is not a C identifier");
  EXPECT_MT_ERROR(mt::aot::check_package_spec(with_name("9lives")), "\"9lives\"",
                  "not a C identifier");
  EXPECT_MT_ERROR(mt::aot::check_package_spec(with_name("my-model")), "\"my-model\"");
  EXPECT_MT_ERROR(mt::aot::check_package_spec(with_name("my model")), "\"my model\"");
  EXPECT_MT_ERROR(mt::aot::check_package_spec(with_name("class")), "\"class\"", "keyword");
  EXPECT_MT_ERROR(mt::aot::check_package_spec(with_name("mt")), "\"mt\"", "reserved");
  EXPECT_MT_ERROR(mt::aot::check_package_spec(with_name("mixtape_aot")), "reserved");
  mt::aot::PackageSpec spec = digits_like_spec(false);
  spec.inputs.push_back({"batch", mt::f32, {1}});
  EXPECT_MT_ERROR(mt::aot::check_package_spec(spec), "\"batch\"", "digits_run");
  spec = digits_like_spec(false);
  spec.outputs.push_back({"x", mt::f32, {1}});
  EXPECT_MT_ERROR(mt::aot::check_package_spec(spec), "named \"x\"");
  spec = digits_like_spec(false);
  spec.inputs[0].shape = {-1, 64};
  EXPECT_MT_ERROR(mt::aot::check_package_spec(spec), "input x", "negative", "[-1, 64]");
  spec = digits_like_spec(false);
  spec.kernels = {{"k", "a", ""}, {"k", "b", ""}};
  EXPECT_MT_ERROR(mt::aot::check_package_spec(spec), "symbol k");
  spec.kernels = {{"k1", "a", ""}, {"k2", "a", ""}};
  EXPECT_MT_ERROR(mt::aot::check_package_spec(spec), "key \"a\"");
  spec.kernels = {{"digits_open", "a", ""}};
  EXPECT_MT_ERROR(mt::aot::check_package_spec(spec), "digits_open", "prefix");
  EXPECT_NO_THROW(mt::aot::check_package_spec(digits_like_spec(true)));
}

// The glue hands the runtime its name, the kernel table (keys byte for byte, whatever they hold)
// and the buffers in order: checked against a C stand-in for the runtime that records them.
TEST(AotPackageFiles, GlueHandsTheRuntimeTheKernelTableAndBuffers) {
  mt::aot::PackageSpec spec = digits_like_spec(true);
  std::string odd_key = "cpu \"k\"\\1\n\t?\?=\x01\xff" + std::string("9");
  spec.kernels = {{"kern_a", "plain", ""}, {"kern_b", odd_key, ""}};
  TempDir dir("mixtape-aot-glue-");
  write(dir.path / "digits_train.h", mt::aot::package_header(spec));
  write(dir.path / "glue.c", mt::aot::package_glue(spec));
  fs::copy_file(fs::path(MIXTAPE_SOURCE_DIR) / "mixtape/runtime/aot_runtime.h",
                dir.path / "mixtape_aot_runtime.h");
  write(dir.path / "fake.c", R"C(
#include <stdint.h>
#include <stdio.h>
#include <string.h>
typedef void (*fn)(void* const*, int64_t, int64_t);
typedef struct { const char* key; fn function; } kernel;
typedef struct {
  const char* target; const char* const* features; int64_t feature_count;
  const kernel* kernels; int64_t kernel_count;
} variant;
static const kernel* table; static int64_t table_size; static int model;
void kern_a(void* const* p, int64_t b, int64_t e) { (void)p; printf("a %lld %lld\n", (long long)b, (long long)e); }
void kern_b(void* const* p, int64_t b, int64_t e) { (void)p; printf("b %lld %lld\n", (long long)b, (long long)e); }
int mixtape_aot_open(const char* dir, const char* name, const char* manifest, const char* device,
                     const variant* v, int64_t n, void** out) {
  printf("open %s %s %s %s %lld %s %lld\n", dir, name, manifest, device ? device : "(null)",
        (long long)n, v[0].target, (long long)v[0].feature_count);
  if (!out) return 1;
  table = v[0].kernels;
  table_size = v[0].kernel_count;
  *out = &model;
  return 0;
}
int mixtape_aot_run(void* m, int64_t batch, const void* const* in, void* const* out) {
  printf("run %d %lld %g %lld %g\n", m == &model, (long long)batch, *(const float*)in[0],
         (long long)*(const int64_t*)in[1], (double)*(float*)out[0]);
  for (int64_t i = 0; i < table_size; ++i) table[i].function(0, i, batch);
  return 5;
}
int mixtape_aot_save(void* m, const char* path) {
  printf("save %d %s\n", m == &model, path);
  return 0;
}
static const char* refused_library;
int mixtape_aot_refuse_interface(const char* name, const char* header, const char* library) {
  printf("refuse %s [%s]\n", name, header ? header : "(null)");
  refused_library = library;
  return 3;
}
int mixtape_aot_load(void* m, const char* path) {
  printf("load %d %s\n", m == &model, path);
  return 2;
}
const char* mixtape_aot_error(const void* m) { return m ? "model error" : "thread error"; }
void mixtape_aot_close(void* m) { printf("close %d\n", m == &model); }
#include "digits_train.h"
int main(void) {
  digits_train* m = 0;
  float x = 1.5f, loss = 2.5f;
  int64_t y = 7;
  if (digits_train_open("some dir", 0, &m) != 0) return 1;
  for (int64_t i = 0; i < table_size; ++i) {
    printf("key %lld:", (long long)i);
    for (const char* c = table[i].key; *c; ++c) printf(" %02x", (unsigned char)*c);
    printf("\n");
  }
  printf("%d\n", digits_train_run(m, 32, &x, &y, &loss));
  printf("%d\n", digits_train_save(m, "s.safetensors"));
  printf("%d\n", digits_train_load(m, "l.safetensors"));
  printf("%s|%s\n", digits_train_error(m), digits_train_error(0));
  digits_train_close(m);
  printf("%d\n", digits_train_open("d", "cpu", 0));
  /* A program built against another export's header: refused, the library's own interface
     named, nothing opened. */
  m = (digits_train*)&x;
  printf("%d ", digits_train_open_interface("d", 0, &m, "another export"));
  printf("%d %d\n", m == 0, strcmp(refused_library, digits_train_INTERFACE));
  return 0;
}
)C");
  fs::path program = dir.path / "glue_test";
  run("cc",
      {"-std=c11", "-Wall", "-Wextra", "-Werror", "-I", dir.path.string(),
       (dir.path / "glue.c").string(), (dir.path / "fake.c").string(), "-o", program.string()});
  std::string hex;
  for (unsigned char c : odd_key) hex += fmt::format(" {:02x}", c);
  EXPECT_EQ(run(program.string(), {}),
            "open some dir digits_train 0123456789abcdef (null) 1 native 0\n"
            "key 0: 70 6c 61 69 6e\n"
            "key 1:" +
                hex +
                "\n"
                "run 1 32 1.5 7 2.5\n"
                "a 0 32\n"
                "b 1 32\n"
                "5\n"
                "save 1 s.safetensors\n"
                "0\n"
                "load 1 l.safetensors\n"
                "2\n"
                "model error|thread error\n"
                "close 1\n"
                "open d digits_train 0123456789abcdef cpu 1 native 0\n"
                "1\n"
                "refuse digits_train [another export]\n"
                "3 1 0\n");
  // What the header hands over names every argument's dtype and shape and the batches.
  EXPECT_NE(mt::aot::package_header(spec).find(
                "#define digits_train_INTERFACE \"digits_train step, batch 32; in x f32 [32, "
                "64]"),
            std::string::npos)
      << mt::aot::package_header(spec);
}

TEST(AotPackageFiles, PkgConfigAndCmakeFilesAreRelativeToThemselves) {
  mt::aot::PackageSpec spec = digits_like_spec(false);
  std::string pc = mt::aot::package_pkg_config(spec, {"-ldnnl", "-lm"}, {});
  EXPECT_NE(pc.find("prefix=${pcfiledir}\n"), std::string::npos) << pc;
  EXPECT_NE(pc.find("Libs: -L${libdir} -Wl,-rpath,${libdir} -ldigits\n"), std::string::npos) << pc;
  EXPECT_NE(pc.find("Libs.private: -ldnnl -lm\n"), std::string::npos) << pc;
  std::string cmake =
      mt::aot::package_cmake_config(spec, {"-ldnnl", "-lm"}, {"-fsanitize=address"});
  EXPECT_NE(cmake.find("\"${_digits_dir}/libdigits.so\""), std::string::npos) << cmake;
  EXPECT_NE(cmake.find("INTERFACE_LINK_LIBRARIES \"dnnl;m\""), std::string::npos) << cmake;
  EXPECT_NE(cmake.find("INTERFACE_LINK_OPTIONS \"-fsanitize=address\""), std::string::npos)
      << cmake;
  EXPECT_EQ(cmake.find('/' + std::string("tmp")), std::string::npos);
}

TEST(RunTool, ArgumentsPassVerbatimAndFailuresSayWhatHappened) {
  std::vector<std::string> odd = {"a b", "'q'", "\"d\"", "$HOME", "*", ""};
  std::string output = run("printf", {"[%s]", odd[0], odd[1], odd[2], odd[3], odd[4], odd[5]});
  EXPECT_EQ(output, "[a b]['q'][\"d\"][$HOME][*][]");
  EXPECT_MT_ERROR(run("sh", {"-c", "echo complaint >&2; exit 3"}), "exit status 3", "complaint");
  EXPECT_MT_ERROR(
      mt::run_tool({"MIXTAPE_TEST_NO_TOOL", "mixtape-no-such-tool", "apt-get install x"}, {}),
      "'mixtape-no-such-tool' was not found", "$MIXTAPE_TEST_NO_TOOL", "apt-get install x");
  ScopedEnv cc("MIXTAPE_TEST_TOOL", "  env   LC_ALL=C\tprintf ");
  EXPECT_EQ(mt::tool_command({"MIXTAPE_TEST_TOOL", "cc", ""}),
            (std::vector<std::string>{"env", "LC_ALL=C", "printf"}));
  EXPECT_EQ(mt::run_tool({"MIXTAPE_TEST_TOOL", "cc", ""}, {"%s", "x y"}), "x y");
  ScopedEnv empty("MIXTAPE_TEST_TOOL", " ");
  EXPECT_EQ(mt::tool_command({"MIXTAPE_TEST_TOOL", "cc", ""}), (std::vector<std::string>{"cc"}));
}

// ---- write_package, end to end ----

namespace {

// A stand-in for the artifact runtime (the real one replays an exported plan): open keeps the
// kernel table, run applies kernel 0 to (inputs[0], outputs[0]) over [0, batch). C++ with a
// standard container and an inline function's static, as the real runtime has: COMDAT groups
// that two artifacts in one program share.
const char* fake_runtime = R"(
#include <cstdint>
#include <string>
#include <vector>
extern "C" {
typedef void (*mixtape_aot_kernel_fn)(void* const*, int64_t, int64_t);
typedef struct { const char* key; mixtape_aot_kernel_fn function; } mixtape_aot_kernel;
typedef struct {
  const char* target; const char* const* features; int64_t feature_count;
  const mixtape_aot_kernel* kernels; int64_t kernel_count;
} mixtape_aot_variant;
}
struct mixtape_aot_model {
  std::vector<mixtape_aot_kernel> kernels;
  std::string error;
};
inline int& opened() { static int count = 0; return count; }
extern "C" int mixtape_aot_open(const char* dir, const char* name, const char*, const char*,
                                const mixtape_aot_variant* v, int64_t, mixtape_aot_model** out) {
  if (!out) return 1;
  const mixtape_aot_kernel* k = v[0].kernels;
  *out = new mixtape_aot_model{{k, k + v[0].kernel_count},
                               std::string(name) + " opened from " + dir};
  return ++opened() > 0 ? 0 : 5;
}
extern "C" int mixtape_aot_run(mixtape_aot_model* m, int64_t batch, const void* const* in,
                               void* const* out) {
  if (!m || m->kernels.empty()) return 1;
  void* params[] = {const_cast<void*>(in[0]), out[0]};
  m->kernels[0].function(params, 0, batch);
  return 0;
}
extern "C" int mixtape_aot_save(mixtape_aot_model*, const char*) { return 5; }
extern "C" int mixtape_aot_refuse_interface(const char*, const char*, const char*) { return 3; }
extern "C" int mixtape_aot_load(mixtape_aot_model*, const char*) { return 5; }
extern "C" const char* mixtape_aot_error(const mixtape_aot_model* m) {
  return m ? m->error.c_str() : "no model";
}
extern "C" void mixtape_aot_close(mixtape_aot_model* m) { delete m; }
)";

const std::vector<float> tiny_input = {-2.5f, -1.0f, -0.1f, 0.0f, 0.3f, 1.0f, 2.75f, 10.0f};

// Prints a program's eight results as their bits, then its model's error text.
const char* tiny_program = R"(
#include <stdio.h>
#include <string.h>
#include "tiny.h"
int main(int argc, char** argv) {
  float x[8] = {-2.5f, -1.0f, -0.1f, 0.0f, 0.3f, 1.0f, 2.75f, 10.0f};
  float y[8];
  tiny* m = NULL;
  if (argc < 2 || tiny_open(argv[1], NULL, &m) != tiny_OK) return 1;
  if (tiny_run(m, 8, x, y) != tiny_OK) return 2;
  for (int i = 0; i < 8; ++i) {
    uint32_t bits;
    memcpy(&bits, &y[i], 4);
    printf("%08x ", bits);
  }
  printf("%s\n", tiny_error(m));
  tiny_close(m);
  return 0;
}
)";

// One fused elementwise kernel over 8 floats, exp(x) * x: a parameter read, one written.
mt::aot::PackageKernel tiny_kernel() {
  auto x = mt::tensor(tiny_input, {8});
  mt::Tensor y = mt::exp(x) * x;
  std::vector<mt::Node*> pending = mt::nodes_in_tape_order({y.node()});
  std::erase_if(pending, [](mt::Node* n) { return n->evaluated(); });
  std::vector<mt::FusionGroup> groups = mt::fuse(pending, {y.node().get()}, {});
  EXPECT_EQ(groups.size(), 1u);
  mt::LoweredKernel lowered = mt::lower(groups.at(0));
  EXPECT_TRUE(lowered.scalars.empty());
  EXPECT_EQ(lowered.kernel.params.size(), 2u);
  EXPECT_FALSE(lowered.kernel.params.at(0).output);
  EXPECT_TRUE(lowered.kernel.params.at(1).output);
  return {lowered.kernel.name, "cpu:" + lowered.kernel.name, mt::emit_llvm(lowered.kernel)};
}

// What the JIT computes with the same kernel, as tiny_program prints it.
std::string jit_bits() {
  mt::aot::PackageKernel kernel = tiny_kernel();
  std::shared_ptr<const mt::JitKernel> jit =
      mt::LlvmJit::instance().load(kernel.symbol, kernel.llvm_ir);
  std::vector<float> x = tiny_input, y(8);
  void* params[] = {x.data(), y.data()};
  jit->function()(params, 0, 8);
  std::string text;
  for (float v : y) {
    uint32_t bits;
    std::memcpy(&bits, &v, 4);
    text += fmt::format("{:08x} ", bits);
  }
  return text;
}

const std::vector<std::string> allowed_in_a_shared_object = {"_init", "_fini", "_edata", "_end",
                                                             "__bss_start"};

// The defined global symbols nm lists (-P: "name type value size" lines; archive member headers
// have no type).
std::set<std::string> exported(const std::vector<std::string>& nm_arguments) {
  std::set<std::string> symbols;
  std::istringstream lines(run("nm", nm_arguments));
  for (std::string line; std::getline(lines, line);) {
    std::vector<std::string> fields = split(line);
    if (fields.size() >= 2 && fields[1].size() == 1) symbols.insert(fields[0]);
  }
  for (const std::string& s : allowed_in_a_shared_object) symbols.erase(s);
  return symbols;
}

}  // namespace

class AotPackage : public ::testing::Test {
 protected:
  // Packages "tiny" (a function) and "tiny_step" (a step) once, with the stand-in runtime, into
  // a directory whose name holds blanks and quotes, through a temporary directory that does too.
  static void SetUpTestSuite() {
    root = new TempDir("mixtape-aot-package-");
    out = root->path / "out 'dir' $x";
    fs::path tmp = root->path / "tmp \"dir\" *";
    fs::create_directories(tmp);
    fs::path fake = root->path / "fake runtime";
    fs::create_directories(fake);
    write(fake / "fake.cpp", fake_runtime);
    run("c++", {"-O2", "-fPIC", "-fno-gnu-unique", "-c", (fake / "fake.cpp").string(), "-o",
                (fake / "fake.o").string()});
    run("ar", {"rcs", (fake / "libfake.a").string(), (fake / "fake.o").string()});
    ScopedEnv archive("MIXTAPE_RUNTIME_ARCHIVE", (fake / "libfake.a").string());
    ScopedEnv temporary("TMPDIR", tmp.string());
    mt::aot::PackageSpec spec;
    spec.dir = out.string();
    spec.name = "tiny";
    spec.inputs = {{"x", mt::f32, {8}}};
    spec.outputs = {{"y", mt::f32, {8}}};
    spec.kernels = {tiny_kernel()};
    spec.variants = {{"native", "", {}}};
    written = new std::vector<std::string>(mt::aot::write_package(spec));
    spec.name = "tiny_step";
    spec.step = true;
    mt::aot::write_package(spec);
    leftovers = std::distance(fs::directory_iterator(tmp), fs::directory_iterator());
  }
  static void TearDownTestSuite() {
    delete written;
    delete root;
  }
  static inline TempDir* root = nullptr;
  static inline fs::path out;
  static inline std::vector<std::string>* written = nullptr;
  static inline int64_t leftovers = -1;
};

TEST_F(AotPackage, WritesTheFilesItNamesAndNothingElse) {
  EXPECT_EQ(*written, (std::vector<std::string>{"tiny.h", "libtiny.a", "libtiny.so", "tiny.pc",
                                                "tinyConfig.cmake"}));
  std::set<std::string> files;
  for (const auto& entry : fs::directory_iterator(out)) {
    files.insert(entry.path().filename().string());
    EXPECT_GT(fs::file_size(entry.path()), 0u) << entry.path();
  }
  EXPECT_EQ(files,
            (std::set<std::string>{"tiny.h", "libtiny.a", "libtiny.so", "tiny.pc",
                                   "tinyConfig.cmake", "tiny_step.h", "libtiny_step.a",
                                   "libtiny_step.so", "tiny_step.pc", "tiny_stepConfig.cmake"}));
  EXPECT_EQ(leftovers, 0) << "the work directory was not removed";
}

TEST_F(AotPackage, HeadersCompileAsC11AndCxx) {
  expect_compiles_as_c_and_cxx(out,
                               "#include \"tiny.h\"\n#include \"tiny_step.h\"\n"
                               "int (*save)(tiny_step*, const char*) = tiny_step_save;\n");
}

TEST_F(AotPackage, OnlyTheCApiIsExported) {
  std::set<std::string> api = {"tiny_open_interface", "tiny_run", "tiny_error", "tiny_close"};
  EXPECT_EQ(exported({"-g", "--defined-only", "-P", (out / "libtiny.a").string()}), api);
  EXPECT_EQ(exported({"-D", "--defined-only", "-P", (out / "libtiny.so").string()}), api);
  std::set<std::string> step = {"tiny_step_open_interface", "tiny_step_run",  "tiny_step_error",
                                "tiny_step_close",          "tiny_step_save", "tiny_step_load"};
  EXPECT_EQ(exported({"-D", "--defined-only", "-P", (out / "libtiny_step.so").string()}), step);
}

TEST_F(AotPackage, SharedLibraryNeedsNoLlvmNvrtcOrJit) {
  std::string needed = run("ldd", {(out / "libtiny.so").string()});
  EXPECT_NE(needed.find("libstdc++"), std::string::npos) << needed;
  for (const char* banned : {"LLVM", "nvrtc", "libmixtape"})
    EXPECT_EQ(needed.find(banned), std::string::npos) << banned << " in\n" << needed;
  EXPECT_EQ(needed.find("not found"), std::string::npos) << needed;
  // Every object says it needs no executable stack (LLVM's kernels too), or the loader would
  // make the whole process's stack executable.
  std::string segments = run("readelf", {"-lW", (out / "libtiny.so").string()});
  size_t stack = segments.find("GNU_STACK");
  ASSERT_NE(stack, std::string::npos) << segments;
  std::string line = segments.substr(stack, segments.find('\n', stack) - stack);
  EXPECT_EQ(line.find("RWE"), std::string::npos) << line;
}

// pkg-config cannot hold blanks or quotes in a path, so this builds from a copy in a plain
// directory: the artifact also works moved.
TEST_F(AotPackage, PkgConfigBuildsAProgramThatComputesWhatTheJitDoes) {
  fs::path moved = root->path / "moved";
  fs::create_directories(moved);
  for (const char* file : {"tiny.h", "libtiny.so", "libtiny.a", "tiny.pc"})
    fs::copy_file(out / file, moved / file);
  ScopedEnv path("PKG_CONFIG_PATH", moved.string());
  std::vector<std::string> flags = split(run("pkg-config", {"--cflags", "--libs", "tiny"}));
  EXPECT_NE(std::find(flags.begin(), flags.end(), "-I" + moved.string()), flags.end());
  write(root->path / "app.c", tiny_program);
  std::vector<std::string> arguments = {"-std=c11", (root->path / "app.c").string(), "-o",
                                        (root->path / "app").string()};
  arguments.insert(arguments.end(), flags.begin(), flags.end());
  run("cc", arguments);
  std::string linked = run("ldd", {(root->path / "app").string()});
  EXPECT_NE(linked.find(moved.string() + "/libtiny.so"), std::string::npos) << linked;
  EXPECT_EQ(run((root->path / "app").string(), {moved.string()}),
            jit_bits() + "tiny opened from " + moved.string() + "\n");
}

// Two artifacts, statically linked into one program, keep their copies of the runtime apart.
TEST_F(AotPackage, TwoArtifactsLinkStaticallyIntoOneProgram) {
  std::string program = tiny_program;
  program.replace(program.find("#include \"tiny.h\""), 17,
                  "#include \"tiny.h\"\n#include \"tiny_step.h\"");
  program.replace(program.find("tiny_close(m);"), 14,
                  "tiny_close(m);\n  tiny_step* s = NULL;\n"
                  "  if (tiny_step_open(\"step\", NULL, &s) != 0) return 3;\n"
                  "  printf(\"%s %d\\n\", tiny_step_error(s), tiny_step_save(s, \"p\"));\n"
                  "  tiny_step_close(s);");
  write(root->path / "two.c", program);
  ScopedEnv path("PKG_CONFIG_PATH", "/nonexistent");
  std::string pc = read(out / "tiny.pc");
  size_t at = pc.find("Libs.private: ") + 14;
  std::vector<std::string> libraries = split(pc.substr(at, pc.find('\n', at) - at));
  std::vector<std::string> arguments = {"-std=c11",
                                        "-I",
                                        out.string(),
                                        (root->path / "two.c").string(),
                                        (out / "libtiny.a").string(),
                                        (out / "libtiny_step.a").string(),
                                        "-o",
                                        (root->path / "two").string()};
  arguments.insert(arguments.end(), libraries.begin(), libraries.end());
#if defined(__SANITIZE_ADDRESS__)
  arguments.push_back("-fsanitize=address,undefined");
#endif
  run("cc", arguments);
  EXPECT_EQ(run((root->path / "two").string(), {"d"}),
            jit_bits() + "tiny opened from d\ntiny_step opened from step 5\n");
}

TEST_F(AotPackage, FindPackageBuildsAgainstTheArtifact) {
  fs::path project = root->path / "consumer";
  fs::create_directories(project);
  write(project / "app.c", tiny_program);
  std::string dir;  // as a CMake quoted argument
  for (char c : out.string()) {
    if (c == '\\' || c == '"' || c == '$') dir += '\\';
    dir += c;
  }
  write(project / "CMakeLists.txt",
        "cmake_minimum_required(VERSION 3.13)\nproject(consumer C)\n"
        "find_package(tiny CONFIG REQUIRED PATHS \"" +
            dir +
            "\" NO_DEFAULT_PATH)\n"
            "add_executable(app app.c)\ntarget_link_libraries(app PRIVATE tiny::tiny)\n"
            "add_executable(app_static app.c)\n"
            "target_link_libraries(app_static PRIVATE tiny::tiny_static)\n");
  fs::path build = project / "build";
  run("cmake", {"-S", project.string(), "-B", build.string(), "-DCMAKE_BUILD_TYPE=Release"});
  run("cmake", {"--build", build.string()});
  std::string expected = jit_bits() + "tiny opened from d\n";
  EXPECT_EQ(run((build / "app").string(), {"d"}), expected);
  EXPECT_EQ(run((build / "app_static").string(), {"d"}), expected);
  EXPECT_EQ(run("ldd", {(build / "app_static").string()}).find("libtiny"), std::string::npos);
}

TEST(AotPackageErrors, AMissingToolIsNamedAndNothingIsWritten) {
  TempDir root("mixtape-aot-notool-");
  ScopedEnv cc("CC", "mixtape-no-such-cc --flag");
  mt::aot::PackageSpec spec = digits_like_spec(false);
  spec.dir = (root.path / "out").string();
  EXPECT_MT_ERROR(mt::aot::write_package(spec), "'mixtape-no-such-cc' was not found", "$CC",
                  "apt-get install gcc");
  EXPECT_TRUE(fs::is_empty(root.path / "out"));
  spec.dir = "";
  EXPECT_MT_ERROR(mt::aot::write_package(spec), "no directory");
  spec.name = "bad name";
  EXPECT_MT_ERROR(mt::aot::write_package(spec), "\"bad name\"");
}

// The real runtime archive (C++: COMDAT groups, static locals, oneDNN and OpenMP) prelinks into
// artifacts that export only their C API, need no LLVM, and link side by side into one program.
TEST(AotPackageRealRuntime, ExportsOnlyTheApiNeedsNoLlvmAndLinksTwice) {
  TempDir root("mixtape-aot-real-");
  fs::path archive = fs::path(MIXTAPE_BINARY_DIR) / "libmixtape_runtime.a";
  ScopedEnv chosen("MIXTAPE_RUNTIME_ARCHIVE", archive.string());
  mt::aot::PackageSpec spec;
  spec.dir = (root.path / "out").string();
  spec.inputs = {{"x", mt::f32, {8}}};
  spec.outputs = {{"y", mt::f32, {8}}};
  spec.kernels = {tiny_kernel()};
  spec.variants = {{"native", "", {}}};
  for (const char* name : {"tiny", "tiny_step"}) {
    spec.name = name;
    spec.step = spec.name == "tiny_step";
    mt::aot::write_package(spec);
  }
  fs::path out = spec.dir;
  EXPECT_EQ(exported({"-g", "--defined-only", "-P", (out / "libtiny.a").string()}),
            (std::set<std::string>{"tiny_open_interface", "tiny_run", "tiny_error", "tiny_close"}));
  EXPECT_EQ(exported({"-D", "--defined-only", "-P", (out / "libtiny.so").string()}),
            (std::set<std::string>{"tiny_open_interface", "tiny_run", "tiny_error", "tiny_close"}));
  std::string needed = run("ldd", {(out / "libtiny.so").string()});
  EXPECT_NE(needed.find("libdnnl"), std::string::npos) << needed;
  for (const char* banned : {"LLVM", "nvrtc", "libmixtape", "not found"})
    EXPECT_EQ(needed.find(banned), std::string::npos) << banned << " in\n" << needed;
  write(root.path / "two.c",
        "#include \"tiny.h\"\n#include \"tiny_step.h\"\nint main(void) {\n"
        "  tiny* a = 0; tiny_step* b = 0;\n"
        "  return tiny_open(\"a\", 0, &a) + tiny_step_open(\"b\", 0, &b);\n}\n");
  std::string pc = read(out / "tiny.pc");
  size_t at = pc.find("Libs.private: ") + 14;
  std::vector<std::string> arguments = {"-std=c11",
                                        "-I",
                                        out.string(),
                                        (root.path / "two.c").string(),
                                        (out / "libtiny.a").string(),
                                        (out / "libtiny_step.a").string(),
                                        "-o",
                                        (root.path / "two").string()};
  for (const std::string& library : split(pc.substr(at, pc.find('\n', at) - at)))
    arguments.push_back(library);
#if defined(__SANITIZE_ADDRESS__)
  arguments.push_back("-fsanitize=address,undefined");
#endif
  run("cc", arguments);
}

// The packager takes kernels' objects from the JIT's cache: what a training run compiled is not
// compiled again, and each is a relocatable ELF object defining the kernel's symbol.
TEST(AotObjects, KernelsTheJitLoadedAreNotCompiledAgain) {
  mt::aot::PackageKernel kernel = tiny_kernel();
  std::shared_ptr<const mt::JitKernel> loaded =
      mt::LlvmJit::instance().load(kernel.symbol, kernel.llvm_ir);
  int64_t compiled = mt::LlvmJit::instance().stats().compiled;
  std::vector<std::vector<std::byte>> objects =
      mt::LlvmJit::instance().objects({{kernel.symbol, kernel.llvm_ir}});
  EXPECT_EQ(mt::LlvmJit::instance().stats().compiled, compiled);
  ASSERT_EQ(objects.size(), 1u);
  ASSERT_GT(objects[0].size(), 64u);
  EXPECT_EQ(std::memcmp(objects[0].data(),
                        "\x7f"
                        "ELF",
                        4),
            0);
  EXPECT_EQ(static_cast<int>(objects[0][16]), 1) << "e_type is not ET_REL";
  TempDir dir("mixtape-aot-object-");
  write(dir.path / "k.o",
        std::string(reinterpret_cast<const char*>(objects[0].data()), objects[0].size()));
  EXPECT_EQ(exported({"-g", "--defined-only", "-P", (dir.path / "k.o").string()}),
            std::set<std::string>{kernel.symbol});
  // Position-independent: no absolute 32-bit relocation, which a shared library cannot hold.
  std::string relocations = run("readelf", {"-rW", (dir.path / "k.o").string()});
  EXPECT_EQ(relocations.find("R_X86_64_32"), std::string::npos) << relocations;
}

// An export folder that cannot be made (its parent is a file) is an mt::Error naming it; the
// std::filesystem_error escaped, and the examples ended in std::terminate after training.
TEST(AotPackageRealRuntime, AnExportFolderThatCannotBeMadeIsAnMtError) {
  TempDir root("mixtape-aot-folder-");
  write(root.path / "a_file", "x");
  auto twice = [](const mt::Tensor& x) { return x * 2.0; };
  const std::string dir = (root.path / "a_file" / "export").string();
  EXPECT_MT_ERROR(mt::aot::export_function(twice, {mt::aot::input("x", {4}, mt::f32)}, {"y"}, dir,
                                           {.name = "twice"}),
                  "cannot create the export folder", dir);
}

// A plain C program built with pkg-config against an exported (and moved) digits MLP, its
// logits centred by their mean (a fused row sum), computes what the JIT computes, at batch 7 and
// 1: the whole path from export to a separate binary. The host's build gives the JIT's bits;
// x86-64-v3's and baseline x86-64's split the row sum into other partial sums (their vector
// widths), so they agree to rounding there (the claim was the same bits, which held only for
// the MLP alone, whose kernels were all oneDNN's).
TEST(AotPackageRealRuntime, ACProgramRunsAnExportedModelAsTheJitDoes) {
  TempDir root("mixtape-aot-run-");
  mt::manual_seed(5);
  DigitsMLP net;
  auto forward = [&](const mt::Tensor& x) {
    mt::Tensor logits = net(x);
    return logits - mt::mean(logits, {1}, true);
  };
  mt::aot::Options options{
      .name = "digits", .dynamic_batch = {.max = 16}, .cpu_targets = {"x86-64-v3", "x86-64"}};
  mt::aot::export_function(forward, {mt::aot::input("x", {16, 64}, mt::f32)}, {"logits"},
                           (root.path / "export").string(), options);
  fs::copy(root.path / "export", root.path / "moved");
  fs::remove_all(root.path / "export");
  auto input = [](int64_t batch) {
    std::vector<float> x(batch * 64);
    for (int64_t i = 0; i < batch * 64; ++i)
      x[i] = static_cast<float>((i * 37) % 101) / 50.0f - 1.0f;
    return x;
  };
  write(root.path / "app.c", R"(
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "digits.h"
int main(int argc, char** argv) {
  int64_t batch = atoi(argv[2]);
  float x[16 * 64], logits[16 * 10];
  for (int64_t i = 0; i < batch * 64; ++i) x[i] = (float)((i * 37) % 101) / 50.0f - 1.0f;
  digits* m = NULL;
  if (digits_open(argv[1], argv[3], &m) != digits_OK) {
    fprintf(stderr, "%s\n", digits_error(NULL));
    return 1;
  }
  if (digits_run(m, batch, x, logits) != digits_OK) {
    fprintf(stderr, "%s\n", digits_error(m));
    return 2;
  }
  for (int64_t i = 0; i < batch * 10; ++i) {
    uint32_t bits;
    memcpy(&bits, &logits[i], 4);
    printf("%08x ", bits);
  }
  digits_close(m);
  return 0;
}
)");
  std::string moved = (root.path / "moved").string();
  ScopedEnv path("PKG_CONFIG_PATH", moved);
  std::vector<std::string> arguments = {"-std=c11", (root.path / "app.c").string(), "-o",
                                        (root.path / "app").string()};
  for (const std::string& flag : split(run("pkg-config", {"--cflags", "--libs", "digits"})))
    arguments.push_back(flag);
  run("cc", arguments);
  for (int64_t batch : {7, 1}) {
    std::vector<float> expected;
    {
      mt::NoGradGuard no_grad;
      expected = forward(mt::tensor(input(batch), {batch, 64})).to_vector<float>();
    }
    std::string bits;
    for (float v : expected) {
      uint32_t b;
      std::memcpy(&b, &v, 4);
      bits += fmt::format("{:08x} ", b);
    }
    for (const char* device : {"cpu", "cpu:native"})
      EXPECT_EQ(run((root.path / "app").string(), {moved, std::to_string(batch), device}), bits)
          << "batch " << batch << " on " << device;
    for (const char* device : {"cpu:x86-64-v3", "cpu:x86-64"}) {
      std::vector<std::string> words =
          split(run((root.path / "app").string(), {moved, std::to_string(batch), device}));
      ASSERT_EQ(words.size(), expected.size()) << device;
      for (size_t i = 0; i < words.size(); ++i) {
        const float got =
            std::bit_cast<float>(static_cast<uint32_t>(std::stoul(words[i], nullptr, 16)));
        EXPECT_NEAR(got, expected[i], 1e-5 * (1 + std::fabs(expected[i])))
            << "batch " << batch << " on " << device << ", element " << i;
      }
    }
  }
  // Exported again into the same directory with other shapes, the library refuses the program
  // built against the first header, which would have handed it buffers sized for those.
  auto narrower = [](const mt::Tensor& x) { return mt::sum(x, {1}, true); };
  mt::aot::export_function(narrower, {mt::aot::input("x", {16, 32}, mt::f32)}, {"logits"}, moved,
                           options);
  EXPECT_MT_ERROR(run((root.path / "app").string(), {moved, "1", "cpu"}), "another export",
                  "in x f32 [batch, 64]", "in x f32 [batch, 32]");
}

// mixtape/codegen/nvrtc.cpp -- NVRTC loaded with dlopen at run time; CUDA C++ -> PTX/CUBIN through
// the kernel cache.
#include "mixtape/codegen/nvrtc.h"

#include <dlfcn.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cstdlib>
#include <mutex>
#include <vector>

#include <fmt/format.h>

#include "mixtape/codegen/kernel_cache.h"
#include "mixtape/dsl/error.h"
#include "mixtape/dsl/log.h"

namespace mixtape {
namespace {

// The few NVRTC declarations used, as nvrtc.h has them (tests/test_nvrtc.cpp checks them
// against the header when the toolkit is installed). The library is never linked.
using nvrtcResult = int;
constexpr nvrtcResult nvrtc_success = 0;
struct NvrtcProgramOpaque;
using nvrtcProgram = NvrtcProgramOpaque*;

struct Nvrtc {
  void* library = nullptr;
  std::string version;
  const char* (*GetErrorString)(nvrtcResult) = nullptr;
  nvrtcResult (*Version)(int*, int*) = nullptr;
  nvrtcResult (*CreateProgram)(nvrtcProgram*, const char*, const char*, int, const char* const*,
                               const char* const*) = nullptr;
  nvrtcResult (*DestroyProgram)(nvrtcProgram*) = nullptr;
  nvrtcResult (*CompileProgram)(nvrtcProgram, int, const char* const*) = nullptr;
  nvrtcResult (*GetProgramLogSize)(nvrtcProgram, size_t*) = nullptr;
  nvrtcResult (*GetProgramLog)(nvrtcProgram, char*) = nullptr;
  nvrtcResult (*GetPTXSize)(nvrtcProgram, size_t*) = nullptr;
  nvrtcResult (*GetPTX)(nvrtcProgram, char*) = nullptr;
  nvrtcResult (*GetCUBINSize)(nvrtcProgram, size_t*) = nullptr;
  nvrtcResult (*GetCUBIN)(nvrtcProgram, char*) = nullptr;
  // Optional (NVRTC 11.2 and later): the sm_NN this NVRTC compiles for.
  nvrtcResult (*GetNumSupportedArchs)(int*) = nullptr;
  nvrtcResult (*GetSupportedArchs)(int*) = nullptr;
};

std::vector<std::string> candidate_paths() {
  std::vector<std::string> names = {"libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"};
  std::vector<std::string> paths = names;
  std::vector<std::string> roots;
  if (const char* home = std::getenv("CUDA_HOME"); home && *home) roots.push_back(home);
  roots.push_back("/usr/local/cuda");
  for (const std::string& root : roots)
    for (const std::string& name : names) paths.push_back(root + "/lib64/" + name);
  return paths;
}

template <typename F>
bool bind(void* library, F& function, const char* name) {
  function = reinterpret_cast<F>(dlsym(library, name));
  return function != nullptr;
}

// Loads NVRTC once; a library without every symbol counts as missing.
const Nvrtc& nvrtc() {
  static const Nvrtc loaded = [] {
    Nvrtc n;
    std::string tried;
    for (const std::string& path : candidate_paths()) {
      n.library = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
      if (n.library) break;
      tried += " " + path;
    }
    if (!n.library) {
      if (log_enabled("nvrtc")) log_line("nvrtc", "not found (tried{})", tried);
      return n;
    }
    bool ok = bind(n.library, n.GetErrorString, "nvrtcGetErrorString") &&
              bind(n.library, n.Version, "nvrtcVersion") &&
              bind(n.library, n.CreateProgram, "nvrtcCreateProgram") &&
              bind(n.library, n.DestroyProgram, "nvrtcDestroyProgram") &&
              bind(n.library, n.CompileProgram, "nvrtcCompileProgram") &&
              bind(n.library, n.GetProgramLogSize, "nvrtcGetProgramLogSize") &&
              bind(n.library, n.GetProgramLog, "nvrtcGetProgramLog") &&
              bind(n.library, n.GetPTXSize, "nvrtcGetPTXSize") &&
              bind(n.library, n.GetPTX, "nvrtcGetPTX") &&
              bind(n.library, n.GetCUBINSize, "nvrtcGetCUBINSize") &&
              bind(n.library, n.GetCUBIN, "nvrtcGetCUBIN");
    int major = 0, minor = 0;
    if (!ok || n.Version(&major, &minor) != nvrtc_success) {
      if (log_enabled("nvrtc")) log_line("nvrtc", "the library found lacks the NVRTC API");
      dlclose(n.library);
      return Nvrtc{};
    }
    bind(n.library, n.GetNumSupportedArchs, "nvrtcGetNumSupportedArchs");
    bind(n.library, n.GetSupportedArchs, "nvrtcGetSupportedArchs");
    n.version = fmt::format("{}.{}", major, minor);
    if (log_enabled("nvrtc")) log_line("nvrtc", "loaded NVRTC {}", n.version);
    return n;
  }();
  return loaded;
}

std::mutex stats_mutex;
NvrtcStats stats;

// "sm_90" -> CUBIN, "compute_90" -> PTX.
bool wants_cubin(const std::string& arch) {
  auto digits_after = [&](size_t prefix) {
    if (arch.size() <= prefix) return false;
    for (size_t i = prefix; i < arch.size(); ++i)
      if ((arch[i] < '0' || arch[i] > '9') &&
          !(i + 1 == arch.size() && std::isalpha(static_cast<unsigned char>(arch[i]))))
        return false;
    return true;
  };
  if (arch.starts_with("sm_") && digits_after(3)) return true;
  if (arch.starts_with("compute_") && digits_after(8)) return false;
  fail("compile_cuda: arch '{}' is neither sm_NN (CUBIN) nor compute_NN (PTX)", arch);
}

std::vector<std::string> options(const std::string& arch) {
  // IEEE arithmetic so that results match the CPU back end's: emit_cuda already uses _rn
  // intrinsics, these keep anything else (libm internals aside) from changing.
  return {"-std=c++17",      "--gpu-architecture=" + arch,
          "-default-device", "--fmad=false",
          "--ftz=false",     "--prec-div=true",
          "--prec-sqrt=true"};
}

std::string compile_uncached(const Nvrtc& n, const std::string& source, const std::string& arch,
                             bool cubin, const std::vector<std::string>& opts,
                             const std::string& program_name) {
  nvrtcProgram program = nullptr;
  nvrtcResult created =
      n.CreateProgram(&program, source.c_str(), program_name.c_str(), 0, nullptr, nullptr);
  if (created != nvrtc_success)
    fail("NVRTC: creating program {}: {}", program_name, n.GetErrorString(created));
  struct Destroy {
    const Nvrtc& n;
    nvrtcProgram& program;
    ~Destroy() { n.DestroyProgram(&program); }
  } destroy{n, program};
  std::vector<const char*> argv;
  for (const std::string& o : opts) argv.push_back(o.c_str());
  nvrtcResult compiled = n.CompileProgram(program, static_cast<int>(argv.size()), argv.data());
  size_t log_size = 0;
  std::string log;
  if (n.GetProgramLogSize(program, &log_size) == nvrtc_success && log_size > 1) {
    log.resize(log_size);
    if (n.GetProgramLog(program, log.data()) != nvrtc_success) log.clear();
    while (!log.empty() && (log.back() == '\0' || log.back() == '\n')) log.pop_back();
  }
  if (compiled != nvrtc_success)
    fail("NVRTC {}: compiling {} for {} failed ({}):\n{}", n.version, program_name, arch,
         n.GetErrorString(compiled), log);
  if (!log.empty() && log_enabled("nvrtc"))
    log_line("nvrtc", "{} for {}: {}", program_name, arch, log);
  nvrtcResult (*size_of)(nvrtcProgram, size_t*) = cubin ? n.GetCUBINSize : n.GetPTXSize;
  nvrtcResult (*get)(nvrtcProgram, char*) = cubin ? n.GetCUBIN : n.GetPTX;
  size_t size = 0;
  if (nvrtcResult r = size_of(program, &size); r != nvrtc_success)
    fail("NVRTC: reading the {} of {}: {}", cubin ? "CUBIN" : "PTX", program_name,
         n.GetErrorString(r));
  std::string out(size, '\0');
  if (nvrtcResult r = get(program, out.data()); r != nvrtc_success)
    fail("NVRTC: reading the {} of {}: {}", cubin ? "CUBIN" : "PTX", program_name,
         n.GetErrorString(r));
  // PTX comes NUL-terminated; keep just the text.
  if (!cubin)
    while (!out.empty() && out.back() == '\0') out.pop_back();
  return out;
}

}  // namespace

bool nvrtc_available() { return nvrtc().library != nullptr; }

std::string nvrtc_version() { return nvrtc().version; }

std::vector<int> nvrtc_supported_archs() {
  const Nvrtc& n = nvrtc();
  if (!n.library || !n.GetNumSupportedArchs || !n.GetSupportedArchs) return {};
  int count = 0;
  if (n.GetNumSupportedArchs(&count) != nvrtc_success || count <= 0) return {};
  std::vector<int> archs(static_cast<size_t>(count));
  if (n.GetSupportedArchs(archs.data()) != nvrtc_success) return {};
  std::sort(archs.begin(), archs.end());
  return archs;
}

std::string nvrtc_target(int compute_capability) {
  std::vector<int> archs = nvrtc_supported_archs();
  if (archs.empty() || std::count(archs.begin(), archs.end(), compute_capability))
    return fmt::format("sm_{}", compute_capability);
  auto newest_below = std::upper_bound(archs.begin(), archs.end(), compute_capability);
  if (newest_below == archs.begin())
    fail(
        "NVRTC {} does not compile for sm_{} (the oldest it supports is sm_{}): use a CUDA "
        "toolkit that supports this GPU",
        nvrtc_version(), compute_capability, archs.front());
  return fmt::format("compute_{}", *std::prev(newest_below));
}

std::string compile_cuda(const std::string& source, const std::string& arch,
                         const std::string& program_name, bool* from_cache) {
  bool cubin = wants_cubin(arch);
  const Nvrtc& n = nvrtc();
  if (!n.library)
    fail("compile_cuda: NVRTC is not available (libnvrtc.so.13/.so.12 not found; set CUDA_HOME)");
  std::vector<std::string> opts = options(arch);
  std::string key = fmt::format("nvrtc v{}\nnvrtc {}\n{}\n", cuda_codegen_version, n.version, arch);
  for (const std::string& o : opts) key += o + "\n";
  key += source;
  KernelCache& cache = kernel_cache();
  if (from_cache) *from_cache = false;
  if (std::optional<std::vector<std::byte>> hit = cache.load(key)) {
    if (from_cache) *from_cache = true;
    std::lock_guard<std::mutex> lock(stats_mutex);
    ++stats.cache_hits;
    return std::string(reinterpret_cast<const char*>(hit->data()), hit->size());
  }
  auto start = std::chrono::steady_clock::now();
  std::string out = compile_uncached(n, source, arch, cubin, opts, program_name);
  double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  cache.store(key, std::span(reinterpret_cast<const std::byte*>(out.data()), out.size()));
  {
    std::lock_guard<std::mutex> lock(stats_mutex);
    ++stats.compiled;
    stats.compile_seconds += seconds;
  }
  if (log_enabled("nvrtc"))
    log_line("nvrtc", "compiled {} for {} in {:.2f} s ({} bytes)", program_name, arch, seconds,
             out.size());
  return out;
}

NvrtcStats nvrtc_stats() {
  std::lock_guard<std::mutex> lock(stats_mutex);
  return stats;
}

}  // namespace mixtape

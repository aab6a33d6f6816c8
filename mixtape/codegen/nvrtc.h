// mixtape/codegen/nvrtc.h -- CUDA C++ -> PTX or CUBIN with NVRTC, loaded with dlopen, through the
// kernel cache.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace mixtape {

/// Bumped whenever the CUDA code emit_cuda prints, or the options it is compiled with, change
/// meaning for the same kernel: part of every cache key.
constexpr int cuda_codegen_version = 2;

/// True when NVRTC could be loaded: libnvrtc.so.13, .so.12, libnvrtc.so from the loader's path,
/// else the same under $CUDA_HOME/lib64 and /usr/local/cuda/lib64. Tried once per process.
bool nvrtc_available();
/// "13.0" for NVRTC 13.0; "" when NVRTC is not available.
std::string nvrtc_version();

/// Compiles `source` (one or more kernels) for `arch`: "sm_90" gives a CUBIN, "compute_90"
/// PTX text; returned as bytes either way. Options: C++17, every function a device function by
/// default, IEEE arithmetic (no fast math, no FMA contraction, no flushing of subnormals).
/// Cached: the key holds the source, arch, options, NVRTC version and cuda_codegen_version, so
/// a second call (or a second process) compiles nothing. mt::Error when NVRTC is missing or the
/// arch is malformed, and on a compile error with NVRTC's whole log. Safe to call from several
/// threads. `program_name` names the source in NVRTC's messages. `from_cache`, when given, says
/// whether the kernel cache answered.
std::string compile_cuda(const std::string& source, const std::string& arch,
                         const std::string& program_name = "mixtape_kernels.cu",
                         bool* from_cache = nullptr);

/// The compute capabilities this NVRTC compiles CUBINs for (90 for sm_90), ascending; empty
/// when NVRTC is missing or too old to say.
std::vector<int> nvrtc_supported_archs();
/// What to compile for a device of `compute_capability`: "sm_NN" when NVRTC supports it (or
/// cannot say), else PTX for the newest older "compute_MM", which the driver compiles for a GPU
/// newer than this NVRTC. mt::Error when the GPU is older than every arch NVRTC supports.
std::string nvrtc_target(int compute_capability);

struct NvrtcStats {
  int64_t compiled = 0;    // NVRTC runs (cache misses)
  int64_t cache_hits = 0;  // answered by the kernel cache (memory or disk)
  double compile_seconds = 0;
};
NvrtcStats nvrtc_stats();

}  // namespace mixtape

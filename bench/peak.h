// bench/peak.h -- the machine's measured FMA, AVX512-BF16 and AMX peaks (intrinsic kernels at 1
// and all threads) that bench_gemm and bench_conv hold their GFLOP/s to, the threads the library
// runs on, and the peaks' JSON record.
#pragma once

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "bench/timing.h"
#include "mixtape/dsl/error.h"
#include "mixtape/runtime/cpu_features.h"

namespace bench {
// Enough independent accumulators to cover the FMA latency (4 cycles) on two FMA ports with
// room to spare, few enough to stay in the 32 (AVX-512) or 16 (AVX2) vector registers.
constexpr int kAccumulators512 = 16;
constexpr int kAccumulators256 = 12;

// Stores and adds the lanes: GCC 12 reports its own _mm512_reduce_add_ps as reading an
// uninitialized value (-Werror=uninitialized).
__attribute__((target("avx512f"))) inline float sum_lanes(__m512 v) {
  alignas(64) float lanes[16];
  _mm512_store_ps(lanes, v);
  float sum = 0;
  for (float lane : lanes) sum += lane;
  return sum;
}

// Each kernel runs `iterations` rounds of one multiply-add per accumulator and returns a sum of
// the accumulators, so the compiler cannot drop the work. x*0.999999+1e-6 stays near 1: no
// overflow and no subnormals.
__attribute__((target("avx512f"))) inline float fma_avx512(int64_t iterations) {
  __m512 acc[kAccumulators512];
  for (int i = 0; i < kAccumulators512; ++i) acc[i] = _mm512_set1_ps(1.0f + 0.001f * i);
  const __m512 mul = _mm512_set1_ps(0.999999f), add = _mm512_set1_ps(1e-6f);
  for (int64_t it = 0; it < iterations; ++it) {
#pragma GCC unroll 16
    for (int i = 0; i < kAccumulators512; ++i) acc[i] = _mm512_fmadd_ps(acc[i], mul, add);
  }
  __m512 total = acc[0];
  for (int i = 1; i < kAccumulators512; ++i) total = _mm512_add_ps(total, acc[i]);
  return sum_lanes(total);
}

// VDPBF16PS: 16 lanes x 2 bf16 products added into f32, 64 flops per instruction.
__attribute__((target("avx512f,avx512bf16"))) inline float bf16_dot_avx512(int64_t iterations) {
  __m512 acc[kAccumulators512];
  for (int i = 0; i < kAccumulators512; ++i) acc[i] = _mm512_set1_ps(0.001f * i);
  const __m512bh x = _mm512_cvtne2ps_pbh(_mm512_set1_ps(1e-3f), _mm512_set1_ps(-1e-3f));
  const __m512bh y = _mm512_cvtne2ps_pbh(_mm512_set1_ps(1e-3f), _mm512_set1_ps(1e-3f));
  for (int64_t it = 0; it < iterations; ++it) {
#pragma GCC unroll 16
    for (int i = 0; i < kAccumulators512; ++i) acc[i] = _mm512_dpbf16_ps(acc[i], x, y);
  }
  __m512 total = acc[0];
  for (int i = 1; i < kAccumulators512; ++i) total = _mm512_add_ps(total, acc[i]);
  return sum_lanes(total);
}

// Linux hands out the AMX tile data state only on request (arch_prctl, kernel 5.16+); oneDNN makes
// the same request for itself.
inline bool amx_permitted() {
  static const bool permitted = [] {
    if (!__builtin_cpu_supports("amx-bf16")) return false;
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return permitted;
}

// The AMX tile configuration (palette 1): tiles 0-3 accumulators of 16 rows x 16 f32, tiles 4-7
// operands of 16 rows x 32 bf16.
struct __attribute__((packed)) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t rows[16] = {};
};

// TDPBF16PS: a 16x16 f32 tile += a 16x32 bf16 tile times a 32x16 one (VNNI pairs), 16,384 flops;
// four independent accumulators (a 2x2 block of C, as a GEMM's inner loop) cover its latency.
__attribute__((target("amx-tile,amx-bf16"))) inline float amx_bf16(int64_t iterations) {
  TileConfig config;
  for (int t = 0; t < 8; ++t) config.bytes_per_row[t] = 64, config.rows[t] = 16;
  _tile_loadconfig(&config);
  alignas(64) static thread_local uint16_t operand[16 * 32];
  alignas(64) static thread_local float result[16 * 16];
  for (uint16_t& v : operand) v = 0x3A83;  // 1e-3 in bf16: sums stay far from overflow
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  _tile_loadd(4, operand, 64);
  _tile_loadd(5, operand, 64);
  _tile_loadd(6, operand, 64);
  _tile_loadd(7, operand, 64);
  for (int64_t it = 0; it < iterations; ++it) {
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  _tile_stored(0, result, 64);
  _tile_release();
  return result[0];
}

__attribute__((target("avx2,fma"))) inline float fma_avx2(int64_t iterations) {
  __m256 acc[kAccumulators256];
  for (int i = 0; i < kAccumulators256; ++i) acc[i] = _mm256_set1_ps(1.0f + 0.001f * i);
  const __m256 mul = _mm256_set1_ps(0.999999f), add = _mm256_set1_ps(1e-6f);
  for (int64_t it = 0; it < iterations; ++it) {
#pragma GCC unroll 12
    for (int i = 0; i < kAccumulators256; ++i) acc[i] = _mm256_fmadd_ps(acc[i], mul, add);
  }
  alignas(32) float lanes[8];
  __m256 total = acc[0];
  for (int i = 1; i < kAccumulators256; ++i) total = _mm256_add_ps(total, acc[i]);
  _mm256_store_ps(lanes, total);
  float sum = 0;
  for (float lane : lanes) sum += lane;
  return sum;
}

/// A peak kernel: how to run it and the flops one iteration does on one thread.
struct PeakKernel {
  const char* isa;
  float (*run)(int64_t iterations);
  double flops_per_iteration;
};

inline std::atomic<float> sink{0};  // keeps every kernel's result alive

/// GFLOP/s of `threads` threads each running the kernel in bursts of about 20 ms; the best of
/// 20 bursts. A peak is the best the machine does, not a typical time, and short bursts let it
/// be seen between other processes' time slices on a shared machine.
inline double peak_gflops(const PeakKernel& kernel, int threads) {
  int64_t iterations = 1 << 12;
  for (;;) {  // grow until one burst lasts long enough to time
    auto start = std::chrono::steady_clock::now();
    sink = sink + kernel.run(iterations);
    double seconds = bench::seconds_since(start);
    if (seconds > 0.005) {
      iterations = static_cast<int64_t>(static_cast<double>(iterations) * 0.02 / seconds) + 1;
      break;
    }
    iterations *= 4;
  }
  double best = 0;
  for (int burst = 0; burst < 20; ++burst) {
    std::atomic<bool> go{false};
    std::vector<std::thread> workers;
    for (int t = 0; t < threads; ++t)
      workers.emplace_back([&] {
        while (!go.load(std::memory_order_acquire)) std::this_thread::yield();
        sink = sink + kernel.run(iterations);
      });
    auto start = std::chrono::steady_clock::now();
    go.store(true, std::memory_order_release);
    for (std::thread& worker : workers) worker.join();
    double seconds = bench::seconds_since(start);
    best = std::max(best, kernel.flops_per_iteration * static_cast<double>(iterations) * threads /
                              seconds / 1e9);
  }
  return best;
}

inline int all_threads() {
  return std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
}

/// Threads the library's parallel regions use: OMP_NUM_THREADS where set (run.py sets it per
/// child), else all of the machine's.
inline int threads_in_use() {
  const char* env = std::getenv("OMP_NUM_THREADS");
  const int threads = env ? std::atoi(env) : 0;
  return threads > 0 ? std::min(threads, all_threads()) : all_threads();
}

/// Peak GFLOP/s by kind ("f32", "bf16") and thread count, measured on first use.
class Peaks {
 public:
  const PeakKernel* kernel(const std::string& kind) const {
    static const PeakKernel f32_512{"avx512f", fma_avx512, 2.0 * 16 * kAccumulators512};
    static const PeakKernel f32_256{"avx2+fma", fma_avx2, 2.0 * 8 * kAccumulators256};
    static const PeakKernel bf16_512{"avx512bf16", bf16_dot_avx512, 4.0 * 16 * kAccumulators512};
    static const PeakKernel amx{"amx-bf16", amx_bf16, 4.0 * 2.0 * 16 * 16 * 32};
    if (kind == "amx") return amx_permitted() ? &amx : nullptr;
    if (kind == "f32") {
      if (__builtin_cpu_supports("avx512f")) return &f32_512;
      if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return &f32_256;
      return nullptr;
    }
    return __builtin_cpu_supports("avx512bf16") ? &bf16_512 : nullptr;
  }
  /// The machine's peak: one core's peak times the cores, or the all-core measurement when that
  /// is higher. On a shared machine the all-core run rarely gets every core at once; the
  /// per-core burst does, so this is the ceiling a GEMM is held to. "bf16" is the better of the
  /// AVX512-BF16 dot products and AMX tiles, where the CPU and the kernel allow AMX.
  double machine_gflops(const std::string& kind) {
    if (kind == "bf16" && kernel("amx") != nullptr)
      return std::max(machine_gflops("avx512bf16"), machine_gflops("amx"));
    const std::string measured = kind == "avx512bf16" ? "bf16" : kind;
    return std::max(gflops(measured, all_threads()), all_threads() * gflops(measured, 1));
  }
  double gflops(const std::string& kind, int threads) {
    auto key = std::make_pair(kind, threads);
    auto found = measured_.find(key);
    if (found != measured_.end()) return found->second;
    const PeakKernel* k = kernel(kind);
    double value = k ? peak_gflops(*k, threads) : 0.0;
    measured_[key] = value;
    return value;
  }

 private:
  std::map<std::pair<std::string, int>, double> measured_;
};

// The CPU's model name as /proc/cpuinfo gives it (empty elsewhere).
inline std::string cpu_model() {
  std::ifstream cpuinfo("/proc/cpuinfo");
  for (std::string line; std::getline(cpuinfo, line);)
    if (line.rfind("model name", 0) == 0 && line.find(':') != std::string::npos)
      return line.substr(line.find(':') + 2);
  return "";
}

inline mt::json::Value fma_peak_record(Peaks& peaks) {
  mt::json::Value threads = mt::json::Value::array(), f32 = threads, bf16 = threads, amx = threads,
                  features = threads;
  std::vector<int> counts{1};
  if (all_threads() > 1) counts.push_back(all_threads());
  for (int t : counts) {
    threads.push_back(t);
    f32.push_back(peaks.gflops("f32", t));
    bf16.push_back(peaks.gflops("bf16", t));
    if (peaks.kernel("amx")) amx.push_back(peaks.gflops("amx", t));
  }
  for (const std::string& feature : mt::host_cpu_features()) features.push_back(feature);
  const PeakKernel* f32_kernel = peaks.kernel("f32");
  const PeakKernel* bf16_kernel = peaks.kernel("bf16");
  return {
      {"system", "mixtape"},
      {"workload", "fma_peak"},
      {"cpu_model", cpu_model()},
      {"cpu_features", features},
      {"amx_permitted", amx_permitted()},
      {"f32_isa", f32_kernel ? f32_kernel->isa : "none"},
      {"bf16_isa", bf16_kernel ? bf16_kernel->isa : "none"},
      {"accumulators", f32_kernel && std::string(f32_kernel->isa) == "avx2+fma" ? kAccumulators256
                                                                                : kAccumulators512},
      {"threads", threads},
      {"f32_gflops", f32},
      {"bf16_gflops", bf16},
      {"amx_bf16_gflops", amx},
      {"machine_f32_gflops", peaks.machine_gflops("f32")},
      {"machine_avx512bf16_gflops", peaks.machine_gflops("avx512bf16")},
      {"machine_bf16_gflops", peaks.machine_gflops("bf16")}};
}

/// The main() of a kernel bench (bench_gemm, bench_conv): each workload on the command line is
/// "fma_peak" or a name `parse(name, workload)` reads, measured by
/// `record(name, workload, peaks, timing)`; another name is an error that lists those it knows
/// (`known`).
template <typename Workload, typename Parse, typename Record>
int run_kernel_bench(int argc, char** argv, const char* program, const char* usage,
                     const char* known, Parse parse, Record record) {
  CommandLine line = parse_command_line(argc, argv, program, usage);
  try {
    Peaks peaks;
    for (const std::string& name : line.workloads) {
      Workload workload;
      if (name == "fma_peak")
        emit(fma_peak_record(peaks));
      else if (parse(name, workload))
        emit(record(name, workload, peaks, line.timing));
      else
        mt::fail("{}: unknown workload '{}' (fma_peak, {})", program, name, known);
    }
  } catch (const mt::Error& e) {
    std::fprintf(stderr, "%s: error: %s\n", program, e.what());
    return 1;
  }
  return 0;
}

}  // namespace bench

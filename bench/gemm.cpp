// bench/gemm.cpp -- bench_gemm: the machine's FMA peak (AVX-512 intrinsics, 1 and all threads) and
// GFLOP/s of runtime/gemm.h's matmuls on N^3 cubes, f32 and bf16, as a fraction of that peak.
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <map>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "bench/timing.h"
#include "runtime/gemm.h"

namespace mt = mixtape;

namespace {

constexpr const char* kUsage =
    "usage: bench_gemm --workloads LIST [--warmup N] [--windows N] [--window-seconds S]\n"
    "                  [--budget-seconds S]\n"
    "  workloads: fma_peak (f32 FMA and bf16 dot-product peak, 1 and all threads),\n"
    "             gemm_f32_<N>, gemm_bf16_<N> (N^3 product through runtime/gemm.h, f32 result)\n";

// Enough independent accumulators to cover the FMA latency (4 cycles) on two FMA ports with
// room to spare, few enough to stay in the 32 (AVX-512) or 16 (AVX2) vector registers.
constexpr int kAccumulators512 = 16;
constexpr int kAccumulators256 = 12;

// Stores and adds the lanes: GCC 12 reports its own _mm512_reduce_add_ps as reading an
// uninitialized value (-Werror=uninitialized).
__attribute__((target("avx512f"))) float sum_lanes(__m512 v) {
  alignas(64) float lanes[16];
  _mm512_store_ps(lanes, v);
  float sum = 0;
  for (float lane : lanes) sum += lane;
  return sum;
}

// Each kernel runs `iterations` rounds of one multiply-add per accumulator and returns a sum of
// the accumulators, so the compiler cannot drop the work. x*0.999999+1e-6 stays near 1: no
// overflow and no subnormals.
__attribute__((target("avx512f"))) float fma_avx512(int64_t iterations) {
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
__attribute__((target("avx512f,avx512bf16"))) float bf16_dot_avx512(int64_t iterations) {
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

__attribute__((target("avx2,fma"))) float fma_avx2(int64_t iterations) {
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

std::atomic<float> sink{0};  // keeps every kernel's result alive

/// GFLOP/s of `threads` threads each running the kernel in bursts of about 20 ms; the best of
/// 20 bursts. A peak is the best the machine does, not a typical time, and short bursts let it
/// be seen between other processes' time slices on a shared machine.
double peak_gflops(const PeakKernel& kernel, int threads) {
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

int all_threads() { return std::max(1, static_cast<int>(std::thread::hardware_concurrency())); }

/// Peak GFLOP/s by kind ("f32", "bf16") and thread count, measured on first use.
class Peaks {
 public:
  const PeakKernel* kernel(const std::string& kind) const {
    static const PeakKernel f32_512{"avx512f", fma_avx512, 2.0 * 16 * kAccumulators512};
    static const PeakKernel f32_256{"avx2+fma", fma_avx2, 2.0 * 8 * kAccumulators256};
    static const PeakKernel bf16_512{"avx512bf16", bf16_dot_avx512, 4.0 * 16 * kAccumulators512};
    if (kind == "f32") {
      if (__builtin_cpu_supports("avx512f")) return &f32_512;
      if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return &f32_256;
      return nullptr;
    }
    return __builtin_cpu_supports("avx512bf16") ? &bf16_512 : nullptr;
  }
  /// The machine's peak: one core's peak times the cores, or the all-core measurement when that
  /// is higher. On a shared machine the all-core run rarely gets every core at once; the
  /// per-core burst does, so this is the ceiling a GEMM is held to.
  double machine_gflops(const std::string& kind) {
    return std::max(gflops(kind, all_threads()), all_threads() * gflops(kind, 1));
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

mt::json::Object fma_peak_record(Peaks& peaks) {
  mt::json::Array threads, f32, bf16;
  std::vector<int> counts{1};
  if (all_threads() > 1) counts.push_back(all_threads());
  for (int t : counts) {
    threads.push_back(t);
    f32.push_back(peaks.gflops("f32", t));
    bf16.push_back(peaks.gflops("bf16", t));
  }
  const PeakKernel* f32_kernel = peaks.kernel("f32");
  const PeakKernel* bf16_kernel = peaks.kernel("bf16");
  return {
      {"system", "mixtape"},
      {"workload", "fma_peak"},
      {"f32_isa", f32_kernel ? f32_kernel->isa : "none"},
      {"bf16_isa", bf16_kernel ? bf16_kernel->isa : "none"},
      {"accumulators", f32_kernel && std::string(f32_kernel->isa) == "avx2+fma" ? kAccumulators256
                                                                                : kAccumulators512},
      {"threads", threads},
      {"f32_gflops", f32},
      {"bf16_gflops", bf16},
      {"machine_f32_gflops", peaks.machine_gflops("f32")},
      {"machine_bf16_gflops", peaks.machine_gflops("bf16")}};
}

mt::json::Object gemm_record(const std::string& name, const std::string& dtype, int64_t size,
                             Peaks& peaks, const bench::TimingOptions& timing) {
  std::mt19937_64 rng(0);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  size_t count = static_cast<size_t>(size * size);
  std::vector<float> a(count), b(count), out(count);
  for (float& v : a) v = normal(rng);
  for (float& v : b) v = normal(rng);
  std::vector<uint16_t> a16, b16;
  mt::GemmDesc desc{.m = size, .n = size, .k = size};
  const void* a_data = a.data();
  const void* b_data = b.data();
  if (dtype == "bf16") {
    a16.resize(count);
    b16.resize(count);
    mt::narrow_to_bf16(a.data(), a16.data(), static_cast<int64_t>(count));
    mt::narrow_to_bf16(b.data(), b16.data(), static_cast<int64_t>(count));
    desc.operand = mt::bf16;
    a_data = a16.data();
    b_data = b16.data();
  }
  auto step = [&] { mt::gemm(desc, a_data, b_data, out.data()); };
  mt::json::Object result = bench::measure(step, timing);
  double calls_per_s = mt::json::Value(result).at("steps_per_s").as_double();
  double gflops = calls_per_s * 2.0 * static_cast<double>(size * size * size) / 1e9;
  // bf16 operands may be widened to f32 and run on the FMA units (runtime/gemm.h), so their
  // ceiling is the better of the two peaks, not the bf16 dot-product peak alone.
  double peak = peaks.machine_gflops("f32");
  if (dtype == "bf16") peak = std::max(peak, peaks.machine_gflops("bf16"));
  mt::json::Object record{{"system", "mixtape"}, {"workload", name},   {"dtype", dtype},
                          {"size", size},        {"out_dtype", "f32"}, {"gflops", gflops},
                          {"peak_gflops", peak}};
  if (peak > 0) record.emplace_back("fraction_of_peak", gflops / peak);
  bench::append(record, result);
  return record;
}

}  // namespace

int main(int argc, char** argv) {
  bench::CommandLine line = bench::parse_command_line(argc, argv, "bench_gemm", kUsage);
  try {
    Peaks peaks;
    for (const std::string& name : line.workloads) {
      char dtype[8] = {};
      long long size = 0;
      int consumed = 0;
      if (name == "fma_peak") {
        bench::emit(fma_peak_record(peaks));
      } else if (std::sscanf(name.c_str(), "gemm_%4[a-z0-9]_%lld%n", dtype, &size, &consumed) ==
                     2 &&
                 static_cast<size_t>(consumed) == name.size() && size > 0 &&
                 (std::string(dtype) == "f32" || std::string(dtype) == "bf16")) {
        bench::emit(gemm_record(name, dtype, size, peaks, line.timing));
      } else {
        mt::fail("bench_gemm: unknown workload '{}' (fma_peak, gemm_f32_<N>, gemm_bf16_<N>)", name);
      }
    }
  } catch (const mt::Error& e) {
    std::fprintf(stderr, "bench_gemm: error: %s\n", e.what());
    return 1;
  }
  return 0;
}

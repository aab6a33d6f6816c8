// bench/conv.cpp -- bench_conv: GFLOP/s of runtime/conv.h's three convolution primitives (forward,
// input gradient, weight gradient; f32 and bf16) at given shapes, as a fraction of the measured
// FMA peaks (bench/peak.h). run.py runs it at ResNet-18's shapes.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "bench/peak.h"
#include "bench/timing.h"
#include "mixtape/dsl/error.h"
#include "mixtape/runtime/conv.h"
#include "mixtape/runtime/half_convert.h"

namespace mt = mixtape;

namespace {

constexpr const char* kUsage =
    "usage: bench_conv --workloads LIST [--warmup N] [--windows N] [--window-seconds S]\n"
    "                  [--budget-seconds S]\n"
    "  workloads: fma_peak (as bench_gemm's),\n"
    "             conv_<f32|bf16>_<fwd|dgrad|wgrad>_n<N>_c<C>_h<H>_o<O>_k<K>_s<S>: x [N, C, H, H]\n"
    "             * w [O, C, K, K], stride S, padding K / 2, through runtime/conv.h; fwd is the\n"
    "             convolution, dgrad its input gradient, wgrad its weight gradient, each with\n"
    "             its result in the operands' dtype, as a training step under autocast runs them;\n"
    "             a suffix :native or :widened picks the bf16 kernel (default: automatic)\n"
    "  GFLOP/s count 2 N O OH OW C K K flops per pass (an im2col GEMM's, padded taps included).\n";

struct ConvWorkload {
  std::string dtype, pass;
  int64_t n = 0, c = 0, h = 0, o = 0, k = 0, s = 0;
  mt::Bf16Kernel bf16_kernel = mt::Bf16Kernel::automatic;
};

bool parse_conv(const std::string& name, ConvWorkload& w) {
  std::string shape = name;
  const size_t colon = name.find(':');
  mt::Bf16Kernel kernel = mt::Bf16Kernel::automatic;
  if (colon != std::string::npos) {
    const std::string suffix = name.substr(colon + 1);
    if (suffix == "native")
      kernel = mt::Bf16Kernel::native;
    else if (suffix == "widened")
      kernel = mt::Bf16Kernel::widened;
    else
      return false;
    shape = name.substr(0, colon);
  }
  char dtype[8] = {}, pass[8] = {};
  long long n = 0, c = 0, h = 0, o = 0, k = 0, s = 0;
  int consumed = 0;
  if (std::sscanf(shape.c_str(), "conv_%4[a-z0-9]_%5[a-z]_n%lld_c%lld_h%lld_o%lld_k%lld_s%lld%n",
                  dtype, pass, &n, &c, &h, &o, &k, &s, &consumed) != 8 ||
      static_cast<size_t>(consumed) != shape.size())
    return false;
  w = {dtype, pass, n, c, h, o, k, s, kernel};
  return (kernel == mt::Bf16Kernel::automatic || w.dtype == "bf16") &&
         (w.dtype == "f32" || w.dtype == "bf16") &&
         (w.pass == "fwd" || w.pass == "dgrad" || w.pass == "wgrad") && n > 0 && c > 0 && h > 0 &&
         o > 0 && k > 0 && s > 0 && h + 2 * (k / 2) >= k;
}

/// The peak of `kind` at `threads`: the machine's (bench_gemm's rule) on all threads, else one
/// core's times `threads`.
double peak_at(bench::Peaks& peaks, const std::string& kind, int threads) {
  if (threads >= bench::all_threads()) return peaks.machine_gflops(kind);
  return threads * peaks.gflops(kind == "avx512bf16" ? "bf16" : kind, 1);
}

std::vector<float> random_values(int64_t count, std::mt19937_64& rng) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> values(static_cast<size_t>(count));
  for (float& v : values) v = normal(rng);
  return values;
}

mt::json::Value conv_record(const std::string& name, const ConvWorkload& w, bench::Peaks& peaks,
                            const bench::TimingOptions& timing) {
  const int64_t pad = w.k / 2, out_size = (w.h + 2 * pad - w.k) / w.s + 1;
  mt::ConvDesc desc;
  desc.op = w.pass == "fwd"     ? mt::OpCode::Conv2d
            : w.pass == "dgrad" ? mt::OpCode::Conv2dInputGrad
                                : mt::OpCode::Conv2dWeightGrad;
  desc.geometry = mt::ConvGeometry{.n = w.n,
                                   .c = w.c,
                                   .h = w.h,
                                   .w = w.h,
                                   .o = w.o,
                                   .kh = w.k,
                                   .kw = w.k,
                                   .oh = out_size,
                                   .ow = out_size,
                                   .window = {}};
  desc.geometry.window.stride[0] = desc.geometry.window.stride[1] = w.s;
  desc.geometry.window.pad[0] = desc.geometry.window.pad[1] = pad;
  const bool bf16 = w.dtype == "bf16";
  desc.operand = desc.out = bf16 ? mt::bf16 : mt::f32;
  desc.bf16_kernel = w.bf16_kernel;
  const int64_t x_count = w.n * w.c * w.h * w.h, w_count = w.o * w.c * w.k * w.k,
                y_count = w.n * w.o * out_size * out_size;
  // The primitive's operands: fwd (x, w) -> y, dgrad (dy, w) -> dx, wgrad (x, dy) -> dw.
  const int64_t a_count = w.pass == "dgrad" ? y_count : x_count;
  const int64_t b_count = w.pass == "wgrad" ? y_count : w_count;
  const int64_t out_count = w.pass == "fwd" ? y_count : w.pass == "dgrad" ? x_count : w_count;
  std::mt19937_64 rng(0);
  std::vector<float> a = random_values(a_count, rng), b = random_values(b_count, rng);
  std::vector<uint16_t> a16, b16, out16;
  std::vector<float> out;
  const void* a_data = a.data();
  const void* b_data = b.data();
  void* out_data = nullptr;
  if (bf16) {
    a16.resize(a.size());
    b16.resize(b.size());
    out16.resize(static_cast<size_t>(out_count));
    mt::narrow_to_bf16(a.data(), a16.data(), a_count);
    mt::narrow_to_bf16(b.data(), b16.data(), b_count);
    a_data = a16.data(), b_data = b16.data(), out_data = out16.data();
  } else {
    out.resize(static_cast<size_t>(out_count));
    out_data = out.data();
  }
  auto step = [&] { mt::conv(desc, a_data, b_data, out_data); };
  mt::json::Value result = bench::measure(step, timing);
  const double calls_per_s = result.at("steps_per_s").get<double>();
  const double flops = 2.0 * static_cast<double>(w.n * w.o * out_size * out_size * w.c * w.k * w.k);
  const double gflops = calls_per_s * flops / 1e9;
  const int threads = bench::threads_in_use();
  // As bench_gemm: bf16 may run on the FMA units (widened), so its ceiling is the better of the
  // f32 and bf16 peaks (AMX's where the machine has it); the record also holds each peak alone.
  const double f32_peak = peak_at(peaks, "f32", threads);
  const double bf16_dot_peak = peak_at(peaks, "avx512bf16", threads);
  const double amx_peak = peaks.kernel("amx") ? peak_at(peaks, "amx", threads) : 0.0;
  const double peak = bf16 ? std::max({f32_peak, bf16_dot_peak, amx_peak}) : f32_peak;
  mt::json::Value record{{"system", "mixtape"},
                         {"workload", name},
                         {"dtype", w.dtype},
                         {"pass", w.pass},
                         {"shape", mt::json::Value{{"n", w.n},
                                                   {"c", w.c},
                                                   {"h", w.h},
                                                   {"o", w.o},
                                                   {"k", w.k},
                                                   {"stride", w.s},
                                                   {"padding", pad},
                                                   {"out", out_size}}},
                         {"kernel", mt::conv_kernel(desc)},
                         {"threads_in_use", threads},
                         {"gflops", gflops},
                         {"peak_gflops", peak},
                         {"f32_fma_peak_gflops", f32_peak},
                         {"avx512bf16_peak_gflops", bf16_dot_peak},
                         {"amx_bf16_peak_gflops", amx_peak}};
  if (peak > 0) record.emplace("fraction_of_peak", gflops / peak);
  if (f32_peak > 0) record.emplace("fraction_of_f32_fma_peak", gflops / f32_peak);
  if (bf16 && bf16_dot_peak > 0)
    record.emplace("fraction_of_avx512bf16_peak", gflops / bf16_dot_peak);
  bench::append(record, result);
  return record;
}

}  // namespace

int main(int argc, char** argv) {
  return bench::run_kernel_bench<ConvWorkload>(
      argc, argv, "bench_conv", kUsage,
      "conv_<f32|bf16>_<fwd|dgrad|wgrad>_n<N>_c<C>_h<H>_o<O>_k<K>_s<S>", parse_conv, conv_record);
}

// bench/gemm.cpp -- bench_gemm: the machine's FMA and bf16 peaks (bench/peak.h) and GFLOP/s of
// runtime/gemm.h's matmuls, f32 and bf16, as a fraction of that peak.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "bench/peak.h"
#include "bench/timing.h"
#include "mixtape/dsl/error.h"
#include "mixtape/runtime/gemm.h"
#include "mixtape/runtime/half_convert.h"
#include "mixtape/runtime/scratch_buffer.h"

namespace mt = mixtape;

namespace {

using bench::Peaks;

constexpr const char* kUsage =
    "usage: bench_gemm --workloads LIST [--warmup N] [--windows N] [--window-seconds S]\n"
    "                  [--budget-seconds S]\n"
    "  workloads: fma_peak (f32 FMA, bf16 dot-product and AMX peaks, 1 and all threads),\n"
    "             gemm_<f32|bf16>_<N> (N^3 product through runtime/gemm.h, f32 result),\n"
    "             gemm_<f32|bf16>_<M>x<N>x<K> (an M x K by K x N product); a suffix\n"
    "             :native, :widened or :own picks the bf16 kernel (default: automatic),\n"
    "             :ta and :tb store a or b transposed, :b<B> makes it B products in one call,\n"
    "             :bf16_out rounds the result to bf16 (as an autocast step's products),\n"
    "             :dense or :padded how the f32 kernel reads its operands (default: automatic)\n";

/// A gemm workload's name parsed: gemm_<dtype>_<N> or gemm_<dtype>_<M>x<N>x<K>, and :kernel.
struct GemmWorkload {
  std::string dtype;
  int64_t batch = 1, m = 0, n = 0, k = 0;
  mt::Bf16Kernel kernel = mt::Bf16Kernel::automatic;
  mt::OperandRows rows = mt::OperandRows::automatic;
  bool transpose_a = false, transpose_b = false;  // the operands stored transposed
  mt::DType out = mt::f32;                        // the result's type
};

bool parse_gemm(const std::string& name, GemmWorkload& w) {
  const size_t colon = name.find(':');
  const std::string shape = name.substr(0, colon);
  // Suffixes after ':': the bf16 kernel (native, widened, own), the transposes (ta, tb), the
  // batch (b<B>), the f32 kernel's operand rows (dense, padded) and the result's type (bf16_out).
  for (size_t at = colon; at != std::string::npos;) {
    const size_t next = name.find(':', at + 1);
    const std::string part = name.substr(at + 1, next == std::string::npos ? next : next - at - 1);
    if (part == "native")
      w.kernel = mt::Bf16Kernel::native;
    else if (part == "widened")
      w.kernel = mt::Bf16Kernel::widened;
    else if (part == "own")
      w.kernel = mt::Bf16Kernel::own;
    else if (part == "dense")
      w.rows = mt::OperandRows::dense;
    else if (part == "padded")
      w.rows = mt::OperandRows::padded;
    else if (part == "ta")
      w.transpose_a = true;
    else if (part == "tb")
      w.transpose_b = true;
    else if (part == "bf16_out")
      w.out = mt::bf16;
    else if (part.size() > 1 && part[0] == 'b' &&
             part.find_first_not_of("0123456789", 1) == std::string::npos)
      w.batch = std::atoll(part.c_str() + 1);
    else
      return false;
    at = next;
  }
  char dtype[8] = {};
  long long m = 0, n = 0, k = 0;
  int consumed = 0;
  if (std::sscanf(shape.c_str(), "gemm_%4[a-z0-9]_%lldx%lldx%lld%n", dtype, &m, &n, &k,
                  &consumed) == 4 &&
      static_cast<size_t>(consumed) == shape.size()) {
  } else if (std::sscanf(shape.c_str(), "gemm_%4[a-z0-9]_%lld%n", dtype, &m, &consumed) == 2 &&
             static_cast<size_t>(consumed) == shape.size()) {
    n = k = m;
  } else {
    return false;
  }
  w.dtype = dtype, w.m = m, w.n = n, w.k = k;
  return (w.dtype == "f32" || w.dtype == "bf16") && m > 0 && n > 0 && k > 0 && w.batch > 0 &&
         (w.kernel == mt::Bf16Kernel::automatic || w.dtype == "bf16");
}

mt::json::Value gemm_record(const std::string& name, const GemmWorkload& w, Peaks& peaks,
                            const bench::TimingOptions& timing) {
  std::mt19937_64 rng(0);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const std::string& dtype = w.dtype;
  // 64-byte aligned blocks from the values' allocator, as a tensor's bytes are: a vector's
  // alignment varies with its size, and oneDNN's speed varies with the alignment.
  const int64_t a_count = w.batch * w.m * w.k, b_count = w.batch * w.k * w.n;
  mt::ScratchBuffer a_block, b_block, out_block, a16_block, b16_block;
  float* a = a_block.get<float>(a_count);
  float* b = b_block.get<float>(b_count);
  float* out = out_block.get<float>(w.batch * w.m * w.n);
  std::generate_n(a, a_count, [&] { return normal(rng); });
  std::generate_n(b, b_count, [&] { return normal(rng); });
  mt::GemmDesc desc{.batch = w.batch,
                    .m = w.m,
                    .n = w.n,
                    .k = w.k,
                    .transpose_a = w.transpose_a,
                    .transpose_b = w.transpose_b,
                    .out = w.out,
                    .bf16_kernel = w.kernel,
                    .operand_rows = w.rows};
  const void* a_data = a;
  const void* b_data = b;
  if (dtype == "bf16") {
    uint16_t* a16 = a16_block.get<uint16_t>(a_count);
    uint16_t* b16 = b16_block.get<uint16_t>(b_count);
    mt::narrow_to_bf16(a, a16, a_count);
    mt::narrow_to_bf16(b, b16, b_count);
    desc.operand = mt::bf16;
    a_data = a16;
    b_data = b16;
  }
  auto step = [&] { mt::gemm(desc, a_data, b_data, out); };
  mt::json::Value result = bench::measure(step, timing);
  double calls_per_s = result.at("steps_per_s").get<double>();
  double gflops = calls_per_s * 2.0 * static_cast<double>(w.batch * w.m * w.n * w.k) / 1e9;
  // bf16 operands may be widened to f32 and run on the FMA units (runtime/gemm.h), so their
  // ceiling is the better of the f32 and bf16 peaks (AMX, where the machine has it).
  double peak = peaks.machine_gflops("f32");
  if (dtype == "bf16") peak = std::max(peak, peaks.machine_gflops("bf16"));
  mt::json::Value record{{"system", "mixtape"},
                         {"workload", name},
                         {"dtype", dtype},
                         {"m", w.m},
                         {"n", w.n},
                         {"k", w.k},
                         {"batch", w.batch},
                         {"kernel", mt::gemm_kernel(desc)},
                         {"out_dtype", std::string(mt::name(w.out))},
                         {"gflops", gflops},
                         {"peak_gflops", peak}};
  if (w.m == w.n && w.n == w.k) record.emplace("size", w.m);
  if (peak > 0) record.emplace("fraction_of_peak", gflops / peak);
  // The same against the peak of the threads the library uses (OMP_NUM_THREADS), as
  // bench_conv holds its products: one thread's product is held to one core's peak.
  const int threads = bench::threads_in_use();
  double peak_here = peaks.gflops("f32", 1) * threads;
  if (dtype == "bf16") peak_here = std::max(peak_here, peaks.gflops("bf16", 1) * threads);
  if (threads >= bench::all_threads()) peak_here = peak;
  record.emplace("library_threads", threads);
  if (peak_here > 0) record.emplace("fraction_of_peak_at_threads", gflops / peak_here);
  bench::append(record, result);
  return record;
}

}  // namespace

int main(int argc, char** argv) {
  return bench::run_kernel_bench<GemmWorkload>(
      argc, argv, "bench_gemm", kUsage,
      "gemm_<f32|bf16>_<N>, gemm_<f32|bf16>_<M>x<N>x<K>, with :native, :widened or :own for bf16, "
      ":ta, :tb, :b<B>, :bf16_out",
      parse_gemm, gemm_record);
}

// bench/gpu_gemm.cpp -- bench_gpu_gemm: cuBLASLt bf16/f16 GEMM TFLOP/s on the GPU, as JSON.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "mixtape/dsl/dtype.h"
#include "mixtape/dsl/half.h"
#include "mixtape/runtime/cublaslt.h"
#include "mixtape/runtime/cuda_allocator.h"
#include "mixtape/runtime/cuda_driver.h"

namespace mt = mixtape;
namespace cu = mixtape::cuda;

namespace {

// H200 (SXM) dense bf16/f16 tensor-core peak without sparsity, NVIDIA's datasheet figure.
constexpr double kPeakTflops = 989.0;

struct Shape {
  std::string name;
  int64_t m, n, k;
  bool transpose_b;  // nn.Linear's weight is [out, in]: x @ W^T
};

std::string json_string(const std::string& s) {
  std::string out = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') out += '\\';
    out += c;
  }
  return out + "\"";
}

// Random half values, tiled from one 1 Mi-element block so that big operands fill fast; zeros
// would overstate the speed (tensor cores draw less power on them).
void fill_random(const cu::DeviceBuffer& buffer, mt::DType type, size_t count) {
  constexpr size_t kTile = size_t{1} << 20;
  std::mt19937 rng(42);
  std::uniform_real_distribution<float> dist(-1, 1);
  std::vector<uint16_t> tile(kTile);
  for (auto& v : tile)
    v = type == mt::bf16 ? mt::f32_to_bf16_bits(dist(rng)) : mt::f32_to_f16_bits(dist(rng));
  for (size_t at = 0; at < count; at += kTile)
    cu::upload(buffer.address() + at * 2, tile.data(), std::min(kTile, count - at) * 2);
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.size() % 2 ? v[v.size() / 2] : (v[v.size() / 2 - 1] + v[v.size() / 2]) / 2;
}

}  // namespace

int main() {
  if (!cu::available() || !cu::cublaslt_available()) {
    std::string reason =
        cu::available() ? cu::cublaslt_unavailable_reason() : cu::unavailable_reason();
    std::printf("{\"skipped\": %s}\n", json_string(reason).c_str());
    return 0;
  }
  std::vector<Shape> shapes;
  for (int64_t n : {1024, 2048, 4096, 8192})
    shapes.push_back({"square_" + std::to_string(n), n, n, n, false});
  // Tokens x hidden for a GPT-style layer (hidden 4096, MLP 4x), 8192 tokens per step.
  shapes.push_back({"qkv_proj", 8192, 3 * 4096, 4096, true});
  shapes.push_back({"attn_out", 8192, 4096, 4096, true});
  shapes.push_back({"mlp_up", 8192, 16384, 4096, true});
  shapes.push_back({"mlp_down", 8192, 4096, 16384, true});
  shapes.push_back({"mlp_down_dgrad", 8192, 16384, 4096, false});

  std::string results;
  for (mt::DType type : {mt::bf16, mt::f16}) {
    for (const Shape& s : shapes) {
      cu::DeviceBuffer a(s.m * s.k * 2), b(s.k * s.n * 2), c(s.m * s.n * 2);
      fill_random(a, type, s.m * s.k);
      fill_random(b, type, s.k * s.n);
      cu::MatmulDesc desc;
      desc.m = s.m;
      desc.n = s.n;
      desc.k = s.k;
      desc.transpose_b = s.transpose_b;
      desc.input = type;
      desc.output = type;
      cu::MatmulArgs args{a.data(), b.data(), c.data()};
      const double flops = 2.0 * s.m * s.n * s.k;
      // Warm-up (plan, clocks), then windows of enough products to last about 20 ms each.
      cu::Event start, end;
      start.record();
      for (int i = 0; i < 3; ++i) cu::matmul(desc, args);
      end.record();
      end.synchronize();
      double warm_ms = cu::Event::elapsed_ms(start, end) / 3;
      int reps = std::clamp(static_cast<int>(20.0 / std::max(warm_ms, 1e-3)), 1, 1000);
      std::vector<double> per_call_ms;
      for (int window = 0; window < 7; ++window) {
        start.record();
        for (int i = 0; i < reps; ++i) cu::matmul(desc, args);
        end.record();
        end.synchronize();
        per_call_ms.push_back(cu::Event::elapsed_ms(start, end) / reps);
      }
      double ms = median(per_call_ms);
      double tflops = flops / (ms * 1e-3) / 1e12;
      results += fmt::format(
          "{}{{\"name\": \"{}\", \"dtype\": \"{}\", \"m\": {}, \"n\": {}, \"k\": {}, "
          "\"transpose_b\": {}, \"ms\": {:.4f}, \"tflops\": {:.1f}, \"fraction_of_peak\": {:.3f}}}",
          results.empty() ? "" : ",\n  ", s.name, mt::name(type), s.m, s.n, s.k,
          s.transpose_b ? "true" : "false", ms, tflops, tflops / kPeakTflops);
    }
  }
  std::printf(
      "{\"device\": %s, \"compute_capability\": %d, \"peak_dense_bf16_tflops\": %.0f, "
      "\"accumulate\": \"f32\", \"timing\": \"CUDA events, 3 warm-up calls, median of 7 "
      "windows\",\n"
      " \"results\": [\n  %s]}\n",
      json_string(cu::device_name()).c_str(), cu::compute_capability(), kPeakTflops,
      results.c_str());
  return 0;
}

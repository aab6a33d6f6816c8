// tests/gpu/test_gpu_runtime.cpp -- CUDA runtime on a device: driver, allocator, copies, cuBLASLt.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <map>
#include <random>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "mixtape/dsl/dtype.h"
#include "mixtape/dsl/half.h"
#include "mixtape/runtime/cublaslt.h"
#include "mixtape/runtime/cuda_allocator.h"
#include "mixtape/runtime/cuda_driver.h"
#include "tests/test_util.h"

namespace mt = mixtape;
namespace cu = mixtape::cuda;

namespace {

#define SKIP_WITHOUT_CUDA()                                                                 \
  do {                                                                                      \
    if (!cu::available()) GTEST_SKIP() << "CUDA unavailable: " << cu::unavailable_reason(); \
  } while (0)

TEST(GpuDriver, DeviceIsDescribed) {
  SKIP_WITHOUT_CUDA();
  EXPECT_FALSE(cu::device_name().empty());
  EXPECT_GE(cu::compute_capability(), 50);
  EXPECT_GT(cu::multiprocessor_count(), 0);
  cu::MemoryInfo memory = cu::memory_info();
  EXPECT_GT(memory.total, size_t{1} << 30);
  EXPECT_LE(memory.free, memory.total);
  std::printf("device %s, sm_%d, %d SMs, driver %d, %.1f of %.1f GiB free\n",
              cu::device_name().c_str(), cu::compute_capability(), cu::multiprocessor_count(),
              cu::driver_version(), memory.free / 1073741824.0, memory.total / 1073741824.0);
}

TEST(GpuDriver, EventsTimeQueuedWork) {
  SKIP_WITHOUT_CUDA();
  cu::DeviceBuffer buffer(64 << 20);
  cu::Event start, end;
  start.record();
  for (int i = 0; i < 4; ++i)
    cu::memset_async(buffer.address(), static_cast<unsigned char>(i), buffer.size());
  end.record();
  end.synchronize();
  EXPECT_TRUE(end.done());
  float ms = cu::Event::elapsed_ms(start, end);
  EXPECT_GT(ms, 0.0f);
  EXPECT_LT(ms, 1000.0f);
}

TEST(GpuAllocator, ReusesBlocksAndCountsThem) {
  SKIP_WITHOUT_CUDA();
  cu::CachingAllocator& allocator = cu::device_allocator();
  cu::AllocatorStats before = allocator.stats();
  void* first;
  {
    cu::DeviceBuffer buffer(3 << 20);  // a 4 MiB block
    first = buffer.data();
    EXPECT_EQ(reinterpret_cast<uintptr_t>(first) % 512, 0u);
    cu::AllocatorStats during = allocator.stats();
    EXPECT_EQ(during.allocated - before.allocated, size_t{4} << 20);
  }
  cu::DeviceBuffer again((3 << 20) + 100);  // same class, same stream: no synchronization needed
  EXPECT_EQ(again.data(), first);
  cu::AllocatorStats after = allocator.stats();
  EXPECT_EQ(after.alloc_count - before.alloc_count, 2);
  EXPECT_GE(after.cache_hits - before.cache_hits, 1);
  EXPECT_GE(after.peak_allocated, after.allocated);
  EXPECT_GE(after.reserved, after.allocated);
  // A real out-of-memory result becomes a one-line error naming the sizes.
  EXPECT_MT_ERROR(cu::DeviceBuffer(size_t{1} << 50), "out of device memory", "bytes requested");
}

TEST(GpuCopies, RoundTripThroughTheStagingRing) {
  SKIP_WITHOUT_CUDA();
  // Crosses several 4 MiB staging chunks and ends mid-chunk.
  const size_t bytes = (size_t{13} << 20) + 123;
  std::vector<uint8_t> host(bytes), back(bytes, 0);
  std::mt19937 rng(7);
  for (auto& b : host) b = static_cast<uint8_t>(rng());
  cu::DeviceBuffer a(bytes), b(bytes);
  cu::upload(a.address(), host.data(), bytes);
  cu::copy_device_to_device_async(b.address(), a.address(), bytes);
  cu::download(back.data(), b.address(), bytes);
  EXPECT_EQ(std::memcmp(host.data(), back.data(), bytes), 0);
  cu::memset_async(b.address() + 5, 0x5A, 1000);
  std::vector<uint8_t> small(2000);
  cu::download(small.data(), b.address(), small.size());
  for (size_t i = 0; i < small.size(); ++i)
    ASSERT_EQ(small[i], i >= 5 && i < 1005 ? 0x5A : host[i]) << i;
}

// ---- cuBLASLt against an f64 reference from the same rounded inputs ----

double round_to(mt::DType t, double x) {
  float f = static_cast<float>(x);
  if (t == mt::f16) return mt::f16_bits_to_f32(mt::f32_to_f16_bits(f));
  if (t == mt::bf16) return mt::bf16_bits_to_f32(mt::f32_to_bf16_bits(f));
  return f;
}

// Host values already representable in `t`, and their device bytes.
struct HostMatrix {
  mt::DType type;
  std::vector<double> values;
  std::vector<uint8_t> bytes;
  HostMatrix(mt::DType t, size_t count) : type(t), values(count), bytes(count * mt::size_of(t)) {}
  void set(size_t i, double x) {
    float f = static_cast<float>(round_to(type, x));
    values[i] = f;
    if (type == mt::f32) {
      std::memcpy(bytes.data() + 4 * i, &f, 4);
    } else {
      uint16_t bits = type == mt::f16 ? mt::f32_to_f16_bits(f) : mt::f32_to_bf16_bits(f);
      std::memcpy(bytes.data() + 2 * i, &bits, 2);
    }
  }
  static double decode(mt::DType t, const uint8_t* p) {
    if (t == mt::f32) {
      float f;
      std::memcpy(&f, p, 4);
      return f;
    }
    uint16_t bits;
    std::memcpy(&bits, p, 2);
    return t == mt::f16 ? mt::f16_bits_to_f32(bits) : mt::bf16_bits_to_f32(bits);
  }
};

HostMatrix random_matrix(mt::DType t, size_t count, std::mt19937& rng) {
  std::uniform_real_distribution<double> dist(-1, 1);
  HostMatrix m(t, count);
  for (size_t i = 0; i < count; ++i) m.set(i, dist(rng));
  return m;
}

cu::DeviceBuffer to_device(const HostMatrix& m) {
  cu::DeviceBuffer buffer(std::max<size_t>(m.bytes.size(), 1));
  cu::upload(buffer.address(), m.bytes.data(), m.bytes.size());
  return buffer;
}

std::vector<uint8_t> from_device(const cu::DeviceBuffer& buffer, size_t bytes) {
  std::vector<uint8_t> host(bytes);
  cu::download(host.data(), buffer.address(), bytes);
  return host;
}

constexpr double kGeluC = 0.7978845608028654;  // sqrt(2 / pi)
double gelu(double x) { return 0.5 * x * (1 + std::tanh(kGeluC * (x + 0.044715 * x * x * x))); }
double gelu_grad(double x) {
  double t = std::tanh(kGeluC * (x + 0.044715 * x * x * x));
  return 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * kGeluC * (1 + 3 * 0.044715 * x * x);
}

bool has_bias_input(cu::Epilogue e) {
  return e == cu::Epilogue::bias || e == cu::Epilogue::relu_bias || e == cu::Epilogue::gelu_bias ||
         e == cu::Epilogue::relu_aux_bias || e == cu::Epilogue::gelu_aux_bias;
}
bool is_bgrad(cu::Epilogue e) {
  return e == cu::Epilogue::drelu_bgrad || e == cu::Epilogue::dgelu_bgrad;
}

// Tolerances: the output's rounding (bf16 2^-8, f16 2^-10 relative, f32 1e-5) on |reference|, plus
// the f32 accumulation (1e-5; TF32 inputs 1e-3) on the sum of |products| (which bounds the
// error where terms cancel).
struct Tolerance {
  double relative, accumulation;
};
Tolerance tolerance(const cu::MatmulDesc& d) {
  double relative = d.output == mt::bf16  ? std::ldexp(1.0, -8)
                    : d.output == mt::f16 ? std::ldexp(1.0, -10)
                                          : 1e-5;
  return {relative, d.allow_tf32 ? 1e-3 : 1e-5};
}

struct CaseResult {
  bool supported = true;
  std::string failure;  // empty when every element is within tolerance
  double worst = 0;     // largest error / tolerance seen
};

// Runs one product on the device and checks C (and bias gradient / aux) against f64.
CaseResult run_case(const cu::MatmulDesc& d, uint32_t seed, float alpha = 1, float beta = 0) {
  std::mt19937 rng(seed);
  const int64_t m = d.m, n = d.n, k = d.k, batch = d.batch;
  HostMatrix a = random_matrix(d.input, batch * m * k, rng);
  HostMatrix b = random_matrix(d.input, batch * k * n, rng);
  HostMatrix c0 = random_matrix(d.output, batch * m * n, rng);
  HostMatrix bias = random_matrix(d.output, n, rng);
  const int64_t aux_ld = cu::matmul_aux_ld(d);
  const size_t aux_bytes = cu::matmul_aux_bytes(d);
  // dgelu_bgrad reads the GELU input, drelu_bgrad the ReLU mask: random ones here.
  HostMatrix gelu_input =
      random_matrix(d.output, std::max<size_t>(aux_bytes / mt::size_of(d.output), 1), rng);
  std::vector<uint8_t> mask(aux_bytes);
  for (auto& byte : mask) byte = static_cast<uint8_t>(rng());

  cu::DeviceBuffer da = to_device(a), db = to_device(b), dc = to_device(c0);
  cu::DeviceBuffer dbias = to_device(bias);
  cu::DeviceBuffer daux(std::max<size_t>(aux_bytes, 1));
  if (d.epilogue == cu::Epilogue::dgelu_bgrad)
    cu::upload(daux.address(), gelu_input.bytes.data(), aux_bytes);
  if (d.epilogue == cu::Epilogue::drelu_bgrad) cu::upload(daux.address(), mask.data(), aux_bytes);
  cu::MatmulArgs args{
      da.data(), db.data(), dc.data(), dbias.data(), aux_bytes ? daux.data() : nullptr,
      alpha,     beta};
  CaseResult result;
  try {
    cu::matmul(d, args);
  } catch (const mt::Error& e) {
    if (std::string(e.what()).find("has no kernel") == std::string::npos) throw;
    result.supported = false;
    result.failure = e.what();
    return result;
  }
  const size_t out_size = mt::size_of(d.output);
  std::vector<uint8_t> c = from_device(dc, c0.bytes.size());
  std::vector<uint8_t> bias_out = from_device(dbias, bias.bytes.size());
  std::vector<uint8_t> aux_out = aux_bytes ? from_device(daux, aux_bytes) : std::vector<uint8_t>();

  const Tolerance tol = tolerance(d);
  std::vector<double> bgrad(n, 0), bgrad_allowed(n, 0);
  auto check = [&](double got, double want, double allowed, const char* what, int64_t bi, int64_t i,
                   int64_t j) {
    double ratio = std::abs(got - want) / allowed;
    if (!(ratio <= 1) && result.failure.empty())
      result.failure = fmt::format("{}[{}][{}][{}] = {} but the reference is {} (allowed {})", what,
                                   bi, i, j, got, want, allowed);
    result.worst = std::max(result.worst, std::isnan(ratio) ? 1e30 : ratio);
  };
  for (int64_t bi = 0; bi < batch; ++bi) {
    for (int64_t i = 0; i < m; ++i) {
      for (int64_t j = 0; j < n; ++j) {
        double sum = 0, magnitude = 0;
        for (int64_t l = 0; l < k; ++l) {
          double av =
              d.transpose_a ? a.values[bi * m * k + l * m + i] : a.values[bi * m * k + i * k + l];
          double bv =
              d.transpose_b ? b.values[bi * k * n + j * k + l] : b.values[bi * k * n + l * n + j];
          sum += av * bv;
          magnitude += std::abs(av * bv);
        }
        const size_t at = bi * m * n + i * n + j;
        const double product = alpha * sum + beta * c0.values[at];
        double pre = product;
        double scale = std::abs(alpha) * magnitude + std::abs(beta * c0.values[at]);
        if (has_bias_input(d.epilogue)) {
          pre += bias.values[j];
          scale += std::abs(bias.values[j]);
        }
        double want = pre, extra = 0;
        double slope = 1;  // the largest |d want / d pre|
        // Bit (i, j) of the mask: cuBLASLt's D is n x m column-major, so element (j, i) at
        // bit i * ld + j.
        const int64_t bit = (bi * m + i) * aux_ld + j;
        switch (d.epilogue) {
          case cu::Epilogue::relu_bias:
          case cu::Epilogue::relu_aux_bias:
            want = std::max(pre, 0.0);
            break;
          case cu::Epilogue::gelu_bias:
          case cu::Epilogue::gelu_aux_bias:
            want = gelu(pre);
            slope = 1.13;  // the largest |gelu'|
            scale *= slope;
            break;
          case cu::Epilogue::drelu_bgrad:
            want = (mask[bit / 8] >> (bit % 8)) & 1 ? pre : 0.0;
            break;
          case cu::Epilogue::dgelu_bgrad: {
            double g = gelu_grad(gelu_input.values[(bi * m + i) * aux_ld + j]);
            want = pre * g;
            // cuBLASLt evaluates gelu' with a fast tanh: about 3e-4 relative error seen on an
            // H200, within 2^-10 of |x * gelu'| for the |x| <= 1 used here.
            extra = std::ldexp(std::abs(pre), -10);
            slope = std::abs(g);
            scale *= slope;
            break;
          }
          default:
            break;
        }
        // For half outputs cuBLASLt may round the product to the output dtype before the
        // epilogue (seen on an H200 with A transposed): a second rounding, of |product|, carried
        // through the epilogue's slope (and into the GELU input it saves).
        const double early_rounding = is_half(d.output) && d.epilogue != cu::Epilogue::none
                                          ? tol.relative * std::abs(product)
                                          : 0.0;
        extra += early_rounding * slope;
        const double allowed = tol.relative * std::abs(want) + tol.accumulation * scale + extra;
        check(HostMatrix::decode(d.output, c.data() + at * out_size), want, allowed, "C", bi, i, j);
        // The bias gradient may sum the rounded or the unrounded elements: either way within
        // the sum of their allowances, plus its own rounding.
        bgrad[j] += want;
        bgrad_allowed[j] += allowed;
        if (d.epilogue == cu::Epilogue::relu_aux_bias && std::abs(pre) > 1e-2 * scale + 1e-6) {
          bool got_bit = (aux_out[bit / 8] >> (bit % 8)) & 1;
          if (got_bit != (pre > 0) && result.failure.empty())
            result.failure =
                fmt::format("relu mask bit ({}, {}, {}) is {} for {}", bi, i, j, got_bit, pre);
        }
        if (d.epilogue == cu::Epilogue::gelu_aux_bias) {
          const uint8_t* p = aux_out.data() + ((bi * m + i) * aux_ld + j) * out_size;
          check(HostMatrix::decode(d.output, p), pre,
                tol.relative * std::abs(pre) + tol.accumulation * scale + early_rounding, "aux", bi,
                i, j);
        }
      }
    }
  }
  if (is_bgrad(d.epilogue))
    for (int64_t j = 0; j < n; ++j)
      check(HostMatrix::decode(d.output, bias_out.data() + j * out_size), bgrad[j],
            tol.relative * std::abs(bgrad[j]) + bgrad_allowed[j], "bias gradient", 0, 0, j);
  return result;
}

struct TypeCase {
  mt::DType input, output;
  bool tf32;
};

TEST(GpuMatmul, EveryDtypeTransposeBatchAndEpilogue) {
  SKIP_WITHOUT_CUDA();
  if (!cu::cublaslt_available()) GTEST_SKIP() << cu::cublaslt_unavailable_reason();
  const TypeCase types[] = {{mt::f16, mt::f16, false},   {mt::f16, mt::f32, false},
                            {mt::bf16, mt::bf16, false}, {mt::bf16, mt::f32, false},
                            {mt::f32, mt::f32, false},   {mt::f32, mt::f32, true}};
  const cu::Epilogue epilogues[] = {cu::Epilogue::none,          cu::Epilogue::bias,
                                    cu::Epilogue::relu_bias,     cu::Epilogue::gelu_bias,
                                    cu::Epilogue::relu_aux_bias, cu::Epilogue::gelu_aux_bias,
                                    cu::Epilogue::drelu_bgrad,   cu::Epilogue::dgelu_bgrad};
  int cases = 0, unsupported = 0;
  std::map<std::string, double> worst_by_group;
  uint32_t seed = 1;
  for (const TypeCase& t : types) {
    for (cu::Epilogue e : epilogues) {
      for (int transposes = 0; transposes < 4; ++transposes) {
        for (int64_t batch : {1, 3}) {
          cu::MatmulDesc d;
          d.batch = batch;
          d.m = 33;
          d.n = 40;
          d.k = 72;
          d.transpose_a = transposes & 1;
          d.transpose_b = transposes & 2;
          d.input = t.input;
          d.output = t.output;
          d.allow_tf32 = t.tf32;
          d.epilogue = e;
          SCOPED_TRACE(fmt::format("{} {}->{}{} batch {} A^T {} B^T {}", cu::name(e),
                                   mt::name(t.input), mt::name(t.output), t.tf32 ? " tf32" : "",
                                   batch, d.transpose_a, d.transpose_b));
          if (is_bgrad(e) && batch > 1) {
            cu::DeviceBuffer buffer(1 << 20);
            void* p = buffer.data();
            EXPECT_MT_ERROR(cu::matmul(d, {p, p, p, p, p}), "batch 1");
            continue;
          }
          CaseResult r = run_case(d, seed++);
          ++cases;
          if (!r.supported) {
            ++unsupported;
            std::printf("unsupported: %s\n", r.failure.c_str());
            // The forward epilogues must exist for every dtype, transpose and batch.
            EXPECT_TRUE(e != cu::Epilogue::none && e != cu::Epilogue::bias &&
                        e != cu::Epilogue::relu_bias && e != cu::Epilogue::gelu_bias);
            continue;
          }
          EXPECT_EQ(r.failure, "");
          std::string group = fmt::format("{} {}->{}{}", cu::name(e), mt::name(t.input),
                                          mt::name(t.output), t.tf32 ? " tf32" : "");
          worst_by_group[group] = std::max(worst_by_group[group], r.worst);
        }
      }
    }
  }
  for (const auto& [group, worst] : worst_by_group)
    std::printf("%-28s worst error %.3f of the tolerance\n", group.c_str(), worst);
  std::printf("%d cases, %d unsupported by cuBLASLt, %zu cached plans\n", cases, unsupported,
              cu::matmul_plan_cache_size());
}

TEST(GpuMatmul, AlphaBetaOddShapesAndPlanReuse) {
  SKIP_WITHOUT_CUDA();
  if (!cu::cublaslt_available()) GTEST_SKIP() << cu::cublaslt_unavailable_reason();
  cu::MatmulDesc d;
  d.m = 7;
  d.n = 5;
  d.k = 3;
  d.input = mt::f32;
  d.output = mt::f32;
  CaseResult r = run_case(d, 100, 0.5f, 1.0f);
  ASSERT_TRUE(r.supported) << r.failure;
  EXPECT_EQ(r.failure, "");
  d.input = mt::bf16;
  d.m = 130;
  d.n = 64;
  d.k = 256;
  d.batch = 2;
  EXPECT_EQ(run_case(d, 101).failure, "");
  size_t plans = cu::matmul_plan_cache_size();
  EXPECT_EQ(run_case(d, 102).failure, "");  // same problem, same alignment: no new plan
  EXPECT_EQ(cu::matmul_plan_cache_size(), plans);
}

TEST(GpuMatmul, InvalidDescriptionsAreErrors) {
  SKIP_WITHOUT_CUDA();
  if (!cu::cublaslt_available()) GTEST_SKIP() << cu::cublaslt_unavailable_reason();
  cu::DeviceBuffer buffer(4096);
  cu::MatmulDesc d;
  d.m = d.n = d.k = 4;
  d.input = mt::f32;
  d.output = mt::bf16;
  EXPECT_MT_ERROR(cu::matmul(d, {buffer.data(), buffer.data(), buffer.data()}),
                  "f32 inputs give an f32 output");
  d.input = mt::bf16;
  d.epilogue = cu::Epilogue::bias;
  EXPECT_MT_ERROR(cu::matmul(d, {buffer.data(), buffer.data(), buffer.data()}), "bias pointer");
}

}  // namespace

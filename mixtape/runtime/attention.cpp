// mixtape/runtime/attention.cpp -- CPU fused attention: forward with an online softmax, backward
// with the flash-attention recurrences, in tiles that fit the caches.
#include "mixtape/runtime/attention.h"

#include <omp.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "mixtape/dsl/attention.h"
#include "mixtape/dsl/convert.h"
#include "mixtape/dsl/half.h"
#include "mixtape/dsl/host_memory.h"
#include "mixtape/runtime/cpu_features.h"
#include "mixtape/runtime/device.h"
#include "mixtape/runtime/random_fill.h"
#include "mixtape/runtime/storage_rows.h"

namespace mixtape {
namespace {

constexpr int64_t kQueryTile = 64;

// Keys per tile: the backward pass's K, K^T, V and V^T tiles in half the L2 cache (512 KiB if
// the system does not say), a power of two from 16 to 256.
int64_t key_tile(int64_t d, int64_t dv, size_t element) {
  long l2 = sysconf(_SC_LEVEL2_CACHE_SIZE);
  if (l2 <= 0) l2 = 512 * 1024;
  const int64_t fit =
      l2 / 2 / static_cast<int64_t>(element * static_cast<size_t>(2 * (d + dv) + 1));
  int64_t tile = 16;
  while (tile * 2 <= fit && tile < 256) tile *= 2;
  return tile;
}

bool half_or_f32(DType t) { return t == f32 || t == f16 || t == bf16; }

// e^x in f32 from arithmetic and bit operations only, so that its loops vectorize (libm's expf
// is a call per element): Cody-Waite reduction by ln 2 and Cephes' degree-6 polynomial, within
// 2 ulp; 0 below -87.3 (every masked score is -inf). exp_parts computes, on a float or on 8
// lanes, p = e^r for the clamped x = n ln 2 + r, and `shifted`, whose low bits hold n.
template <typename V>
[[gnu::always_inline]] inline void exp_parts(const V& clamped, V& shifted, V& p) {
  const float magic = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  shifted = clamped * 1.44269504088896341f + magic;
  const V n = shifted - magic;
  V r = clamped - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  p = V{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
}
[[gnu::always_inline]] inline float exp_f32(float x) {
  const float clamped = std::min(std::max(x, -87.3f), 88.7f);
  float shifted, p;
  exp_parts(clamped, shifted, p);
  const int32_t exponent = (std::bit_cast<int32_t>(shifted) - 0x4B400000 + 127) << 23;
  const float result = p * std::bit_cast<float>(exponent);
  return x < -87.3f ? 0.0f : result;
}
inline double exp_f64(double x) { return std::exp(x); }
template <typename T>
[[gnu::always_inline]] inline T exp_t(T x) {
  if constexpr (sizeof(T) == 4)
    return exp_f32(x);
  else
    return exp_f64(x);
}

// A row's maximum and sum in 8 lanes, and its elements shifted and exponentiated in place:
// without -ffast-math a compiler keeps a reduction in order (scalar), so the lanes are written out.
// The maximum is NaN where a score is: the row is then NaN, as PyTorch's softmax makes it (a
// maximum that skipped NaN found no score and gave the row zero weights).
constexpr int64_t kLanes = 8;
template <typename T>
[[gnu::always_inline]] inline T nan_max(T a, T b) {
  return a < b || b != b ? b : a;
}
template <typename T>
[[gnu::always_inline]] inline T row_max(const T* __restrict x, int64_t n, T init) {
  T lane[kLanes];
  for (int64_t k = 0; k < kLanes; ++k) lane[k] = init;
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes)
    for (int64_t k = 0; k < kLanes; ++k) lane[k] = nan_max(lane[k], x[j + k]);
  for (; j < n; ++j) lane[0] = nan_max(lane[0], x[j]);
  T top = lane[0];
  for (int64_t k = 1; k < kLanes; ++k) top = nan_max(top, lane[k]);
  return top;
}
template <typename T>
[[gnu::always_inline]] inline T row_sum(const T* __restrict x, int64_t n) {
  T lane[kLanes] = {};
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes)
    for (int64_t k = 0; k < kLanes; ++k) lane[k] += x[j + k];
  for (; j < n; ++j) lane[0] += x[j];
  T total = 0;
  for (int64_t k = 0; k < kLanes; ++k) total += lane[k];
  return total;
}

// Rows [at, at + count) of a value as T, rounded to the node's compute type first where that is a
// 16-bit type the value is not stored in (an f32 value read by an f16 node, as the reference).
template <typename T>
void load(const Storage& s, int64_t at, int64_t count, T* out, DType compute) {
  if (count == 0) return;
  if constexpr (sizeof(T) == 8) {
    for (int64_t i = 0; i < count; ++i) out[i] = load_element<double>(s, at + i);
  } else {
    widen_row(s, at, out, count);
    if (s.dtype != compute && compute == f16)
      for (int64_t i = 0; i < count; ++i) out[i] = f16_bits_to_f32(f32_to_f16_bits(out[i]));
    else if (s.dtype != compute && compute == bf16)
      for (int64_t i = 0; i < count; ++i) out[i] = bf16_bits_to_f32(f32_to_bf16_bits(out[i]));
  }
}

template <typename T>
void store(const T* in, Storage& s, int64_t at, int64_t count) {
  if (count == 0) return;
  if constexpr (sizeof(T) == 8) {
    for (int64_t i = 0; i < count; ++i) store_element(s, at + i, in[i]);
  } else {
    narrow_row(in, s, at, count);
  }
}

// What one node's tasks read.
struct Operands {
  AttentionGeometry g;
  const Storage *q, *k, *v, *o = nullptr, *go = nullptr, *mask = nullptr;
  DropoutDraw drop;  // where g.has_dropout
  DType compute;
  int64_t key_tile;
};

template <typename T>
using HostVector = std::vector<T, HostAllocator<T>>;

// A thread's tiles (zeros), from the values' allocator, so that the measured peak counts them
// (tiles_per_thread makes them before the parallel region: past the memory limit an allocation
// is an mt::Error, which must not leave an OpenMP region).
template <typename T>
struct Tiles {
  HostVector<T> q, k, kt, v, vt, s, dp, pt, acc, m, l, go, o, delta, inverse_sum, dq, z;
  HostVector<float> u;   // a row's uniform draws for dropout, from its first Philox block on
  HostVector<T> dk, dv;  // backward: one (batch, head)'s key and value gradients
  Tiles(const Operands& a, bool backward) {
    const auto& g = a.g;
    const size_t rows = kQueryTile, cols = static_cast<size_t>(a.key_tile);
    auto zeros = [](auto& tile, size_t n) { tile.assign(n, {}); };
    zeros(q, rows * g.d), zeros(k, cols * g.d), zeros(kt, cols * g.d);
    zeros(v, cols * g.dv), zeros(vt, cols * g.dv), zeros(s, rows * cols), zeros(dp, rows * cols);
    zeros(pt, rows * cols);
    zeros(acc, rows * g.dv), zeros(m, rows), zeros(l, rows), zeros(go, rows * g.dv);
    zeros(o, rows * g.dv), zeros(delta, rows), zeros(inverse_sum, rows), zeros(dq, rows * g.d);
    zeros(z, cols), zeros(u, cols + 8);
    if (backward)
      zeros(dk, static_cast<size_t>(g.tk * g.d)), zeros(dv, static_cast<size_t>(g.tk * g.dv));
  }
};

// A Tiles for each thread a region `parallel` runs on.
template <typename T>
std::vector<Tiles<T>> tiles_per_thread(const Operands& a, bool parallel, bool backward) {
  std::vector<Tiles<T>> tiles;
  const int threads = parallel ? omp_get_max_threads() : 1;
  tiles.reserve(static_cast<size_t>(threads));
  for (int i = 0; i < threads; ++i) tiles.emplace_back(a, backward);
  return tiles;
}

// c [rows, cols] (+)= a [rows, depth] b [depth, cols], row-major with leading dims lda, ldb,
// ldc. f32: blocks of 4 rows and 2W columns keep their sums in 8 registers of W floats (GCC's
// vector types: W = 16 in the AVX-512 build, 8 in the AVX2 one, SSE pairs in the baseline's)
// while the depth loop broadcasts a's elements and streams b's rows; then W-column strips, then
// scalar edges. Each element's sum runs over the depth in order whatever W is, so both widths
// give the same bits. Always inlined, so no call passes a vector: GCC's note on the AVX calling
// convention is moot.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wpsabi"
template <int W>
struct Lanes {
  typedef float F __attribute__((vector_size(4 * W)));
  typedef int32_t I __attribute__((vector_size(4 * W)));
};
template <int W>
[[gnu::always_inline]] inline typename Lanes<W>::F load_lanes(const float* p) {
  typename Lanes<W>::F v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
template <int W>
[[gnu::always_inline]] inline void store_lanes(float* p, typename Lanes<W>::F v) {
  std::memcpy(p, &v, sizeof v);
}
// exp_f32 on W lanes, operation for operation: the scalar loop does not vectorize, its clamps
// becoming branches.
template <int W>
[[gnu::always_inline]] inline void exp_lanes(typename Lanes<W>::F& x) {
  using F = typename Lanes<W>::F;
  const F low = F{} - 87.3f, high = F{} + 88.7f;
  F clamped = x < low ? low : x;
  clamped = high < clamped ? high : clamped;
  F shifted, p;
  exp_parts(clamped, shifted, p);
  typename Lanes<W>::I bits;
  std::memcpy(&bits, &shifted, sizeof bits);
  const typename Lanes<W>::I exponent = (bits - 0x4B400000 + 127) << 23;
  F scale;
  std::memcpy(&scale, &exponent, sizeof scale);
  const F result = p * scale;
  x = x < low ? F{} : result;
}
// x[j] = e^(x[j] - shift) in place.
template <int W, typename T>
[[gnu::always_inline]] inline void exp_shifted(T* __restrict x, int64_t n, T shift) {
  int64_t j = 0;
  if constexpr (sizeof(T) == 4)
    for (; j + W <= n; j += W) {
      typename Lanes<W>::F lanes = load_lanes<W>(x + j) - shift;
      exp_lanes<W>(lanes);
      store_lanes<W>(x + j, lanes);
    }
  for (; j < n; ++j) x[j] = exp_t<T>(x[j] - shift);
}

template <bool Accumulate, int W, typename T>
[[gnu::always_inline]] inline void gemm(const T* __restrict a, int64_t lda, const T* __restrict b,
                                        int64_t ldb, T* __restrict c, int64_t ldc, int64_t rows,
                                        int64_t cols, int64_t depth) {
  int64_t r = 0;
  if constexpr (sizeof(T) == 4) {
    using F = typename Lanes<W>::F;
    constexpr int64_t kRows = 4;
    for (; r + kRows <= rows; r += kRows) {
      int64_t j = 0;
      for (; j + 2 * W <= cols; j += 2 * W) {
        F sum[kRows][2];
        for (int64_t i = 0; i < kRows; ++i)
          for (int64_t h = 0; h < 2; ++h)
            sum[i][h] = Accumulate ? load_lanes<W>(c + (r + i) * ldc + j + W * h) : F{};
        for (int64_t e = 0; e < depth; ++e) {
          const F b0 = load_lanes<W>(b + e * ldb + j), b1 = load_lanes<W>(b + e * ldb + j + W);
          for (int64_t i = 0; i < kRows; ++i) {
            const F x = F{} + a[(r + i) * lda + e];
            sum[i][0] += x * b0;
            sum[i][1] += x * b1;
          }
        }
        for (int64_t i = 0; i < kRows; ++i)
          for (int64_t h = 0; h < 2; ++h) store_lanes<W>(c + (r + i) * ldc + j + W * h, sum[i][h]);
      }
      for (; j + W <= cols; j += W) {
        F sum[kRows];
        for (int64_t i = 0; i < kRows; ++i)
          sum[i] = Accumulate ? load_lanes<W>(c + (r + i) * ldc + j) : F{};
        for (int64_t e = 0; e < depth; ++e) {
          const F b0 = load_lanes<W>(b + e * ldb + j);
          for (int64_t i = 0; i < kRows; ++i) sum[i] += (F{} + a[(r + i) * lda + e]) * b0;
        }
        for (int64_t i = 0; i < kRows; ++i) store_lanes<W>(c + (r + i) * ldc + j, sum[i]);
      }
      // The columns left over, row by row.
      for (int64_t i = 0; i < kRows; ++i) {
        T* __restrict cr = c + (r + i) * ldc;
        if (!Accumulate)
          for (int64_t k = j; k < cols; ++k) cr[k] = 0;
        for (int64_t e = 0; e < depth; ++e) {
          const T x = a[(r + i) * lda + e];
          for (int64_t k = j; k < cols; ++k) cr[k] += x * b[e * ldb + k];
        }
      }
    }
  }
  for (; r < rows; ++r) {
    T* __restrict cr = c + r * ldc;
    if (!Accumulate)
      for (int64_t k = 0; k < cols; ++k) cr[k] = 0;
    for (int64_t e = 0; e < depth; ++e) {
      const T x = a[r * lda + e];
      const T* __restrict br = b + e * ldb;
      for (int64_t k = 0; k < cols; ++k) cr[k] += x * br[k];
    }
  }
}

#pragma GCC diagnostic pop

// out [cols, rows] = in [rows, cols] (leading dim ld) transposed.
template <typename T>
void transpose_tile(const T* in, int64_t ld, T* out, int64_t rows, int64_t cols) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < cols; ++j) out[j * rows + r] = in[r * ld + j];
}

// Loads key rows [j0, j0 + cols) of batch b: K [cols, D] and K^T [D, ld].
template <typename T>
void load_keys(const Operands& a, Tiles<T>& t, int64_t b, int64_t j0, int64_t cols) {
  const auto& g = a.g;
  load(*a.k, (b * g.tk + j0) * g.d, cols * g.d, t.k.data(), a.compute);
  for (int64_t j = 0; j < cols; ++j)
    for (int64_t e = 0; e < g.d; ++e) t.kt[e * a.key_tile + j] = t.k[j * g.d + e];
}

// The scaled, masked scores of query rows [i0, i0 + rows) and keys [j0, j0 + cols) into t.s.
template <int W, typename T>
[[gnu::always_inline]] inline void scores(const Operands& a, Tiles<T>& t, int64_t b, int64_t i0,
                                          int64_t rows, int64_t j0, int64_t cols) {
  const auto& g = a.g;
  const int64_t ld = a.key_tile;
  gemm<false, W>(t.q.data(), g.d, t.kt.data(), ld, t.s.data(), ld, rows, cols, g.d);
  const T scale = static_cast<T>(g.scale), ninf = -std::numeric_limits<T>::infinity();
  for (int64_t r = 0; r < rows; ++r) {
    T* __restrict sr = t.s.data() + r * ld;
    for (int64_t j = 0; j < cols; ++j) sr[j] *= scale;
    if (g.has_mask) {
      const int64_t at = g.mask_offset(b, i0 + r) + j0 * g.mask_col_stride;
      const Storage& m = *a.mask;
      if (g.bool_mask) {
        const auto* bits = reinterpret_cast<const uint8_t*>(m.host_data());
        for (int64_t j = 0; j < cols; ++j)
          if (!bits[at + j * g.mask_col_stride]) sr[j] = ninf;
      } else if (m.dtype == f32) {
        const float* add = m.as<float>();
        for (int64_t j = 0; j < cols; ++j) sr[j] += add[at + j * g.mask_col_stride];
      } else {
        for (int64_t j = 0; j < cols; ++j)
          sr[j] += static_cast<T>(load_element<double>(m, at + j * g.mask_col_stride));
      }
    }
    if (g.causal)
      for (int64_t j = std::max<int64_t>(0, i0 + r + 1 - j0); j < cols; ++j) sr[j] = ninf;
  }
}

// Row i's dropout factors (1/(1-p) or 0) for keys [j0, j0 + cols) into t.z.
template <typename T>
[[gnu::always_inline]] inline void dropout_factors(const Operands& a, Tiles<T>& t, int64_t b,
                                                   int64_t i, int64_t j0, int64_t cols) {
  // The stream's vectorized fill from the block holding weight `first`: DropoutDraw::scales
  // decisions (rand's f32 element against p), a block of four at a time.
  const uint64_t first = static_cast<uint64_t>((b * a.g.tq + i) * a.g.tk + j0);
  const int64_t lane = static_cast<int64_t>(first % 4), blocks = (lane + cols + 3) / 4;
  uniform_blocks(t.u.data(), blocks, a.drop.seed, a.drop.offset + first / 4);
  const float* __restrict u = t.u.data() + lane;
  const float p = a.drop.p;
  const T kept = static_cast<T>(a.drop.keep_scale);
  T* __restrict z = t.z.data();
  for (int64_t j = 0; j < cols; ++j) z[j] = u[j] >= p ? kept : T(0);
}

// The keys query rows [i0, i0 + rows) see: all, or up to the last row's position when causal.
int64_t keys_seen(const AttentionGeometry& g, int64_t i0, int64_t rows) {
  return g.causal ? std::min(g.tk, i0 + rows) : g.tk;
}

template <int W, typename T>
[[gnu::always_inline]] inline void forward_task(const Operands& a, Tiles<T>& t, Storage& out,
                                                int64_t b, int64_t i0) {
  const auto& g = a.g;
  const int64_t rows = std::min(kQueryTile, g.tq - i0), ld = a.key_tile;
  const T ninf = -std::numeric_limits<T>::infinity();
  load(*a.q, (b * g.tq + i0) * g.d, rows * g.d, t.q.data(), a.compute);
  std::fill(t.m.begin(), t.m.end(), ninf);
  std::fill(t.l.begin(), t.l.end(), T(0));
  std::fill(t.acc.begin(), t.acc.end(), T(0));
  const int64_t end = keys_seen(g, i0, rows);
  for (int64_t j0 = 0; j0 < end; j0 += ld) {
    const int64_t cols = std::min(ld, end - j0);
    load_keys(a, t, b, j0, cols);
    load(*a.v, (b * g.tk + j0) * g.dv, cols * g.dv, t.v.data(), a.compute);
    scores<W>(a, t, b, i0, rows, j0, cols);
    for (int64_t r = 0; r < rows; ++r) {
      T* __restrict sr = t.s.data() + r * ld;
      T top = t.m[r];
      top = row_max(sr, cols, top);
      T* __restrict acc = t.acc.data() + r * g.dv;
      if (top == ninf) {  // nothing seen yet in this row: weights 0
        for (int64_t j = 0; j < cols; ++j) sr[j] = 0;
        continue;
      }
      const T correction = exp_t<T>(t.m[r] - top);
      if (correction != T(1))
        for (int64_t e = 0; e < g.dv; ++e) acc[e] *= correction;
      exp_shifted<W>(sr, cols, top);
      t.l[r] = t.l[r] * correction + row_sum(sr, cols);
      t.m[r] = top;
      if (g.has_dropout) {  // the sum is over every weight, the values meet the kept ones
        dropout_factors(a, t, b, i0 + r, j0, cols);
        for (int64_t j = 0; j < cols; ++j) sr[j] *= t.z[j];
      }
    }
    gemm<true, W>(t.s.data(), ld, t.v.data(), g.dv, t.acc.data(), g.dv, rows, g.dv,
                  cols);  // += P V
  }
  for (int64_t r = 0; r < rows; ++r) {
    T* acc = t.acc.data() + r * g.dv;
    const T inverse = t.l[r] > 0 ? T(1) / t.l[r] : T(0);
    for (int64_t e = 0; e < g.dv; ++e) acc[e] *= inverse;
  }
  store(t.acc.data(), out, (b * g.tq + i0) * g.dv, rows * g.dv);
}

// One (batch, head): dQ tile by tile, dK and dV accumulated over the query tiles.
template <int W, typename T>
[[gnu::always_inline]] inline void backward_batch(const Operands& a, Tiles<T>& t, Storage& out,
                                                  int64_t b) {
  const auto& g = a.g;
  const int64_t ld = a.key_tile, per_batch = g.tq * g.d + g.tk * (g.d + g.dv);
  const T ninf = -std::numeric_limits<T>::infinity(), scale = static_cast<T>(g.scale);
  HostVector<T>& dk = t.dk;
  HostVector<T>& dv = t.dv;
  std::fill(dk.begin(), dk.end(), T(0));
  std::fill(dv.begin(), dv.end(), T(0));
  for (int64_t i0 = 0; i0 < g.tq; i0 += kQueryTile) {
    const int64_t rows = std::min(kQueryTile, g.tq - i0), end = keys_seen(g, i0, rows);
    load(*a.q, (b * g.tq + i0) * g.d, rows * g.d, t.q.data(), a.compute);
    load(*a.go, (b * g.tq + i0) * g.dv, rows * g.dv, t.go.data(), a.compute);
    load(*a.o, (b * g.tq + i0) * g.dv, rows * g.dv, t.o.data(), a.compute);
    for (int64_t r = 0; r < rows; ++r) {
      T sum = 0;
      for (int64_t e = 0; e < g.dv; ++e) sum += t.go[r * g.dv + e] * t.o[r * g.dv + e];
      t.delta[r] = sum;
    }
    // Each row's maximum and sum of exponentials, online over the key tiles. The weights are
    // exp(s - max) / sum, as the forward pass makes them: one log-sum-exp, max + log(sum), loses
    // log(sum) to rounding when max is huge (a row whose keys an additive mask of -1e9 hides),
    // which made each weight 1 instead of 1 / keys.
    std::fill(t.m.begin(), t.m.end(), ninf);
    std::fill(t.l.begin(), t.l.end(), T(0));
    for (int64_t j0 = 0; j0 < end; j0 += ld) {
      const int64_t cols = std::min(ld, end - j0);
      load_keys(a, t, b, j0, cols);
      scores<W>(a, t, b, i0, rows, j0, cols);
      for (int64_t r = 0; r < rows; ++r) {
        T* sr = t.s.data() + r * ld;
        T top = t.m[r];
        top = row_max(sr, cols, top);
        if (top == ninf) continue;
        exp_shifted<W>(sr, cols, top);
        t.l[r] = t.l[r] * exp_t<T>(t.m[r] - top) + row_sum(sr, cols);
        t.m[r] = top;
      }
    }
    for (int64_t r = 0; r < rows; ++r) t.inverse_sum[r] = T(1) / t.l[r];
    std::fill(t.dq.begin(), t.dq.end(), T(0));
    for (int64_t j0 = 0; j0 < end; j0 += ld) {
      const int64_t cols = std::min(ld, end - j0);
      load_keys(a, t, b, j0, cols);
      load(*a.v, (b * g.tk + j0) * g.dv, cols * g.dv, t.v.data(), a.compute);
      for (int64_t j = 0; j < cols; ++j)
        for (int64_t e = 0; e < g.dv; ++e) t.vt[e * ld + j] = t.v[j * g.dv + e];
      scores<W>(a, t, b, i0, rows, j0, cols);
      gemm<false, W>(t.go.data(), g.dv, t.vt.data(), ld, t.dp.data(), ld, rows, cols,
                     g.dv);  // dO V^T
      for (int64_t r = 0; r < rows; ++r) {
        T* __restrict p = t.s.data() + r * ld;
        T* __restrict ds = t.dp.data() + r * ld;
        const T top = t.m[r], inverse_sum = t.inverse_sum[r], delta = t.delta[r];
        if (top == ninf) {
          for (int64_t j = 0; j < cols; ++j) p[j] = ds[j] = 0;
          continue;
        }
        exp_shifted<W>(p, cols, top);
        if (!g.has_dropout) {
          for (int64_t j = 0; j < cols; ++j) {
            p[j] *= inverse_sum;
            ds[j] = p[j] * (ds[j] - delta) * scale;
          }
          continue;
        }
        // dS = P (Z dP - delta); dV then takes the kept weights P Z.
        dropout_factors(a, t, b, i0 + r, j0, cols);
        const T* __restrict z = t.z.data();
        for (int64_t j = 0; j < cols; ++j) {
          p[j] *= inverse_sum;
          ds[j] = p[j] * (z[j] * ds[j] - delta) * scale;
          p[j] *= z[j];
        }
      }
      // dV += P^T dO, dQ += dS K, dK += dS^T Q.
      transpose_tile(t.s.data(), ld, t.pt.data(), rows, cols);
      gemm<true, W>(t.pt.data(), rows, t.go.data(), g.dv, dv.data() + j0 * g.dv, g.dv, cols, g.dv,
                    rows);
      gemm<true, W>(t.dp.data(), ld, t.k.data(), g.d, t.dq.data(), g.d, rows, g.d, cols);
      transpose_tile(t.dp.data(), ld, t.pt.data(), rows, cols);
      gemm<true, W>(t.pt.data(), rows, t.q.data(), g.d, dk.data() + j0 * g.d, g.d, cols, g.d, rows);
    }
    store(t.dq.data(), out, b * per_batch + i0 * g.d, rows * g.d);
  }
  store(dk.data(), out, b * per_batch + g.tq * g.d, g.tk * g.d);
  store(dv.data(), out, b * per_batch + g.tq * g.d + g.tk * g.d, g.tk * g.dv);
}

// The per-task loops, compiled for the build's baseline and (f32) for AVX2 with FMA and for
// AVX-512, chosen by the CPU; the OpenMP regions call them per task (an outlined region would not
// inherit a target). The AVX2 and AVX-512 loops contract a * b + c into FMAs (the build's
// -ffp-contract=off is for code whose bits must match the JIT's; nothing else computes these
// tiles): the tile products run at twice the rate, and the bits differ from the baseline loops'
// but not between runs, checkpointed recomputations, compiled replays or artifacts on one CPU
// (nor between the two widths: each sum keeps its order).
template <typename T>
struct Loops {
  void (*forward)(const Operands&, Tiles<T>&, Storage&, int64_t b, int64_t i0);
  void (*backward)(const Operands&, Tiles<T>&, Storage&, int64_t b);
};
template <typename T>
void forward_plain(const Operands& a, Tiles<T>& t, Storage& out, int64_t b, int64_t i0) {
  forward_task<8>(a, t, out, b, i0);
}
template <typename T>
void backward_plain(const Operands& a, Tiles<T>& t, Storage& out, int64_t b) {
  backward_batch<8>(a, t, out, b);
}
#if defined(__x86_64__)
// forward_<name> and backward_<name>: the loops W lanes wide, compiled for the `isa` target.
#define MT_ATTENTION_LOOPS(name, isa, W)                                         \
  [[gnu::target(isa), gnu::optimize("fp-contract=fast")]] void forward_##name(   \
      const Operands& a, Tiles<float>& t, Storage& out, int64_t b, int64_t i0) { \
    forward_task<W>(a, t, out, b, i0);                                           \
  }                                                                              \
  [[gnu::target(isa), gnu::optimize("fp-contract=fast")]] void backward_##name(  \
      const Operands& a, Tiles<float>& t, Storage& out, int64_t b) {             \
    backward_batch<W>(a, t, out, b);                                             \
  }
MT_ATTENTION_LOOPS(avx2, "avx2,fma", 8)
MT_ATTENTION_LOOPS(avx512, "avx512f,avx2,fma", 16)
#undef MT_ATTENTION_LOOPS
#endif

std::atomic<bool>& avx512_setting() {
  static std::atomic<bool> enabled{true};
  return enabled;
}

template <typename T>
Loops<T> loops() {
#if defined(__x86_64__)
  if constexpr (sizeof(T) == 4) {
    static const bool avx512 = missing_cpu_features({"avx512f", "avx2", "fma"}).empty();
    static const bool avx2 = missing_cpu_features({"avx2", "fma"}).empty();
    if (avx512 && attention_avx512()) return {forward_avx512, backward_avx512};
    if (avx2) return {forward_avx2, backward_avx2};
  }
#endif
  return {forward_plain<T>, backward_plain<T>};
}

template <typename T>
void run_forward(const Operands& a, Storage& out) {
  const auto& g = a.g;
  const Loops<T> run = loops<T>();
  const int64_t tiles = (g.tq + kQueryTile - 1) / kQueryTile, tasks = g.batch * tiles;
  const bool parallel = tasks > 1 && g.tq * g.tk * g.d >= (1 << 16);
  std::vector<Tiles<T>> per_thread = tiles_per_thread<T>(a, parallel, false);
#pragma omp parallel if (parallel)
  {
    FlushDenormalScope float_mode;  // the team's threads may be the caller's too
    Tiles<T>& t = per_thread[static_cast<size_t>(omp_get_thread_num())];
#pragma omp for schedule(dynamic)
    for (int64_t task = 0; task < tasks; ++task)
      run.forward(a, t, out, task / tiles, (task % tiles) * kQueryTile);
  }
}

template <typename T>
void run_backward(const Operands& a, Storage& out) {
  const auto& g = a.g;
  const Loops<T> run = loops<T>();
  const bool parallel = g.batch > 1 && g.tq * g.tk * g.d >= (1 << 16);
  std::vector<Tiles<T>> per_thread = tiles_per_thread<T>(a, parallel, true);
#pragma omp parallel if (parallel)
  {
    FlushDenormalScope float_mode;  // the team's threads may be the caller's too
    Tiles<T>& t = per_thread[static_cast<size_t>(omp_get_thread_num())];
#pragma omp for schedule(dynamic)
    for (int64_t b = 0; b < g.batch; ++b) run.backward(a, t, out, b);
  }
}

}  // namespace

bool attention_avx512() { return avx512_setting().load(std::memory_order_relaxed); }
void set_attention_avx512(bool enabled) { avx512_setting().store(enabled); }

bool attention_cpu_supported(const Node& node) {
  const DType compute = node.precision.compute;
  const bool wide = compute == f64;
  if (!wide && !half_or_f32(compute)) return false;
  if (wide ? node.precision.storage_type != f64 : !half_or_f32(node.precision.storage_type))
    return false;
  const size_t operands = node.op == OpCode::Attention ? 3 : 5;
  for (size_t i = 0; i < operands; ++i) {
    const DType t = node.inputs[i]->value->dtype;
    if (wide ? t != f64 : !half_or_f32(t)) return false;
  }
  return true;
}

void attention_cpu(const Node& node, Storage& out) {
  // A device value's host copy is fetched on first read: fetch every input here, once, rather
  // than from the OpenMP team at once (a host step of the CUDA back end).
  for (const NodePtr& input : node.inputs) input->value->host_data();
  Operands a;
  a.g = AttentionGeometry::of(node);
  a.q = node.inputs[0]->value.get();
  a.k = node.inputs[1]->value.get();
  a.v = node.inputs[2]->value.get();
  const bool forward = node.op == OpCode::Attention;
  if (!forward) a.o = node.inputs[3]->value.get(), a.go = node.inputs[4]->value.get();
  if (a.g.has_mask) a.mask = node.inputs[forward ? 3 : 5]->value.get();
  if (a.g.has_dropout) a.drop = DropoutDraw::of(node);
  a.compute = node.precision.compute;
  const bool wide = a.compute == f64;
  a.key_tile = key_tile(a.g.d, a.g.dv, wide ? sizeof(double) : sizeof(float));
  if (wide)
    forward ? run_forward<double>(a, out) : run_backward<double>(a, out);
  else
    forward ? run_forward<float>(a, out) : run_backward<float>(a, out);
}

}  // namespace mixtape

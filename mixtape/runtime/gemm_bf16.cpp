// mixtape/runtime/gemm_bf16.cpp -- a 6x64 VDPBF16PS register tile over B packed in pairs of k, for
// the small bf16 products where it was measured ahead of oneDNN 2.6 (gemm.cpp's rule).
#include "mixtape/runtime/gemm_bf16.h"

#include <algorithm>
#include <chrono>
#include <cstring>

#include <immintrin.h>
#include <omp.h>

#include "mixtape/runtime/scratch_buffer.h"

// Every function that uses AVX-512 carries a target attribute instead of the file being compiled
// with -mavx512*: inline functions of the standard headers compiled here could otherwise be the
// copy the linker keeps for the whole program and crash a CPU without AVX-512. Such functions are
// only reached after gemm_bf16_own_available() said yes.
#define MIXTAPE_AVX512_BF16 __attribute__((target("avx512f,avx512bw,avx512bf16")))

namespace mixtape {
namespace {

// The register tile: kRows rows of A times 64 columns of B (4 vectors of 16 f32), 24 of the 32
// vector registers as accumulators, 4 for B and 1 for a broadcast A pair: 24 independent chains
// hide VDPBF16PS's latency (with 6, a 16-column tile, it ran at 0.35 of the peak).
constexpr int kRows = 6;
constexpr int kVectors = 4;
constexpr int64_t kPanel = 16 * kVectors;  // columns of a packed B panel
// Pairs of k per block: 64 pairs of a panel are 16 KiB, half of Zen 4's 32 KiB L1. Unblocked, a
// k = 256 panel (32 KiB) filled L1 and 256x64x256 ran at 0.62 of the peak against 0.90 at k = 128.
constexpr int64_t kBlockPairs = 64;

struct Scratch {
  ScratchBuffer a, b, stage;
};

Scratch& scratch() {
  thread_local Scratch buffers;
  return buffers;
}

uint32_t load_pair(const uint16_t* at) {
  uint32_t word;
  std::memcpy(&word, at, sizeof word);
  return word;
}

// Where a tile's sums go, and where they resume from. A k block before the last stores its f32
// sums (to `out`, or for a bf16 result to a staging buffer) and the next one resumes from them;
// the last adds the bias, applies the relu and rounds to bf16 in registers, so the result is
// written once (a separate epilogue pass over an f32 result was about a tenth of a step).
struct TileOutput {
  const float* resume = nullptr;  // the earlier blocks' sums, or null for the first block
  int64_t resume_ld = 0;
  void* out = nullptr;  // f32, or bf16 when `bf16`
  int64_t ldo = 0;
  const float* bias = nullptr;  // f32, added by the last block only
  bool bf16 = false, relu = false;
  bool round_product = false;  // the sums rounded to bf16 before the bias is added
  int last_lanes = 16;         // lanes the last vector of columns stores
};

// The reference's relu (x for x > 0 and NaN, +0 otherwise, -0 included), then dsl/half.h's
// f32_to_bf16_bits on 16 lanes: round to nearest even by an integer add, a NaN quieted with its
// sign and top payload bits. VCVTNEPS2BF16 would flush subnormals, which that rounding keeps.
MIXTAPE_AVX512_BF16 __m512 reference_relu(__m512 x) {
  return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_NLE_UQ), x);
}
MIXTAPE_AVX512_BF16 __m512i bf16_bits(__m512 x) {
  const __m512i f = _mm512_castps_si512(x);
  // The zero-masked shifts with every lane selected: GCC 12's plain forms pass an undefined vector
  // and -Werror=maybe-uninitialized rejects them.
  const __mmask16 all = 0xFFFF;
  const __m512i high = _mm512_maskz_srli_epi32(all, f, 16);
  const __m512i carry =
      _mm512_add_epi32(_mm512_and_si512(high, _mm512_set1_epi32(1)), _mm512_set1_epi32(0x7FFF));
  const __m512i rounded = _mm512_maskz_srli_epi32(all, _mm512_add_epi32(f, carry), 16);
  const __mmask16 nan = _mm512_cmpgt_epi32_mask(_mm512_and_si512(f, _mm512_set1_epi32(0x7FFFFFFF)),
                                                _mm512_set1_epi32(0x7F800000));
  return _mm512_mask_mov_epi32(rounded, nan, _mm512_or_si512(high, _mm512_set1_epi32(0x0040)));
}

// x rounded to bf16 as bf16_bits rounds, as an f32 again.
MIXTAPE_AVX512_BF16 __m512 bf16_value(__m512 x) {
  return _mm512_castsi512_ps(_mm512_maskz_slli_epi32(0xFFFF, bf16_bits(x), 16));
}

// One rows x (16 * vectors) block of the result: row r's pair p of A is the (unaligned) 32-bit
// word at a + 2 * (r * row_words + p * pair_words); `panel` points at the packed B panel
// ([pairs][64] words, each a pair of bf16 from rows 2p and 2p+1 of one column).
template <int rows, int vectors>
MIXTAPE_AVX512_BF16 void tile(const uint16_t* a, int64_t row_words, int64_t pair_words,
                              const uint32_t* panel, int64_t pairs, const TileOutput& o) {
  // Every loop over rows and vectors is unrolled, so that the accumulators stay in registers
  // (without the pragmas GCC kept them on the stack around the stores, about a tenth of a
  // 256x64x64 product's time).
  // The output's fields as locals: read through `o`, each would be read again after every store
  // (a store might change them), about a tenth of a 4096x64x64 product's time.
  const __mmask16 last = static_cast<__mmask16>((1u << o.last_lanes) - 1u);
  const float* const resume = o.resume;
  const float* const bias = o.bias;
  const int64_t resume_ld = o.resume_ld, ldo = o.ldo;
  const bool relu = o.relu, bf16 = o.bf16, round_product = o.round_product;
  float* const out32 = static_cast<float*>(o.out);
  uint16_t* const out16 = static_cast<uint16_t*>(o.out);
  __m512 acc[rows][vectors];
#pragma GCC unroll 8
  for (int r = 0; r < rows; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < vectors; ++v)
      acc[r][v] = resume != nullptr ? _mm512_maskz_loadu_ps(v == vectors - 1 ? last : 0xFFFF,
                                                            resume + r * resume_ld + 16 * v)
                                    : _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
    __m512bh bv[vectors];
#pragma GCC unroll 4
    for (int v = 0; v < vectors; ++v)
      bv[v] = (__m512bh)_mm512_loadu_si512(panel + p * kPanel + 16 * v);
#pragma GCC unroll 8
    for (int r = 0; r < rows; ++r) {
      const __m512bh av = (__m512bh)_mm512_set1_epi32(
          static_cast<int>(load_pair(a + 2 * (r * row_words + p * pair_words))));
#pragma GCC unroll 4
      for (int v = 0; v < vectors; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], av, bv[v]);
    }
  }
#pragma GCC unroll 4
  for (int v = 0; v < vectors; ++v) {
    const __mmask16 mask = v == vectors - 1 ? last : static_cast<__mmask16>(0xFFFF);
    const __m512 add =
        bias != nullptr ? _mm512_maskz_loadu_ps(mask, bias + 16 * v) : _mm512_setzero_ps();
#pragma GCC unroll 8
    for (int r = 0; r < rows; ++r) {
      __m512 x = round_product ? bf16_value(acc[r][v]) : acc[r][v];
      if (bias != nullptr) x = _mm512_add_ps(x, add);
      if (relu) x = reference_relu(x);
      if (bf16)
        _mm512_mask_cvtepi32_storeu_epi16(out16 + r * ldo + 16 * v, mask, bf16_bits(x));
      else
        _mm512_mask_storeu_ps(out32 + r * ldo + 16 * v, mask, x);
    }
  }
}

using TileFunction = void (*)(const uint16_t*, int64_t, int64_t, const uint32_t*, int64_t,
                              const TileOutput&);

template <int rows>
constexpr TileFunction tile_for_vectors(int vectors) {
  switch (vectors) {
    case 1:
      return tile<rows, 1>;
    case 2:
      return tile<rows, 2>;
    case 3:
      return tile<rows, 3>;
    default:
      return tile<rows, 4>;
  }
}

TileFunction tile_for(int rows, int vectors) {
  switch (rows) {
    case 1:
      return tile_for_vectors<1>(vectors);
    case 2:
      return tile_for_vectors<2>(vectors);
    case 3:
      return tile_for_vectors<3>(vectors);
    case 4:
      return tile_for_vectors<4>(vectors);
    case 5:
      return tile_for_vectors<5>(vectors);
    default:
      return tile_for_vectors<6>(vectors);
  }
}

// B [k, n] (rows `ld` apart) into panels of 64 columns, [panel][pair][64] words, zero past k and
// n. Rows 2p and 2p+1 are interleaved 32 columns at a time by VPERMT2W.
MIXTAPE_AVX512_BF16 void pack_b_rows(const uint16_t* b, int64_t k, int64_t n, int64_t ld,
                                     uint32_t* packed) {
  const int64_t pairs = (k + 1) / 2;
  alignas(64) static constexpr uint16_t kLow[32] = {0,  32, 1,  33, 2,  34, 3,  35, 4,  36, 5,
                                                    37, 6,  38, 7,  39, 8,  40, 9,  41, 10, 42,
                                                    11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  const __m512i low = _mm512_load_si512(kLow);
  const __m512i high = _mm512_add_epi16(low, _mm512_set1_epi16(16));
  for (int64_t j0 = 0; j0 < n; j0 += kPanel) {
    uint32_t* panel = packed + (j0 / kPanel) * pairs * kPanel;
    for (int64_t half = 0; half < kPanel; half += 32) {
      const int64_t columns = std::clamp<int64_t>(n - j0 - half, 0, 32);
      const __mmask32 mask = columns == 32 ? ~__mmask32{0} : (__mmask32{1} << columns) - 1;
      for (int64_t p = 0; p < pairs; ++p) {
        const uint16_t* row = b + 2 * p * ld + j0 + half;
        const __m512i even = _mm512_maskz_loadu_epi16(mask, row);
        const __m512i odd =
            2 * p + 1 < k ? _mm512_maskz_loadu_epi16(mask, row + ld) : _mm512_setzero_si512();
        _mm512_storeu_si512(panel + p * kPanel + half, _mm512_permutex2var_epi16(even, low, odd));
        _mm512_storeu_si512(panel + p * kPanel + half + 16,
                            _mm512_permutex2var_epi16(even, high, odd));
      }
    }
  }
}

// Transposes a 16x16 matrix of 32-bit words held as 16 rows. The zero-masked forms with every
// lane selected: GCC 12's plain forms pass an undefined vector and -Werror=maybe-uninitialized
// rejects them.
constexpr __mmask16 kAll16 = 0xFFFF;
constexpr __mmask8 kAll8 = 0xFF;
MIXTAPE_AVX512_BF16 void transpose_16x16(__m512i r[16]) {
  __m512i t[16], u[16];
  for (int i = 0; i < 8; ++i) {  // pairs of rows interleaved by words
    t[2 * i] = _mm512_maskz_unpacklo_epi32(kAll16, r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_maskz_unpackhi_epi32(kAll16, r[2 * i], r[2 * i + 1]);
  }
  // u[4i + x], 128-bit lane l: rows 4i..4i+3 of column 4l + x.
  for (int i = 0; i < 4; ++i) {
    u[4 * i] = _mm512_maskz_unpacklo_epi64(kAll8, t[4 * i], t[4 * i + 2]);
    u[4 * i + 1] = _mm512_maskz_unpackhi_epi64(kAll8, t[4 * i], t[4 * i + 2]);
    u[4 * i + 2] = _mm512_maskz_unpacklo_epi64(kAll8, t[4 * i + 1], t[4 * i + 3]);
    u[4 * i + 3] = _mm512_maskz_unpackhi_epi64(kAll8, t[4 * i + 1], t[4 * i + 3]);
  }
  for (int x = 0; x < 4; ++x) {  // column 4l + x gathers lane l of u[x], u[4+x], u[8+x], u[12+x]
    const __m512i v0 = _mm512_maskz_shuffle_i32x4(kAll16, u[x], u[4 + x], 0x88);
    const __m512i v1 = _mm512_maskz_shuffle_i32x4(kAll16, u[x], u[4 + x], 0xDD);
    const __m512i w0 = _mm512_maskz_shuffle_i32x4(kAll16, u[8 + x], u[12 + x], 0x88);
    const __m512i w1 = _mm512_maskz_shuffle_i32x4(kAll16, u[8 + x], u[12 + x], 0xDD);
    r[x] = _mm512_maskz_shuffle_i32x4(kAll16, v0, w0, 0x88);
    r[8 + x] = _mm512_maskz_shuffle_i32x4(kAll16, v0, w0, 0xDD);
    r[4 + x] = _mm512_maskz_shuffle_i32x4(kAll16, v1, w1, 0x88);
    r[12 + x] = _mm512_maskz_shuffle_i32x4(kAll16, v1, w1, 0xDD);
  }
}

// B stored transposed, [n, k]: a column's pair is one 32-bit word of its row, so 16 columns by
// 16 pairs are a 16x16 word transpose (gathers ran at 0.69 of the peak where oneDNN ran at 0.80,
// 64x64x128). Masked loads stop at k: an odd k's last pair gets its zero pad, and no load reads
// past a row (the next row's element, or the end of b).
MIXTAPE_AVX512_BF16 void pack_b_columns(const uint16_t* b, int64_t k, int64_t n, uint32_t* packed) {
  const int64_t pairs = (k + 1) / 2;
  for (int64_t j0 = 0; j0 < n; j0 += kPanel) {
    uint32_t* panel = packed + (j0 / kPanel) * pairs * kPanel;
    for (int64_t c = 0; c < kPanel; c += 16) {
      const int64_t lanes = std::clamp<int64_t>(n - j0 - c, 0, 16);
      for (int64_t p0 = 0; p0 < pairs; p0 += 16) {
        const int64_t elements = std::min<int64_t>(32, k - 2 * p0);
        const __mmask32 mask = elements == 32 ? ~__mmask32{0} : (__mmask32{1} << elements) - 1;
        __m512i r[16];
        for (int64_t j = 0; j < 16; ++j)
          r[j] = j < lanes ? _mm512_maskz_loadu_epi16(mask, b + (j0 + c + j) * k + 2 * p0)
                           : _mm512_setzero_si512();
        transpose_16x16(r);
        const int64_t here = std::min<int64_t>(16, pairs - p0);
        for (int64_t q = 0; q < here; ++q) _mm512_storeu_si512(panel + (p0 + q) * kPanel + c, r[q]);
      }
    }
  }
}

// A [m, k] with an odd k as rows of k + 1 bf16, the pad a zero: a row's pair p is word p.
void pack_a_rows(const uint16_t* a, int64_t m, int64_t k, uint16_t* packed) {
  for (int64_t i = 0; i < m; ++i) {
    std::copy(a + i * k, a + (i + 1) * k, packed + i * (k + 1));
    packed[i * (k + 1) + k] = 0;
  }
}

}  // namespace

bool gemm_bf16_own_available() {
#if defined(__x86_64__)
  static const bool available = __builtin_cpu_supports("avx512f") &&
                                __builtin_cpu_supports("avx512bw") &&
                                __builtin_cpu_supports("avx512bf16");
  return available;
#else
  return false;
#endif
}

namespace {

constexpr int kChains = 12;  // independent accumulators: enough to fill every port on both kinds

// `iterations` rounds of kChains independent accumulations: FMAs of f32 vectors, or (kDot)
// VDPBF16PS dot products of bf16 pairs. noipa: else GCC finds the bursts free of side effects
// and moves them out of the timed span.
template <bool kDot>
__attribute__((noipa)) MIXTAPE_AVX512_BF16 float vector_burst(int64_t iterations) {
  __m512 acc[kChains];
  for (int i = 0; i < kChains; ++i) acc[i] = _mm512_set1_ps(static_cast<float>(i));
  const __m512 x = _mm512_set1_ps(0.999f), y = _mm512_set1_ps(1e-3f);
  const __m512bh x_pairs = (__m512bh)_mm512_set1_epi16(0x3A83);  // 1e-3: sums stay small
  const __m512bh y_pairs = (__m512bh)_mm512_set1_epi16(0x3F80);  // 1
  for (int64_t it = 0; it < iterations; ++it) {
#pragma GCC unroll 16  // the accumulators must stay in registers
    for (int i = 0; i < kChains; ++i) {
      if constexpr (kDot)
        acc[i] = _mm512_dpbf16_ps(acc[i], x_pairs, y_pairs);
      else
        acc[i] = _mm512_fmadd_ps(acc[i], x, y);
    }
  }
  __m512 sum = acc[0];
  for (int i = 1; i < kChains; ++i) sum = _mm512_add_ps(sum, acc[i]);
  alignas(64) float lanes[16];
  _mm512_store_ps(lanes, sum);
  return lanes[0];  // keeps the work alive
}

double seconds_of(float (*burst)(int64_t), int64_t iterations, volatile float& sink) {
  const auto start = std::chrono::steady_clock::now();
  sink = sink + burst(iterations);
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace

double bf16_dot_speed_over_f32() {
  static const double ratio = [] {
    if (!gemm_bf16_own_available()) return 0.0;
    // About 0.1 ms a burst at 3 GHz; best of 15 of each kind, interleaved, so that another
    // process's time slice or a clock change slows only some bursts of both kinds. An FMA does
    // 32 flops per vector, a VDPBF16PS 64.
    constexpr int64_t kIterations = 1 << 12;
    volatile float sink = 0;
    double fma = 1e30, dot = 1e30;
    seconds_of(vector_burst<false>, kIterations, sink);  // warm up the vector units
    for (int burst = 0; burst < 15; ++burst) {
      fma = std::min(fma, seconds_of(vector_burst<false>, kIterations, sink));
      dot = std::min(dot, seconds_of(vector_burst<true>, kIterations, sink));
    }
    return (64.0 / dot) / (32.0 / fma);
  }();
  return ratio;
}

namespace {

// Rows of A a work item takes: one packed panel of a transposed A, else 192 rows, a multiple of
// the tile's 6 rows (items of 64 rows left a 4-row tile in each, 10% slower at 4096x64x64). Items
// are shared out among the OpenMP team; every element's sum is the same whichever thread
// computes it.
constexpr int64_t kItemRows = 32 * kRows;

struct Problem {
  int64_t m, n, k, pairs, panels;
  bool transpose_a, transpose_b;
  const uint16_t* a;
  const uint16_t* b;
  const float* bias;
  void* out;
  bool bf16, relu, round_product;
};

// Rows [i_begin, i_end) of batch `bi`'s result, their A packed here where it must be. `packed_b`
// holds this batch's B.
MIXTAPE_AVX512_BF16 void run_rows(const Problem& q, int64_t bi, int64_t i_begin, int64_t i_end,
                                  const uint32_t* packed_b) {
  Scratch& buffers = scratch();
  const int64_t rows = i_end - i_begin, pairs = q.pairs;
  const uint16_t* a_batch = q.a + bi * q.m * q.k;
  // A's pairs: read in place (untransposed, even k: rows already are whole pairs), rows padded
  // (odd k), or, transposed, packed like B: one panel of these 64 rows, [pair][64] words.
  const uint16_t* a_rows = a_batch + i_begin * q.k;
  if (q.transpose_a) {
    auto* packed = buffers.a.get<uint32_t>(pairs * kPanel);
    pack_b_rows(a_batch + i_begin, q.k, rows, q.m, packed);
    a_rows = reinterpret_cast<const uint16_t*>(packed);
  } else if (q.k % 2 != 0) {
    uint16_t* packed = buffers.a.get<uint16_t>(rows * pairs * 2);
    pack_a_rows(a_rows, rows, q.k, packed);
    a_rows = packed;
  }
  const int64_t row_words = q.transpose_a ? 1 : pairs, pair_words = q.transpose_a ? kPanel : 1;
  const size_t out_size = q.bf16 ? sizeof(uint16_t) : sizeof(float);
  // A bf16 result over more than one k block stages its f32 sums here, [rows][64].
  float* stage = q.bf16 && pairs > kBlockPairs ? buffers.stage.get<float>(rows * kPanel) : nullptr;
  for (int64_t j0 = 0; j0 < q.n; j0 += kPanel) {
    const int64_t columns = std::min(kPanel, q.n - j0);
    const int vectors = static_cast<int>((columns + 15) / 16);
    const uint32_t* panel = packed_b + (j0 / kPanel) * pairs * kPanel;
    auto* out = static_cast<char*>(q.out) + out_size * ((bi * q.m + i_begin) * q.n + j0);
    // k in blocks whose slice of the panel fits in L1 beside A's rows; a later block resumes
    // from the f32 sums stored by the one before, so the sums and their order are unchanged.
    for (int64_t p0 = 0; p0 < pairs; p0 += kBlockPairs) {
      const int64_t block = std::min(kBlockPairs, pairs - p0);
      const bool first = p0 == 0, last = p0 + block == pairs;
      for (int64_t i = 0; i < rows;) {
        const int rows_here = static_cast<int>(std::min<int64_t>(kRows, rows - i));
        TileOutput o;
        o.last_lanes = static_cast<int>(columns - 16 * (vectors - 1));
        if (!first && stage != nullptr) {
          o.resume = stage + i * kPanel, o.resume_ld = kPanel;
        } else if (!first) {  // an f32 result: the sums so far are in place
          o.resume = reinterpret_cast<const float*>(out) + i * q.n, o.resume_ld = q.n;
        }
        if (last) {
          o.out = out + out_size * i * q.n, o.ldo = q.n;
          o.bias = q.bias != nullptr ? q.bias + j0 : nullptr;
          o.bf16 = q.bf16, o.relu = q.relu, o.round_product = q.round_product;
        } else if (stage != nullptr) {
          o.out = stage + i * kPanel, o.ldo = kPanel;
        } else {
          o.out = out + out_size * i * q.n, o.ldo = q.n;
        }
        tile_for(rows_here, vectors)(a_rows + 2 * (i * row_words + p0 * pair_words), row_words,
                                     pair_words, panel + p0 * kPanel, block, o);
        i += rows_here;
      }
    }
  }
}

MIXTAPE_AVX512_BF16 void pack_b(const Problem& q, int64_t bi, uint32_t* packed) {
  const uint16_t* b_batch = q.b + bi * q.k * q.n;
  if (q.transpose_b)
    pack_b_columns(b_batch, q.k, q.n, packed);
  else
    pack_b_rows(b_batch, q.k, q.n, q.n, packed);
}

}  // namespace

void gemm_bf16_own(int64_t batch, int64_t m, int64_t n, int64_t k, bool transpose_a,
                   bool transpose_b, const uint16_t* a, const uint16_t* b, const float* bias,
                   void* out, bool bf16_out, bool relu, bool team, bool round_product) {
  const int64_t pairs = (k + 1) / 2, panels = (n + kPanel - 1) / kPanel;
  const Problem q{m, n, k,    pairs, panels,   transpose_a, transpose_b,
                  a, b, bias, out,   bf16_out, relu,        round_product && bias != nullptr};
  int64_t item_rows = transpose_a ? kPanel : kItemRows;
  if (team && !transpose_a) {
    // As many items of at most kItemRows as the team has threads, or a multiple of that, of
    // equal rows (to the tile's): 256 rows as items of 192 and 64 left one of two threads idle
    // two thirds of the time (256x256x64: 0.47 of the bf16 peak, oneDNN 0.66-0.73).
    const int64_t threads = std::max(1, omp_get_max_threads());
    const int64_t items =
        (batch * ((m + kItemRows - 1) / kItemRows) + threads - 1) / threads * threads;
    const int64_t per_batch = (items + batch - 1) / batch;
    item_rows = ((m + per_batch - 1) / per_batch + kRows - 1) / kRows * kRows;
  }
  const int64_t items_per_batch = (m + item_rows - 1) / item_rows;
  const int64_t items = batch * items_per_batch;
  // Each thread packs B for the batches of its items (consecutive: a static schedule).
  auto run_items = [&](int64_t begin, int64_t end) {
    uint32_t* packed_b = scratch().b.get<uint32_t>(panels * pairs * kPanel);
    int64_t packed_batch = -1;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t bi = item / items_per_batch, i0 = (item % items_per_batch) * item_rows;
      if (bi != packed_batch) pack_b(q, bi, packed_b), packed_batch = bi;
      run_rows(q, bi, i0, std::min(m, i0 + item_rows), packed_b);
    }
  };
  if (!team || items < 2) {
    run_items(0, items);
    return;
  }
#pragma omp parallel
  {
    const int64_t t = omp_get_thread_num(), threads = omp_get_num_threads();
    run_items(items * t / threads, items * (t + 1) / threads);
  }
}

}  // namespace mixtape

// mixtape/runtime/conv_columns.cpp -- the batch-last transpose and the im2col of a weight gradient
// run as a GEMM.
#include "mixtape/runtime/conv_columns.h"

#include <algorithm>
#include <vector>

#include <omp.h>

#if defined(__SSE2__)
#include <immintrin.h>
#endif

namespace mixtape {
namespace {

// Runs body(begin, end) over [0, count) in one contiguous share per member of the OpenMP team
// when `team`, else whole on the calling thread.
template <typename Body>
void share_out(int64_t count, bool team, Body body) {
  if (!team) return body(int64_t{0}, count);
#pragma omp parallel
  {
    const int64_t t = omp_get_thread_num(), threads = omp_get_num_threads();
    body(count * t / threads, count * (t + 1) / threads);
  }
}

// out [rows, batch] = in [batch, rows] for the block of images [b0, b1) and rows [r0, r1).
template <typename T>
void transpose_block(const T* in, int64_t batch, int64_t rows, T* out, int64_t b0, int64_t b1,
                     int64_t r0, int64_t r1) {
  for (int64_t r = r0; r < r1; ++r)
    for (int64_t b = b0; b < b1; ++b) out[r * batch + b] = in[b * rows + r];
}

#if defined(__SSE2__)
// An 8x8 block of 16-bit elements (or a 4x4 block of 32-bit ones) transposed in SSE2 registers,
// the baseline of x86-64: interleaving pairs of rows by elements, then by 32 and 64 bits. The
// element-by-element loop took a fifth of a weight gradient's time at ResNet-18's 4x4 stage.
void transpose_8x8(const uint16_t* in, int64_t in_ld, uint16_t* out, int64_t out_ld) {
  __m128i r[8], a[8];
  for (int i = 0; i < 8; ++i)
    r[i] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(in + i * in_ld));
  for (int i = 0; i < 4; ++i) {
    a[2 * i] = _mm_unpacklo_epi16(r[2 * i], r[2 * i + 1]);
    a[2 * i + 1] = _mm_unpackhi_epi16(r[2 * i], r[2 * i + 1]);
  }
  for (int h = 0; h < 2; ++h)
    for (int q = 0; q < 2; ++q) {
      r[4 * h + 2 * q] = _mm_unpacklo_epi32(a[4 * h + q], a[4 * h + q + 2]);
      r[4 * h + 2 * q + 1] = _mm_unpackhi_epi32(a[4 * h + q], a[4 * h + q + 2]);
    }
  // r[4 h + q] holds columns 2q and 2q + 1 of rows 4h..4h+3, one in each half.
  for (int q = 0; q < 4; ++q) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + (2 * q) * out_ld),
                     _mm_unpacklo_epi64(r[q], r[q + 4]));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + (2 * q + 1) * out_ld),
                     _mm_unpackhi_epi64(r[q], r[q + 4]));
  }
}

void transpose_4x4(const float* in, int64_t in_ld, float* out, int64_t out_ld) {
  __m128 r0 = _mm_loadu_ps(in), r1 = _mm_loadu_ps(in + in_ld), r2 = _mm_loadu_ps(in + 2 * in_ld),
         r3 = _mm_loadu_ps(in + 3 * in_ld);
  _MM_TRANSPOSE4_PS(r0, r1, r2, r3);
  _mm_storeu_ps(out, r0);
  _mm_storeu_ps(out + out_ld, r1);
  _mm_storeu_ps(out + 2 * out_ld, r2);
  _mm_storeu_ps(out + 3 * out_ld, r3);
}
#endif

}  // namespace

template <typename T>
void batch_last(const T* in, int64_t batch, int64_t rows, T* out, bool team) {
#if defined(__SSE2__)
  constexpr int64_t kBlock = 16 / sizeof(T);  // 8 16-bit or 4 32-bit elements: one SSE register
#else
  constexpr int64_t kBlock = 8;
#endif
  // A strip of rows at a time, its images kBlock at a time, each of those images walked along the
  // strip: only kBlock input lines are in use at once (an image's rows are often a power of two
  // of bytes apart, and more lines at such a stride share one L1 set and evict each other), and
  // the strip's outputs, revisited once per block of images, stay in L1.
  constexpr int64_t kStrip = 256;
  share_out((rows + kStrip - 1) / kStrip, team, [&](int64_t begin, int64_t end) {
    for (int64_t s0 = begin * kStrip; s0 < std::min(rows, end * kStrip); s0 += kStrip) {
      const int64_t s1 = std::min(rows, s0 + kStrip);
      const int64_t whole_r = s0 + (s1 - s0) / kBlock * kBlock;
      int64_t b0 = 0;
#if defined(__SSE2__)
      for (; b0 + kBlock <= batch; b0 += kBlock)
        for (int64_t r0 = s0; r0 < whole_r; r0 += kBlock) {
          if constexpr (sizeof(T) == 2)
            transpose_8x8(in + b0 * rows + r0, rows, out + r0 * batch + b0, batch);
          else
            transpose_4x4(in + b0 * rows + r0, rows, out + r0 * batch + b0, batch);
        }
      transpose_block(in, batch, rows, out, 0, b0, whole_r, s1);  // the strip's last rows
#endif
      transpose_block(in, batch, rows, out, b0, batch, s0, s1);  // the last images
    }
  });
}

template <typename T>
void gather_columns(const ConvGeometry& g, const T* x_t, T* columns, bool team) {
  const ConvWindow& w = g.window;
  const int64_t taps = g.kh * g.kw, positions = g.oh * g.ow, plane = g.h * g.w;
  // Per tap and output position, the position the tap reads in a channel's plane; -1: padding.
  std::vector<int64_t> reads(static_cast<size_t>(taps * positions));
  for (int64_t ky = 0; ky < g.kh; ++ky)
    for (int64_t kx = 0; kx < g.kw; ++kx)
      for (int64_t oy = 0; oy < g.oh; ++oy)
        for (int64_t ox = 0; ox < g.ow; ++ox) {
          const int64_t iy = oy * w.stride[0] - w.pad[0] + ky * w.dil[0];
          const int64_t ix = ox * w.stride[1] - w.pad[1] + kx * w.dil[1];
          const bool inside = iy >= 0 && iy < g.h && ix >= 0 && ix < g.w;
          reads[static_cast<size_t>((ky * g.kw + kx) * positions + oy * g.ow + ox)] =
              inside ? iy * g.w + ix : -1;
        }
  share_out(g.c * taps, team, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const int64_t c = row / taps;
      const int64_t* tap = reads.data() + (row % taps) * positions;
      const T* channel = x_t + c * plane * g.n;
      T* out = columns + row * positions * g.n;
      for (int64_t p = 0; p < positions; ++p, out += g.n) {
        if (tap[p] < 0)
          std::fill_n(out, g.n, T{});
        else
          std::copy_n(channel + tap[p] * g.n, g.n, out);
      }
    }
  });
}

template void batch_last(const uint16_t*, int64_t, int64_t, uint16_t*, bool);
template void batch_last(const float*, int64_t, int64_t, float*, bool);
template void gather_columns(const ConvGeometry&, const uint16_t*, uint16_t*, bool);
template void gather_columns(const ConvGeometry&, const float*, float*, bool);

}  // namespace mixtape

// mixtape/runtime/pool.cpp -- the CPU max-pooling loops. Each plane is widened to f32 and padded
// with -inf to the extent the windows read, so that the window loops need no bounds checks: a
// padding tap never beats the maximum so far (-inf > m is false) nor is NaN, and so is never a
// pick. Each padded row is stored as `stride` phases (columns c with c % stride = phase, in order),
// so that the taps one window offset reads along an output row are contiguous: the row loops
// vectorize (compiled for x86-64-v4 too, chosen at run time; compares and selects give the same
// bits on every instruction set). Picks follow the reference's rule
// (runtime/reference_executor.cpp): the last NaN, else the first maximum, a window of only -inf
// taking its first tap inside the input; gradients are summed per position in output order in f32,
// as there.
#include "mixtape/runtime/pool.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <vector>

#include "mixtape/dsl/vision.h"
#include "mixtape/runtime/cpu_features.h"
#include "mixtape/runtime/device.h"
#include "mixtape/runtime/half_convert.h"
#include "mixtape/runtime/storage_rows.h"

namespace mixtape {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
// Below this many input values in all a run stays on one thread (the team costs more).
constexpr int64_t kParallelValues = int64_t{1} << 15;

// ---- the row loops: one window offset along an output row of n windows ----
// best = max(best, tap) with the pick rule: a tap is taken when greater or NaN. Bitwise | keeps
// the test branch-free, so that it vectorizes as compares and a blend.
inline void max_row_loop(float* __restrict best, const float* __restrict tap, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float v = tap[i], m = best[i];
    best[i] = ((v > m) | (v != v)) ? v : m;
  }
}
// The same, keeping the taken tap's position (first + i) in pick.
inline void pick_row_loop(float* __restrict best, int32_t* __restrict pick,
                          const float* __restrict tap, int32_t first, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float v = tap[i], m = best[i];
    const bool take = (v > m) | (v != v);
    best[i] = take ? v : m;
    pick[i] = take ? first + static_cast<int32_t>(i) : pick[i];
  }
}

// ---- planes ----
struct Plan {
  PoolGeometry g;
  int64_t rows, cols;          // the padded plane's extent
  int64_t phases, phase_cols;  // the column stride, and ceil(cols / stride) columns per phase
  int64_t row_size() const { return phases * phase_cols; }
  // A padded position (r, c) in the phase layout.
  int64_t at(int64_t r, int64_t c) const {
    return r * row_size() + (c % phases) * phase_cols + c / phases;
  }
};

Plan plan_of(const Node& node) {
  Plan p{PoolGeometry::of(node), 0, 0, 0, 0};
  const PoolWindow& w = p.g.window;
  // What the windows read: the left padding, the input, then padding or a cropped end.
  p.rows = (p.g.oh - 1) * w.stride[0] + w.dil[0] * (w.kernel[0] - 1) + 1;
  p.cols = (p.g.ow - 1) * w.stride[1] + w.dil[1] * (w.kernel[1] - 1) + 1;
  p.phases = w.stride[1];
  p.phase_cols = (p.cols + p.phases - 1) / p.phases;
  return p;
}

// Calls f(position in a padded row's phase layout, input column c) for the input's columns
// c < cols, phase by phase: no division per element.
template <typename F>
void for_each_column(const Plan& p, int64_t cols, F f) {
  const int64_t pad_x = p.g.window.pad[1];
  for (int64_t phase = 0; phase < p.phases; ++phase)
    for (int64_t j = 0; j < p.phase_cols; ++j) {
      const int64_t c = j * p.phases + phase - pad_x;
      if (c >= 0 && c < cols) f(phase * p.phase_cols + j, c);
    }
}

// Plane `plane` of x, padded with -inf, into `padded` in the phase layout.
void pad_plane(const Plan& p, const Storage& x, int64_t plane, std::vector<float>& padded,
               std::vector<float>& row) {
  const PoolGeometry& g = p.g;
  padded.assign(static_cast<size_t>(p.rows * p.row_size()), kNegInf);
  const int64_t pad_y = g.window.pad[0], pad_x = g.window.pad[1];
  const int64_t rows = std::min(g.h, p.rows - pad_y), cols = std::min(g.w, p.cols - pad_x);
  row.resize(static_cast<size_t>(std::max<int64_t>(cols, 0)));
  for (int64_t r = 0; r < rows; ++r) {
    float* dst = padded.data() + (pad_y + r) * p.row_size();
    if (p.phases == 1) {
      widen_row(x, (plane * g.h + r) * g.w, dst + pad_x, cols);
      continue;
    }
    widen_row(x, (plane * g.h + r) * g.w, row.data(), cols);
    for_each_column(p, cols, [&](int64_t to, int64_t c) { dst[to] = row[static_cast<size_t>(c)]; });
  }
}

// Where the tap (ky, kx) of output row oy's first window is, in the phase layout.
inline int64_t tap_at(const Plan& p, int64_t oy, int64_t ky, int64_t kx) {
  const PoolWindow& w = p.g.window;
  return p.at(oy * w.stride[0] + ky * w.dil[0], kx * w.dil[1]);
}

// Every window's maximum of a padded plane: y [oh, ow].
inline void plane_max(const Plan& p, const float* padded, float* y) {
  const PoolGeometry& g = p.g;
  const PoolWindow& w = g.window;
  for (int64_t oy = 0; oy < g.oh; ++oy) {
    float* best = y + oy * g.ow;
    std::fill(best, best + g.ow, kNegInf);
    for (int64_t ky = 0; ky < w.kernel[0]; ++ky)
      for (int64_t kx = 0; kx < w.kernel[1]; ++kx)
        max_row_loop(best, padded + tap_at(p, oy, ky, kx), g.ow);
  }
}

// Every window's pick of a padded plane (a position in it, -1 where no tap beat -inf): best and
// pick [oh, ow].
inline void plane_picks(const Plan& p, const float* padded, float* best, int32_t* pick) {
  const PoolGeometry& g = p.g;
  const PoolWindow& w = g.window;
  std::fill(best, best + g.oh * g.ow, kNegInf);
  std::fill(pick, pick + g.oh * g.ow, -1);
  for (int64_t oy = 0; oy < g.oh; ++oy)
    for (int64_t ky = 0; ky < w.kernel[0]; ++ky)
      for (int64_t kx = 0; kx < w.kernel[1]; ++kx) {
        const int64_t first = tap_at(p, oy, ky, kx);
        pick_row_loop(best + oy * g.ow, pick + oy * g.ow, padded + first,
                      static_cast<int32_t>(first), g.ow);
      }
}

// The plane loops for the CPU's instruction set, chosen once per call: planes are small (ResNet's
// stem pools 8x8 outputs), so dispatching per row would cost as much as the row.
struct PlaneLoops {
  void (*max)(const Plan&, const float*, float*);
  void (*picks)(const Plan&, const float*, float*, int32_t*);
};
constexpr PlaneLoops baseline_planes{
    [](const Plan& p, const float* padded, float* y) { plane_max(p, padded, y); },
    [](const Plan& p, const float* padded, float* best, int32_t* pick) {
      plane_picks(p, padded, best, pick);
    }};
#if defined(__x86_64__)
// The library's baseline is SSE2; AVX-512 runs the row loops on 16 lanes.
[[gnu::target("arch=x86-64-v4")]] void plane_max_v4(const Plan& p, const float* padded, float* y) {
  plane_max(p, padded, y);
}
[[gnu::target("arch=x86-64-v4")]] void plane_picks_v4(const Plan& p, const float* padded,
                                                      float* best, int32_t* pick) {
  plane_picks(p, padded, best, pick);
}
constexpr PlaneLoops v4_planes{plane_max_v4, plane_picks_v4};
#endif

const PlaneLoops& plane_loops() {
#if defined(__x86_64__)
  if (cpu_runs_x86_64_v4()) return v4_planes;
#endif
  return baseline_planes;
}

// The first tap of window (oy, ox) inside the input, as (row, column) of the padded plane; false
// for none.
bool first_inside(const Plan& p, int64_t oy, int64_t ox, int64_t& r, int64_t& c) {
  const PoolWindow& w = p.g.window;
  for (int64_t ky = 0; ky < w.kernel[0]; ++ky) {
    r = oy * w.stride[0] + ky * w.dil[0];
    if (r < w.pad[0] || r >= w.pad[0] + p.g.h) continue;
    for (int64_t kx = 0; kx < w.kernel[1]; ++kx) {
      c = ox * w.stride[1] + kx * w.dil[1];
      if (c >= w.pad[1] && c < w.pad[1] + p.g.w) return true;
    }
  }
  return false;
}

// gx (the plane, zeroed, h x w) += gy at each window's pick, in output order. input_of maps a
// padded position inside the input to the input's index.
void backward_plane(const Plan& p, const std::vector<float>& padded,
                    const std::vector<int32_t>& input_of, const float* gy, float* gx,
                    std::vector<float>& best, std::vector<int32_t>& pick) {
  const PoolGeometry& g = p.g;
  const PoolWindow& w = g.window;
  best.resize(static_cast<size_t>(g.oh * g.ow));
  pick.resize(static_cast<size_t>(g.oh * g.ow));
  plane_loops().picks(p, padded.data(), best.data(), pick.data());
  for (int64_t oy = 0; oy < g.oh; ++oy)
    for (int64_t ox = 0; ox < g.ow; ++ox) {
      const int32_t at = pick[static_cast<size_t>(oy * g.ow + ox)];
      int64_t r, c;
      if (at >= 0)
        gx[input_of[static_cast<size_t>(at)]] += gy[oy * g.ow + ox];
      else if (first_inside(p, oy, ox, r, c))
        gx[(r - w.pad[0]) * g.w + (c - w.pad[1])] += gy[oy * g.ow + ox];
    }
}

}  // namespace

bool max_pool_cpu_supported(const Node& node) {
  // Inputs and result may differ in type (a policy may store the result narrower): each is
  // widened to f32 or rounded once from it, as the reference loads and stores.
  auto fits = [](DType t) { return t == f32 || t == bf16 || t == f16; };
  if (!fits(node.precision.storage_type)) return false;
  for (const NodePtr& input : node.inputs)
    if (!input->value || !fits(input->value->dtype)) return false;
  // Picks are 32-bit positions in the padded plane, mapped to 32-bit input positions.
  const Plan p = plan_of(node);
  return p.rows * p.row_size() < (int64_t{1} << 31) && p.g.h * p.g.w < (int64_t{1} << 31);
}

void max_pool_cpu(const Node& node, Storage& out) {
  const Plan p = plan_of(node);
  const PoolGeometry& g = p.g;
  const Storage& x = *node.inputs[0]->value;
  const bool backward = node.op == OpCode::MaxPool2dGrad;
  const int64_t planes = g.n * g.c, in_plane = g.h * g.w, out_plane = g.oh * g.ow;
  const bool parallel = planes > 1 && x.count >= kParallelValues;
  std::vector<int32_t> input_of;
  if (backward) {
    input_of.assign(static_cast<size_t>(p.rows * p.row_size()), -1);
    const int64_t pad_y = g.window.pad[0], cols = std::min(g.w, p.cols - g.window.pad[1]);
    for (int64_t r = 0; r < std::min(g.h, p.rows - pad_y); ++r)
      for_each_column(p, cols, [&](int64_t to, int64_t c) {
        input_of[static_cast<size_t>((pad_y + r) * p.row_size() + to)] =
            static_cast<int32_t>(r * g.w + c);
      });
  }
#pragma omp parallel if (parallel)
  {
    FlushDenormalScope float_mode;  // the team's threads may be the caller's too
    std::vector<float> padded, row, y, gy, gx, best;
    std::vector<int32_t> pick;
#pragma omp for schedule(static)
    for (int64_t plane = 0; plane < planes; ++plane) {
      pad_plane(p, x, plane, padded, row);
      if (!backward) {
        y.resize(static_cast<size_t>(out_plane));
        plane_loops().max(p, padded.data(), y.data());
        narrow_row(y.data(), out, plane * out_plane, out_plane);
        continue;
      }
      gy.resize(static_cast<size_t>(out_plane));
      widen_row(*node.inputs[1]->value, plane * out_plane, gy.data(), out_plane);
      gx.assign(static_cast<size_t>(in_plane), 0.f);
      backward_plane(p, padded, input_of, gy.data(), gx.data(), best, pick);
      narrow_row(gx.data(), out, plane * in_plane, in_plane);
    }
  }
}

}  // namespace mixtape

// runtime/pool.cpp -- the CPU max-pooling loops. Each plane is widened to f32 and padded with -inf
// to the extent the windows read, so that the window loops need no bounds checks: a padding tap
// never beats the maximum so far (-inf > m is false) nor is NaN, and so is never a pick. Picks
// follow the reference's rule (runtime/reference_executor.cpp): the last NaN, else the first
// maximum, a window of only -inf taking its first tap inside the input.
#include "runtime/pool.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <vector>

#include "dsl/vision.h"
#include "runtime/half_convert.h"

namespace mixtape {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
// Below this many input values in all a run stays on one thread (the team costs more).
constexpr int64_t kParallelValues = int64_t{1} << 15;

struct Plan {
  PoolGeometry g;
  int64_t rows, cols;  // the padded plane's extent
};

Plan plan_of(const Node& node) {
  Plan p{PoolGeometry::of(node), 0, 0};
  const PoolWindow& w = p.g.window;
  // What the windows read: the left padding, the input, then padding or a cropped end.
  p.rows = (p.g.oh - 1) * w.stride[0] + w.dil[0] * (w.kernel[0] - 1) + 1;
  p.cols = (p.g.ow - 1) * w.stride[1] + w.dil[1] * (w.kernel[1] - 1) + 1;
  return p;
}

void widen_row(const Storage& s, int64_t at, float* out, int64_t count) {
  if (s.dtype == f32)
    std::memcpy(out, s.as<float>() + at, static_cast<size_t>(count) * sizeof(float));
  else if (s.dtype == bf16)
    widen_bf16(s.as<uint16_t>() + at, out, count);
  else
    widen_f16(s.as<uint16_t>() + at, out, count);
}

void narrow_row(const float* in, Storage& s, int64_t at, int64_t count) {
  if (s.dtype == f32)
    std::memcpy(s.as<float>() + at, in, static_cast<size_t>(count) * sizeof(float));
  else if (s.dtype == bf16)
    narrow_to_bf16(in, s.as<uint16_t>() + at, count);
  else
    narrow_to_f16(in, s.as<uint16_t>() + at, count);
}

// Plane `plane` of x, padded with -inf, into `padded` (p.rows x p.cols).
void pad_plane(const Plan& p, const Storage& x, int64_t plane, std::vector<float>& padded) {
  const PoolGeometry& g = p.g;
  padded.assign(static_cast<size_t>(p.rows * p.cols), kNegInf);
  const int64_t pad_y = g.window.pad[0], pad_x = g.window.pad[1];
  const int64_t rows = std::min(g.h, p.rows - pad_y), cols = std::min(g.w, p.cols - pad_x);
  for (int64_t r = 0; r < rows; ++r)
    widen_row(x, (plane * g.h + r) * g.w, padded.data() + (pad_y + r) * p.cols + pad_x, cols);
}

// m = max(m, v) with the pick rule: v taken when greater or NaN.
inline bool takes(float v, float m) { return v > m || v != v; }

void forward_plane(const Plan& p, const std::vector<float>& padded, float* y) {
  const PoolGeometry& g = p.g;
  const PoolWindow& w = g.window;
  const int64_t sx = w.stride[1];
  for (int64_t oy = 0; oy < g.oh; ++oy) {
    float* best = y + oy * g.ow;
    std::fill(best, best + g.ow, kNegInf);
    for (int64_t ky = 0; ky < w.kernel[0]; ++ky) {
      const float* row = padded.data() + (oy * w.stride[0] + ky * w.dil[0]) * p.cols;
      for (int64_t kx = 0; kx < w.kernel[1]; ++kx) {
        const float* tap = row + kx * w.dil[1];
        if (sx == 1)
          for (int64_t ox = 0; ox < g.ow; ++ox)
            best[ox] = takes(tap[ox], best[ox]) ? tap[ox] : best[ox];
        else
          for (int64_t ox = 0; ox < g.ow; ++ox)
            best[ox] = takes(tap[ox * sx], best[ox]) ? tap[ox * sx] : best[ox];
      }
    }
  }
}

// The first tap of window (oy, ox) inside the input, as a padded-plane position; -1 for none.
int64_t first_inside(const Plan& p, int64_t oy, int64_t ox) {
  const PoolWindow& w = p.g.window;
  for (int64_t ky = 0; ky < w.kernel[0]; ++ky) {
    const int64_t r = oy * w.stride[0] + ky * w.dil[0];
    if (r < w.pad[0] || r >= w.pad[0] + p.g.h) continue;
    for (int64_t kx = 0; kx < w.kernel[1]; ++kx) {
      const int64_t c = ox * w.stride[1] + kx * w.dil[1];
      if (c >= w.pad[1] && c < w.pad[1] + p.g.w) return r * p.cols + c;
    }
  }
  return -1;
}

// gx (the plane, zeroed, h x w) += gy at each window's pick, in output order.
void backward_plane(const Plan& p, const std::vector<float>& padded, const float* gy, float* gx,
                    std::vector<float>& best, std::vector<int64_t>& pick) {
  const PoolGeometry& g = p.g;
  const PoolWindow& w = g.window;
  const int64_t sx = w.stride[1];
  best.resize(static_cast<size_t>(g.ow));
  pick.resize(static_cast<size_t>(g.ow));
  for (int64_t oy = 0; oy < g.oh; ++oy) {
    std::fill(best.begin(), best.end(), kNegInf);
    std::fill(pick.begin(), pick.end(), -1);
    float* b = best.data();
    int64_t* k = pick.data();
    for (int64_t ky = 0; ky < w.kernel[0]; ++ky) {
      const int64_t row = (oy * w.stride[0] + ky * w.dil[0]) * p.cols;
      for (int64_t kx = 0; kx < w.kernel[1]; ++kx) {
        const int64_t first = row + kx * w.dil[1];
        const float* tap = padded.data() + first;
        for (int64_t ox = 0; ox < g.ow; ++ox) {
          const float v = tap[ox * sx];
          const bool take = takes(v, b[ox]);
          b[ox] = take ? v : b[ox];
          k[ox] = take ? first + ox * sx : k[ox];
        }
      }
    }
    for (int64_t ox = 0; ox < g.ow; ++ox) {
      const int64_t at = k[ox] >= 0 ? k[ox] : first_inside(p, oy, ox);
      if (at < 0) continue;
      const int64_t r = at / p.cols - w.pad[0], c = at % p.cols - w.pad[1];
      gx[r * g.w + c] += gy[oy * g.ow + ox];
    }
  }
}

}  // namespace

bool max_pool_cpu_supported(const Node& node) {
  auto fits = [](DType t) { return t == f32 || t == bf16 || t == f16; };
  if (!fits(node.storage)) return false;
  for (const NodePtr& input : node.inputs)
    if (!input->value || input->value->dtype != node.storage) return false;
  return true;
}

void max_pool_cpu(const Node& node, Storage& out) {
  const Plan p = plan_of(node);
  const PoolGeometry& g = p.g;
  const Storage& x = *node.inputs[0]->value;
  const bool backward = node.op == OpCode::MaxPool2dGrad;
  const int64_t planes = g.n * g.c, in_plane = g.h * g.w, out_plane = g.oh * g.ow;
  const bool parallel = planes > 1 && x.count >= kParallelValues;
#pragma omp parallel if (parallel)
  {
    std::vector<float> padded, y, gy, gx, best;
    std::vector<int64_t> pick;
#pragma omp for schedule(static)
    for (int64_t plane = 0; plane < planes; ++plane) {
      pad_plane(p, x, plane, padded);
      if (!backward) {
        y.resize(static_cast<size_t>(out_plane));
        forward_plane(p, padded, y.data());
        narrow_row(y.data(), out, plane * out_plane, out_plane);
        continue;
      }
      gy.resize(static_cast<size_t>(out_plane));
      widen_row(*node.inputs[1]->value, plane * out_plane, gy.data(), out_plane);
      gx.assign(static_cast<size_t>(in_plane), 0.f);
      backward_plane(p, padded, gy.data(), gx.data(), best, pick);
      narrow_row(gx.data(), out, plane * in_plane, in_plane);
    }
  }
}

}  // namespace mixtape

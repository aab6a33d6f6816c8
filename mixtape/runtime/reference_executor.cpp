// mixtape/runtime/reference_executor.cpp -- readable per-op loops; the oracle every back end is
// tested against.
#include "mixtape/runtime/reference_executor.h"

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <numeric>
#include <tuple>
#include <type_traits>

#include "mixtape/dsl/attention.h"
#include "mixtape/dsl/conv.h"
#include "mixtape/dsl/convert.h"
#include "mixtape/dsl/error.h"
#include "mixtape/dsl/ops.h"
#include "mixtape/dsl/random.h"
#include "mixtape/dsl/scalar_math.h"
#include "mixtape/dsl/vision.h"
#include "mixtape/runtime/all_reduce.h"
#include "mixtape/runtime/axis_lines.h"
#include "mixtape/runtime/matmul_dims.h"
#include "mixtape/runtime/random_fill.h"

namespace mixtape {
namespace {

using StoragePtr = std::shared_ptr<Storage>;

// Names what the user called: a composite's own name (cross_entropy) before the primitive inside
// it that failed, which the user never wrote.
template <typename... Args>
[[noreturn]] void node_fail(const Node& node, fmt::format_string<Args...> format, Args&&... args) {
  std::string detail = fmt::format(format, std::forward<Args>(args)...);
  std::string what =
      node.origin.composite
          ? fmt::format("{}: {} (in its {})", node.origin.composite, detail, op_name(node.op))
          : fmt::format("{}: {}", op_name(node.op), detail);
  std::string where = short_location(node.origin.location);
  if (!node.origin.module_path.empty())
    fail("{} [module '{}', at {}]", what, node.origin.module_path, where);
  fail("{} [at {}]", what, where);
}

template <typename T>
bool is_nan(T a) {
  if constexpr (std::is_floating_point_v<T>)
    return std::isnan(a);
  else
    return false;
}

const Storage& value_of(const Node& node, size_t i) { return *node.inputs[i]->value; }

// The counter base of a rand or randn node: its generator's offset (0-d i64, the bits of a
// uint64).
uint64_t draw_offset(const Node& node) {
  return std::bit_cast<uint64_t>(load_element<int64_t>(value_of(node, 0), 0));
}

StoragePtr new_storage(const Node& node) {
  return allocate_value(node, node.precision.storage_type, node.numel(), false);
}

// Calls f with a value of the compute type for elements of `dtype`.
template <typename F>
auto with_compute_type(DType dtype, F&& f) {
  if (dtype == f64) return f(double{});
  if (is_floating(dtype)) return f(float{});
  return f(int64_t{});
}

// ---- pointwise ----
// Input i of a pointwise node as T, rounded to the node's compute type when that is a 16-bit
// float: an f32 bias or scalar constant entering an f16 op is used as f16, as PyTorch rounds a
// Python scalar or an autocast-cast parameter (node.h: compute is what float inputs are rounded
// to). The math itself then runs in T and rounds once at the output.
template <typename T>
std::vector<T> pointwise_input(const Node& node, size_t i) {
  std::vector<T> values = load_all<T>(value_of(node, i));
  if constexpr (std::is_floating_point_v<T>) {
    if (is_half(node.precision.compute) && value_of(node, i).dtype != node.precision.compute) {
      Storage rounded(node.precision.compute, 1);
      for (T& v : values) {
        store_element(rounded, 0, v);
        v = load_element<T>(rounded, 0);
      }
    }
  }
  return values;
}

// f over the node's first N inputs element by element, called with Arity arguments: those past N
// are zeros (a fused op's expression, MT_FUSED, does not name them).
constexpr size_t kFusedMaxArity = 7;
template <size_t N, size_t Arity = N, typename F>
StoragePtr map_pointwise(const Node& node, F f) {
  static_assert(N <= Arity);
  StoragePtr out = new_storage(node);
  with_compute_type(node.inputs[0]->dtype, [&](auto zero) {
    using T = decltype(zero);
    std::array<std::vector<T>, N> in;
    for (size_t k = 0; k < N; ++k) in[k] = pointwise_input<T>(node, k);
    std::array<T, Arity> x{};
    for (int64_t i = 0; i < out->count; ++i) {
      // A fused op's 0-d operand is the same element at every point.
      for (size_t k = 0; k < N; ++k) x[k] = in[k][in[k].size() == 1 ? 0 : static_cast<size_t>(i)];
      store_element(*out, i, std::apply(f, x));
    }
  });
  return out;
}

StoragePtr ref_Where(const Node& node) {
  StoragePtr out = new_storage(node);
  std::vector<int64_t> cond = load_all<int64_t>(value_of(node, 0));
  with_compute_type(node.dtype, [&](auto zero) {
    using T = decltype(zero);
    std::vector<T> a = load_all<T>(value_of(node, 1));
    std::vector<T> b = load_all<T>(value_of(node, 2));
    for (int64_t i = 0; i < out->count; ++i) store_element(*out, i, cond[i] ? a[i] : b[i]);
  });
  return out;
}

StoragePtr ref_Cast(const Node& node) {
  StoragePtr out = new_storage(node);
  const Storage& in = value_of(node, 0);
  if (is_floating(in.dtype) || is_floating(node.dtype)) {
    // Through double, which holds every value of every source dtype up to 2^53 exactly.
    for (int64_t i = 0; i < out->count; ++i) store_element(*out, i, load_element<double>(in, i));
  } else {
    for (int64_t i = 0; i < out->count; ++i) store_element(*out, i, load_element<int64_t>(in, i));
  }
  return out;
}

// Input 1 gives only the type, which is the node's.
StoragePtr ref_CastLike(const Node& node) { return ref_Cast(node); }

// ---- leaves ----
StoragePtr ref_Constant(const Node& node) { node_fail(node, "constant has no data"); }

StoragePtr ref_Full(const Node& node) {
  StoragePtr out = new_storage(node);
  for (int64_t i = 0; i < out->count; ++i) store_element(*out, i, node.attrs.value);
  return out;
}

StoragePtr ref_Arange(const Node& node) {
  StoragePtr out = new_storage(node);
  for (int64_t i = 0; i < out->count; ++i)
    store_element(*out, i, node.attrs.value + static_cast<double>(i) * node.attrs.step);
  return out;
}

// Random streams are counter-based, so elements are independent: large f64 draws (~40 ns an
// element) are split across threads with identical results. f32, f16 and bf16 draws take
// runtime/random_fill.h's vectorized streams, which split large draws themselves.
constexpr int64_t kParallelDraws = 2048;

// A draw of `node`'s stream: `fill` for the dtypes random_fill.h vectorizes, `element` per
// element otherwise.
template <void (*fill)(Storage&, uint64_t, uint64_t),
          double (*element)(uint64_t, uint64_t, uint64_t)>
StoragePtr draw(const Node& node) {
  const uint64_t seed = node.attrs.seed, offset = draw_offset(node);
  if (has_random_fill(node.precision.storage_type)) {
    auto out = allocate_value(node, node.precision.storage_type, node.numel(), true);
    fill(*out, seed, offset);
    return out;
  }
  StoragePtr out = new_storage(node);
#pragma omp parallel for if (out->count >= kParallelDraws)
  for (int64_t i = 0; i < out->count; ++i) store_element(*out, i, element(seed, offset, i));
  return out;
}

StoragePtr ref_RandUniform(const Node& node) { return draw<fill_uniform, philox_uniform>(node); }
StoragePtr ref_RandNormal(const Node& node) { return draw<fill_normal, philox_normal>(node); }

// ---- data movement: element copies by strided offsets ----
// Copies each element of the output (of shape `shape`) from input offset
// base + sum(index[d] * strides[d]).
StoragePtr strided_copy(const Node& node, const Storage& in, const std::vector<int64_t>& strides,
                        int64_t base) {
  StoragePtr out = new_storage(node);
  size_t bytes = size_of(node.precision.storage_type);
  const Shape& shape = node.shape;
  std::vector<int64_t> index(shape.size(), 0);
  int64_t offset = base;
  for (int64_t i = 0; i < out->count; ++i) {
    std::memcpy(out->host_data() + i * bytes, in.host_data() + offset * bytes, bytes);
    for (size_t d = shape.size(); d-- > 0;) {  // odometer increment
      offset += strides[d];
      if (++index[d] < shape[d]) break;
      offset -= strides[d] * shape[d];
      index[d] = 0;
    }
  }
  return out;
}

StoragePtr ref_Reshape(const Node& node) { return input_as_storage(node, 0); }

StoragePtr ref_Permute(const Node& node) {
  std::vector<int64_t> in_strides = strides_of(node.inputs[0]->shape), strides;
  for (int64_t axis : node.attrs.axes) strides.push_back(in_strides[axis]);
  return strided_copy(node, *input_as_storage(node, 0), strides, 0);
}

StoragePtr ref_BroadcastTo(const Node& node) {
  const Shape& in = node.inputs[0]->shape;
  std::vector<int64_t> in_strides = strides_of(in), strides(node.shape.size(), 0);
  size_t lead = node.shape.size() - in.size();
  for (size_t d = 0; d < in.size(); ++d) strides[lead + d] = in[d] == 1 ? 0 : in_strides[d];
  return strided_copy(node, *input_as_storage(node, 0), strides, 0);
}

StoragePtr ref_Slice(const Node& node) {
  std::vector<int64_t> in_strides = strides_of(node.inputs[0]->shape), strides;
  int64_t base = 0;
  for (size_t d = 0; d < in_strides.size(); ++d) {
    strides.push_back(in_strides[d] * node.attrs.steps[d]);
    base += node.attrs.starts[d] * in_strides[d];
  }
  return strided_copy(node, *input_as_storage(node, 0), strides, base);
}

StoragePtr ref_Unslice(const Node& node) {
  StoragePtr out = new_storage(node);  // zero-initialized bytes are 0 in every dtype
  StoragePtr converted = input_as_storage(node, 0);
  const Storage& in = *converted;
  const Shape& window = node.inputs[0]->shape;
  size_t bytes = size_of(node.precision.storage_type);
  // unslice() returns a window as large as its tensor (every 0-d one) unchanged: rank >= 1 here.
  if (in.count == 0) return out;
  std::vector<int64_t> out_strides = strides_of(node.shape);
  // The window's last dim is copied a run at a time: one memcpy where its step is 1.
  size_t last = window.size() - 1;
  int64_t run = window[last], step = node.attrs.steps[last] * out_strides[last];
  std::vector<int64_t> index(window.size(), 0);
  for (int64_t i = 0; i < in.count; i += run) {
    int64_t offset = 0;
    for (size_t d = 0; d < window.size(); ++d)
      offset += (node.attrs.starts[d] + index[d] * node.attrs.steps[d]) * out_strides[d];
    std::byte* to = out->host_data() + offset * bytes;
    const std::byte* from = in.host_data() + i * bytes;
    if (step == 1)
      std::memcpy(to, from, run * bytes);
    else
      for (int64_t j = 0; j < run; ++j) std::memcpy(to + j * step * bytes, from + j * bytes, bytes);
    for (size_t d = last; d-- > 0;) {
      if (++index[d] < window[d]) break;
      index[d] = 0;
    }
  }
  return out;
}

StoragePtr ref_Concat(const Node& node) {
  StoragePtr out = new_storage(node);
  size_t bytes = size_of(node.precision.storage_type);
  int64_t axis = node.attrs.axis;
  int64_t outer = 1, inner = 1;
  for (int64_t d = 0; d < axis; ++d) outer *= node.shape[d];
  for (size_t d = axis + 1; d < node.shape.size(); ++d) inner *= node.shape[d];
  int64_t out_row = node.shape[axis] * inner, column = 0;
  for (size_t i = 0; i < node.inputs.size(); ++i) {
    const NodePtr& input = node.inputs[i];
    StoragePtr converted = input_as_storage(node, i);
    int64_t row = input->shape[axis] * inner;
    if (row == 0) continue;  // an empty input (its buffer may be null)
    for (int64_t o = 0; o < outer; ++o)
      std::memcpy(out->host_data() + (o * out_row + column) * bytes,
                  converted->host_data() + o * row * bytes, row * bytes);
    column += row;
  }
  return out;
}

// ---- reductions ----
// For every input element, the flat index of the output element it reduces into.
std::vector<int64_t> reduction_targets(const Shape& in, const std::vector<int64_t>& axes) {
  std::vector<int64_t> kept_strides(in.size(), 0);
  int64_t stride = 1;
  for (size_t d = in.size(); d-- > 0;) {
    bool reduced = std::find(axes.begin(), axes.end(), static_cast<int64_t>(d)) != axes.end();
    if (!reduced) {
      kept_strides[d] = stride;
      stride *= in[d];
    }
  }
  std::vector<int64_t> targets(static_cast<size_t>(numel(in)));
  std::vector<int64_t> index(in.size(), 0);
  int64_t offset = 0;
  for (size_t i = 0; i < targets.size(); ++i) {
    targets[i] = offset;
    for (size_t d = in.size(); d-- > 0;) {
      offset += kept_strides[d];
      if (++index[d] < in[d]) break;
      offset -= kept_strides[d] * in[d];
      index[d] = 0;
    }
  }
  return targets;
}

// Accumulators are f64, at least as accurate as an f32 accum; a policy that asks for a 16-bit
// accumulator gets every partial sum rounded to it, as 16-bit hardware accumulation would.
struct Accumulator {
  DType accum;
  bool rounds() const { return is_half(accum); }
  double add(double sum, double term) const {
    if (!rounds()) return sum + term;
    Storage rounded(accum, 1);
    store_element(rounded, 0, sum + term);
    return load_element<double>(rounded, 0);
  }
};

StoragePtr ref_Sum(const Node& node) {
  StoragePtr out = new_storage(node);
  std::vector<int64_t> targets = reduction_targets(node.inputs[0]->shape, node.attrs.axes);
  auto accumulate = [&](auto zero) {
    using T = decltype(zero);
    std::vector<T> in = load_all<T>(value_of(node, 0));
    std::vector<T> acc(static_cast<size_t>(out->count), T(0));
    if constexpr (std::is_floating_point_v<T>) {
      Accumulator accumulator{node.precision.accum};
      for (size_t i = 0; i < in.size(); ++i)
        acc[targets[i]] = accumulator.add(acc[targets[i]], in[i]);
    } else {
      for (size_t i = 0; i < in.size(); ++i) acc[targets[i]] += in[i];
    }
    for (int64_t i = 0; i < out->count; ++i) store_element(*out, i, acc[i]);
  };
  if (is_floating(node.dtype))
    accumulate(double{});
  else
    accumulate(int64_t{});
  return out;
}

StoragePtr ref_Max(const Node& node) {
  StoragePtr out = new_storage(node);
  std::vector<int64_t> targets = reduction_targets(node.inputs[0]->shape, node.attrs.axes);
  with_compute_type(node.dtype, [&](auto zero) {
    using T = decltype(zero);
    std::vector<T> in = load_all<T>(value_of(node, 0));
    std::vector<T> best(static_cast<size_t>(out->count), std::numeric_limits<T>::lowest());
    if constexpr (std::is_floating_point_v<T>)
      std::fill(best.begin(), best.end(), -std::numeric_limits<T>::infinity());
    // Floats: the maximum in the order -inf < ... < -0 < +0 < ... < +inf, whatever order the
    // elements come in, and the quiet NaN if any element is NaN. The compiled back end reduces
    // by integer keys of that order, which vectorizes, and agrees bit for bit.
    for (size_t i = 0; i < in.size(); ++i) {
      T& b = best[targets[i]];
      T x = in[i];
      if (is_nan(b)) continue;
      if constexpr (std::is_floating_point_v<T>) {
        if (is_nan(x))
          b = std::numeric_limits<T>::quiet_NaN();
        else if (x > b || (x == b && std::signbit(b) && !std::signbit(x)))
          b = x;
      } else if (x > b) {
        b = x;
      }
    }
    for (int64_t i = 0; i < out->count; ++i) store_element(*out, i, best[i]);
  });
  return out;
}

StoragePtr ref_Argmax(const Node& node) {
  StoragePtr out = new_storage(node);
  const Shape& shape = node.inputs[0]->shape;
  int64_t axis = node.attrs.axes[0];
  int64_t outer = 1, inner = 1, dim = shape[axis];
  for (int64_t d = 0; d < axis; ++d) outer *= shape[d];
  for (size_t d = axis + 1; d < shape.size(); ++d) inner *= shape[d];
  // Integers compared as integers: through doubles, 2^53 and 2^53 + 1 tied.
  auto search = [&](auto zero) {
    using T = decltype(zero);
    std::vector<T> in = load_all<T>(value_of(node, 0));
    for (int64_t o = 0; o < outer; ++o)
      for (int64_t i = 0; i < inner; ++i) {
        int64_t best = 0;
        T best_value = in[o * dim * inner + i];
        for (int64_t k = 1; k < dim && !is_nan(best_value); ++k) {
          T v = in[(o * dim + k) * inner + i];
          if (is_nan(v) || v > best_value) {
            best = k;
            best_value = v;
          }
        }
        out->as<int64_t>()[o * inner + i] = best;
      }
  };
  if (is_floating(node.inputs[0]->dtype))
    search(double{});
  else
    search(int64_t{});
  return out;
}

// ---- scans and sorting: one loop per line along the node's axis (AxisLines) ----

// log(exp(a) + exp(b)) without overflow, as PyTorch's _log_add_exp_helper: equal infinities give
// themselves (not inf - inf), and a NaN anywhere gives NaN.
double log_add_exp(double a, double b) {
  if (std::isnan(a) || std::isnan(b)) return std::numeric_limits<double>::quiet_NaN();
  double lo = std::min(a, b), hi = std::max(a, b);
  if (lo == hi && !std::isfinite(lo)) return a;
  return hi + std::log1p(std::exp(lo - hi));
}

// A scan: out[k] = step(out[k - 1], in[k]) from `init`, in the node's direction, kept in the
// accumulation type (f64, or rounded to a half accumulator) and rounded to the storage type
// at each output.
template <typename T, typename Step>
StoragePtr scan(const Node& node, T init, Step step) {
  StoragePtr out = new_storage(node);
  AxisLines lines(node.shape, node.attrs.axis);
  std::vector<T> in = load_all<T>(value_of(node, 0));
  const bool reverse = node.attrs.reverse;
  Accumulator accumulator{node.precision.accum};
  lines.for_each([&](auto at) {
    T acc = init;
    for (int64_t j = 0; j < lines.dim; ++j) {
      int64_t k = at(reverse ? lines.dim - 1 - j : j);
      acc = step(acc, in[k]);
      if constexpr (std::is_floating_point_v<T>)
        if (accumulator.rounds()) acc = accumulator.add(acc, T(0));
      store_element(*out, k, acc);
    }
  });
  return out;
}

StoragePtr ref_Cumsum(const Node& node) {
  if (!is_floating(node.dtype)) return scan<int64_t>(node, 0, std::plus<>());
  return scan<double>(node, 0.0, std::plus<>());
}

StoragePtr ref_Cumprod(const Node& node) {
  if (!is_floating(node.dtype)) return scan<int64_t>(node, 1, std::multiplies<>());
  return scan<double>(node, 1.0, std::multiplies<>());
}

StoragePtr ref_Logcumsumexp(const Node& node) {
  return scan<double>(node, -std::numeric_limits<double>::infinity(), log_add_exp);
}

// A stable sort of each line's positions: ascending puts NaN last, descending first, as
// torch.sort; equal elements (-0 and +0 among them) keep their order either way.
StoragePtr ref_Argsort(const Node& node) {
  StoragePtr out = new_storage(node);
  AxisLines lines(node.shape, node.attrs.axis);
  const bool descending = node.attrs.reverse;
  with_compute_type(node.inputs[0]->dtype, [&](auto zero) {
    using T = decltype(zero);
    std::vector<T> in = load_all<T>(value_of(node, 0));
    std::vector<int64_t> order(static_cast<size_t>(lines.dim));
    std::vector<T> line(static_cast<size_t>(lines.dim));
    lines.for_each([&](auto at) {
      for (int64_t k = 0; k < lines.dim; ++k) line[k] = in[at(k)];
      std::iota(order.begin(), order.end(), int64_t{0});
      std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
        T x = line[a], y = line[b];
        if (descending) return is_nan(x) ? !is_nan(y) : !is_nan(y) && x > y;
        return !is_nan(x) && (is_nan(y) || x < y);
      });
      for (int64_t k = 0; k < lines.dim; ++k) out->as<int64_t>()[at(k)] = order[k];
    });
  });
  return out;
}

// ---- matmul ----
// Row-major [batch, rows, cols] copy of one operand in f64, transposed if asked.
// Operands are rounded to the compute type first: an f16 matmul sees f16 inputs, as tensor cores
// do, whatever the inputs are stored as.
std::vector<double> matrix_operand(const Storage& in, int64_t batch, int64_t rows, int64_t cols,
                                   bool transposed, DType compute) {
  std::vector<double> values = load_all<double>(in);
  if (compute != in.dtype && compute != f64) {
    Storage rounded(compute, 1);
    for (double& v : values) {
      store_element(rounded, 0, v);
      v = load_element<double>(rounded, 0);
    }
  }
  if (!transposed) return values;
  std::vector<double> out(values.size());
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < cols; ++c)
        out[(b * rows + r) * cols + c] = values[(b * cols + c) * rows + r];
  return out;
}

StoragePtr ref_MatMul(const Node& node) {
  StoragePtr out = new_storage(node);
  const auto [m, n, k, batch] = matmul_dims(node);
  if (m * n == 0 || k == 0) return out;  // empty, or sums over nothing: zeros
  std::vector<double> a = matrix_operand(value_of(node, 0), batch, m, k, node.attrs.transpose_a,
                                         node.precision.compute);
  std::vector<double> b = matrix_operand(value_of(node, 1), batch, k, n, node.attrs.transpose_b,
                                         node.precision.compute);
  std::vector<double> row(static_cast<size_t>(n));
  Accumulator accumulator{node.precision.accum};
  for (int64_t bi = 0; bi < batch; ++bi)
    for (int64_t i = 0; i < m; ++i) {
      std::fill(row.begin(), row.end(), 0.0);
      const double* a_row = &a[(bi * m + i) * k];
      for (int64_t p = 0; p < k; ++p) {
        double av = a_row[p];
        const double* b_row = &b[(bi * k + p) * n];
        if (accumulator.rounds())
          for (int64_t j = 0; j < n; ++j) row[j] = accumulator.add(row[j], av * b_row[j]);
        else  // the common case, kept a plain loop so that it vectorizes
          for (int64_t j = 0; j < n; ++j) row[j] += av * b_row[j];
      }
      for (int64_t j = 0; j < n; ++j) store_element(*out, (bi * m + i) * n + j, row[j]);
    }
  return out;
}

// ---- convolutions ----
// Calls f(x index, w index, y index) for every tap of a 2-d convolution that reads the input (not
// its padding), each output element's taps in a row.
template <typename F>
void for_each_tap(const ConvGeometry& g, F f) {
  const ConvWindow& win = g.window;
  const int64_t cg = g.c / win.groups, og = g.o / win.groups;
  for (int64_t n = 0; n < g.n; ++n)
    for (int64_t o = 0; o < g.o; ++o)
      for (int64_t oy = 0; oy < g.oh; ++oy)
        for (int64_t ox = 0; ox < g.ow; ++ox) {
          const int64_t y_at = ((n * g.o + o) * g.oh + oy) * g.ow + ox;
          const int64_t first_channel = o / og * cg;
          for (int64_t ic = 0; ic < cg; ++ic)
            for (int64_t ky = 0; ky < g.kh; ++ky) {
              const int64_t iy = oy * win.stride[0] - win.pad[0] + ky * win.dil[0];
              if (iy < 0 || iy >= g.h) continue;
              for (int64_t kx = 0; kx < g.kw; ++kx) {
                const int64_t ix = ox * win.stride[1] - win.pad[1] + kx * win.dil[1];
                if (ix < 0 || ix >= g.w) continue;
                f(((n * g.c + first_channel + ic) * g.h + iy) * g.w + ix,
                  ((o * cg + ic) * g.kh + ky) * g.kw + kx, y_at);
              }
            }
        }
}

// The three primitives are one sum over the taps: of x * w into y (Conv2d), of gy * w into x's
// shape (Conv2dInputGrad), of x * gy into w's shape (Conv2dWeightGrad). Operands are rounded to
// the compute type first, as for matmul.
StoragePtr conv_reference(const Node& node) {
  const ConvGeometry g = ConvGeometry::of(node);
  const Storage &first = value_of(node, 0), &second = value_of(node, 1);
  std::vector<double> a = matrix_operand(first, 1, first.count, 1, false, node.precision.compute);
  std::vector<double> b = matrix_operand(second, 1, second.count, 1, false, node.precision.compute);
  std::vector<double> acc(static_cast<size_t>(node.numel()), 0.0);
  Accumulator accumulator{node.precision.accum};
  auto add = [&](int64_t at, double term) { acc[at] = accumulator.add(acc[at], term); };
  if (node.op == OpCode::Conv2d)
    for_each_tap(g, [&](int64_t x, int64_t w, int64_t y) { add(y, a[x] * b[w]); });
  else if (node.op == OpCode::Conv2dInputGrad)
    for_each_tap(g, [&](int64_t x, int64_t w, int64_t y) { add(x, a[y] * b[w]); });
  else
    for_each_tap(g, [&](int64_t x, int64_t w, int64_t y) { add(w, a[x] * b[y]); });
  StoragePtr out = new_storage(node);
  for (size_t i = 0; i < acc.size(); ++i) store_element(*out, static_cast<int64_t>(i), acc[i]);
  return out;
}

StoragePtr ref_Conv2d(const Node& node) { return conv_reference(node); }
StoragePtr ref_Conv2dInputGrad(const Node& node) { return conv_reference(node); }
StoragePtr ref_Conv2dWeightGrad(const Node& node) { return conv_reference(node); }

// ---- max pooling ----
// Each window's pick, PyTorch's rule: over the taps inside the input in row-major window order,
// the first tap, then any tap greater than the maximum so far or NaN. Calls f(x index, y index)
// per output element that has a tap (every window of a valid geometry has one).
template <typename F>
void for_each_pick(const PoolGeometry& g, const Storage& x, F f) {
  const PoolWindow& w = g.window;
  for (int64_t plane = 0; plane < g.n * g.c; ++plane)
    for (int64_t oy = 0; oy < g.oh; ++oy)
      for (int64_t ox = 0; ox < g.ow; ++ox) {
        int64_t pick = -1;
        double best = 0;
        for (int64_t ky = 0; ky < w.kernel[0]; ++ky) {
          const int64_t iy = oy * w.stride[0] - w.pad[0] + ky * w.dil[0];
          if (iy < 0 || iy >= g.h) continue;
          for (int64_t kx = 0; kx < w.kernel[1]; ++kx) {
            const int64_t ix = ox * w.stride[1] - w.pad[1] + kx * w.dil[1];
            if (ix < 0 || ix >= g.w) continue;
            const int64_t at = (plane * g.h + iy) * g.w + ix;
            const double v = load_element<double>(x, at);
            if (pick < 0 || v > best || std::isnan(v)) pick = at, best = v;
          }
        }
        if (pick >= 0) f(pick, (plane * g.oh + oy) * g.ow + ox);
      }
}

StoragePtr ref_MaxPool2d(const Node& node) {
  const PoolGeometry g = PoolGeometry::of(node);
  const Storage& x = value_of(node, 0);
  StoragePtr out = new_storage(node);
  for (int64_t i = 0; i < out->count; ++i)
    store_element(*out, i, -std::numeric_limits<double>::infinity());
  for_each_pick(
      g, x, [&](int64_t at, int64_t y) { store_element(*out, y, load_element<double>(x, at)); });
  return out;
}

// The gradients each position receives are summed in output order in f32 (f64 for f64 values),
// rounded once to the result's type: the order and rounding every back end follows.
StoragePtr ref_MaxPool2dGrad(const Node& node) {
  const PoolGeometry g = PoolGeometry::of(node);
  const Storage &x = value_of(node, 0), &gy = value_of(node, 1);
  const bool wide = node.precision.storage_type == f64 || gy.dtype == f64;
  std::vector<double> acc(static_cast<size_t>(node.numel()), 0.0);
  for_each_pick(g, x, [&](int64_t at, int64_t y) {
    const double sum = acc[static_cast<size_t>(at)] + load_element<double>(gy, y);
    acc[static_cast<size_t>(at)] = wide ? sum : static_cast<float>(sum);
  });
  StoragePtr out = new_storage(node);
  for (size_t i = 0; i < acc.size(); ++i)
    store_element(*out, static_cast<int64_t>(i), wide ? acc[i] : static_cast<float>(acc[i]));
  return out;
}

// ---- fused attention ----
// Materialized, in f64 over inputs rounded to the compute type: every score of a row, then its
// softmax (a masked key weighs 0; a row with no key left is zeros), rounded once at the output.
// Dropout multiplies each weight the values meet by its factor, 1/(1-p) or 0.
struct AttentionRows {
  AttentionGeometry g;
  DropoutDraw drop;
  std::vector<double> q, k, v, mask;
  AttentionRows(const Node& node, size_t mask_input) : g(AttentionGeometry::of(node)) {
    auto operand = [&](size_t i) {
      const Storage& in = value_of(node, i);
      return matrix_operand(in, 1, 1, in.count, false, node.precision.compute);
    };
    q = operand(0), k = operand(1), v = operand(2);
    if (g.has_mask) mask = load_all<double>(value_of(node, mask_input));
    if (g.has_dropout) drop = DropoutDraw::of(node);
  }
  // Row i of batch b's dropout factors (all 1 without dropout).
  std::vector<double> kept(int64_t b, int64_t i) const {
    std::vector<double> z(static_cast<size_t>(g.tk), 1.0);
    if (g.has_dropout) drop.scales(static_cast<uint64_t>((b * g.tq + i) * g.tk), g.tk, z.data());
    return z;
  }
  // Row i of batch b's weights.
  std::vector<double> weights(int64_t b, int64_t i) const {
    const double ninf = -std::numeric_limits<double>::infinity();
    std::vector<double> p(static_cast<size_t>(g.tk), ninf);
    double top = ninf;
    for (int64_t j = 0; j < g.key_end(i); ++j) {
      double s = 0;
      for (int64_t c = 0; c < g.d; ++c)
        s += q[(b * g.tq + i) * g.d + c] * k[(b * g.tk + j) * g.d + c];
      s *= g.scale;
      if (g.has_mask) {
        const double m = mask[g.mask_offset(b, i) + j * g.mask_col_stride];
        s = g.bool_mask ? (m != 0 ? s : ninf) : s + m;
      }
      p[j] = s;
      top = s > top || std::isnan(s) ? s : top;  // a NaN score makes the row NaN, as PyTorch's
    }
    double total = 0;
    for (double& x : p) total += x = top == ninf ? 0 : std::exp(x - top);
    for (double& x : p) x = top == ninf ? 0 : x / total;
    return p;
  }
};

StoragePtr ref_Attention(const Node& node) {
  const AttentionRows r(node, 3);
  const AttentionGeometry& g = r.g;
  StoragePtr out = new_storage(node);
  for (int64_t b = 0; b < g.batch; ++b)
    for (int64_t i = 0; i < g.tq; ++i) {
      std::vector<double> p = r.weights(b, i);
      const std::vector<double> z = r.kept(b, i);
      for (int64_t c = 0; c < g.dv; ++c) {
        double acc = 0;
        for (int64_t j = 0; j < g.tk; ++j) acc += p[j] * z[j] * r.v[(b * g.tk + j) * g.dv + c];
        store_element(*out, (b * g.tq + i) * g.dv + c, acc);
      }
    }
  return out;
}

// dV = (P Z)^T dO, dP = Z dO V^T, dS = P (dP - rowsum(dO O)), dQ = scale dS K, dK = scale dS^T
// Q, with Z the dropout factors.
StoragePtr ref_AttentionBackward(const Node& node) {
  const AttentionRows r(node, 5);
  const AttentionGeometry& g = r.g;
  const Storage &o_in = value_of(node, 3), &go_in = value_of(node, 4);
  const std::vector<double> o =
      matrix_operand(o_in, 1, 1, o_in.count, false, node.precision.compute);
  const std::vector<double> go =
      matrix_operand(go_in, 1, 1, go_in.count, false, node.precision.compute);
  const int64_t per_batch = g.tq * g.d + g.tk * (g.d + g.dv);
  std::vector<double> acc(static_cast<size_t>(g.batch * per_batch), 0.0);
  for (int64_t b = 0; b < g.batch; ++b) {
    double* dq = &acc[b * per_batch];
    double* dk = dq + g.tq * g.d;
    double* dv = dk + g.tk * g.d;
    for (int64_t i = 0; i < g.tq; ++i) {
      std::vector<double> p = r.weights(b, i);
      const std::vector<double> z = r.kept(b, i);
      const double* go_row = &go[(b * g.tq + i) * g.dv];
      double delta = 0;
      for (int64_t c = 0; c < g.dv; ++c) delta += go_row[c] * o[(b * g.tq + i) * g.dv + c];
      for (int64_t j = 0; j < g.tk; ++j) {
        if (p[j] == 0) continue;
        const double* v_row = &r.v[(b * g.tk + j) * g.dv];
        double dp = 0;
        for (int64_t c = 0; c < g.dv; ++c) {
          dp += go_row[c] * v_row[c];
          dv[j * g.dv + c] += p[j] * z[j] * go_row[c];
        }
        const double ds = p[j] * (z[j] * dp - delta) * g.scale;
        for (int64_t c = 0; c < g.d; ++c) {
          dq[i * g.d + c] += ds * r.k[(b * g.tk + j) * g.d + c];
          dk[j * g.d + c] += ds * r.q[(b * g.tq + i) * g.d + c];
        }
      }
    }
  }
  StoragePtr out = new_storage(node);
  for (size_t i = 0; i < acc.size(); ++i) store_element(*out, static_cast<int64_t>(i), acc[i]);
  return out;
}

// ---- indexing ----
int64_t checked_index(const Node& node, int64_t index, int64_t dim, int64_t axis) {
  if (index < 0 || index >= dim)
    node_fail(node, "index {} is out of range for axis {} of size {}", index, axis, dim);
  return index;
}

// The size of the axis the indices name: of the input IndexSelect and Gather read, of the
// result the others write.
int64_t indexed_dim(const Node& node) {
  const bool reads = node.op == OpCode::IndexSelect || node.op == OpCode::Gather;
  const Shape& shape = reads ? node.inputs[0]->shape : node.shape;
  return shape[node.attrs.axis];
}

StoragePtr ref_IndexSelect(const Node& node) {
  StoragePtr out = new_storage(node);
  const Shape& shape = node.inputs[0]->shape;
  int64_t axis = node.attrs.axis, outer = 1, inner = 1, dim = shape[axis];
  for (int64_t d = 0; d < axis; ++d) outer *= shape[d];
  for (size_t d = axis + 1; d < shape.size(); ++d) inner *= shape[d];
  std::vector<int64_t> index = checked_indices(node);
  int64_t count = static_cast<int64_t>(index.size());
  size_t bytes = size_of(node.precision.storage_type);
  StoragePtr converted = input_as_storage(node, 0);
  const Storage& in = *converted;
  for (int64_t o = 0; o < outer; ++o)
    for (int64_t j = 0; j < count; ++j)
      std::memcpy(out->host_data() + ((o * count + j) * inner) * bytes,
                  in.host_data() + ((o * dim + index[j]) * inner) * bytes, inner * bytes);
  return out;
}

StoragePtr ref_Check(const Node& node) {
  const Storage& ok = value_of(node, 1);
  for (int64_t i = 0; i < ok.count; ++i)
    if (!load_element<bool>(ok, i))
      node_fail(node, "{}", check_message(static_cast<CheckKind>(node.attrs.check)));
  return host_copy(*input_as_storage(node, 0));
}

StoragePtr ref_IndexAdd(const Node& node) {
  StoragePtr out = new_storage(node);
  const Shape& shape = node.shape;
  int64_t axis = node.attrs.axis, outer = 1, inner = 1, dim = shape[axis];
  for (int64_t d = 0; d < axis; ++d) outer *= shape[d];
  for (size_t d = axis + 1; d < shape.size(); ++d) inner *= shape[d];
  std::vector<int64_t> index = checked_indices(node);
  int64_t count = static_cast<int64_t>(index.size());
  // Integers add as integers (through doubles, 2^53 + 1 became 2^53), floats in doubles.
  auto accumulate = [&](auto zero) {
    using T = decltype(zero);
    std::vector<T> acc = load_all<T>(value_of(node, 0));
    const Accumulator accumulator{node.precision.accum};
    auto add_rows = [&](const auto* source) {
      for (int64_t o = 0; o < outer; ++o)
        for (int64_t j = 0; j < count; ++j) {
          T* to = acc.data() + (o * dim + index[j]) * inner;
          const auto* from = source + (o * count + j) * inner;
          if constexpr (std::is_floating_point_v<T>) {
            if (accumulator.rounds()) {  // a 16-bit accumulator a custom policy asked for
              for (int64_t i = 0; i < inner; ++i)
                to[i] = accumulator.add(to[i], static_cast<T>(from[i]));
              continue;
            }
          }
          for (int64_t i = 0; i < inner; ++i) to[i] += static_cast<T>(from[i]);
        }
    };
    // f32 sources (an embedding's gradient) are read in place; others through T.
    const Storage& source = value_of(node, 2);
    if (std::is_floating_point_v<T> && source.dtype == f32)
      add_rows(source.as<float>());
    else
      add_rows(load_all<T>(source).data());
    for (int64_t i = 0; i < out->count; ++i) store_element(*out, i, acc[i]);
  };
  if (is_floating(node.dtype))
    accumulate(double{});
  else
    accumulate(int64_t{});
  return out;
}

// Visits every element of `index_shape`, passing its flat position and the flat offset of the
// element it names in a tensor of `data_shape` (with the index value substituted on `axis`).
// The indices are checked_indices'.
template <typename F>
void for_each_gathered(const Shape& data_shape, const Shape& index_shape,
                       const std::vector<int64_t>& index, int64_t axis, F visit) {
  std::vector<int64_t> data_strides = strides_of(data_shape);
  std::vector<int64_t> position(index_shape.size(), 0);
  for (size_t i = 0; i < index.size(); ++i) {
    int64_t offset = 0;
    for (size_t d = 0; d < index_shape.size(); ++d) {
      int64_t coordinate = static_cast<int64_t>(d) == axis ? index[i] : position[d];
      offset += coordinate * data_strides[d];
    }
    visit(static_cast<int64_t>(i), offset);
    for (size_t d = index_shape.size(); d-- > 0;) {
      if (++position[d] < index_shape[d]) break;
      position[d] = 0;
    }
  }
}

StoragePtr ref_Gather(const Node& node) {
  StoragePtr out = new_storage(node);
  std::vector<int64_t> index = checked_indices(node);
  size_t bytes = size_of(node.precision.storage_type);
  StoragePtr converted = input_as_storage(node, 0);
  const Storage& in = *converted;
  for_each_gathered(
      node.inputs[0]->shape, node.shape, index, node.attrs.axis, [&](int64_t i, int64_t offset) {
        std::memcpy(out->host_data() + i * bytes, in.host_data() + offset * bytes, bytes);
      });
  return out;
}

StoragePtr ref_ScatterAdd(const Node& node) {
  StoragePtr out = new_storage(node);
  std::vector<int64_t> index = checked_indices(node);
  auto accumulate = [&](auto zero) {  // integers as integers, as ref_IndexAdd
    using T = decltype(zero);
    std::vector<T> acc = load_all<T>(value_of(node, 0));
    std::vector<T> source = load_all<T>(value_of(node, 2));
    const Accumulator accumulator{node.precision.accum};
    for_each_gathered(node.shape, node.inputs[1]->shape, index, node.attrs.axis,
                      [&](int64_t i, int64_t offset) {
                        if constexpr (std::is_floating_point_v<T>)
                          acc[offset] = accumulator.add(acc[offset], source[i]);
                        else
                          acc[offset] += source[i];
                      });
    for (int64_t i = 0; i < out->count; ++i) store_element(*out, i, acc[i]);
  };
  if (is_floating(node.dtype))
    accumulate(double{});
  else
    accumulate(int64_t{});
  return out;
}

StoragePtr ref_Scatter(const Node& node) {
  std::vector<int64_t> index = checked_indices(node);
  size_t bytes = size_of(node.precision.storage_type);
  StoragePtr base = input_as_storage(node, 0), source = input_as_storage(node, 2);
  StoragePtr out = new_storage(node);
  std::memcpy(out->host_data(), base->host_data(), static_cast<size_t>(out->size_bytes()));
  // In index order, so that of repeated positions the last write stays (PyTorch's CPU order).
  for_each_gathered(
      node.shape, node.inputs[1]->shape, index, node.attrs.axis, [&](int64_t i, int64_t offset) {
        std::memcpy(out->host_data() + offset * bytes, source->host_data() + i * bytes, bytes);
      });
  return out;
}

StoragePtr ref_Custom(const Node& node) { return input_as_storage(node, 0); }

StoragePtr ref_AllReduce(const Node& node) { return collective_value(node); }
StoragePtr ref_ReduceScatter(const Node& node) { return collective_value(node); }
StoragePtr ref_AllGather(const Node& node) { return collective_value(node); }

}  // namespace

StoragePtr input_as_storage(const Node& node, size_t i) {
  const StoragePtr& in = node.inputs[i]->value;
  if (in->dtype == node.precision.storage_type) return in;
  return converted(*in, node.precision.storage_type);
}

std::vector<int64_t> checked_indices(const Node& node) {
  std::vector<int64_t> index = load_all<int64_t>(value_of(node, 1));
  int64_t dim = indexed_dim(node);
  for (int64_t i : index) checked_index(node, i, dim, node.attrs.axis);
  return index;
}

std::shared_ptr<Storage> reference_compute(const Node& node) {
  switch (node.op) {
#define MT_OP(Name, fname, kind, arity, category) \
  case OpCode::Name:                              \
    return ref_##Name(node);
#define MT_UNARY(Name, fname, category, domain, REF, VJP) \
  case OpCode::Name:                                      \
    return map_pointwise<1>(node, [](auto a) {            \
      using T = decltype(a);                              \
      return static_cast<T>(REF);                         \
    });
#define MT_BINARY(Name, fname, category, domain, REF, VJP0, VJP1) \
  case OpCode::Name:                                              \
    return map_pointwise<2>(node, [](auto a, auto b) {            \
      using T = decltype(a);                                      \
      return T(REF);                                              \
    });
#define MT_COMPARE(Name, fname, REF) \
  case OpCode::Name:                 \
    return map_pointwise<2>(node, [](auto a, auto b) { return REF; });
#define MT_FUSED(Name, fname, arity, REF)                                                     \
  case OpCode::Name:                                                                          \
    return map_pointwise<arity, kFusedMaxArity>(                                              \
        node,                                                                                 \
        [](auto a, [[maybe_unused]] auto b, [[maybe_unused]] auto c, [[maybe_unused]] auto d, \
           [[maybe_unused]] auto e, [[maybe_unused]] auto f, [[maybe_unused]] auto g) {       \
          using T = decltype(a);                                                              \
          return T(REF);                                                                      \
        });
#include "mixtape/dsl/ops.def"
  }
  node_fail(node, "unknown op code {}", static_cast<int>(node.op));
}

}  // namespace mixtape

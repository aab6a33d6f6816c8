// mixtape/runtime/cpu_indexing.cpp -- the CPU loops of the indexing primitives. Every op visits
// the elements of its index (IndexSelect and IndexAdd: of their result and source) as
// [outer, along, inner] around the axis, each naming a position of the data: the offset of its
// outer and inner coordinates plus its index value times the axis's stride. Two elements with
// different outer or inner coordinates never name the same position, so the team splits the outer
// and inner coordinates and walks `along` in order: a position's writes (Scatter: the last stays)
// and sums (in f64, rounded once, as the reference executor adds) keep the reference's order.
#include "mixtape/runtime/cpu_indexing.h"

#include <omp.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <vector>

#include "mixtape/dsl/convert.h"
#include "mixtape/runtime/device.h"
#include "mixtape/runtime/reference_executor.h"
#include "mixtape/runtime/scratch_buffer.h"

namespace mixtape {
namespace {

// Below this many visited elements a run stays on one thread (the team costs more).
constexpr int64_t kParallelElements = int64_t{1} << 15;

bool selects_rows(OpCode op) { return op == OpCode::IndexSelect || op == OpCode::IndexAdd; }
bool adds(OpCode op) { return op == OpCode::IndexAdd || op == OpCode::ScatterAdd; }

// The shape of the data whose positions the elements name (what Gather and IndexSelect read,
// what the others write) and of the elements visited: the index's, and for IndexSelect and
// IndexAdd (whose index, of any rank, names rows) the data's with its indices along the axis.
const Shape& data_shape(const Node& node) {
  return node.op == OpCode::IndexSelect || node.op == OpCode::Gather ? node.inputs[0]->shape
                                                                     : node.shape;
}
Shape visited_shape(const Node& node) {
  if (!selects_rows(node.op)) return node.inputs[1]->shape;
  Shape rows = data_shape(node);
  rows[static_cast<size_t>(node.attrs.axis)] = numel(node.inputs[1]->shape);
  return rows;
}

struct Geometry {
  int64_t outer = 1, along = 1, inner = 1;
  int64_t axis_stride = 1;        // the data's stride along the axis
  std::vector<int64_t> outer_at;  // the data offset of each outer coordinate
  std::vector<int64_t> inner_at;  // and of each inner coordinate
  int64_t elements() const { return outer * along * inner; }
};

// The data offsets of the coordinates of `shape[from, to)` in row-major order, for a data tensor
// whose strides are `strides`.
std::vector<int64_t> offsets_of(const Shape& shape, const std::vector<int64_t>& strides,
                                size_t from, size_t to) {
  std::vector<int64_t> offsets{0};
  for (size_t d = from; d < to; ++d) {
    std::vector<int64_t> next;
    next.reserve(offsets.size() * static_cast<size_t>(shape[d]));
    for (int64_t base : offsets)
      for (int64_t c = 0; c < shape[d]; ++c) next.push_back(base + c * strides[d]);
    offsets = std::move(next);
  }
  return offsets;
}

Geometry geometry_of(const Node& node) {
  const Shape visited = visited_shape(node), &data = data_shape(node);
  const size_t axis = static_cast<size_t>(node.attrs.axis);
  std::vector<int64_t> strides(data.size(), 1);
  for (size_t d = data.size(); d-- > 1;) strides[d - 1] = strides[d] * data[d];
  Geometry g;
  for (size_t d = 0; d < axis; ++d) g.outer *= visited[d];
  g.along = visited[axis];
  for (size_t d = axis + 1; d < visited.size(); ++d) g.inner *= visited[d];
  g.axis_stride = strides[axis];
  if (g.elements() == 0) return g;
  g.outer_at = offsets_of(visited, strides, 0, axis);
  g.inner_at = offsets_of(visited, strides, axis + 1, visited.size());
  return g;
}

bool parallel(const Geometry& g) {
  return g.elements() >= kParallelElements && omp_get_max_threads() > 1;
}

// Calls visit(element, position, n) for every visited element (its flat index in the visited
// shape) and the data position it names, n = 1, or for runs of n elements naming n consecutive
// positions (IndexSelect's and IndexAdd's rows); the team splits outer and inner coordinates.
template <typename Visit>
void for_each_run(const Node& node, const Geometry& g, const int64_t* indices, Visit visit) {
  if (g.elements() == 0) return;
  const bool rows = selects_rows(node.op);  // inner coordinates are the data's: inner_at[q] = q
  // Enough blocks for the team to share evenly; at least 64 inner coordinates a block.
  const int64_t wanted = 4 * static_cast<int64_t>(omp_get_max_threads());
  const int64_t chunk = g.outer >= wanted
                            ? g.inner
                            : std::max<int64_t>(64, (g.inner * g.outer + wanted - 1) / wanted);
  const int64_t chunks = (g.inner + chunk - 1) / chunk;
  // Locals, so that the loops keep them in registers (the visits store through pointers).
  const int64_t *outer_at = g.outer_at.data(), *inner_at = g.inner_at.data();
  const int64_t along = g.along, inner = g.inner, stride = g.axis_stride;
#pragma omp parallel if (parallel(g))
  {
    FlushDenormalScope float_mode;  // the team's threads may be the caller's too
#pragma omp for schedule(static)
    for (int64_t block = 0; block < g.outer * chunks; ++block) {
      const int64_t o = block / chunks, q0 = block % chunks * chunk;
      const int64_t q1 = std::min(inner, q0 + chunk), base = outer_at[o];
      if (inner == 1) {  // the last axis (then q0 = 0, q1 = 1): no inner loop
        const int64_t first = o * along;
        if (rows)
          for (int64_t j = 0; j < along; ++j) visit(first + j, base + indices[j] * stride, 1);
        else
          for (int64_t j = 0; j < along; ++j)
            visit(first + j, base + indices[first + j] * stride, 1);
      } else if (rows) {
        for (int64_t j = 0; j < along; ++j)
          visit((o * along + j) * inner + q0, base + indices[j] * stride + q0, q1 - q0);
      } else {
        for (int64_t j = 0; j < along; ++j) {
          const int64_t row = (o * along + j) * inner;
          for (int64_t q = q0; q < q1; ++q)
            visit(row + q, base + indices[row + q] * stride + inner_at[q], 1);
        }
      }
    }
  }
}

// Copies elements of `bytes` bytes as one unsigned integer type of that width.
template <typename F>
void with_element_type(size_t bytes, F&& f) {
  switch (bytes) {
    case 1:
      return f(uint8_t{});
    case 2:
      return f(uint16_t{});
    case 4:
      return f(uint32_t{});
    default:
      return f(uint64_t{});
  }
}

void copy_elements(const Node& node, const Geometry& g, const int64_t* index, Storage& out) {
  with_element_type(size_of(node.precision.storage_type), [&](auto zero) {
    using E = decltype(zero);
    E* to = reinterpret_cast<E*>(out.host_data());
    if (node.op == OpCode::Scatter) {
      const std::shared_ptr<Storage> base = input_as_storage(node, 0),
                                     source = input_as_storage(node, 2);
      std::memcpy(to, base->host_data(), static_cast<size_t>(out.size_bytes()));
      const E* from = reinterpret_cast<const E*>(source->host_data());
      for_each_run(node, g, index, [to, from](int64_t i, int64_t at, int64_t n) {
        for (int64_t k = 0; k < n; ++k) to[at + k] = from[i + k];
      });
      return;
    }
    const std::shared_ptr<Storage> data = input_as_storage(node, 0);
    const E* from = reinterpret_cast<const E*>(data->host_data());
    for_each_run(node, g, index, [to, from](int64_t i, int64_t at, int64_t n) {
      for (int64_t k = 0; k < n; ++k) to[i + k] = from[at + k];
    });
  });
}

void add_elements(const Node& node, const Geometry& g, const int64_t* index, Storage& out) {
  // The f64 sums in a workspace kept between calls (a fresh one faults in its pages each time,
  // as long as the adds themselves took), from the values' allocator so that the peak counts it.
  thread_local ScratchBuffer workspace;
  double* sums = workspace.get<double>(out.count);
  const Storage& base = *node.inputs[0]->value;
  const float* base_f32 = base.dtype == f32 ? base.as<float>() : nullptr;
  if (base.count > 0) base.host_data();  // fetched once, outside the team
#pragma omp parallel if (out.count >= kParallelElements)
  {
    FlushDenormalScope float_mode;
#pragma omp for schedule(static)
    for (int64_t i = 0; i < out.count; ++i)
      sums[i] = base_f32 ? base_f32[i] : load_element<double>(base, i);
  }
  auto add = [&](const auto* from) {
    for_each_run(node, g, index, [sums, from](int64_t i, int64_t at, int64_t n) {
      for (int64_t k = 0; k < n; ++k) sums[at + k] += static_cast<double>(from[i + k]);
    });
  };
  const Storage& source = *node.inputs[2]->value;
  if (source.dtype == f32)  // an embedding's or an upsampling's gradient: read in place
    add(source.as<float>());
  else
    add(load_all<double>(source).data());
  // Rounded once, as store_element rounds (its f32 case without the per-element switch).
  float* out_f32 = out.dtype == f32 ? out.as<float>() : nullptr;
  if (out.count > 0) out.host_data();
#pragma omp parallel if (out.count >= kParallelElements)
  {
    FlushDenormalScope float_mode;
#pragma omp for schedule(static)
    for (int64_t i = 0; i < out.count; ++i) {
      if (out_f32)
        out_f32[i] = static_cast<float>(sums[i]);
      else
        store_element(out, i, sums[i]);
    }
  }
  workspace.trim();
}

}  // namespace

bool indexing_cpu_supported(const Node& node) {
  switch (node.op) {
    case OpCode::IndexSelect:
    case OpCode::Gather:
    case OpCode::Scatter:
      return true;
    case OpCode::IndexAdd:
    case OpCode::ScatterAdd:
      // Integer sums and a 16-bit accumulator a custom policy asks for take the reference's.
      return is_floating(node.dtype) && !is_half(node.precision.accum);
    default:
      return false;
  }
}

bool indexing_cpu_splits(const Node& node) {
  // The sums' widening and rounding passes go over the result, which may be far larger than
  // the index (a few rows added into an embedding table's gradient).
  const int64_t work = std::max(numel(visited_shape(node)), adds(node.op) ? node.numel() : 0);
  return indexing_cpu_supported(node) && work >= kParallelElements && omp_get_max_threads() > 1;
}

void indexing_cpu(const Node& node, Storage& out) {
  const Geometry g = geometry_of(node);
  // The indices, read in place where they are i64; an index out of range is the reference's
  // error (checked_indices names the first).
  const Storage& stored = *node.inputs[1]->value;
  std::vector<int64_t> copied;
  const int64_t* index = nullptr;
  if (stored.dtype == i64) {
    index = stored.as<int64_t>();
    const auto size = static_cast<uint64_t>(data_shape(node)[node.attrs.axis]);
    bool inside = true;
    for (int64_t i = 0; i < stored.count; ++i) inside &= static_cast<uint64_t>(index[i]) < size;
    if (!inside) checked_indices(node);
  } else {
    copied = checked_indices(node);
    index = copied.data();
  }
  if (adds(node.op))
    add_elements(node, g, index, out);
  else
    copy_elements(node, g, index, out);
}

}  // namespace mixtape

// mixtape/runtime/cpu_sort.cpp -- the CPU loops of Argsort. Each element becomes an unsigned key
// whose order is the reference's (runtime/reference_executor.cpp): floats by their bits with
// the sign folded in, -0 as +0, every NaN above +inf; descending flips the key, so NaN comes
// first, as torch.sort puts it. Sorting (key, position) pairs is then a stable sort: equal keys
// keep their positions' order. Floats (f32, bf16, f16: 32-bit keys) pack the pair into one
// 64-bit word. Lines are independent, so the team splits them.
#include "mixtape/runtime/cpu_sort.h"

#include <omp.h>

#include <algorithm>
#include <bit>
#include <cstdint>
#include <type_traits>
#include <utility>
#include <vector>

#include "mixtape/dsl/convert.h"
#include "mixtape/runtime/axis_lines.h"
#include "mixtape/runtime/device.h"

namespace mixtape {
namespace {

// Below this many elements a run stays on one thread (the team costs more).
constexpr int64_t kParallelElements = int64_t{1} << 14;

// The key of an element, ascending: unsigned order is the reference's order.
template <typename Bits, typename T>
Bits ordered_key(T v) {
  if (v != v) return ~Bits{0};  // NaN, any sign or payload, above everything
  const Bits bits = std::bit_cast<Bits>(v == 0 ? T(0) : v);  // -0 sorts as +0
  constexpr Bits sign = Bits{1} << (8 * sizeof(Bits) - 1);
  return bits & sign ? ~bits : bits | sign;
}

uint64_t key_of(float v) { return ordered_key<uint32_t>(v); }
uint64_t key_of(double v) { return ordered_key<uint64_t>(v); }
uint64_t key_of(int64_t v) { return static_cast<uint64_t>(v) ^ (uint64_t{1} << 63); }

template <typename T>
void sort_lines(const Node& node, const std::vector<T>& in, int64_t* out) {
  const AxisLines lines(node.shape, node.attrs.axis);
  constexpr bool packed = std::is_same_v<T, float>;  // a 32-bit key and a 32-bit position
  const uint64_t flip = !node.attrs.reverse ? 0 : packed ? 0xffffffffu : ~uint64_t{0};
  const int64_t count = lines.count();
#pragma omp parallel if (count > 1 && count * lines.dim >= kParallelElements)
  {
    FlushDenormalScope float_mode;                    // the team's threads may be the caller's too
    std::vector<uint64_t> words;                      // packed: key << 32 | position
    std::vector<std::pair<uint64_t, int64_t>> pairs;  // otherwise
#pragma omp for schedule(static)
    for (int64_t line = 0; line < count; ++line) {
      const int64_t first = lines.at(line, 0);
      auto at = [&](int64_t k) { return first + k * lines.inner; };
      if constexpr (packed) {
        words.resize(static_cast<size_t>(lines.dim));
        for (int64_t k = 0; k < lines.dim; ++k)
          words[k] = (key_of(in[at(k)]) ^ flip) << 32 | static_cast<uint64_t>(k);
        std::sort(words.begin(), words.end());
        for (int64_t k = 0; k < lines.dim; ++k)
          out[at(k)] = static_cast<int64_t>(words[k] & 0xffffffffu);
      } else {
        pairs.resize(static_cast<size_t>(lines.dim));
        for (int64_t k = 0; k < lines.dim; ++k) pairs[k] = {key_of(in[at(k)]) ^ flip, k};
        std::sort(pairs.begin(), pairs.end());
        for (int64_t k = 0; k < lines.dim; ++k) out[at(k)] = pairs[k].second;
      }
    }
  }
}

}  // namespace

bool argsort_cpu_supported(const Node& node) {
  return node.op == OpCode::Argsort && node.precision.storage_type == i64 &&
         node.shape[node.attrs.axis] < (int64_t{1} << 32);
}

bool argsort_cpu_splits(const Node& node) {
  return argsort_cpu_supported(node) && node.numel() >= kParallelElements &&
         node.numel() > node.shape[node.attrs.axis] && omp_get_max_threads() > 1;
}

void argsort_cpu(const Node& node, Storage& out) {
  const Storage& in = *node.inputs[0]->value;
  int64_t* positions = out.as<int64_t>();
  // Compared as the reference compares: in f64, in f32 (the 16-bit floats widen exactly), or
  // as 64-bit integers.
  const DType type = node.inputs[0]->dtype;
  if (type == f64)
    sort_lines(node, load_all<double>(in), positions);
  else if (is_floating(type))
    sort_lines(node, load_all<float>(in), positions);
  else
    sort_lines(node, load_all<int64_t>(in), positions);
}

}  // namespace mixtape

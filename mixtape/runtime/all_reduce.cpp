// mixtape/runtime/all_reduce.cpp -- the all_reduce step: reduce-scatter by rank-ordered sums, then
// all-gather, over the installed process group's byte transfers.
#include "mixtape/runtime/all_reduce.h"

#include <chrono>
#include <cstring>
#include <limits>
#include <mutex>
#include <vector>

#include "mixtape/dsl/convert.h"
#include "mixtape/dsl/graph.h"
#include "mixtape/dsl/process_group.h"

namespace mixtape {
namespace {

std::mutex stats_mutex;
CollectiveStats stats;

// Counts one collective step into the stats when it ends, however it ends.
class CollectiveTimer {
 public:
  explicit CollectiveTimer(int64_t bytes) : bytes_(bytes) {}
  ~CollectiveTimer() {
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
    std::lock_guard lock(stats_mutex);
    ++stats.calls;
    stats.bytes += bytes_;
    stats.seconds += seconds;
  }
  CollectiveTimer(const CollectiveTimer&) = delete;
  CollectiveTimer& operator=(const CollectiveTimer&) = delete;

 private:
  int64_t bytes_;
  std::chrono::steady_clock::time_point start_ = std::chrono::steady_clock::now();
};

// chunk[q] .. chunk[q + 1]: the elements process q sums, as even as the count allows.
std::vector<int64_t> chunk_bounds(int64_t count, int processes) {
  std::vector<int64_t> bounds(static_cast<size_t>(processes) + 1);
  for (int q = 0; q <= processes; ++q)
    bounds[q] = count / processes * q + std::min<int64_t>(q, count % processes);
  return bounds;
}

// out[i] = in[0][i] + in[1][i] + ... + in[P - 1][i], left to right in A, rounded once to out's
// dtype. `in` holds the P pieces one after the other, `width` elements each.
template <typename A>
void sum_in_rank_order(const Storage& in, int processes, int64_t width, Storage& out) {
  if (in.dtype == f32 && std::is_same_v<A, float>) {  // the common case: f32 gradients
    // Piece by piece, each added to every element's running sum: the same additions in the
    // same order as element by element, in loops that vectorize.
    const float* x = in.as<float>();
    float* y = out.as<float>();
    std::memcpy(y, x, static_cast<size_t>(width) * sizeof(float));
    for (int q = 1; q < processes; ++q) {
      const float* piece = x + q * width;
      for (int64_t i = 0; i < width; ++i) y[i] += piece[i];
    }
    return;
  }
  for (int64_t i = 0; i < width; ++i) {
    A acc = load_element<A>(in, i);
    for (int q = 1; q < processes; ++q) acc += load_element<A>(in, q * width + i);
    store_element(out, i, acc);
  }
}

// Node values in the storage type (the policy may store the input otherwise).
std::shared_ptr<Storage> input_in(const Node& node, DType dtype) {
  const std::shared_ptr<Storage>& in = node.inputs[0]->value;
  if (in->dtype == dtype) return in;
  auto out = std::make_shared<Storage>(dtype, in->count, Storage::Uninitialized{});
  for (int64_t i = 0; i < in->count; ++i)
    if (is_floating(dtype))
      store_element(*out, i, load_element<double>(*in, i));
    else
      store_element(*out, i, load_element<int64_t>(*in, i));
  return out;
}

}  // namespace

CollectiveStats collective_stats() {
  std::lock_guard lock(stats_mutex);
  return stats;
}

void reset_collective_stats() {
  std::lock_guard lock(stats_mutex);
  stats = {};
}

std::shared_ptr<Storage> all_reduce_value(const Node& node) {
  std::shared_ptr<Storage> in = input_in(node, node.precision.storage_type);
  ProcessGroup* group = process_group();
  if (!group || group->size() == 1) return in;
  CollectiveTimer timer(in->size_bytes());
  const int processes = group->size(), rank = group->rank();
  const int64_t count = in->count,
                element = static_cast<int64_t>(size_of(node.precision.storage_type));
  const std::vector<int64_t> bounds = chunk_bounds(count, processes);
  const int64_t width = bounds[rank + 1] - bounds[rank];
  std::vector<int64_t> send_count(processes), send_at(processes), recv_count(processes),
      recv_at(processes);
  for (int q = 0; q < processes; ++q) {
    send_count[q] = (bounds[q + 1] - bounds[q]) * element;
    send_at[q] = bounds[q] * element;
    recv_count[q] = width * element;
    recv_at[q] = q * width * element;
  }
  auto pieces = allocate_value(node, node.precision.storage_type, width * processes, true);
  group->all_to_all(in->host_data(), send_count, send_at, pieces->host_data(), recv_count, recv_at);
  auto mine = allocate_value(node, node.precision.storage_type, width, true);
  if (node.precision.storage_type == f64 || node.precision.accum == f64)
    sum_in_rank_order<double>(*pieces, processes, width, *mine);
  else if (is_floating(node.precision.storage_type))
    sum_in_rank_order<float>(*pieces, processes, width, *mine);
  else
    sum_in_rank_order<int64_t>(*pieces, processes, width, *mine);
  pieces.reset();
  auto out = allocate_value(node, node.precision.storage_type, count, true);
  group->all_gather(mine->host_data(), width * element, out->host_data(), send_count, send_at);
  return out;
}

}  // namespace mixtape

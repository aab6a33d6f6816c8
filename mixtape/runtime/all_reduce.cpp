// mixtape/runtime/all_reduce.cpp -- the collective steps: all_reduce (reduce-scatter by
// rank-ordered sums, then all-gather), reduce_scatter and all_gather, over byte transfers.
#include "mixtape/runtime/all_reduce.h"

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <future>
#include <limits>
#include <mutex>
#include <thread>
#include <vector>

#include "mixtape/dsl/convert.h"
#include "mixtape/dsl/error.h"
#include "mixtape/dsl/graph.h"
#include "mixtape/dsl/process_group.h"
#include "mixtape/runtime/device.h"

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

// The accumulator of a node's sums: f64 for f64 values or accumulation, f32 for the other
// floats, i64 for integers.
DType accumulator(const Node& node) {
  const DType dtype = node.precision.storage_type;
  if (dtype == f64 || node.precision.accum == f64) return f64;
  return is_floating(dtype) ? f32 : i64;
}

// out[i] = in[0][i] + in[1][i] + ... + in[P - 1][i], left to right in A, rounded once to out's
// dtype. `in` holds the P pieces one after the other, `width` elements each.
template <typename A>
void add_pieces(const Storage& in, int processes, int64_t width, Storage& out) {
  if (in.dtype == f32 && std::is_same_v<A, float>) {  // the common case: f32 gradients
    const float* x = in.as<float>();
    float* y = out.as<float>();
    // Piece by piece, each added to every element's running sum: the same additions in the
    // same order as element by element, in loops that vectorize.
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

// A host value in `dtype` (the policy may store a collective's input otherwise).
std::shared_ptr<Storage> converted(const std::shared_ptr<Storage>& in, DType dtype) {
  if (in->dtype == dtype) return in;
  auto out = std::make_shared<Storage>(dtype, in->count, Storage::Uninitialized{});
  for (int64_t i = 0; i < in->count; ++i)
    if (is_floating(dtype))
      store_element(*out, i, load_element<double>(*in, i));
    else
      store_element(*out, i, load_element<int64_t>(*in, i));
  return out;
}

// Host memory, moved by the installed ProcessGroup; the input value as the caller took it.
class HostTransport : public CollectiveTransport {
 public:
  HostTransport(ProcessGroup& group, std::shared_ptr<Storage> input)
      : group_(group), input_(std::move(input)) {}
  int rank() const override { return group_.rank(); }
  int size() const override { return group_.size(); }
  std::shared_ptr<Storage> input(const Node&, DType dtype) override {
    return converted(input_, dtype);
  }
  std::shared_ptr<Storage> allocate(const Node& node, DType dtype, int64_t count) override {
    return allocate_value(node, dtype, count, true);
  }
  void all_to_all(Storage& send, std::span<const int64_t> send_count,
                  std::span<const int64_t> send_at, Storage& recv,
                  std::span<const int64_t> recv_count, std::span<const int64_t> recv_at) override {
    group_.all_to_all(send.host_data(), send_count, send_at, recv.host_data(), recv_count, recv_at);
  }
  void all_gather(Storage& send, int64_t bytes, Storage& recv, std::span<const int64_t> counts,
                  std::span<const int64_t> at) override {
    group_.all_gather(send.host_data(), bytes, recv.host_data(), counts, at);
  }
  void sum_in_rank_order(Storage& pieces, int processes, int64_t width, DType accum,
                         Storage& out) override {
    add_pieces_on_host(pieces, processes, width, accum, out);
  }

 private:
  ProcessGroup& group_;
  std::shared_ptr<Storage> input_;
};

std::shared_ptr<Storage> host_value(const Node& node, std::shared_ptr<Storage> input) {
  ProcessGroup* group = process_group();
  if (!group) return converted(input, node.precision.storage_type);
  CollectiveNodeScope made_for(node);
  HostTransport transport(*group, std::move(input));
  return collective_value(node, transport);
}

// The communication thread: collectives run one after another, in the order started, beside the
// evaluating thread (MPI_THREAD_SERIALIZED: one thread in MPI at a time, and between the runs that
// start them the evaluating thread makes its own calls only once they are done).
class CollectiveThread {
 public:
  CollectiveThread() : thread_([this] { serve(); }) {}
  ~CollectiveThread() {
    {
      std::lock_guard lock(mutex_);
      stopping_ = true;
    }
    ready_.notify_one();
    thread_.join();
  }
  std::future<std::shared_ptr<Storage>> post(std::packaged_task<std::shared_ptr<Storage>()> job) {
    auto value = job.get_future();
    {
      std::lock_guard lock(mutex_);
      jobs_.push_back(std::move(job));
    }
    ready_.notify_one();
    return value;
  }

 private:
  void serve() {
    for (;;) {
      std::packaged_task<std::shared_ptr<Storage>()> job;
      {
        std::unique_lock lock(mutex_);
        ready_.wait(lock, [this] { return stopping_ || !jobs_.empty(); });
        if (jobs_.empty()) return;
        job = std::move(jobs_.front());
        jobs_.pop_front();
      }
      job();  // an error goes to the future
    }
  }
  std::mutex mutex_;
  std::condition_variable ready_;
  std::deque<std::packaged_task<std::shared_ptr<Storage>()>> jobs_;
  bool stopping_ = false;
  std::thread thread_;  // last: started once the rest exists
};

// Each process sums its chunk bounds[rank] .. bounds[rank + 1] of `in` over every process, in
// rank order: the reduce-scatter half of every reduction. Returns the summed chunk.
std::shared_ptr<Storage> sum_my_chunk(const Node& node, Storage& in, CollectiveTransport& transport,
                                      const std::vector<int64_t>& bounds) {
  const int processes = transport.size(), rank = transport.rank();
  const DType dtype = node.precision.storage_type;
  const int64_t element = static_cast<int64_t>(size_of(dtype));
  const int64_t width = bounds[rank + 1] - bounds[rank];
  std::vector<int64_t> send_count(processes), send_at(processes), recv_count(processes),
      recv_at(processes);
  for (int q = 0; q < processes; ++q) {
    send_count[q] = (bounds[q + 1] - bounds[q]) * element;
    send_at[q] = bounds[q] * element;
    recv_count[q] = width * element;
    recv_at[q] = q * width * element;
  }
  auto pieces = transport.allocate(node, dtype, width * processes);
  transport.all_to_all(in, send_count, send_at, *pieces, recv_count, recv_at);
  auto mine = transport.allocate(node, dtype, width);
  transport.sum_in_rank_order(*pieces, processes, width, accumulator(node), *mine);
  return mine;
}

}  // namespace

void add_pieces_on_host(const Storage& pieces, int processes, int64_t width, DType accum,
                        Storage& out) {
  if (width == 0) return;  // this process's chunk is empty (fewer elements than processes)
  if (accum == f64)
    add_pieces<double>(pieces, processes, width, out);
  else if (accum == f32)
    add_pieces<float>(pieces, processes, width, out);
  else
    add_pieces<int64_t>(pieces, processes, width, out);
}

CollectiveStats collective_stats() {
  std::lock_guard lock(stats_mutex);
  return stats;
}

void reset_collective_stats() {
  std::lock_guard lock(stats_mutex);
  stats = {};
}

namespace {

std::shared_ptr<Storage> all_reduce_value(const Node& node, CollectiveTransport& transport) {
  std::shared_ptr<Storage> in = transport.input(node, node.precision.storage_type);
  if (transport.size() == 1) return in;
  CollectiveTimer timer(in->size_bytes());
  const int processes = transport.size();
  const int64_t count = in->count,
                element = static_cast<int64_t>(size_of(node.precision.storage_type));
  const std::vector<int64_t> bounds = chunk_bounds(count, processes);
  std::shared_ptr<Storage> mine = sum_my_chunk(node, *in, transport, bounds);
  std::vector<int64_t> counts(processes), at(processes);
  for (int q = 0; q < processes; ++q) {
    counts[q] = (bounds[q + 1] - bounds[q]) * element;
    at[q] = bounds[q] * element;
  }
  auto out = transport.allocate(node, node.precision.storage_type, count);
  transport.all_gather(*mine, mine->count * element, *out, counts, at);
  return out;
}

std::shared_ptr<Storage> reduce_scatter_value(const Node& node, CollectiveTransport& transport) {
  std::shared_ptr<Storage> in = transport.input(node, node.precision.storage_type);
  if (transport.size() == 1) return in;
  CollectiveTimer timer(in->size_bytes());
  const int processes = transport.size();
  if (in->count != node.shape[0] * processes)
    fail("reduce_scatter: built for {} elements per process over {} processes, run over {}",
         node.shape[0], in->count / std::max(node.shape[0], int64_t{1}), processes);
  std::vector<int64_t> bounds(static_cast<size_t>(processes) + 1);
  for (int q = 0; q <= processes; ++q) bounds[q] = q * node.shape[0];
  return sum_my_chunk(node, *in, transport, bounds);
}

std::shared_ptr<Storage> all_gather_value(const Node& node, CollectiveTransport& transport) {
  std::shared_ptr<Storage> in = transport.input(node, node.precision.storage_type);
  if (transport.size() == 1) return in;
  CollectiveTimer timer(in->size_bytes());
  const int processes = transport.size();
  if (in->count * processes != node.shape[0])
    fail("all_gather: built for {} elements from {} processes, run over {}", node.shape[0],
         node.shape[0] / std::max(in->count, int64_t{1}), processes);
  const int64_t bytes = in->size_bytes();
  std::vector<int64_t> counts(processes, bytes), at(processes);
  for (int q = 0; q < processes; ++q) at[q] = q * bytes;
  auto out = transport.allocate(node, in->dtype, in->count * processes);
  transport.all_gather(*in, bytes, *out, counts, at);
  return out;
}

}  // namespace

std::shared_ptr<Storage> collective_value(const Node& node, CollectiveTransport& transport) {
  switch (node.op) {
    case OpCode::AllReduce:
      return all_reduce_value(node, transport);
    case OpCode::ReduceScatter:
      return reduce_scatter_value(node, transport);
    case OpCode::AllGather:
      return all_gather_value(node, transport);
    default:
      fail("internal: {} is not a collective op", op_name(node.op));
  }
}

std::shared_ptr<Storage> collective_value(const Node& node) {
  return host_value(node, node.inputs[0]->value);
}

std::future<std::shared_ptr<Storage>> start_collective(const Node& node) {
  static CollectiveThread thread;
  // The input moves into the work, so that its buffer goes when the sum is done, not when the
  // run collects the value; the thread rounds subnormals as the evaluating thread does.
  return thread.post(std::packaged_task<std::shared_ptr<Storage>()>(
      [&node, input = node.inputs[0]->value]() mutable {
        apply_flush_denormal();
        return host_value(node, std::move(input));
      }));
}

void note_collective_wait(double seconds) {
  std::lock_guard lock(stats_mutex);
  stats.waited_seconds += seconds;
}

void note_steps_beside_collectives(int64_t steps) {
  std::lock_guard lock(stats_mutex);
  stats.steps_beside += steps;
}

}  // namespace mixtape

// mixtape/runtime/all_reduce.h -- the collective ops' steps (all_reduce, reduce_scatter,
// all_gather): deterministic sums over the processes of the run, the same on every back end.
#pragma once

#include <cstdint>
#include <future>
#include <memory>
#include <span>

#include "mixtape/dsl/node.h"

namespace mixtape {

/// The collective steps this process ran since reset_execution_stats() (which clears these too):
/// how many, the bytes of their inputs, and their wall time, waiting for the other processes
/// included. What a data-parallel step spends in communication against its compute.
struct CollectiveStats {
  int64_t calls = 0;
  int64_t bytes = 0;
  double seconds = 0;
  /// Of a run that overlaps them (runtime/program.h, overlap_collectives): the seconds the
  /// evaluating thread waited for collectives, and the steps it ran while one was in flight.
  double waited_seconds = 0;
  int64_t steps_beside = 0;
};
CollectiveStats collective_stats();
void reset_collective_stats();

/// Where a collective step's values live and how their bytes move between the processes: host
/// memory through the installed ProcessGroup (MPI), or device memory through NCCL
/// (runtime/cuda_collectives.cpp). Which process sums which elements, and in which order, is
/// the same on both, so both give the same bits.
class CollectiveTransport {
 public:
  virtual ~CollectiveTransport() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  /// The node's input 0 in `dtype` (the policy may store it otherwise).
  virtual std::shared_ptr<Storage> input(const Node& node, DType dtype) = 0;
  virtual std::shared_ptr<Storage> allocate(const Node& node, DType dtype, int64_t count) = 0;
  /// ProcessGroup::all_to_all over the values' bytes (counts and offsets in bytes).
  virtual void all_to_all(Storage& send, std::span<const int64_t> send_count,
                          std::span<const int64_t> send_at, Storage& recv,
                          std::span<const int64_t> recv_count,
                          std::span<const int64_t> recv_at) = 0;
  /// ProcessGroup::all_gather: each process's first `bytes` of `send` at recv[at[r]].
  virtual void all_gather(Storage& send, int64_t bytes, Storage& recv,
                          std::span<const int64_t> counts, std::span<const int64_t> at) = 0;
  /// out[i] = pieces[i] + pieces[width + i] + ... + pieces[(processes - 1) width + i], added
  /// left to right in `accum` (f32, f64 or i64), rounded once to out's dtype.
  virtual void sum_in_rank_order(Storage& pieces, int processes, int64_t width, DType accum,
                                 Storage& out) = 0;
};

/// CollectiveTransport::sum_in_rank_order in host memory: out[i] = pieces[i] + pieces[width + i]
/// + ... over `processes` pieces of out's dtype, left to right in `accum`, rounded once.
void add_pieces_on_host(const Storage& pieces, int processes, int64_t width, DType accum,
                        Storage& out);

/// A collective node's value through `transport`:
/// - all_reduce: each process sums one contiguous chunk of the elements over every process in
///   rank order (accumulated in f32, f64 for f64, i64 for integers; rounded once to the node's
///   storage type), then every process gathers every chunk, so the bits are the same on every
///   process and in every run of the same world size;
/// - reduce_scatter: this process's equal share of the sum, added as all_reduce adds (ZeRO-1's
///   gradient reduction);
/// - all_gather: every process's input in rank order (bytes only).
std::shared_ptr<Storage> collective_value(const Node& node, CollectiveTransport& transport);
/// The same through the installed ProcessGroup in host memory; one process: the input.
std::shared_ptr<Storage> collective_value(const Node& node);
/// collective_value(node) on the communication thread (one per process, collectives in the order
/// started), for a run that goes on meanwhile: the input's value is taken now, so the run may
/// drop the input node's; the node's other fields must stay until the future is ready.
std::future<std::shared_ptr<Storage>> start_collective(const Node& node);
/// Counted by run_program for collective_stats().
void note_collective_wait(double seconds);
void note_steps_beside_collectives(int64_t steps);

}  // namespace mixtape

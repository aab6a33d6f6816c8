// mixtape/dsl/process_group.h -- the processes a data-parallel run spans, as the collective ops
// (all_reduce) see them: an interface that dist/ implements with MPI; none installed is one
// process.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>

namespace mixtape {

/// Moves bytes between the processes of a run. Every process must make the same calls in the
/// same order (a collective): the programs of a data-parallel step are the same graph on each.
class ProcessGroup {
 public:
  virtual ~ProcessGroup() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  /// Process r sends send[send_at[q], +send_count[q]) to q, which keeps it at
  /// recv[recv_at[r], +recv_count[r]) (MPI_Alltoallv, in bytes).
  virtual void all_to_all(const std::byte* send, std::span<const int64_t> send_count,
                          std::span<const int64_t> send_at, std::byte* recv,
                          std::span<const int64_t> recv_count,
                          std::span<const int64_t> recv_at) = 0;
  /// Each process's `count` bytes land at recv[at[r], +counts[r]) on every process
  /// (MPI_Allgatherv).
  virtual void all_gather(const std::byte* send, int64_t count, std::byte* recv,
                          std::span<const int64_t> counts, std::span<const int64_t> at) = 0;
  /// root's `count` bytes at `data` replace everyone's (MPI_Bcast).
  virtual void broadcast(std::byte* data, int64_t count, int root) = 0;
};

struct Node;
/// While one lives, the collectives this thread makes through the process group are made for
/// `node` (a collective node of a graph that runs), which MIXTAPE_DIST_DEBUG's check
/// (dist/checked_group.h) compares between the processes by its op and where it was built, and
/// names. Scopes nest; outside any, a collective is made for no node (a host exchange).
class CollectiveNodeScope {
 public:
  explicit CollectiveNodeScope(const Node& node);
  ~CollectiveNodeScope();
  CollectiveNodeScope(const CollectiveNodeScope&) = delete;
  CollectiveNodeScope& operator=(const CollectiveNodeScope&) = delete;

 private:
  const Node* previous_;
};
/// The node of this thread's innermost CollectiveNodeScope, or null.
const Node* collective_node();

/// The installed group (dist::init installs MPI's); null: one process.
ProcessGroup* process_group();
void set_process_group(std::shared_ptr<ProcessGroup> group);
/// set_process_group returning the group it replaces: a test runs one process's code (null)
/// inside a run of several, then puts the group back.
std::shared_ptr<ProcessGroup> exchange_process_group(std::shared_ptr<ProcessGroup> group);
/// process_group()'s rank and size, 0 and 1 without one.
int process_rank();
int process_count();

struct TensorImpl;
/// Marks a parameter's gradient as sharded over the processes: each process holds its own
/// elements of the reduced gradient and zeros elsewhere (dist::Zero leaves them so), so a norm
/// over them (grad_norm) adds the processes' partial sums, and dist::DataParallel leaves their
/// reduction to ZeRO. Unmarked when `sharded` is false.
void set_gradient_sharded(const TensorImpl* parameter, bool sharded);
bool gradient_sharded(const TensorImpl* parameter);
/// gradient_sharded, and its gradient held as shards now: not while a no_sync hold is taken or
/// local gradients wait for the backward that folds them in (each process then holds its own
/// whole local gradient). What grad_norm and gradient_health add up over the processes.
bool gradient_held_as_shards(const TensorImpl* parameter);

/// dist::DataParallel::no_sync's state. While a hold is taken (holds nest), backward() leaves
/// the gradients local: the data-parallel reductions (DataParallel's all_reduce, ZeRO's
/// reduce_scatter) make no collective, and a reducer whose parameters took local gradients
/// counts itself pending (add_pending_local_gradients) until the next reducing backward, which
/// folds them into its reduction.
void hold_gradient_sync();
void release_gradient_sync();
bool gradient_sync_held();
void add_pending_local_gradients(int delta);
/// "" for an ordinary step, "no_sync" while a hold is taken, "unsynced" for the step that folds
/// the local gradients in: the variant of the graph a backward makes, which mt::compile keys its
/// traces on, so that a replay never runs the graph of another variant.
const char* gradient_sync_variant();

}  // namespace mixtape

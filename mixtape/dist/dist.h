// mixtape/dist/dist.h -- data-parallel training over processes: dist::init (MPI, from mpirun's
// environment), DataParallel (gradients averaged in the step's graph), shard() for loaders.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "mixtape/autograd/grad.h"
#include "mixtape/dsl/data.h"
#include "mixtape/dsl/module.h"

namespace mixtape::dist {

class LocalGradients;

/// The processes of this run, as init() found them.
struct World {
  int rank = 0;
  int size = 1;
  /// Why the run is one process (empty when it spans several): no MPI in this build, no MPI
  /// launcher in the environment, or a launcher that started one process.
  std::string single_reason;
  /// Why collectives on GPU values go through host memory and MPI instead of NCCL (empty when
  /// NCCL carries them): one process, NCCL or CUDA missing on some process, or MIXTAPE_NCCL=0.
  std::string nccl_reason;
};

/// Joins the processes an MPI launcher (mpirun -np N) started, from its environment, and
/// installs them as the process group every collective op uses; without a launcher, or in a
/// build without MPI, the run is one process and the result says why. Call it before any
/// training step; later calls return the first one's result. MPI is finalized at exit.
World init();
/// How long a collective waits for the other processes (default 300 s, as the 5 min):
/// a process that died or hangs makes the others fail with an mt::Error after it instead of
/// waiting forever. (mpirun itself ends the whole job when a process dies.)
void set_timeout(double seconds);
/// This process's rank and the number of processes (0 and 1 before init()).
int rank();
int world_size();
/// This process's share of every epoch, for DataLoader (same seed on every process).
Shard shard();

struct DataParallelOptions {
  /// Gradients are reduced in buckets of about this many bytes, as PyTorch DDP's 25 MB ones:
  /// each bucket is one all_reduce node.
  int64_t bucket_bytes = int64_t{25} << 20;
  /// The first bucket's size (DDP's 1 MB): it holds the last layers' gradients, which the
  /// backward pass finishes first, so that their reduction starts early.
  int64_t first_bucket_bytes = int64_t{1} << 20;
  /// Reduce in this type (bf16 halves the bytes moved, as DDP's bf16 compression hook) and
  /// cast back; unset: in each parameter's own type (f32 for f32 master weights, whatever
  /// type autocast gave their gradients, as PyTorch AMP's gradients are f32).
  std::optional<DType> reduce_dtype = std::nullopt;
};

/// PyTorch's DistributedDataParallel for `module`: at construction every process checks that
/// the parameters and buffers (names, shapes, dtypes) agree with rank 0's (an mt::Error naming
/// the first difference, on every process, otherwise) and takes rank 0's values; afterwards
/// every backward() replaces the module's parameter gradients by their average over the
/// processes: all_reduce nodes in the step's graph (sum in rank order, then / world_size), so
/// GradScaler, clip_grad_norm and the optimizers see the global gradients, and mt::compile
/// replays the reduction with the rest of the step. The module's buffers (batch norm's running
/// statistics) then take rank 0's values, in the same graph, as DDP's broadcast_buffers: each
/// process updates its own from its batch, and every backward() replaces them by rank 0's, so
/// they are the same bits on every process after each step and follow rank 0's batches (what
/// DDP's broadcast before each forward gives). With one process it changes nothing. Keep it
/// alive for as long as the module trains.
class DataParallel {
 public:
  explicit DataParallel(Module& module, DataParallelOptions options = {});
  ~DataParallel();
  DataParallel(const DataParallel&) = delete;
  DataParallel& operator=(const DataParallel&) = delete;

  Module& module() const { return *module_; }
  const DataParallelOptions& options() const { return options_; }
  /// The all_reduce nodes (buckets) the last backward() made.
  int64_t last_buckets() const { return last_buckets_; }

  /// PyTorch DDP's no_sync, for gradient accumulation: while the guard lives, backward() makes
  /// no collective and accumulates each process's own gradients into .grad; the next backward
  /// outside it reduces the accumulated sums with its own gradients (the micro-steps' sum,
  /// averaged over the processes).
  ///   for (int micro = 0; micro + 1 < k; ++micro) {
  ///     auto guard = ddp.no_sync();
  ///     (loss(micro) / k).backward();
  ///   }
  ///   (loss(k - 1) / k).backward();  // reduces
  ///   opt.step();
  /// The hold is the process's: it also suspends a ZeRO optimizer's reduce_scatter. mt::compile
  /// keys its traces on it (dsl/process_group.h's gradient_sync_variant()), so a step compiled
  /// under no_sync and the same step compiled outside it each replay their own graph; a guard
  /// taken inside a compiled function is part of its trace.
  class [[nodiscard]] NoSync {
   public:
    NoSync();
    ~NoSync();
    NoSync(const NoSync&) = delete;
    NoSync& operator=(const NoSync&) = delete;
  };
  NoSync no_sync() const { return NoSync(); }

 private:
  void average(LeafGradients& gradients);
  // Sets every buffer to rank 0's value (all_reduce nodes, appended to `collectives`).
  void take_rank0_buffers(std::vector<Tensor>& collectives);

  Module* module_;
  DataParallelOptions options_;
  // The module's parameters that take gradients, in the module's order (the same on every
  // process): what every reduction covers, whichever of them this process's backward reached.
  std::vector<std::weak_ptr<TensorImpl>> params_;
  int64_t hook_ = 0;
  int64_t last_buckets_ = 0;
  std::unique_ptr<LocalGradients> local_;  // no_sync's pending local gradients
};

}  // namespace mixtape::dist

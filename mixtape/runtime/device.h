// mixtape/runtime/device.h -- choosing where graphs run (MIXTAPE_DEVICE, MIXTAPE_EAGER) and
// execution stats.
#pragma once

#include <cstdint>

namespace mixtape {

enum class Device : uint8_t {
  reference,  // the per-op oracle (runtime/reference_executor.cpp)
  cpu,        // fused kernels compiled by LLVM, matmuls by oneDNN
  cuda,       // NVIDIA GPUs: NVRTC kernels, cuBLASLt matmuls (runtime/cuda_executor.h)
};

/// The device evaluation uses. Starts as MIXTAPE_DEVICE (cpu | reference | cuda | auto; default
/// and auto: cuda when the CUDA back end can run here, else cpu, saying why on stderr once when
/// an NVIDIA driver is present but fails); an unknown value is an mt::Error at the first
/// evaluation. cuda (here or in set_device) is an mt::Error with the reason when CUDA cannot run.
Device current_device();
void set_device(Device device);
const char* device_name(Device device);

/// Eager mode: one kernel per op, no fusion (MIXTAPE_EAGER=1 or eager_scope), for debugging and
/// as the unfused baseline of benchmarks.
bool eager_mode();
void set_eager_mode(bool eager);
/// Asynchronous optimizer steps on the CPU (on by default; MIXTAPE_ASYNC=0 at start turns it
/// off). Optimizer::step's evaluation of a small program (every kernel and product below its
/// threading threshold, no convolution, pooling or attention) that ran before queues its kernels
/// and matmuls on a worker thread (the CPU stream, runtime/cpu_stream.h) and returns: the
/// training loop traces the next step while they run, as with CUDA streams, JAX's asynchronous
/// dispatch or MLX's async_eval. Results are bit-identical. Reading a value on the host (item(),
/// to_vector(), a checkpoint) waits for the work that computes it, and writing a buffer that
/// queued work reads (set_lr) waits for that work. Every other evaluation runs as before, and so
/// do mt::compile's traces and replays, MIXTAPE_LOG=profile and several processes. The worker
/// runs the queued work alone on one core: an OpenMP team of the caller's that spins between its
/// regions (OMP_WAIT_POLICY=active) shares that core. An error in queued work (an internal
/// failure: nothing a user's values can cause) is reported by the next read, or
/// mt::synchronize(), and every value it left uncomputed is an mt::Error when read.
void set_async_evaluation(bool on);
bool async_evaluation();
/// Waits until every evaluation queued so far, on the CPU stream and on the GPU, has finished;
/// an mt::Error if one failed.
void synchronize();
/// Flush-to-zero on the CPU, as torch.set_flush_denormal: subnormal results of float arithmetic
/// become zero and subnormal inputs count as zero (x86 MXCSR's FTZ and DAZ), in kernels, matmuls
/// and host ops alike. Off by default (IEEE). Worth it where values decay through the subnormals
/// (Adam's moments of parameters whose gradients are zero): each such operation costs x86 a
/// microcode assist. MIXTAPE_FLUSH_DENORMAL=1 turns it on at start. Returns false, changing
/// nothing, where the CPU has no such mode.
bool set_flush_denormal(bool on);
bool flush_denormal();
/// Sets the calling thread's float mode to the setting above; the back ends call it on each
/// thread of their own that runs a step (cheap when nothing changes).
void apply_flush_denormal();
/// The setting above on a thread that is not ours (the caller of an evaluation, an exported
/// artifact's NAME_run, an OpenMP team thread) for the scope's life, and the mode the thread had
/// given back after: a program built with -ffast-math (FTZ and DAZ on) keeps its mode, and
/// mixtape's results do not depend on it.
class FlushDenormalScope {
 public:
  FlushDenormalScope();
  ~FlushDenormalScope();
  FlushDenormalScope(const FlushDenormalScope&) = delete;
  FlushDenormalScope& operator=(const FlushDenormalScope&) = delete;

 private:
  unsigned saved_ = 0;
};
/// TF32 tensor cores for f32 matmuls on the cuda device, as torch.backends.cuda.matmul.allow_tf32
/// (torch.set_float32_matmul_precision("high")): operands rounded to TF32's 10-bit mantissa, f32
/// accumulation (CUBLAS_COMPUTE_32F_FAST_TF32), several times the f32 rate at about 1e-3
/// relative error. Off by default, so f32 matmuls are IEEE f32 products; MIXTAPE_ALLOW_TF32=1
/// turns it on at start. Read at every matmul launch, so it applies to programs built before
/// (and to mt::compile replays). Half-precision matmuls and the CPU back ends are unaffected.
/// cuDNN's f32 convolutions follow it too (TF32 tensor-core kernels allowed, else FMA ones only).
void set_allow_tf32(bool allow);
bool allow_tf32();
/// cuDNN for convolutions on the cuda device (runtime/cudnn.h), as torch.backends.cudnn.enabled:
/// on by default, where libcudnn loads; MIXTAPE_CUDNN=0 turns it off at start. Off, or where cuDNN
/// is missing or has no deterministic direct algorithm for a problem, the fixed kernels' direct
/// loops run them with the reference's bits, far slower. Read at every convolution.
void set_use_cudnn(bool use);
bool use_cudnn();

class eager_scope {
 public:
  explicit eager_scope(bool eager = true);
  ~eager_scope();
  eager_scope(const eager_scope&) = delete;
  eager_scope& operator=(const eager_scope&) = delete;

 private:
  bool previous_;
};

/// Counters of the compiled back end since the process started (or the last reset).
struct ExecutionStats {
  int64_t evaluations = 0;         // calls that ran something
  int64_t evaluations_queued = 0;  // of those, queued on the CPU stream (async_evaluation)
  int64_t programs_built = 0;      // evaluations of a new graph structure: fused and lowered
  int64_t programs_reused = 0;     // evaluations that replayed a program built before
  int64_t kernels = 0;             // generated kernels launched
  int64_t kernel_nodes = 0;        // graph nodes computed inside them
  int64_t gemms = 0;               // library matmuls
  int64_t convolutions = 0;        // library convolutions (and their gradients)
  int64_t host_ops = 0;            // ops run by the reference loops (gathers, random, ...)
  int64_t bytes_read = 0;          // by kernels and matmuls, from their parameters
  int64_t bytes_written = 0;
  // Kernel outputs computed into the buffer of an input that was no longer needed (an optimizer's
  // update into the old parameter and state: dsl/reusable_buffers.h) rather than a fresh one.
  int64_t outputs_in_place = 0;
  int64_t peak_bytes = 0;  // most bytes of one evaluation's stored values alive at once
  // The process's measured memory high-water marks since the last reset (or start): the host
  // allocator's live bytes (dsl/host_memory.h: every value, so parameters, gradients, optimizer
  // state, activations and batches, and the library calls' workspace) and the CUDA caching
  // allocator's allocated bytes (0 without a GPU); memory_peak_bytes is their sum.
  int64_t host_peak_bytes = 0;
  int64_t device_peak_bytes = 0;
  int64_t memory_peak_bytes = 0;
  int64_t bytes_uploaded = 0;     // cuda: host values copied to the device (constants, batches)
  int64_t bytes_downloaded = 0;   // cuda: device values copied to the host (reads, host ops)
  int64_t kernels_compiled = 0;   // LLVM and NVRTC compilations (disk-cache misses)
  int64_t kernels_from_disk = 0;  // LLVM objects and CUDA images taken from the kernel cache
  double compile_seconds = 0;
  double load_seconds = 0;  // their fetch and load (for CUDA: to a function ready to launch)
  // Host wall time of evaluations by phase: what the traced loop pays each step beyond running
  // the program (bench/trace_phases.cpp reports them per step). Building programs and compiling
  // are in lookup_seconds; the programs' steps (kernels, matmuls) in run_seconds.
  double pending_seconds = 0;    // finding the unevaluated nodes the outputs need
  double precision_seconds = 0;  // the precision policy pass
  double sign_seconds = 0;       // the graph's signature (cpu back end; cuda's is in run)
  double lookup_seconds = 0;     // the program cache (cpu back end; cuda's is in run)
  double run_seconds = 0;        // running the program, and what the evaluation does after it
                                 // (for a queued evaluation: binding it, and waiting to queue)
};
ExecutionStats execution_stats();
void reset_execution_stats();

}  // namespace mixtape

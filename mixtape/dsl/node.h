// mixtape/dsl/node.h -- graph nodes: op codes and per-op facts generated from ops.def, attributes,
// storage.
#pragma once

#include <atomic>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <source_location>
#include <string>
#include <vector>

#include "mixtape/dsl/dtype.h"
#include "mixtape/dsl/host_memory.h"
#include "mixtape/dsl/node_inputs.h"
#include "mixtape/dsl/shape.h"

namespace mixtape {

enum class OpCode : uint16_t {
#define MT_OP(Name, fname, kind, arity, category) Name,
#include "mixtape/dsl/ops.def"
};

/// What an op is to fusion and the graph walkers (dsl/ops.def says which kind each op is).
enum class OpKind : uint8_t {
  Leaf,
  Pointwise,
  Reduce,     // a reduction kernels fuse: sum, max
  ArgReduce,  // one they do not: argmax
  Scan,       // a running reduction along one axis (cumsum): a host step
  Sort,       // an order along one axis (argsort): a host step
  MatMul,
  Conv,       // a convolution or one of its gradients: a library call, as MatMul
  Pool,       // max pooling or its gradient: a loop of runtime/pool.h, a fixed kernel on CUDA
  Attention,  // fused attention or its gradient: runtime/attention.h's tiles, a host step
  View,       // an affine index map kernels read through: reshape, permute, broadcast_to, slice
  Copy,       // data movement that is not one: unslice, concat
  Gather,
  // A collective (all_reduce): a host step on every back end that every process of the run
  // joins (dsl/process_group.h); its value is never released for recomputation, since a
  // recomputation on one process would be a collective the others never join.
  Collective,
  Opaque
};

/// Precision categories (DESIGN.md decision 4); the policy pass maps them to dtypes. Like: the
/// type the op's last input is stored in (cast_like).
enum class Category : uint8_t { LowOk, Fp32, Fp32Accum, Promote, Follow, Like };

struct OpInfo {
  const char* name;  // the user-facing function name, used in errors and reports
  OpKind kind;
  int arity;  // -1: variadic
  Category category;
  bool differentiable;  // false: the result never requires grad (detach, sign, comparisons)
};

const OpInfo& op_info(OpCode op);
inline const char* op_name(OpCode op) { return op_info(op).name; }
int op_count();

/// Waits until everything queued on the CPU stream has run (runtime/cpu_stream.h); then an
/// mt::Error if some of it failed since the last call. Returns at once on the stream's thread.
void finish_cpu_stream();
/// Whether the calling thread is the CPU stream's worker.
bool on_cpu_stream();

struct DeviceCopy;  // a value's copy in device memory, defined by the device back end

/// A flat buffer of elements of one dtype, row-major and contiguous. A value computed on a GPU
/// lives there (`device`) and has no host copy until something on the host reads it: every host
/// read goes through host_data() / as<T>(), which fetches it (synchronizing with the device)
/// the first time. Values made on the host keep `device` empty until a device back end uploads
/// them, once, and keeps the copy here. A value that work queued on the CPU stream computes
/// (async_evaluation()) is read only once that work has run.
struct Storage {
  DType dtype;
  int64_t count;
  // The host copy: valid unless host_stale; empty until first read for device-only values.
  // Read it through host_data() (or as<T>()), never directly.
  std::vector<std::byte, HostAllocator<std::byte>> bytes;
  std::shared_ptr<DeviceCopy> device;  // opaque to dsl; runtime/cuda_executor.cpp defines it
  std::atomic<bool> host_stale{false};
  // How many times a tensor's value or gradient has moved off this buffer (moved_off below),
  // or its requires_grad flag changed. mt::compile's replay plans carry state in buffers: one
  // they carry that a tensor left (assign, load_state, set_grad, zero_grad, a gradient
  // accumulated outside the step) makes them trace again, whatever else still holds the buffer
  // (another plan, a detached copy).
  std::atomic<uint32_t> moves_off{0};
  // Pieces of work queued on the CPU stream (runtime/cpu_stream.h) that have not run yet and
  // read or write this buffer, and those of them that write it: the host bytes are not this
  // value's until the writers have run.
  std::atomic<int32_t> queued_uses{0}, queued_writes{0};

  /// Zeros (every dtype's zero is all-zero bits).
  Storage(DType dtype, int64_t count)
      : dtype(dtype),
        count(count),
        bytes(static_cast<size_t>(count) * size_of(dtype), std::byte{0}) {}
  /// Uninitialized bytes, for a value about to be written whole (a kernel's output).
  struct Uninitialized {};
  Storage(DType dtype, int64_t count, Uninitialized)
      : dtype(dtype), count(count), bytes(static_cast<size_t>(count) * size_of(dtype)) {}
  /// A value that exists only on the device; the host bytes are allocated on first read.
  Storage(DType dtype, int64_t count, std::shared_ptr<DeviceCopy> device_copy)
      : dtype(dtype), count(count), device(std::move(device_copy)), host_stale(true) {}
  Storage(const Storage&) = delete;
  Storage& operator=(const Storage&) = delete;

  /// The host bytes, fetched from the device first if they are stale. Waits for the CPU stream
  /// first where queued work writes them, or, as the caller may write through the pointer, reads
  /// them.
  std::byte* host_data() {
    if (host_stale.load(std::memory_order_acquire) ||
        queued_uses.load(std::memory_order_acquire) > 0) [[unlikely]]
      settle_host();
    return bytes.data();
  }
  /// The same for reading: waits only where queued work writes them.
  const std::byte* host_data() const {
    if (host_stale.load(std::memory_order_acquire) ||
        queued_writes.load(std::memory_order_acquire) > 0) [[unlikely]]
      const_cast<Storage*>(this)->settle_host();
    return bytes.data();
  }
  /// Whether the host bytes hold the value now: not on a device only, nor queued to be written.
  bool host_ready() const {
    return !host_stale.load(std::memory_order_acquire) &&
           queued_writes.load(std::memory_order_acquire) == 0;
  }
  template <typename T>
  T* as() {
    return reinterpret_cast<T*>(host_data());
  }
  template <typename T>
  const T* as() const {
    return reinterpret_cast<const T*>(host_data());
  }
  /// Call after writing the host bytes in place: a device copy would no longer match.
  void host_written() { device.reset(); }
  int64_t size_bytes() const { return count * static_cast<int64_t>(size_of(dtype)); }
  /// Exchanges the values (host bytes and device copy) of two storages of one dtype and size,
  /// so that every holder of this one sees `other`'s value: how mt::compile updates state in
  /// place.
  void swap_value(Storage& other) {
    // Queued work reads and writes the bytes by address; a value it failed to compute stays
    // marked on its storage (host_data() then fails), whose bytes this would hand on unmarked.
    if (queued_uses.load(std::memory_order_acquire) > 0 ||
        other.queued_uses.load(std::memory_order_acquire) > 0) {
      settle_host();
      other.settle_host();
    }
    bytes.swap(other.bytes);
    device.swap(other.device);
    bool stale = host_stale.load();
    host_stale.store(other.host_stale.load());
    other.host_stale.store(stale);
  }

  /// How a device back end copies a stale value to the host: fills `bytes` (sized by then) and
  /// clears host_stale. Registered by the back end before it makes its first device value.
  using HostFetch = void (*)(Storage& storage);
  static void set_host_fetch(HostFetch fetch);

 private:
  void settle_host();  // dsl/tensor.cpp
};

/// A buffer of its own holding `value`'s host bytes as they are now (fetched from the device
/// first, where the host copy is stale): a snapshot that later writes of `value` do not reach.
std::shared_ptr<Storage> host_copy(const Storage& value);

class Policy;  // precision_policy/policy.h
struct TensorImpl;
class Tensor;

/// The vjp of a user-defined op: (inputs, output, incoming gradient) -> one gradient per input.
using CustomVjp = std::function<std::vector<Tensor>(const std::vector<Tensor>& inputs,
                                                    const Tensor& output, const Tensor& grad)>;

using Ints = std::vector<int64_t>;

/// Per-op parameters, one field per line of dsl/attrs.def; each op reads only the fields its line
/// there names.
struct Attrs {
#define MT_ATTR(type, name, default_value, hashed, ops) type name = default_value;
#include "mixtape/dsl/attrs.def"
  std::shared_ptr<CustomVjp> vjp;  // Custom
};

/// Whether two values of an attribute are the same, doubles by their bits (-0 is not 0, a NaN
/// is itself): what the program signature and an exported plan compare with the default.
template <typename T>
bool same_attr(const T& a, const T& b) {
  if constexpr (std::is_floating_point_v<T>)
    return std::bit_cast<uint64_t>(a) == std::bit_cast<uint64_t>(b);
  else
    return a == b;
}

/// A node's precision (DESIGN.md decision 4), as the policy pass decided it before the node
/// runs; until then every type equals the one tracing gave the node.
struct NodePrecision {
  DType storage_type = f32;  // what the value is stored as (rounded RNE to it)
  DType compute = f32;       // what float data inputs are rounded to before the op
  DType accum = f32;         // what reductions and matmuls accumulate in
  bool assigned = false;     // the pass has decided (or an importer has set) the types above
  std::shared_ptr<const std::string> rule;  // why the policy chose them (reports)

  /// What a node traced as `dtype` has until the pass decides: f32 accumulation (f64 for f64).
  static NodePrecision traced(DType dtype) {
    NodePrecision precision;
    precision.storage_type = precision.compute = dtype;
    precision.accum = dtype == f64 ? f64 : f32;
    return precision;
  }
};

/// One call of a module's forward pass (a ModulePathScope, dsl/graph.h): the module's path and
/// the call it was made in. Activation checkpointing recomputes each call from its own inputs,
/// so a module called twice in a step (weights shared) is two regions.
struct ModuleCall {
  std::string path;
  std::shared_ptr<const ModuleCall> parent;
};

/// Where a node was made: what the policy pass matches on and what reports and errors name.
struct NodeOrigin {
  std::shared_ptr<const Policy> policy;  // the autocast policy active when the node was made
  const char* composite = nullptr;       // the outermost composite (softmax, ...) that made it
  std::source_location location;
  std::string module_path;
  std::shared_ptr<const ModuleCall> module_call;  // the innermost call module_path names
};

/// One value of the lazy graph. Nodes are immutable once made, except that evaluation fills
/// `value` and may drop `inputs` of nodes no gradient will ever flow through.
///
/// The fields every pass reads (graph walks, the precision pass, signing a graph, running it)
/// come first and fit in the first two cache lines: the traced loop builds and walks a few
/// hundred nodes every step, and where they sat among the fields only reports read, each node
/// cost several cache misses per pass. Dr.Jit's compact Variable is the model.
struct Node : std::enable_shared_from_this<Node> {
  // Not `= default`: make_shared value-initializes, which zero-fills a class whose default
  // constructor is implicit before running it, and every field has an initializer anyway.
  Node() {}
  /// A node of `op` with the traced types and the parts make_node hands over, moved in as the
  /// node is built rather than assigned after (the traced loop makes hundreds every step).
  Node(OpCode op, DType dtype, Shape&& shape, NodeInputs&& inputs, Attrs&& attrs,
       const std::string& module_path)
      : op(op),
        dtype(dtype),
        precision(NodePrecision::traced(dtype)),
        shape(std::move(shape)),
        inputs(std::move(inputs)),
        attrs(std::move(attrs)) {
    origin.module_path = module_path;
  }

  OpCode op = OpCode::Constant;
  DType dtype = f32;

  // `dtype` is what tracing typed; the policy pass fills `precision` before the node runs.
  NodePrecision precision;

  bool requires_grad = false;
  bool backward_done = false;  // a backward() without retain_graph went through this node
  bool backward = false;       // made by autograd for the forward node below
  // A clone of a checkpointed forward node that a backward pass made to recompute it
  // (autograd/recompute.h): a forward node in every respect but this, read only by the backward.
  bool recomputed = false;
  // A Cast that type promotion made (ops.cpp's conform: a bf16 or integer operand of an f32 op),
  // not one the user asked for: policies treat it as part of the op that reads it, as PyTorch's
  // autocast sees no such cast (a bf16 operand stays bf16, an integer one does not widen).
  bool promotion = false;
  // Of those, one of an integer or boolean operand: weak beside float operands, as a Python
  // number is (kept here: an evaluated node's inputs are dropped, and policies still ask).
  bool weak_promotion = false;
  // An evaluation computed a new value into this node's buffer (dsl/reusable_buffers.h): its
  // value is no longer its own, and an evaluation that reads it fails.
  bool overwritten = false;
  OpCode forward_op = OpCode::Constant;

  // Scratch of the evaluation that computes this node: its ref in the signature sign() made for
  // it (runtime/program.h): its index in the pending list while it is pending, the negative ref
  // of an external input once evaluated. Only trusted where that list says the same.
  int32_t sign_slot = -1;
  // Scratch of a backward pass through it (autograd/backward.cpp): the slot of its gradient's
  // terms, valid while grad_walk is that pass's number. Marks instead of maps keyed by address:
  // the traced loop runs a backward pass every step.
  int32_t grad_slot = -1;
  uint64_t grad_walk = 0;
  uint64_t pending_walk = 0;  // the last pending_nodes() walk that reached it
  uint64_t id = 0;            // creation order: the tape order that backward walks in reverse

  std::shared_ptr<Storage> value;  // set once evaluated (always set for Constant)
  Shape shape;
  NodeInputs inputs;
  Attrs attrs;

  NodeOrigin origin;
  // The tensor this leaf is the value of (requires_grad_, assign): where backward() accumulates
  // its gradient if it requires one, and what mt::compile reads a value assigned outside the
  // step through.
  std::weak_ptr<TensorImpl> grad_owner;
  // Its companion, once made (make_companion, dsl/graph.h): the node with the id after its own.
  std::weak_ptr<Node> companion;

  bool evaluated() const { return value != nullptr; }
  int64_t numel() const { return mixtape::numel(shape); }
};

/// Records that a tensor's value (or gradient) moves from node `from` to node `to` (null: none):
/// the buffer `from` held, when `to` does not hold it too, counts one more move off (see
/// Storage::moves_off).
inline void moved_off(const Node* from, const Node* to) {
  if (from != nullptr && from->value != nullptr && (to == nullptr || to->value != from->value))
    from->value->moves_off.fetch_add(1, std::memory_order_relaxed);
}

}  // namespace mixtape

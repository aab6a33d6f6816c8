// mixtape/codegen/fusion.h -- partitions the nodes of one evaluation into kernels, library calls
// and host ops.
#pragma once

#include <string>
#include <unordered_map>
#include <vector>

#include "mixtape/codegen/kernel_ir.h"
#include "mixtape/dsl/node.h"

namespace mixtape {

/// Where a member of a kernel group is evaluated: an affine function of the loop variables per
/// coordinate of the node's shape, or (below a reshape) one affine function giving the flat
/// row-major element index.
struct Access {
  bool flat = false;
  std::vector<kir::Affine> coords;
  bool operator==(const Access&) const = default;
};

struct FusionGroup {
  // Alias: a reshape of a value another group stores, or a custom op's forward result that a
  // matmul or host op computes, sharing its buffer (no copy).
  enum class Kind { Kernel, MatMul, Host, Alias };
  Kind kind = Kind::Host;
  std::vector<Node*> members;  // tape order
  std::vector<Node*> outputs;  // members whose values are stored
  // Kernel groups: the loop nest, and where each member is evaluated (a member read through two
  // different views is evaluated twice).
  // Reductions all share the loop nest (same input shape, same reduced axes); a reduction whose
  // body reads another's result runs in a later pass over the inner dims (kir::Kernel).
  std::vector<int64_t> dims;
  int reduce_from = -1;
  std::vector<Node*> reductions;  // tape order
  std::unordered_map<Node*, std::vector<Access>> access;
  // MatMul groups whose product's readers fused into its epilogue (FusionOptions::matmul_epilogue):
  // members are the matmul, then a bias add (the add and the broadcast of `bias`, one value per
  // column) and a relu; only the last is stored. The epilogue keeps the unfused graph's roundings:
  // the product is rounded to `product_type` (the matmul's storage type, or the add's 16-bit
  // compute type) before the bias, read in `bias_type` (the broadcast's storage type, to which
  // the bias is rounded first), is added in f32, and the sum to the add's storage type.
  Node* matmul = nullptr;
  Node* bias = nullptr;
  bool relu = false;
  DType product_type = f32, bias_type = f32;
};

struct FusionOptions {
  bool fuse = true;  // false: eager mode, one kernel per op
  // false: at most one reduction per kernel, and nothing after it that varies along the reduced
  // axes (single-pass kernels only).
  bool multi_pass = true;
  int max_members = 96;
  int max_params = 48;
  // Run structurally identical, independent flat pointwise kernels (the per-parameter optimizer
  // updates, the unscale and inf checks) as one multi-tensor step (kir::Kernel::multi_tensor).
  // build_program forms them, after fusion and lowering.
  bool multi_tensor = false;
  // A matmul's only reader, a bias add (a broadcast row) and then a relu, or a relu alone, runs
  // in the matmul's epilogue instead of a kernel of its own (the CPU's gemm takes both).
  bool matmul_epilogue = false;
};

/// Groups `pending` (unevaluated nodes in tape order) so that every node in `required` is stored.
/// Groups come back in an order in which each one's inputs are ready. With MIXTAPE_LOG=fusion
/// each group and each rejected merge is logged with its reason.
std::vector<FusionGroup> fuse(const std::vector<Node*>& pending, const std::vector<Node*>& required,
                              const FusionOptions& options);

/// The access of input `k` of `node` when `node` is evaluated at `access` in a loop nest over
/// `dims`; false, with the reason, when it is not affine.
bool transfer_access(const Node& node, size_t k, const Access& access,
                     const std::vector<int64_t>& dims, Access& out, std::string& why);

/// Whether a kernel evaluating `node` reads its input `k`: all of them, but for a custom op
/// only its traced forward result (input 0), which is its value; the other inputs are its
/// gradient's.
bool kernel_reads(const Node& node, size_t k);

/// A value that every kernel can recompute for free: an unevaluated fill, or a view of one.
bool is_constant_fill(const Node& node);

/// Gradient sums (reductions of the backward pass) made in different calls of a module are
/// kept in different kernels: merged with the adds that accumulate a shared weight's gradient,
/// they would keep every call's output gradient (and, checkpointed, its recomputed values)
/// alive until the last call's backward. What fusion reads of it, which signing hashes and an
/// AOT plan stores: per node, 0, or for such a sum 1 + the number of its module call among the
/// graph's sums in order of first appearance (tape order).
class GradientSumCalls {
 public:
  uint64_t number(const Node& node);

 private:
  std::vector<const ModuleCall*> calls_;
};

}  // namespace mixtape

// mixtape/codegen/lower.cpp -- fusion group -> kernel IR, tracing ops.def's REF expressions with
// Sym.
#include "mixtape/codegen/lower.h"

#include <algorithm>
#include <array>
#include <memory>
#include <optional>
#include <unordered_map>
#include <unordered_set>

#include "mixtape/codegen/hash.h"
#include "mixtape/codegen/scalar_trace.h"
#include "mixtape/dsl/convert.h"
#include "mixtape/dsl/error.h"
#include "mixtape/dsl/scalar_math.h"
#include "mixtape/dsl/shape.h"

namespace mixtape {
namespace {

using kir::Affine;
using kir::Op;
using kir::Sym;
using kir::Type;
using kir::ValueBuilder;

// The register type the reference executor computes a pointwise op of `dtype` in (its
// with_compute_type): f32 for all float types but f64, and i64 for integers and bool.
Type compute_type(DType dtype) {
  if (dtype == f64) return Type::f64;
  return is_floating(dtype) ? Type::f32 : Type::i64;
}

// The value `fill` takes once stored as `dtype`, as a double.
double stored_constant(double fill, DType dtype) {
  // One element of each dtype, kept per thread: every kernel launch of the traced loop rounds
  // each fill it reads, and a Storage made for each was a heap block taken and given back.
  thread_local std::array<std::unique_ptr<Storage>, 8> ones;
  std::unique_ptr<Storage>& one = ones.at(static_cast<size_t>(dtype));
  if (!one) one = std::make_unique<Storage>(dtype, 1);
  store_element(*one, 0, fill);
  return load_element<double>(*one, 0);
}

class Lowerer {
 public:
  explicit Lowerer(const FusionGroup& group) : group_(group) {
    members_.insert(group.members.begin(), group.members.end());
  }

  LoweredKernel run() {
    kir::Kernel& k = out_.kernel;
    k.dims = group_.dims;
    k.reduce_from = group_.reduce_from;
    // Pass p computes the reductions of level p and the stored values of level p that vary
    // along the reduced axes; stored values that do not vary wait for the epilogue.
    int passes = 1;
    for (Node* r : group_.reductions) passes = std::max(passes, level(r) + 1);
    for (Node* output : group_.outputs)
      if (!group_.reductions.empty() && !is_reduction(output) && varies(output))
        passes = std::max(passes, level(output) + 1);
    k.later_passes.resize(passes - 1);
    for (int p = 0; p < passes; ++p)
      passes_.push_back(Stage{p == 0 ? &k.body : &k.later_passes[p - 1].body, p, {}});
    std::vector<Node*> reductions = group_.reductions;
    std::stable_sort(reductions.begin(), reductions.end(),
                     [&](Node* a, Node* b) { return level(a) < level(b); });
    for (Node* r : reductions) add_reduction(r);
    for (Node* output : group_.outputs) {
      const std::vector<Access>& accesses = group_.access.at(output);
      bool in_pass = group_.reductions.empty() || (!is_reduction(output) && varies(output));
      Stage& stage = in_pass ? passes_[level(output)] : epilogue_;
      int32_t value = emit(output, accesses[0], stage);
      kir::Store store{output_param(output), value, offset(accesses[0], output->shape)};
      if (!in_pass)
        k.epilogue_stores.push_back(store);
      else if (stage.pass == 0)
        k.stores.push_back(store);
      else
        k.later_passes[stage.pass - 1].stores.push_back(store);
    }
    kir::collapse_dims(k);
    std::string listing = kir::to_string(k);
    k.name = "mt_" + hash_string(listing).hex();
    return std::move(out_);
  }

 private:
  struct Stage {
    std::vector<kir::Value>* values;
    int pass;  // -1: the epilogue
    std::vector<std::pair<std::pair<Node*, Access>, int32_t>> memo;
  };

  bool is_reduction(Node* node) const {
    return std::find(group_.reductions.begin(), group_.reductions.end(), node) !=
           group_.reductions.end();
  }

  // The first pass that can compute `node`: one after the last pass of any reduction it reads.
  // A reduction's own level is its input's: the pass that accumulates it.
  int level(Node* node) {
    auto found = levels_.find(node);
    if (found != levels_.end()) return found->second;
    int l = 0;
    for (const NodePtr& input : node->inputs)
      if (members_.count(input.get()))
        l = std::max(l, level(input.get()) + (is_reduction(input.get()) ? 1 : 0));
    levels_[node] = l;
    return l;
  }

  // Whether `node` is evaluated at more than one point of the reduced dims.
  bool varies(Node* node) const {
    for (const Access& access : group_.access.at(node))
      for (const Affine& a : access.coords)
        for (size_t d = group_.reduce_from; d < a.coeff.size(); ++d)
          if (a.coeff[d] != 0) return true;
    return false;
  }

  // Traces the reduction's input into the body of its pass.
  void add_reduction(Node* r) {
    int pass = level(r);
    int32_t value = emit(r->inputs[0].get(), reduction_input_access(r), passes_[pass]);
    kir::Reduction red;
    red.kind = r->op == OpCode::Sum ? kir::ReduceKind::Sum : kir::ReduceKind::Max;
    if (r->op == OpCode::Sum)
      red.type =
          is_floating(r->dtype) ? (r->precision.accum == f64 ? Type::f64 : Type::f32) : Type::i64;
    else
      red.type = compute_type(r->dtype);
    if (red.kind == kir::ReduceKind::Sum && is_half(r->precision.accum))
      red.round_to = r->precision.accum;
    red.value = convert(passes_[pass], value, red.type);
    red.pass = pass;
    reduction_index_[r] = static_cast<int32_t>(out_.kernel.reductions.size());
    out_.kernel.reductions.push_back(red);
  }

  Access reduction_input_access(Node* r) const {
    // The loop var of each input axis: kept axes are the outer dims in order, reduced ones the
    // inner dims in order (fusion.cpp builds the nest the same way).
    const Shape& in = r->inputs[0]->shape;
    size_t rank = group_.dims.size();
    int outer = static_cast<int>(rank) - static_cast<int>(in.size());  // 1 for a full reduction
    int kept = 0, reduced = 0;
    for (size_t d = 0; d < in.size(); ++d)
      if (std::find(r->attrs.axes.begin(), r->attrs.axes.end(), static_cast<int64_t>(d)) ==
          r->attrs.axes.end())
        ++kept;
    Access access;
    for (size_t d = 0; d < in.size(); ++d) {
      bool is_reduced = std::find(r->attrs.axes.begin(), r->attrs.axes.end(),
                                  static_cast<int64_t>(d)) != r->attrs.axes.end();
      int var = is_reduced ? outer + kept + reduced++ : outer + (static_cast<int>(d) - reduced);
      Affine a;
      a.coeff.assign(rank, 0);
      a.coeff[var] = 1;
      access.coords.push_back(a);
    }
    return access;
  }

  // An output's parameter, made the first time the output is stored or read back.
  int32_t output_param(Node* node) {
    for (size_t i = 0; i < out_.nodes.size(); ++i)
      if (out_.nodes[i] == node && out_.kernel.params[i].output) return static_cast<int32_t>(i);
    out_.nodes.push_back(node);
    out_.kernel.params.push_back({node->precision.storage_type, true});
    return static_cast<int32_t>(out_.kernel.params.size() - 1);
  }

  // A value an earlier pass computed, read back from a buffer rather than computed again (a row
  // just written, in cache). The same bits: a value's register holds its rounded, stored value.
  // - A stored output is read back from its own buffer: softmax's composite, whose exp(x - max)
  //   its backward keeps, divides it in the last pass.
  // - Another value is kept in the buffer of an output that the reading pass (or a later one)
  //   stores at the same elements, in a type that holds it exactly; that output's own store
  //   comes after the read. Softmax's last pass reads exp(x - max) from the buffer of its
  //   result, where the pass of the sum left it (as PyTorch's softmax kernels do).
  std::optional<int32_t> read_back(Node* node, const Access& access, Stage& stage) {
    Affine at = offset(access, node->shape);
    auto load_from = [&](Node* owner) {
      kir::Value load{Op::Load, kir::register_type(owner->precision.storage_type)};
      load.param = output_param(owner);
      load.map = at;
      return ValueBuilder(*stage.values).add(load);
    };
    int pass = stored_pass(node);
    if (pass >= 0) {
      if (pass < stage.pass && at == offset(group_.access.at(node)[0], node->shape))
        return load_from(node);
      return std::nullopt;
    }
    auto kept = kept_in_.find(node);
    if (kept != kept_in_.end()) {
      // After the pass that left it there (a pass's stores follow its loads), until the pass
      // that stores the output's own value.
      const Kept& k = kept->second;
      if (k.at == at && k.pass < stage.pass && stage.pass <= stored_pass(k.owner))
        return load_from(k.owner);
      return std::nullopt;
    }
    // Worth a store and a load: an op whose own code (inputs aside) is long, as exp's is.
    constexpr size_t min_own_values = 8;
    auto cost = own_values_.find(node);
    if (!is_floating(node->precision.storage_type) || cost == own_values_.end() ||
        cost->second < min_own_values)
      return std::nullopt;
    // The earlier pass that computed it at this point, and an output to keep it in.
    for (int p = 0; p < stage.pass; ++p) {
      auto& memo = passes_[p].memo;
      auto found = std::find_if(memo.begin(), memo.end(), [&](const auto& entry) {
        return entry.first.first == node && entry.first.second == access;
      });
      if (found == memo.end()) continue;
      Node* owner = keeper(node, at, stage.pass);
      if (!owner) return std::nullopt;
      kept_in_[node] = {owner, at, p};
      kir::Store keep{output_param(owner), found->second, at};
      (p == 0 ? out_.kernel.stores : out_.kernel.later_passes[p - 1].stores).push_back(keep);
      return load_from(owner);
    }
    return std::nullopt;
  }

  // An output stored in pass `from` or later at the elements `at` whose buffer holds a value of
  // `node`'s type exactly, and that keeps no other value yet.
  Node* keeper(Node* node, const Affine& at, int from) {
    for (Node* output : group_.outputs) {
      int pass = stored_pass(output);
      if (pass < from || output == node) continue;
      bool exact = output->precision.storage_type == node->precision.storage_type ||
                   (output->precision.storage_type == f32 && is_half(node->precision.storage_type));
      bool taken = std::any_of(kept_in_.begin(), kept_in_.end(),
                               [&](const auto& entry) { return entry.second.owner == output; });
      if (exact && !taken && at == offset(group_.access.at(output)[0], output->shape))
        return output;
    }
    return nullptr;
  }

  // The pass an output that varies along the reduced axes is stored in (-1 for the epilogue's
  // or a pointwise kernel's), which later passes can read back instead of recomputing it.
  int stored_pass(Node* node) {
    if (group_.reductions.empty() || is_reduction(node) ||
        std::find(group_.outputs.begin(), group_.outputs.end(), node) == group_.outputs.end() ||
        !varies(node))
      return -1;
    return level(node);
  }

  int32_t input_param(Node* node) {
    for (size_t i = 0; i < out_.nodes.size(); ++i)
      if (out_.nodes[i] == node && !out_.kernel.params[i].output) return static_cast<int32_t>(i);
    out_.nodes.push_back(node);
    out_.kernel.params.push_back({stored_dtype(node), false});
    return static_cast<int32_t>(out_.nodes.size() - 1);
  }

  static Affine offset(const Access& access, const Shape& shape) {
    if (access.flat) return access.coords[0];
    Affine sum;
    sum.coeff.assign(access.coords.empty() ? 0 : access.coords[0].coeff.size(), 0);
    std::vector<int64_t> strides = strides_of(shape);
    for (size_t j = 0; j < access.coords.size(); ++j) {
      sum.base += access.coords[j].base * strides[j];
      for (size_t d = 0; d < sum.coeff.size(); ++d)
        sum.coeff[d] += access.coords[j].coeff[d] * strides[j];
    }
    return sum;
  }

  int32_t convert(Stage& stage, int32_t value, Type to) {
    return ValueBuilder(*stage.values).convert(value, to);
  }

  // A value computed as `from` stored as `storage` and read back: the rounding every node output
  // gets in the reference executor (store_element), kept in a register.
  int32_t to_storage(Stage& stage, int32_t value, DType storage) {
    ValueBuilder b(*stage.values);
    Type from = b.type_of(value);
    if (is_half(storage)) {
      if (from == Type::i64 || from == Type::i1) value = b.convert(value, Type::f64);
      kir::Value round{Op::RoundTo, Type::f32};
      round.a = value;
      round.dtype = storage;
      return b.add(round);
    }
    if (storage == i32) {
      // C's conversion to int32: wrap (the value is an int64 or a truncated float).
      int32_t wide = b.convert(value, Type::i64);
      kir::Value round{Op::RoundTo, Type::i64};
      round.a = wide;
      round.dtype = i32;
      return b.add(round);
    }
    return b.convert(value, kir::register_type(storage));
  }

  // Input k of a pointwise node as its compute type T, rounded to the node's compute dtype when
  // that is a 16-bit float the input is not stored as (reference_executor's pointwise_input).
  int32_t pointwise_input(Node* node, size_t k, const Access& access, Stage& stage, Type t,
                          bool round_to_compute) {
    // Pointwise inputs share the node's shape, so they are read at the node's own access; a fused
    // op's 0-d operand is read at its one element (transfer_access, as fusion planned it).
    Node* in = node->inputs[k].get();
    Access at;
    std::string why;
    if (!transfer_access(*node, k, access, group_.dims, at, why)) fail("lowering: {}", why);
    int32_t v = convert(stage, emit(in, at, stage), t);
    DType stored = stored_dtype(in);
    if (round_to_compute && t == Type::f32 && is_half(node->precision.compute) &&
        stored != node->precision.compute) {
      kir::Value round{Op::RoundTo, Type::f32};
      round.a = v;
      round.dtype = node->precision.compute;
      v = ValueBuilder(*stage.values).add(round);
    }
    return v;
  }

  DType stored_dtype(Node* node) const {
    return node->value ? node->value->dtype : node->precision.storage_type;
  }

  int32_t emit(Node* node, const Access& access, Stage& stage) {
    for (auto& [key, id] : stage.memo)
      if (key.first == node && key.second == access) return id;
    int32_t id = compute(node, access, stage);
    stage.memo.push_back({{node, access}, id});
    return id;
  }

  int32_t compute(Node* node, const Access& access, Stage& stage) {
    ValueBuilder b(*stage.values);
    if (!members_.count(node)) {
      // A fill, or a view of one (fusion inlines those): the same value at every point.
      if (is_constant_fill(*node)) return fill(b, node);
      // Another group's output, which may not have run yet: the program is built before it runs.
      kir::Value load{Op::Load, kir::register_type(stored_dtype(node))};
      load.param = input_param(node);
      load.map = offset(access, node->shape);
      return b.add(load);
    }
    if (stage.pass > 0) {
      if (std::optional<int32_t> v = read_back(node, access, stage)) return *v;
    }
    if (is_reduction(node)) {
      auto found = reduction_index_.find(node);
      if (found == reduction_index_.end() ||
          (stage.pass >= 0 && out_.kernel.reductions[found->second].pass >= stage.pass))
        fail("lowering: {} #{} is read before its pass ends", op_name(node->op), node->id);
      kir::Value acc{Op::Accumulated, out_.kernel.reductions[found->second].type};
      acc.param = found->second;
      return to_storage(stage, b.add(acc), node->precision.storage_type);
    }
    if (node->op == OpCode::Full) return fill(b, node);
    if (node->op == OpCode::Custom)  // its traced forward result (fusion.h, kernel_reads)
      return to_storage(stage, emit(node->inputs[0].get(), access, stage),
                        node->precision.storage_type);
    if (op_info(node->op).kind == OpKind::View) {
      Access in;
      std::string why;
      if (!transfer_access(*node, 0, access, group_.dims, in, why)) {
        // A view of a fill is the same value at every point, whatever the access (fusion does
        // not trace accesses into fills).
        if (is_constant_fill(*node)) return fill(b, node);
        fail("lowering: {}", why);
      }
      int32_t v = emit(node->inputs[0].get(), in, stage);
      return to_storage(stage, v, node->precision.storage_type);
    }
    if (node->op == OpCode::Cast || node->op == OpCode::CastLike) {  // cast_like's 2nd: a type
      int32_t v = emit(node->inputs[0].get(), access, stage);
      Type from = b.type_of(v);
      bool floats = is_floating(stored_dtype(node->inputs[0].get())) || is_floating(node->dtype);
      // Through double (exact for every source) or int64, as ref_Cast does.
      if (floats && from != Type::f32) v = b.convert(v, Type::f64);
      if (!floats) v = b.convert(v, Type::i64);
      return to_storage(stage, v, node->precision.storage_type);
    }
    if (node->op == OpCode::Where) {
      Type t = compute_type(node->dtype);
      int32_t cond = emit(node->inputs[0].get(), access, stage);
      cond = b.convert(b.convert(cond, Type::i64), Type::i1);
      int32_t x = b.convert(emit(node->inputs[1].get(), access, stage), t);
      int32_t y = b.convert(emit(node->inputs[2].get(), access, stage), t);
      return to_storage(stage, b.select(cond, x, y), node->precision.storage_type);
    }
    return pointwise(node, access, stage);
  }

  // Float fills become scalar slots, passed at launch, so that a value that changes from step
  // to step (a learning rate, a bias correction) reuses the kernel. Integer and bool fills stay
  // constants: a double could not hold every int64, and they do not change between steps.
  int32_t fill(ValueBuilder& b, Node* node) {
    kir::Type type = kir::register_type(node->precision.storage_type);
    if (!is_floating(node->precision.storage_type)) return b.constant(type, fill_value(*node));
    kir::Value scalar{Op::Scalar, type};
    scalar.param = out_.kernel.scalars++;
    out_.scalars.push_back(fill_value(*node));
    out_.scalar_nodes.push_back(node);
    return b.add(scalar);
  }

  int32_t pointwise(Node* node, const Access& access, Stage& stage) {
    Type t = compute_type(node->inputs[0]->dtype);
    kir::TraceContext& context = kir::trace_context();
    kir::TraceContext saved = context;
    ValueBuilder b(*stage.values);
    context.builder = &b;
    context.literal_type = t;
    auto input = [&](size_t k) {
      return Sym(pointwise_input(node, k, access, stage, t, true), t, 0);
    };
    int32_t result = -1;
    size_t own_start = 0;
    switch (node->op) {
#define MT_OP(Name, fname, kind, arity, category)
#define MT_UNARY(Name, fname, category, domain, REF, VJP) \
  case OpCode::Name: {                                    \
    using T = Sym;                                        \
    Sym a = input(0);                                     \
    own_start = stage.values->size();                     \
    result = static_cast<T>(REF).id;                      \
    break;                                                \
  }
#define MT_BINARY(Name, fname, category, domain, REF, VJP0, VJP1) \
  case OpCode::Name: {                                            \
    using T = Sym;                                                \
    Sym a = input(0);                                             \
    Sym b = input(1);                                             \
    own_start = stage.values->size();                             \
    result = T(REF).id;                                           \
    break;                                                        \
  }
#define MT_COMPARE(Name, fname, REF)  \
  case OpCode::Name: {                \
    Sym a = input(0);                 \
    Sym b = input(1);                 \
    own_start = stage.values->size(); \
    result = Sym(REF).id;             \
    break;                            \
  }
// The names past the op's arity are never read by its expression.
#define MT_FUSED(Name, fname, arity, REF)                                       \
  case OpCode::Name: {                                                          \
    using T = Sym;                                                              \
    static_assert((arity) <= 7, "REF names its inputs a to g");                 \
    auto at = [&](size_t k) { return k < (arity) ? input(k) : Sym(-1, t, 0); }; \
    std::array<Sym, 7> in{at(0), at(1), at(2), at(3), at(4), at(5), at(6)};     \
    [[maybe_unused]] auto& [a, b, c, d, e, f, g] = in;                          \
    own_start = stage.values->size();                                           \
    result = T(REF).id;                                                         \
    break;                                                                      \
  }
#include "mixtape/dsl/ops.def"
      default:
        context = saved;
        fail("lowering: {} is not a pointwise op", op_name(node->op));
    }
    context = saved;
    own_values_.emplace(node, stage.values->size() - own_start);
    return to_storage(stage, result, node->precision.storage_type);
  }

  const FusionGroup& group_;
  std::unordered_set<Node*> members_;
  std::unordered_map<Node*, int> levels_;
  std::unordered_map<Node*, int32_t> reduction_index_;
  // A value left in an output's buffer: the owner, the elements and the pass that stored it.
  struct Kept {
    Node* owner;
    Affine at;
    int pass;
  };
  std::unordered_map<Node*, Kept> kept_in_;
  std::unordered_map<Node*, size_t> own_values_;  // kir values of a pointwise op's own code
  LoweredKernel out_;
  std::vector<Stage> passes_;
  Stage epilogue_{&out_.kernel.epilogue, -1, {}};
};

}  // namespace

LoweredKernel lower(const FusionGroup& group) { return Lowerer(group).run(); }

double fill_value(const Node& node) {
  // Rounded to each storage type on the way up, as the reference executor would. Recursive, not
  // a list of the chain: every kernel launch of the traced loop asks this of each fill it reads.
  if (node.op == OpCode::Full)
    return stored_constant(node.attrs.value, node.precision.storage_type);
  if (node.inputs.empty()) fail("lowering: {} is not a fill", op_name(node.op));
  return stored_constant(fill_value(*node.inputs[0]), node.precision.storage_type);
}

}  // namespace mixtape

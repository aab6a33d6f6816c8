// mixtape/runtime/program.cpp -- graph signatures, programs of fusion groups, their cache and
// memory plan.
#include "mixtape/runtime/program.h"

#include <sched.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <chrono>
#include <cstdlib>
#include <exception>
#include <map>
#include <string_view>
#include <thread>
#include <type_traits>
#include <unordered_set>

#include "mixtape/codegen/kernel_ir.h"
#include "mixtape/codegen/lower.h"
#include "mixtape/codegen/nvrtc.h"
#include "mixtape/dsl/error.h"
#include "mixtape/dsl/graph.h"
#include "mixtape/dsl/host_memory.h"
#include "mixtape/dsl/log.h"
#include "mixtape/dsl/process_group.h"
#include "mixtape/dsl/sort_by_id.h"
#include "mixtape/precision_policy/assign.h"
#include "mixtape/runtime/all_reduce.h"
#include "mixtape/runtime/cpu_kernels.h"
#include "mixtape/runtime/cuda_allocator.h"
#include "mixtape/runtime/multi_tensor.h"

#define XXH_INLINE_ALL
#include <omp.h>
#include <xxhash.h>

namespace mixtape {
namespace {

// The program cache lives in this process only, so its key needs no stable byte format: the
// signature's words are gathered in a buffer and hashed at once by XXH3-128, which goes through
// them several words at a time. (Hashing each word as it came, through a chain of multiplies
// each waiting on the last, was most of signing's cost; the signature is taken on every
// evaluation of the traced loop.)
class WordHasher {
 public:
  WordHasher() : words_(buffer()) {
    if (words_.size() < 1024) words_.resize(1024);
    next_ = words_.data();
    end_ = next_ + words_.size();
  }
  WordHasher(const WordHasher&) = delete;
  WordHasher& operator=(const WordHasher&) = delete;

  template <typename T>
  requires std::is_arithmetic_v<T> || std::is_enum_v<T> WordHasher& update(T value) {
    if (next_ == end_) [[unlikely]]
      grow();
    if constexpr (std::is_floating_point_v<T>)
      *next_++ = std::bit_cast<uint64_t>(static_cast<double>(value));
    else
      *next_++ = static_cast<uint64_t>(value);
    return *this;
  }
  WordHasher& update(std::string_view text) {
    update(text.size());
    for (char c : text) update(c);
    return *this;
  }
  Hash128 finish() const {
    XXH128_hash_t digest =
        XXH3_128bits(words_.data(), static_cast<size_t>(next_ - words_.data()) * sizeof(uint64_t));
    return {digest.low64, digest.high64};
  }

 private:
  // One buffer per thread, reused (one hasher per thread at a time: signing does not nest).
  static std::vector<uint64_t>& buffer() {
    thread_local std::vector<uint64_t> words;
    return words;
  }
  void grow() {
    size_t used = words_.size();
    words_.resize(used * 2);
    next_ = words_.data() + used;
    end_ = words_.data() + words_.size();
  }
  std::vector<uint64_t>& words_;
  uint64_t* next_;
  uint64_t* end_;
};

template <typename T>
void update_all(WordHasher& h, const std::vector<T>& values) {
  h.update(values.size());
  for (const T& v : values) h.update(v);
}

// What fusion and lowering read of one node, packed into few words: the signature is taken on
// every evaluation of the traced loop, and hashing a word per field was most of its cost. The
// first word holds the op, the types and a bit per scalar attribute of dsl/attrs.def that differs
// from its default; the counts of the shape, the inputs and the list attributes follow, then the
// values announced. Equal hashes still mean equal fields, since every optional part is announced
// before it is hashed. Launch-time attributes (hashed false in the table) are left out.
struct NodeWords {
  static constexpr int kFirstFlag = 48;
  uint64_t word = 0;
  int flag = kFirstFlag;
  size_t counts[8] = {};
  int count_n = 0;

  void announce(bool hashed, const Ints& list) { counts[count_n++] = hashed ? list.size() : 0; }
  template <typename T>
  void announce(bool hashed, const T& value, const T& default_value) {
    if (hashed && !same_attr(value, default_value)) word |= uint64_t{1} << flag;
    ++flag;
  }
};
constexpr int kListAttrs = 0
#define MT_ATTR(type, name, default_value, hashed, ops) \
  +int {                                                \
    std::is_same_v<type, Ints>                          \
  }
#include "mixtape/dsl/attrs.def"
    ;
constexpr int kScalarAttrs = 0
#define MT_ATTR(type, name, default_value, hashed, ops) \
  +int {                                                \
    !std::is_same_v<type, Ints>                         \
  }
#include "mixtape/dsl/attrs.def"
    ;
static_assert(2 + kListAttrs <= 8, "NodeWords::counts holds the shape's, the inputs' and a list's");
static_assert(NodeWords::kFirstFlag + kScalarAttrs <= 63, "the first word has a bit per scalar");

void announce_attr(NodeWords& w, bool hashed, const Ints& list, const Ints&) {
  w.announce(hashed, list);
}
template <typename T>
void announce_attr(NodeWords& w, bool hashed, const T& value, const T& default_value) {
  w.announce(hashed, value, default_value);
}
void hash_attr(WordHasher& h, bool hashed, const Ints& list, const Ints&) {
  if (hashed)
    for (int64_t x : list) h.update(x);
}
void hash_attr(WordHasher&, bool, bool, bool) {}  // its flag bit is its value
template <typename T>
void hash_attr(WordHasher& h, bool hashed, const T& value, const T& default_value) {
  if (hashed && !same_attr(value, default_value)) h.update(value);
}

void hash_node(WordHasher& h, const Node& node) {
  const Attrs& a = node.attrs;
  static const Attrs defaults;
  NodeWords w;
  w.word = static_cast<uint64_t>(node.op) | uint64_t{static_cast<uint8_t>(node.dtype)} << 16 |
           uint64_t{static_cast<uint8_t>(node.precision.storage_type)} << 24 |
           uint64_t{static_cast<uint8_t>(node.precision.compute)} << 32 |
           uint64_t{static_cast<uint8_t>(node.precision.accum)} << 40 |
           // Program building keeps a checkpoint's recomputation out of multi-tensor kernels.
           uint64_t{node.recomputed} << 48;
  w.counts[w.count_n++] = node.shape.size();
  w.counts[w.count_n++] = node.inputs.size();
#define MT_ATTR(type, name, default_value, hashed, ops) \
  announce_attr(w, hashed, a.name, defaults.name);
#include "mixtape/dsl/attrs.def"
  bool small = true;
  for (int i = 0; i < w.count_n; ++i) small &= w.counts[i] < 0x1000;
  h.update(w.word | uint64_t{small} << 63);
  if (small) {
    // Five counts of 12 bits to a word.
    for (int i = 0; i < w.count_n; i += 5) {
      uint64_t packed = 0;
      for (int j = i; j < std::min(i + 5, w.count_n); ++j) packed = packed << 12 | w.counts[j];
      h.update(packed);
    }
  } else {
    for (int i = 0; i < w.count_n; ++i) h.update(w.counts[i]);
  }
  for (int64_t d : node.shape) h.update(d);
#define MT_ATTR(type, name, default_value, hashed, ops) hash_attr(h, hashed, a.name, defaults.name);
#include "mixtape/dsl/attrs.def"
}

int64_t stored_bytes(const Node* node) { return node->value ? node->value->size_bytes() : 0; }

// The bytes of what step `step` stores, measured by `bytes_of` (run_program and the plan-only
// peak count the same values); none for a reshape (an Alias step), which shares its input's
// buffer (Program::frees_buffer).
template <typename BytesOf>
int64_t step_output_bytes(const Step& step, const std::vector<Node*>& pending, const Signature& sig,
                          BytesOf bytes_of) {
  if (step.kind == FusionGroup::Kind::Alias) return 0;
  if (step.kind != FusionGroup::Kind::Kernel) return bytes_of(sig.resolve(step.output, pending));
  int64_t bytes = 0;
  for (size_t p = 0; p < step.params.size(); ++p)
    if (step.param_is_output(p)) bytes += bytes_of(sig.resolve(step.params[p], pending));
  return bytes;
}

bool is_collective_step(const Step& step, const std::vector<Node*>& pending, const Signature& sig) {
  return step.kind == FusionGroup::Kind::Host &&
         op_info(sig.resolve(step.node, pending)->op).kind == OpKind::Collective;
}

// Each collective step, with the steps that exist only to feed it (a bucket's reshapes, casts and
// concatenation, made after the whole backward pass), moves up to just after the steps that store
// their inputs, keeping the collectives' own order (every process runs them in one order); each
// step notes the last collective whose value it reads (Step::awaits). A run that starts
// collectives on another thread (StepRunners::start_collective) then goes on with the steps
// between: a data-parallel bucket's reduction beside the rest of the backward pass.
void hoist_collectives(Program& program, const std::vector<Node*>& pending, const Signature& sig) {
  const size_t n = program.steps.size();
  std::vector<std::vector<size_t>> producers(n), consumers(n);
  std::vector<bool> required(n, false);  // stores a value the caller asked for
  std::unordered_set<Node*> stored(sig.stored.begin(), sig.stored.end());
  {
    std::unordered_map<NodeRef, size_t> stored_by;
    std::vector<NodeRef> reads, writes;
    for (size_t i = 0; i < n; ++i) {
      step_io(program.steps[i], pending, sig, reads, writes);
      for (NodeRef ref : reads)
        if (auto found = stored_by.find(ref); found != stored_by.end()) {
          producers[i].push_back(found->second);
          consumers[found->second].push_back(i);
        }
      for (NodeRef ref : writes) {
        stored_by[ref] = i;
        required[i] = required[i] || stored.count(pending[ref]) > 0;
      }
    }
  }
  // Where each step goes: (position, rank) sorted, the position an original index. A hoisted
  // step takes its latest producer's position and a rank after it; the others keep their own.
  std::vector<std::pair<int64_t, size_t>> place(n);
  for (size_t i = 0; i < n; ++i) place[i] = {static_cast<int64_t>(i), 0};
  std::vector<bool> hoisted(n, false);
  int64_t last_collective = -1;
  size_t rank = 0;
  std::vector<bool> collective(n);
  for (size_t i = 0; i < n; ++i) collective[i] = is_collective_step(program.steps[i], pending, sig);
  for (size_t c = 0; c < n; ++c) {
    if (!collective[c]) continue;
    // The steps whose every reader is in the cone (transitively), found from the collective up.
    std::vector<bool> cone(n, false);
    cone[c] = true;
    for (size_t i = c; i-- > 0;) {
      if (required[i] || consumers[i].empty() || hoisted[i]) continue;
      cone[i] = std::all_of(consumers[i].begin(), consumers[i].end(),
                            [&](size_t reader) { return cone[reader]; });
    }
    for (size_t i = 0; i <= c; ++i) {
      if (!cone[i]) continue;
      std::pair<int64_t, size_t> at{-1, 0};  // inputs from outside the program: the front
      for (size_t p : producers[i]) at = std::max(at, place[p]);
      if (i == c) at = std::max(at, std::pair<int64_t, size_t>{last_collective, 0});
      place[i] = {at.first, ++rank};
      hoisted[i] = true;
    }
    last_collective = place[c].first;
  }
  std::vector<size_t> order(n);
  for (size_t i = 0; i < n; ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t a, size_t b) { return place[a] < place[b]; });
  std::vector<int32_t> moved_to(n);
  for (size_t at = 0; at < n; ++at) moved_to[order[at]] = static_cast<int32_t>(at);
  for (size_t i = 0; i < n; ++i)
    for (size_t p : producers[i])
      if (collective[p]) program.steps[i].awaits = std::max(program.steps[i].awaits, moved_to[p]);
  std::vector<Step> steps;
  steps.reserve(n);
  for (size_t i : order) steps.push_back(std::move(program.steps[i]));
  program.steps = std::move(steps);
}

// What each step reads and stores, by reference, for the memory plan.
void plan_memory(Program& program, const std::vector<Node*>& pending, const Signature& sig) {
  std::unordered_map<NodeRef, size_t> last_use;
  std::vector<NodeRef> stored_order;
  std::vector<NodeRef> reads, writes;
  for (size_t i = 0; i < program.steps.size(); ++i) {
    step_io(program.steps[i], pending, sig, reads, writes);
    for (NodeRef ref : reads)
      if (ref >= 0) last_use[ref] = i;
    for (NodeRef ref : writes) {
      last_use.emplace(ref, i);
      stored_order.push_back(ref);
    }
  }
  std::unordered_set<Node*> keep(sig.stored.begin(), sig.stored.end());
  program.release_after.assign(program.steps.size(), {});
  // A collective's value stays: recomputing it for a later evaluation on one process would be a
  // collective the other processes never join.
  for (NodeRef ref : stored_order)
    if (!keep.count(pending[ref]) && op_info(pending[ref]->op).kind != OpKind::Collective)
      program.release_after[last_use.at(ref)].push_back(ref);
  // Each stored node's buffer by its first holder (negative: an external's), and the holders of
  // each: a buffer is freed by the release of its last holder, never while one is kept.
  std::unordered_map<NodeRef, NodeRef> first_holder;
  for (const Step& step : program.steps) {
    if (step.kind != FusionGroup::Kind::Alias) continue;
    step_io(step, pending, sig, reads, writes);
    auto shared = first_holder.find(reads[0]);
    first_holder[writes[0]] = shared != first_holder.end() ? shared->second : reads[0];
  }
  auto buffer_of = [&](NodeRef ref) {
    auto shared = first_holder.find(ref);
    return shared != first_holder.end() ? shared->second : ref;
  };
  std::unordered_map<NodeRef, int64_t> holders;
  for (NodeRef ref : stored_order) ++holders[buffer_of(ref)];
  program.frees_buffer.assign(program.steps.size(), {});
  for (size_t i = 0; i < program.steps.size(); ++i)
    for (NodeRef ref : program.release_after[i]) {
      const NodeRef buffer = buffer_of(ref);
      program.frees_buffer[i].push_back(--holders[buffer] == 0 && buffer >= 0);
    }
}

// Whether `kernel` reads param `input` only where it writes the same element of param `output`:
// every load of the input uses the map of the output's store, in the same place (the body of a
// pointwise kernel, the epilogue of a reduction, which runs once per outer point). A store writes
// each element at one point only, so each element of the input is read at that point alone, and
// computing the output into the input's buffer gives the same values.
bool same_element(const kir::Kernel& kernel, size_t input, size_t output) {
  const bool reduction = kernel.is_reduction();
  const std::vector<kir::Store>& stores = reduction ? kernel.epilogue_stores : kernel.stores;
  const kir::Affine* map = nullptr;
  for (const kir::Store& store : stores)
    if (static_cast<size_t>(store.param) == output) map = &store.map;
  if (!map) return false;
  auto reads_elsewhere = [&](const std::vector<kir::Value>& values) {
    for (const kir::Value& v : values)
      if (v.op == kir::Op::Load && static_cast<size_t>(v.param) == input) return true;
    return false;
  };
  if (reduction) {
    for (int pass = 0; pass < kernel.pass_count(); ++pass)
      if (reads_elsewhere(kernel.pass_body(pass))) return false;
  }
  bool loads = false;
  for (const kir::Value& v : reduction ? kernel.epilogue : kernel.body)
    if (v.op == kir::Op::Load && static_cast<size_t>(v.param) == input) {
      if (!(v.map == *map)) return false;
      loads = true;
    }
  return loads;
}

// Step::in_place for each kernel step of `program` (after plan_memory, whose releases it reads).
void plan_in_place(Program& program, const std::vector<Node*>& pending, const Signature& sig) {
  std::vector<long> edges(sig.externals.size(), 0);
  for (Node* node : pending)
    for (const NodePtr& input : node->inputs)
      if (input->evaluated()) ++edges[static_cast<size_t>(-sig.ref(input.get(), pending) - 1)];
  // Each value's last reader, a reader of a reshape that shares an external's buffer (an Alias
  // step) counting as one of the external's.
  std::unordered_map<NodeRef, size_t> last_read;
  std::unordered_map<NodeRef, NodeRef> shares_buffer_of;  // alias -> the external it shares
  std::unordered_set<NodeRef> released;
  size_t last_host = 0;
  bool any_host = false;
  std::vector<NodeRef> reads, writes;
  for (size_t i = 0; i < program.steps.size(); ++i) {
    step_io(program.steps[i], pending, sig, reads, writes);
    for (NodeRef ref : reads) {
      auto alias = shares_buffer_of.find(ref);
      last_read[alias != shares_buffer_of.end() ? alias->second : ref] = i;
    }
    if (program.steps[i].kind == FusionGroup::Kind::Alias && reads.size() == 1) {
      auto alias = shares_buffer_of.find(reads[0]);
      if (reads[0] < 0 || alias != shares_buffer_of.end())
        shares_buffer_of[writes[0]] = reads[0] < 0 ? reads[0] : alias->second;
    }
    released.insert(program.release_after[i].begin(), program.release_after[i].end());
    if (program.steps[i].kind == FusionGroup::Kind::Host) {
      last_host = std::max(last_host, i);
      any_host = true;
    }
    // A collective started on another thread fails, if it does, where a step awaits it, or at
    // the end of the run: no kernel before that computes in place.
    if (program.steps[i].awaits >= 0) last_host = std::max(last_host, i);
    if (is_collective_step(program.steps[i], pending, sig) &&
        std::none_of(program.steps.begin() + static_cast<std::ptrdiff_t>(i) + 1,
                     program.steps.end(),
                     [&](const Step& later) {  // a wait waits for every collective before
                       return later.awaits >= static_cast<int32_t>(i);
                     }))
      last_host = program.steps.size();
  }
  for (size_t i = 0; i < program.steps.size(); ++i) {
    Step& step = program.steps[i];
    // A host step after the kernel could fail (a collective's timeout) once the old value is
    // gone, where the caller would still hold it.
    if (step.kind != FusionGroup::Kind::Kernel || (any_host && last_host > i)) continue;
    const kir::Kernel& kernel = *step.kernel;
    const size_t per_segment = kernel.params.size();
    for (size_t at = 0; at < step.params.size(); at += per_segment)
      for (size_t out = 0; out < per_segment; ++out) {
        const NodeRef output = step.params[at + out];
        if (!kernel.params[out].output || released.count(output)) continue;
        // Every input that qualifies, in order: the run takes the first one its caller lists.
        for (size_t in = 0; in < per_segment; ++in) {
          const NodeRef input = step.params[at + in];
          if (kernel.params[in].output || input >= 0 || last_read.at(input) != i ||
              kernel.params[in].dtype != kernel.params[out].dtype)
            continue;
          // Every param of the step that is this input (the same node read through two views,
          // or by two segments) must read it where the output is written.
          bool safe = true;
          for (size_t p = 0; p < step.params.size() && safe; ++p)
            if (step.params[p] == input)
              safe = p >= at && p < at + per_segment && same_element(kernel, p - at, out);
          if (safe)
            step.in_place.push_back({static_cast<uint32_t>(at + out),
                                     static_cast<uint32_t>(at + in),
                                     edges[static_cast<size_t>(-input - 1)]});
        }
      }
  }
}

}  // namespace

ExecutionStats& execution_counters() {
  static ExecutionStats s;
  return s;
}

namespace {
// The compilers keep their own lifetime counters; a reset remembers them so that stats count
// from it.
struct CompilerBaseline {
  CompilerStats jit;
  NvrtcStats nvrtc;
};
CompilerStats cpu_compiler_stats() {
  CpuKernelCompiler* compiler = cpu_kernel_compiler();
  return compiler ? compiler->stats() : CompilerStats{};
}
CompilerBaseline& compiler_baseline() {
  static CompilerBaseline baseline;
  return baseline;
}
}  // namespace

ExecutionStats execution_stats() {
  ExecutionStats s = execution_counters();
  CompilerStats jit = cpu_compiler_stats();
  NvrtcStats nvrtc = nvrtc_stats();
  const CompilerBaseline& base = compiler_baseline();
  s.kernels_compiled = jit.compiled - base.jit.compiled + nvrtc.compiled - base.nvrtc.compiled;
  // The counters hold the CUDA back end's cache loads; LLVM's come from its own counters.
  s.kernels_from_disk += jit.disk_loaded - base.jit.disk_loaded;
  s.compile_seconds = jit.compile_seconds - base.jit.compile_seconds + nvrtc.compile_seconds -
                      base.nvrtc.compile_seconds;
  s.load_seconds += jit.load_seconds - base.jit.load_seconds;
  s.host_peak_bytes = host_memory_stats().peak_bytes;
  s.device_peak_bytes = static_cast<int64_t>(cuda::device_allocator_stats().peak_allocated);
  s.memory_peak_bytes = s.host_peak_bytes + s.device_peak_bytes;
  return s;
}

void reset_execution_stats() {
  execution_counters() = ExecutionStats{};
  reset_collective_stats();
  compiler_baseline() = {cpu_compiler_stats(), nvrtc_stats()};
  reset_host_memory_peak();
  cuda::reset_device_allocator_peak();
}

NodeRef Signature::ref(const Node* node, const std::vector<Node*>& pending) const {
  int32_t slot = node->sign_slot;
  if (slot >= 0 && static_cast<size_t>(slot) < pending.size() && pending[slot] == node) return slot;
  size_t x = static_cast<size_t>(-static_cast<int64_t>(slot) - 1);
  if (slot < 0 && x < externals.size() && externals[x] == node) return slot;
  auto cached = [&]() -> NodeRef {
    auto found = external_refs_.find(node);
    return found != external_refs_.end() && externals[-found->second - 1] == node ? found->second
                                                                                  : 0;
  };
  if (NodeRef x = cached()) return x;
  // Built on first use, and again once the externals changed (mt::compile's plan replaces
  // them by private leaves).
  external_refs_.clear();
  for (size_t x = 0; x < externals.size(); ++x)
    external_refs_.emplace(externals[x], -static_cast<NodeRef>(x) - 1);
  if (NodeRef x = cached()) return x;
  fail("internal: {} is neither computed nor read by this evaluation", op_name(node->op));
}

void fail_overwritten(const Node& value, const char* reader) {
  fail(
      "{} a {} {} value whose buffer an optimizer step has since updated in place (the step "
      "computed the new parameter or state into the buffer of the old one, which it found no "
      "tensor holding): {}evaluate it before the step, or keep a tensor of the old value "
      "(x.detach()), which makes the step leave that buffer alone",
      reader ? fmt::format("{} reads", reader) : "reading", name(value.dtype),
      to_string(value.shape),
      reader ? "this graph was built before the step and is evaluated after it; " : "");
}

Signature sign(const std::vector<Node*>& pending, const std::vector<Node*>& required, bool fuse,
               std::string_view salt) {
  Signature sig;
  WordHasher h;
  h.update(salt);
  h.update(fuse);
  h.update(pending.size());
  // Every unevaluated input is pending (pending_nodes), every evaluated one external. A node
  // keeps its ref in sign_slot (no map on the traced path): a pending node its index, an
  // external its negative ref, trusted only where pending or externals says the same.
  for (size_t i = 0; i < pending.size(); ++i) pending[i]->sign_slot = static_cast<int32_t>(i);
  // Per pending node: its readers among the pending nodes, how many references hold it (read
  // off a reader's input edge, a plain load, where weak_from_this() would take and drop a weak
  // reference, two atomic operations per node), and whether the caller asked for it. Scratch
  // kept per thread, so signing allocates nothing of its own.
  struct Uses {
    int64_t readers;
    long holders;
    bool asked;
  };
  thread_local std::vector<Uses> uses;
  uses.assign(pending.size(), {0, 0, false});
  GradientSumCalls sum_calls;  // fusion reads them
  for (Node* node : pending) {
    hash_node(h, *node);
    if (const uint64_t call = sum_calls.number(*node)) h.update(call);
    for (const NodePtr& input : node->inputs) {
      if (!input->evaluated()) {
        int32_t slot = input->sign_slot;
        if (slot < 0 || static_cast<size_t>(slot) >= pending.size() || pending[slot] != input.get())
          fail("internal: {} reads an unevaluated {} that is not pending", op_name(node->op),
               op_name(input->op));
        h.update(slot);
        ++uses[slot].readers;
        uses[slot].holders = input.use_count();
        continue;
      }
      int32_t slot = input->sign_slot;
      size_t x = static_cast<size_t>(-static_cast<int64_t>(slot) - 1);
      if (slot < 0 && x < sig.externals.size() && sig.externals[x] == input.get()) {
        h.update(slot);
        continue;
      }
      if (input->overwritten) [[unlikely]]
        fail_overwritten(*input, op_name(node->op));
      input->sign_slot = -static_cast<NodeRef>(sig.externals.size()) - 1;
      h.update(input->sign_slot);
      sig.externals.push_back(input.get());
      h.update(input->value->dtype);
      update_all(h, input->shape);
    }
  }
  sig.stored = required;
  for (Node* node : required) uses[sig.ref(node, pending)].asked = true;
  for (size_t i = 0; i < pending.size(); ++i) {
    const Uses& u = uses[i];
    if (u.asked) continue;
    // A node no pending node reads has no edge to read its count from.
    long holders = u.readers > 0 ? u.holders : pending[i]->weak_from_this().use_count();
    if (holders > u.readers) sig.stored.push_back(pending[i]);
  }
  h.update(sig.stored.size());
  for (Node* node : sig.stored) h.update(sig.ref(node, pending));
  sig.hash = h.finish();
  return sig;
}

namespace {

Step kernel_step(LoweredKernel&& lowered, int64_t members, const std::vector<Node*>& pending,
                 const Signature& sig, const KernelLoader& load) {
  Step step;
  step.kind = FusionGroup::Kind::Kernel;
  KernelRef ref = load(lowered.kernel);
  step.compiled = ref.address;
  step.code = std::move(ref.owner);
  for (Node* node : lowered.nodes) step.params.push_back(sig.ref(node, pending));
  for (Node* node : lowered.scalar_nodes) step.scalar_nodes.push_back(sig.ref(node, pending));
  step.parallel_extent = lowered.kernel.parallel_extent();
  for (int64_t d : lowered.kernel.dims) step.points *= d;
  step.kernel = std::make_shared<const kir::Kernel>(std::move(lowered.kernel));
  step.members = members;
  return step;
}

}  // namespace

Program build_program(const std::vector<Node*>& pending, const FusionOptions& options,
                      const Signature& sig, const KernelLoader& load) {
  Program program;
  std::vector<FusionGroup> groups = fuse(pending, sig.stored, options);
  // Kernel steps get their params now (the sets need what each reads and stores) and their
  // kernels once the sets are known.
  std::vector<PendingKernel> lowered(groups.size());
  std::vector<PendingKernel*> kernels(groups.size(), nullptr);
  std::vector<Step> steps(groups.size());
  for (size_t i = 0; i < groups.size(); ++i) {
    const FusionGroup& group = groups[i];
    Step& step = steps[i];
    step.kind = group.kind;
    if (group.kind != FusionGroup::Kind::Kernel) {
      step.node = sig.ref(group.matmul ? group.matmul : group.members[0], pending);
      step.output = sig.ref(group.outputs[0], pending);
      step.has_bias = group.bias != nullptr;
      if (step.has_bias) step.bias = sig.ref(group.bias, pending);
      step.relu = group.relu;
      step.product_type = group.product_type;
      step.bias_type = group.bias_type;
      continue;
    }
    PendingKernel& k = lowered[i];
    kernels[i] = &k;
    k.lowered = lower(group);
    k.members = static_cast<int64_t>(group.members.size());
    for (Node* node : k.lowered.nodes) step.params.push_back(sig.ref(node, pending));
    step.kernel = std::make_shared<const kir::Kernel>(k.lowered.kernel);
    // A checkpointed module's recomputation (autograd/recompute.h) stays where the backward pass
    // put it, before that module's gradients. Recomputations of different module instances are
    // independent of one another, so kernels of one form would merge across them, and the
    // merged step would pull every instance's recomputation to the first of them, keeping all
    // their values alive at once.
    const bool recomputes = std::any_of(group.members.begin(), group.members.end(),
                                        [](const Node* node) { return node->recomputed; });
    if (options.multi_tensor && !recomputes) {
      std::vector<bool> zero_rank;
      for (Node* node : k.lowered.nodes) zero_rank.push_back(node->shape.empty());
      k.flat = kir::multi_tensor_form(k.lowered.kernel, zero_rank);
      if (k.flat) k.key = kir::to_string(*k.flat);
    }
  }
  std::vector<std::vector<size_t>> order;
  if (options.multi_tensor) {
    order = multi_tensor_order(steps, kernels, pending, sig);
  } else {
    for (size_t i = 0; i < groups.size(); ++i) order.push_back({i});
  }
  for (const std::vector<size_t>& entry : order) {
    size_t i = entry[0];
    if (entry.size() > 1)
      program.steps.push_back(multi_tensor_step(entry, kernels, pending, sig, load));
    else if (kernels[i])
      program.steps.push_back(
          kernel_step(std::move(kernels[i]->lowered), kernels[i]->members, pending, sig, load));
    else
      program.steps.push_back(std::move(steps[i]));
  }
  hoist_collectives(program, pending, sig);
  plan_memory(program, pending, sig);
  plan_in_place(program, pending, sig);
  return program;
}

std::shared_ptr<const Program> ProgramCache::get(const std::vector<Node*>& pending,
                                                 const FusionOptions& options, const Signature& sig,
                                                 const KernelLoader& load) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (const std::shared_ptr<const Program>* found = programs_.find(sig.hash)) {
      ++execution_counters().programs_reused;
      return *found;
    }
  }
  auto program = std::make_shared<const Program>(build_program(pending, options, sig, load));
  ++execution_counters().programs_built;
  std::lock_guard<std::mutex> lock(mutex_);
  programs_.put(sig.hash, program, approximate_bytes(*program));
  return program;
}

ProgramCache::Stats ProgramCache::stats() {
  std::lock_guard<std::mutex> lock(mutex_);
  return {static_cast<int64_t>(programs_.size()), programs_.bytes(), programs_.evictions()};
}

namespace {
template <typename T>
int64_t vector_bytes(const std::vector<T>& values) {
  return static_cast<int64_t>(values.capacity() * sizeof(T));
}

int64_t kernel_bytes(const kir::Kernel& k) {
  int64_t bytes = sizeof(kir::Kernel) + static_cast<int64_t>(k.name.capacity()) +
                  vector_bytes(k.params) + vector_bytes(k.dims) + vector_bytes(k.body) +
                  vector_bytes(k.stores) + vector_bytes(k.reductions) + vector_bytes(k.epilogue) +
                  vector_bytes(k.epilogue_stores);
  for (const kir::Pass& pass : k.later_passes)
    bytes += sizeof(pass) + vector_bytes(pass.body) + vector_bytes(pass.stores);
  return bytes;
}

// A CPU kernel's object is a few KiB (more for multi-tensor steps), and the JIT keeps about as
// much again in symbol tables and sections; CUDA images are of the same order. Counted once per
// step: kernels shared between programs are counted in each, which errs towards a smaller cache.
constexpr int64_t compiled_code_allowance = 8 << 10;
}  // namespace

int64_t approximate_bytes(const Program& program) {
  int64_t bytes =
      sizeof(Program) + vector_bytes(program.steps) + vector_bytes(program.release_after);
  for (const Step& step : program.steps) {
    bytes += vector_bytes(step.params) + vector_bytes(step.scalar_nodes) +
             vector_bytes(step.segment_table);
    if (step.kernel) bytes += kernel_bytes(*step.kernel) + compiled_code_allowance;
  }
  for (const std::vector<NodeRef>& released : program.release_after)
    bytes += vector_bytes(released);
  for (const std::vector<uint8_t>& frees : program.frees_buffer) bytes += vector_bytes(frees);
  return bytes;
}

namespace {
// MIXTAPE_LOG=profile: wall time per step, summed by what the step is, printed at exit with the
// heaviest first, so a user can see where a training step's time goes. On a device that runs
// steps asynchronously the wall time is the launch's, so a second table has the device's time.
class StepProfile {
 public:
  static StepProfile* active() {
    static StepProfile* profile = log_enabled("profile") ? new StepProfile : nullptr;
    return profile;
  }
  void add(std::string label, double seconds, bool on_device = false) {
    std::lock_guard lock(mutex_);
    Entry& e = (on_device ? device_ : wall_)[std::move(label)];
    e.seconds += seconds;
    ++e.count;
  }

 private:
  struct Entry {
    double seconds = 0;
    int64_t count = 0;
  };
  using Table = std::map<std::string, Entry>;
  StepProfile() {
    std::atexit([] { active()->print(); });
  }
  void print() {
    std::lock_guard lock(mutex_);
    if (!device_.empty()) log_line("profile", "wall time on the host (launches, for the device)");
    print(wall_);
    if (device_.empty()) return;
    log_line("profile", "time on the device");
    print(device_);
  }
  static void print(const Table& table) {
    std::vector<std::pair<std::string, Entry>> rows(table.begin(), table.end());
    std::sort(rows.begin(), rows.end(),
              [](const auto& a, const auto& b) { return a.second.seconds > b.second.seconds; });
    double total = 0, collective = 0;
    for (const auto& [label, e] : rows) {
      total += e.seconds;
      if (label.starts_with("collective ")) collective += e.seconds;
    }
    log_line("profile", "{:>10} {:>6} {:>10} {:>9}  step", "total ms", "share", "runs", "us/run");
    for (const auto& [label, e] : rows)
      log_line("profile", "{:>10.1f} {:>5.1f}% {:>10} {:>9.1f}  {}", e.seconds * 1e3,
               100 * e.seconds / total, e.count, e.seconds * 1e6 / e.count, label);
    // Data parallel: the collectives (communication, and waiting for the other processes)
    // against the rest of the steps (compute).
    if (collective > 0)
      log_line("profile", "collectives {:.1f} ms ({:.1f}%), compute {:.1f} ms", collective * 1e3,
               100 * collective / total, (total - collective) * 1e3);
  }
  std::mutex mutex_;
  Table wall_, device_;
};

std::string step_label(const Step& step, const std::vector<Node*>& pending, const Signature& sig) {
  if (step.kind == FusionGroup::Kind::Kernel) {
    const kir::Kernel& k = *step.kernel;
    std::string kind = k.multi_tensor     ? "multi-tensor x" + std::to_string(step.segments())
                       : k.is_reduction() ? "reduction"
                                          : "pointwise";
    return fmt::format("kernel {} {} {} nodes {}", kind, to_string(k.dims), step.members, k.name);
  }
  const Node& node = *sig.resolve(step.node, pending);
  std::string inputs;
  for (const NodePtr& input : node.inputs)
    inputs += fmt::format("{}{} ", name(input->precision.storage_type), to_string(input->shape));
  std::string epilogue;  // what the matmul's epilogue does
  if (step.has_bias) epilogue += fmt::format("+ bias {} ", name(step.bias_type));
  if (step.relu) epilogue += "+ relu ";
  const Node& output = *sig.resolve(step.output, pending);
  const char* kind = step.kind == FusionGroup::Kind::MatMul        ? "matmul"
                     : op_info(node.op).kind == OpKind::Collective ? "collective"
                                                                   : "host";
  return fmt::format("{} {} {}{}-> {}{}", kind, op_name(node.op), inputs, epilogue,
                     name(output.precision.storage_type), to_string(output.shape));
}
}  // namespace

namespace {

// The collectives a run has started on another thread (StepRunners::start_collective) and not
// yet waited for, in the order every process runs them.
class CollectivesInFlight {
 public:
  // A step threw: the thread must be done with the nodes first, and a collective that finished
  // keeps its value (recomputing it later on this process alone would be a collective the
  // others never join).
  ~CollectivesInFlight() {
    for (InFlight& c : in_flight_) try {
        c.node->value = c.value.get();
      } catch (...) {
      }
  }
  bool empty() const { return in_flight_.empty(); }
  // Whether a collective started is still running (not merely not yet waited for).
  bool running() const {
    return !in_flight_.empty() &&
           in_flight_.back().value.wait_for(std::chrono::seconds(0)) != std::future_status::ready;
  }
  // Room for one more first: once the job is posted, nothing may fail before it is listed.
  void reserve() { in_flight_.reserve(in_flight_.size() + 1); }
  void start(size_t step, Node* node, std::future<std::shared_ptr<Storage>> value) {
    in_flight_.push_back({step, node, std::move(value)});
  }
  // Waits for those started at or before `step` (all: SIZE_MAX) and gives each its value;
  // returns their stored bytes. The first failure is thrown once all are done.
  int64_t wait_through(size_t step) {
    const auto start = std::chrono::steady_clock::now();
    int64_t bytes = 0;
    std::exception_ptr failure;
    size_t done = 0;
    for (; done < in_flight_.size() && in_flight_[done].step <= step; ++done) {
      InFlight& c = in_flight_[done];
      try {
        c.node->value = c.value.get();
        bytes += stored_bytes(c.node);
      } catch (...) {
        if (!failure) failure = std::current_exception();
      }
    }
    in_flight_.erase(in_flight_.begin(), in_flight_.begin() + static_cast<std::ptrdiff_t>(done));
    if (done > 0)
      note_collective_wait(
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
    if (failure) std::rethrow_exception(failure);
    return bytes;
  }

 private:
  struct InFlight {
    size_t step;
    Node* node;
    std::future<std::shared_ptr<Storage>> value;
  };
  std::vector<InFlight> in_flight_;
};

}  // namespace

void run_program(const Program& program, const std::vector<Node*>& pending, const Signature& sig,
                 const StepRunners& run) {
  ++execution_counters().evaluations;
  FlushDenormalScope float_mode;
  StepProfile* profile = StepProfile::active();
  const DeviceTimer* timer = profile ? run.timer : nullptr;
  std::vector<std::string> timed;  // the label of each step the timer marked, in order
  if (timer) timer->elapsed();     // drops the marks of an evaluation that threw midway
  const bool overlap = run.start_collective && overlap_collectives() && process_count() > 1;
  CollectivesInFlight in_flight;
  int64_t steps_beside = 0;  // compute steps started while a collective was running
  // Bytes of this evaluation's stored values alive at once, for peak_bytes.
  int64_t live = 0, peak = 0;
  for (size_t i = 0; i < program.steps.size(); ++i) {
    const Step& step = program.steps[i];
    if (step.awaits >= 0 && overlap)
      live += in_flight.wait_through(static_cast<size_t>(step.awaits));
    if (step.kind == FusionGroup::Kind::Kernel || step.kind == FusionGroup::Kind::MatMul)
      steps_beside += in_flight.running() ? 1 : 0;
    auto start =
        profile ? std::chrono::steady_clock::now() : std::chrono::steady_clock::time_point();
    bool marked = timer && step.kind != FusionGroup::Kind::Alias;
    if (marked) timer->mark();
    bool started = false;
    if (step.kind == FusionGroup::Kind::Alias) {
      // Every back end stores values flat and row-major: a reshape shares its input's storage
      // (counted once, Program::frees_buffer).
      Node* node = sig.resolve(step.node, pending);
      node->value = node->inputs[0]->value;
    } else if (step.kind == FusionGroup::Kind::Kernel) {
      run.kernel(step, pending, sig);
    } else if (step.kind == FusionGroup::Kind::MatMul) {
      run.matmul(step, pending, sig);
    } else if (Node* node = sig.resolve(step.node, pending);
               overlap && op_info(node->op).kind == OpKind::Collective) {
      in_flight.reserve();
      in_flight.start(i, node, run.start_collective(*node));
      ++execution_counters().host_ops;  // as the back end counts the collective it runs itself
      started = true;
    } else {
      run.host(*node);
    }
    if (marked) timer->mark();
    if (profile && step.kind != FusionGroup::Kind::Alias) {
      std::string label = step_label(step, pending, sig);
      if (started) label = "started: " + label;
      profile->add(label,
                   std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
      if (marked) timed.push_back(std::move(label));
    }
    if (!started) live += step_output_bytes(step, pending, sig, stored_bytes);
    peak = std::max(peak, live);
    for (size_t r = 0; r < program.release_after[i].size(); ++r) {
      Node* node = pending[program.release_after[i][r]];
      if (program.frees_buffer[i][r]) live -= stored_bytes(node);
      node->value.reset();
    }
  }
  if (!in_flight.empty()) {
    live += in_flight.wait_through(SIZE_MAX);
    peak = std::max(peak, live);
  }
  if (steps_beside > 0) note_steps_beside_collectives(steps_beside);
  if (timer) {
    std::vector<double> seconds = timer->elapsed();
    for (size_t i = 0; i < timed.size() && i < seconds.size(); ++i)
      profile->add(std::move(timed[i]), seconds[i], true);
  }
  ExecutionStats& s = execution_counters();
  s.peak_bytes = std::max(s.peak_bytes, peak);
}

FusionOptions fusion_options(Device device) {
  FusionOptions options;
  options.fuse = !eager_mode();
  options.multi_tensor = device != Device::reference && options.fuse && multi_tensor_steps();
  options.matmul_epilogue = device == Device::cpu && options.fuse && matmul_epilogue_steps();
  return options;
}

namespace {
// On unless the environment variable is "0" (to compare).
bool on_unless_zero(const char* variable) {
  const char* value = std::getenv(variable);
  return !(value && std::string_view(value) == "0");
}
std::atomic<bool>& multi_tensor_setting() {
  static std::atomic<bool> enabled{on_unless_zero("MIXTAPE_MULTI_TENSOR")};
  return enabled;
}
std::atomic<bool>& matmul_epilogue_setting() {
  static std::atomic<bool> enabled{on_unless_zero("MIXTAPE_MATMUL_EPILOGUE")};
  return enabled;
}
std::atomic<bool>& in_place_setting() {
  static std::atomic<bool> enabled{on_unless_zero("MIXTAPE_IN_PLACE")};
  return enabled;
}
// Overlap needs a core for the communication thread: where the processes' OpenMP teams take
// every core (2 processes of 1 thread on 2 cores), its polls take the core the other process
// computes on (the digits MLP ran 6% slower, the char GPT no faster). MIXTAPE_OVERLAP_COLLECTIVES=1
// or 0 decides.
bool spare_core_for_collectives() {
  const char* value = std::getenv("MIXTAPE_OVERLAP_COLLECTIVES");
  if (value && *value) return std::string_view(value) != "0";
  int local = 1;
  for (const char* name :
       {"OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "SLURM_NTASKS_PER_NODE"})
    if (const char* count = std::getenv(name); count && std::atoi(count) > 0) {
      local = std::atoi(count);
      break;
    }
  // The cores this process may run on (mpirun binds each process to its own by default)
  // against its OpenMP team; without binding, the host's cores against all its processes' teams.
  const int host = static_cast<int>(std::thread::hardware_concurrency());
  cpu_set_t allowed;
  const int cores =
      sched_getaffinity(0, sizeof(allowed), &allowed) == 0 ? CPU_COUNT(&allowed) : host;
  return cores < host ? cores > omp_get_max_threads() : cores > local * omp_get_max_threads();
}
std::atomic<bool>& overlap_setting() {
  static std::atomic<bool> enabled{spare_core_for_collectives()};
  return enabled;
}
}  // namespace

bool multi_tensor_steps() { return multi_tensor_setting().load(); }
void set_multi_tensor_steps(bool enabled) { multi_tensor_setting().store(enabled); }
bool matmul_epilogue_steps() { return matmul_epilogue_setting().load(); }
void set_matmul_epilogue_steps(bool enabled) { matmul_epilogue_setting().store(enabled); }
bool in_place_outputs() { return in_place_setting().load(std::memory_order_relaxed); }
void set_in_place_outputs(bool enabled) { in_place_setting().store(enabled); }
bool overlap_collectives() { return overlap_setting().load(std::memory_order_relaxed); }
void set_overlap_collectives(bool enabled) { overlap_setting().store(enabled); }

std::vector<Node*> pending_nodes(const std::vector<NodePtr>& outputs) {
  // Each walk marks the unevaluated nodes it reaches with a number of its own, instead of
  // keeping a set: the traced loop walks every step's graph.
  static std::atomic<uint64_t> walks{0};
  uint64_t walk = ++walks;
  // Each node with its id, read while the walk has it at hand, so that ordering them takes no
  // second trip to each node.
  thread_local std::vector<std::pair<uint64_t, Node*>> found;
  thread_local std::vector<Node*> stack;
  found.clear();
  stack.clear();
  for (const NodePtr& output : outputs)
    if (output && !output->evaluated()) stack.push_back(output.get());
  while (!stack.empty()) {
    Node* node = stack.back();
    stack.pop_back();
    if (node->pending_walk == walk) continue;
    node->pending_walk = walk;
    found.emplace_back(node->id, node);
    for (const NodePtr& input : node->inputs)
      if (!input->evaluated() && input->pending_walk != walk) stack.push_back(input.get());
  }
  // Inputs are always made before their users, so creation order is a topological order.
  sort_by_id(found);
  std::vector<Node*> pending;
  pending.reserve(found.size());
  for (const auto& [id, node] : found) pending.push_back(node);
  return pending;
}

int64_t planned_peak_bytes(const std::vector<NodePtr>& outputs) {
  std::vector<Node*> pending = pending_nodes(outputs);
  if (pending.empty()) return 0;
  assign_precision(pending);
  std::vector<Node*> required;
  for (const NodePtr& output : outputs)
    if (output && !output->evaluated()) required.push_back(output.get());
  FusionOptions options = fusion_options(current_device());
  Signature sig = sign(pending, required, options.fuse, "mixtape-memory-plan");
  Program program =
      build_program(pending, options, sig, [](const kir::Kernel&) { return KernelRef{}; });
  auto planned_bytes = [](const Node* node) {
    return node->numel() * static_cast<int64_t>(size_of(node->precision.storage_type));
  };
  int64_t live = 0, peak = 0;
  for (size_t i = 0; i < program.steps.size(); ++i) {
    live += step_output_bytes(program.steps[i], pending, sig, planned_bytes);
    peak = std::max(peak, live);
    for (size_t r = 0; r < program.release_after[i].size(); ++r)
      if (program.frees_buffer[i][r]) live -= planned_bytes(pending[program.release_after[i][r]]);
  }
  return peak;
}

}  // namespace mixtape

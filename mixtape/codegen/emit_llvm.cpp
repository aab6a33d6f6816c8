// mixtape/codegen/emit_llvm.cpp -- kernel IR -> LLVM 16 IR text (opaque pointers) for the ORC JIT.
#include "mixtape/codegen/emit_llvm.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <functional>
#include <optional>
#include <set>
#include <utility>

#include <fmt/format.h>

#include "mixtape/dsl/error.h"

namespace mixtape {
namespace {

using kir::Affine;
using kir::Op;
using kir::Type;
using kir::Value;

const char* llvm_type(Type type) { return traits(type).llvm; }

bool is_float(Type type) { return type == Type::f32 || type == Type::f64; }

std::string constant(Type type, double imm) {
  switch (type) {
    case Type::f32:  // LLVM spells float constants as the double of the same value, in hex
      return fmt::format("0x{:016X}",
                         std::bit_cast<uint64_t>(static_cast<double>(static_cast<float>(imm))));
    case Type::f64:
      return fmt::format("0x{:016X}", std::bit_cast<uint64_t>(imm));
    case Type::i64:
      return fmt::format("{}", static_cast<int64_t>(imm));
    case Type::i1:
      return imm != 0 ? "true" : "false";
  }
  return "";
}

class Emitter {
 public:
  explicit Emitter(const kir::Kernel& kernel) : k_(kernel) {}

  std::string run() {
    emit_function();
    std::string function = std::move(out_);
    std::string text = fmt::format("; mixtape kernel {}\n", k_.name);
    for (const std::string& decl : declarations_) text += decl + "\n";
    return text + function;
  }

 private:
  template <typename... Args>
  void line(fmt::format_string<Args...> format, Args&&... args) {
    out_ += "  ";
    out_ += fmt::format(format, std::forward<Args>(args)...);
    out_ += "\n";
  }
  void label(const std::string& name) { out_ += name + ":\n"; }
  std::string tmp() { return fmt::format("%t{}", next_tmp_++); }

  void emit_function() {
    if (k_.multi_tensor) {
      emit_multi_tensor();
      return;
    }
    out_ += fmt::format(
        "define void @{}(ptr noalias nocapture readonly %params, i64 %begin, i64 %end) #0 {{\n",
        k_.name);
    label("entry");
    load_params();
    int rank = static_cast<int>(k_.dims.size());
    bool column = k_.column_reduction();
    int column_dim = k_.reduce_from - 1;
    vector_columns_ = column && k_.pass_count() == 1 && k_.dims[column_dim] >= column_lanes &&
                      lanes_fit(column_dim);
    vector_rows_ = !column && vectorizable_rows(rank);
    allocate_loop_state(rank, column, column_dim);
    // The executor hands out ranges of the parallel dims flattened: decompose per point. A
    // column split's range is of columns: the body runs once, its column loops over the range.
    split_columns_ = k_.column_split();
    int parallel = split_columns_ ? 0 : k_.parallel_dims();
    outer_loop_head(parallel);
    if (column)
      column_reduction_body(parallel, rank, column_dim);
    else if (k_.is_reduction())
      reduction_body(parallel, rank);
    else
      inner_loops(parallel, rank, 0, [&] {
        values(k_.body, "v");
        stores(k_.stores);
      });
    line("%o.next = add nsw i64 {}, 1", split_columns_ ? "%end" : "%o");
    line("store i64 %o.next, ptr %o.addr");
    line("br label %outer.head");
    finish_function();
  }

  // Loads the parameter pointers and the scalar slots (a double array behind the last pointer),
  // once per call.
  void load_params() {
    for (size_t p = 0; p < k_.params.size(); ++p) {
      line("%pp{} = getelementptr inbounds ptr, ptr %params, i64 {}", p, p);
      line("%p{} = load ptr, ptr %pp{}, !noalias !0", p, p);
    }
    if (k_.scalars > 0) {
      line("%sp = getelementptr inbounds ptr, ptr %params, i64 {}", k_.params.size());
      line("%sa = load ptr, ptr %sp, !noalias !0");
      for (int32_t s = 0; s < k_.scalars; ++s) {
        line("%sg{} = getelementptr inbounds double, ptr %sa, i64 {}", s, s);
        line("%s{} = load double, ptr %sg{}, !noalias !0", s, s);
      }
    }
  }

  // The loop variables' and accumulators' slots (one accumulator per column when `column`).
  void allocate_loop_state(int rank, bool column, int column_dim) {
    for (int d = 0; d < rank; ++d) {
      line("%i{}.addr = alloca i64", d);
      var_.push_back(fmt::format("%i{}", d));
    }
    line("%o.addr = alloca i64");
    for (size_t r = 0; r < k_.reductions.size(); ++r) {
      const char* t = acc_type(k_.reductions[r]);
      if (column)
        line("%acc{}.addr = alloca {}, i64 {}", r, t, k_.dims[column_dim]);
      else
        line("%acc{}.addr = alloca {}", r, t);
      acc_ptr_.push_back(fmt::format("%acc{}.addr", r));
      acc_value_.push_back(fmt::format("%acc{}", r));
      wide_ptr_.push_back(fmt::format("%wide{}.addr", r));
      if (vector_columns_)
        line("%vacc{}.addr = alloca <{} x {}>", r, column_lanes, llvm_type(k_.reductions[r].type));
      for (int b = 0; vector_rows_ && b < k_.dims[rank - 1] / column_lanes; ++b)
        line("%vacc{}.{}.addr = alloca <{} x float>", r, b, column_lanes);
      if (!widened(k_.reductions[r])) continue;
      if (column)
        line("%wide{}.addr = alloca double, i64 {}", r, k_.dims[column_dim]);
      else
        line("%wide{}.addr = alloca double", r);
      if (vector_columns_ || vector_rows_)
        line("%vwide{}.addr = alloca <{} x double>", r, column_lanes);
    }
    if (vector_columns_) line("%vb.addr = alloca i64");
    for (int d = 0; d < rank; ++d) line("%blk{}.addr = alloca i64", d);
  }

  // The loop over the call's range [begin, end), its point decomposed into the parallel dims.
  void outer_loop_head(int parallel) {
    line("store i64 %begin, ptr %o.addr");
    line("br label %outer.head");
    label("outer.head");
    line("%o = load i64, ptr %o.addr");
    line("%outer.more = icmp slt i64 %o, %end");
    line("br i1 %outer.more, label %outer.body, label %exit");
    label("outer.body");
    std::string rest = "%o";
    for (int d = parallel - 1; d >= 0; --d) {
      if (d == 0) {
        line("%i0 = add i64 {}, 0", rest);
      } else {
        line("%i{} = urem i64 {}, {}", d, rest, k_.dims[d]);
        line("%q{} = udiv i64 {}, {}", d, rest, k_.dims[d]);
        rest = fmt::format("%q{}", d);
      }
    }
  }

  // One accumulator per column: initialize them, add the reduced dims' terms with the column
  // loop innermost (once per pass), then run the epilogue per column.
  void column_reduction_body(int parallel, int rank, int column_dim) {
    column_loop(column_dim, [&] {
      point_accumulators(column_dim);
      initialize_accumulators();
    });
    if (vector_columns_) {
      vector_column_blocks(parallel, rank, column_dim);
    } else {
      column_passes(parallel, rank, column_dim, "");
    }
    column_loop(column_dim, [&] {
      point_accumulators(column_dim);
      for (size_t r = 0; r < k_.reductions.size(); ++r) acc_value_[r] = load_final(r);
      values(k_.epilogue, "e");
      stores(k_.epilogue_stores);
    });
  }

  // The passes of a column reduction, the column loop innermost, over the columns from `from`
  // (the first of the range when empty).
  void column_passes(int parallel, int rank, int column_dim, const std::string& from) {
    for (int pass = 0; pass < k_.pass_count(); ++pass) {
      std::string prefix = pass == 0 ? "v" : fmt::format("v{}.", pass);
      // Blocked (many rows): each column's f64 accumulator takes its block's sum per block.
      auto column_wide_sums = [&](Wide step) {
        column_loop(
            column_dim,
            [&] {
              point_accumulators(column_dim);
              wide_sums(step, pass);
            },
            from);
      };
      blocks_ = block_plan(pass, parallel + 1, rank, chain_terms);
      blocks_.flush = [&] { column_wide_sums(Wide::add); };
      const bool blocked = blocks_.dim >= 0;
      if (blocked) column_wide_sums(Wide::start);
      inner_loops(parallel + 1, rank, pass, [&] {
        column_loop(
            column_dim,
            [&] {
              point_accumulators(column_dim);
              for (size_t r = 0; r < k_.reductions.size(); ++r)
                if (k_.reductions[r].pass < pass)  // final: read by this pass
                  acc_value_[r] = load_final(r);
              values(k_.pass_body(pass), prefix.c_str());
              stores(k_.pass_stores(pass));
              accumulate(pass);
            },
            from);
      });
      if (blocked) column_wide_sums(Wide::finish);
      blocks_ = {};
    }
  }

  // ---- Column reductions in vector registers ----
  // The column loop keeps each column's accumulator in memory: vectorized, every reduced row
  // loads, adds and stores the accumulators of the thread's columns, a chain through memory
  // and a short loop of unknown trip count per row (34 us of a [4096, 64] bf16 bias gradient).
  // Where the pass is plain arithmetic, columns are instead taken column_lanes at a time,
  // their accumulators a vector the reduced rows add to in registers; the columns left over
  // (fewer than column_lanes) take the column loop. Each lane is one column's accumulator, adding
  // its rows in the same order as the column loop, so the bits are the same.
  static constexpr int column_lanes = 16;

  // Whether a single-pass fast or sequential f32/f64 sum's body runs lane by lane along `dim`:
  // plain arithmetic, every load along it contiguous or constant, every store contiguous.
  bool lanes_fit(int dim) const {
    for (const kir::Reduction& r : k_.reductions)
      if (r.kind != kir::ReduceKind::Sum || !is_float(r.type) || is_half(r.round_to)) return false;
    for (int pass = 0; pass < k_.pass_count(); ++pass)
      if (!lanes_fit(dim, k_.pass_body(pass), k_.pass_stores(pass))) return false;
    return true;
  }
  bool lanes_fit(int dim, const std::vector<Value>& body,
                 const std::vector<kir::Store>& stores) const {
    for (const Value& v : body) {
      switch (v.op) {
        case Op::Load:
          if (lane_step(v.map, dim) > 1) return false;
          break;
        case Op::RoundTo:
          if ((v.dtype != DType::bf16 && v.dtype != DType::f16) || body[v.a].type != Type::f32)
            return false;
          break;
        case Op::Const:
        case Op::Scalar:
        case Op::Accumulated:  // an earlier pass's result, the same in every lane
        case Op::Neg:
        case Op::Or:
        case Op::Select:
        case Op::IsNan:
        case Op::Sqrt:
        case Op::Convert:
          break;
        default: {
          kir::OpForm form = kir::traits(v.op).form;
          if (form != kir::OpForm::Arith && form != kir::OpForm::Compare) return false;
        }
      }
    }
    for (const kir::Store& st : stores)
      if (lane_step(st.map, dim) != 1) return false;
    return true;
  }

  // A fast sum over short rows (a batch norm's statistics over [N, 4 * 4] or [N, 8 * 8]) ends
  // each row's vector loop in a horizontal sum and an accumulator store: it keeps a vector of
  // column_lanes partial sums per column_lanes elements of a row instead (one to four,
  // independent chains), across all its rows, added vector by vector and then lane by lane at
  // the end (vector_row_blocks). The split is the emitter's, so both tiers give the same bits.
  bool vectorizable_rows(int rank) const {
    const int last = rank - 1;
    return k_.is_reduction() && k_.reduce_from <= rank - 2 && k_.dims[last] % column_lanes == 0 &&
           k_.dims[last] <= 4 * column_lanes && lanes_fit(last) &&
           std::all_of(k_.reductions.begin(), k_.reductions.end(),
                       [](const kir::Reduction& r) { return r.type == Type::f32; });
  }

  // How far a map moves per step of `dim` (0 for a map without coefficients, a 0-d value's).
  int64_t lane_step(const Affine& map, int dim) const {
    if (map.coeff.size() != k_.dims.size()) return 0;
    return map.coeff[dim] < 0 ? column_lanes : map.coeff[dim];
  }

  // Adds this point's terms of every reduction of `pass` to its vector of partial sums (the
  // alloca %vacc<r><suffix>.addr).
  void add_to_vector_sums(const std::string& suffix, int pass = 0) {
    for (size_t r = 0; r < k_.reductions.size(); ++r) {
      if (k_.reductions[r].pass != pass) continue;
      std::string t = ty(k_.reductions[r].type), acc = tmp(), next = tmp();
      line("{} = load {}, ptr %vacc{}{}.addr", acc, t, r, suffix);
      line("{} = fadd {} {}, {}", next, t, acc, names_[k_.reductions[r].value]);
      line("store {} {}, ptr %vacc{}{}.addr", t, next, r, suffix);
    }
  }

  int acc_bytes(size_t r) const { return k_.reductions[r].type == Type::f32 ? 4 : 8; }

  // How a register is spelled: the element, or a vector of lanes_ of them while the emitter
  // writes column blocks (vector_column_blocks).
  std::string lanes(const char* element) const {
    return lanes_ == 1 ? std::string(element) : fmt::format("<{} x {}>", lanes_, element);
  }
  std::string ty(Type type) const { return lanes(llvm_type(type)); }
  // A constant in every lane.
  std::string lit(const char* element, const std::string& value) const {
    if (lanes_ == 1) return value;
    std::string text = "<";
    for (int l = 0; l < lanes_; ++l) text += fmt::format("{}{} {}", l ? ", " : "", element, value);
    return text + ">";
  }
  std::string zero(const char* scalar) const { return lanes_ == 1 ? scalar : "zeroinitializer"; }

  // `scalar` (an SSA value of `element` type) in every lane.
  std::string broadcast(const char* element, const std::string& scalar) {
    std::string one = tmp(), all = tmp();
    const std::string v = lanes(element);
    line("{} = insertelement {} poison, {} {}, i64 0", one, v, element, scalar);
    line("{} = shufflevector {} {}, {} poison, <{} x i32> zeroinitializer", all, v, one, v, lanes_);
    return all;
  }

  // The column blocks: from the range's first column, column_lanes columns while they fit, each
  // swept over the reduced dims with vector accumulators; then the rest through the column loop.
  void vector_column_blocks(int parallel, int rank, int column_dim) {
    const bool split = split_columns_ && column_dim == 0;
    const std::string first = split ? "%begin" : "0";
    const std::string last = split ? "%end" : std::to_string(k_.dims[column_dim]);
    line("store i64 {}, ptr %vb.addr", first);
    line("br label %vb.head");
    label("vb.head");
    line("%vb = load i64, ptr %vb.addr");
    line("%vb.end = add nsw i64 %vb, {}", column_lanes);
    line("%vb.fits = icmp sle i64 %vb.end, {}", last);
    line("br i1 %vb.fits, label %vb.body, label %vb.rest");
    label("vb.body");
    lanes_ = column_lanes;
    vector_dim_ = column_dim;
    auto block_accumulators = [&](bool load) {  // the accumulator array's lanes <-> registers
      for (size_t r = 0; r < k_.reductions.size(); ++r) {
        const kir::Reduction& red = k_.reductions[r];
        std::string t = ty(red.type), at = tmp(), value = tmp();
        line("{} = getelementptr inbounds {}, ptr %acc{}.addr, i64 %vb", at, llvm_type(red.type),
             r);
        // The accumulator array is aligned to its elements only.
        if (load) {
          line("{} = load {}, ptr {}, align {}", value, t, at, acc_bytes(r));
          line("store {} {}, ptr %vacc{}.addr", t, value, r);
        } else {
          line("{} = load {}, ptr %vacc{}.addr", value, t, r);
          line("store {} {}, ptr {}, align {}", t, value, at, acc_bytes(r));
        }
      }
    };
    block_accumulators(true);
    // Blocked (many rows): each lane's block of rows into an f64 lane, rounded at the end.
    auto vector_wide_sums = [&](Wide step) {
      wide_sums(
          step, 0, [&](size_t r) { return fmt::format("%vacc{}.addr", r); },
          [&](size_t r) { return fmt::format("%vwide{}.addr", r); });
    };
    blocks_ = block_plan(0, parallel + 1, rank, chain_terms);
    blocks_.flush = [&] { vector_wide_sums(Wide::add); };
    const bool blocked = blocks_.dim >= 0;
    if (blocked) vector_wide_sums(Wide::start);
    inner_loops(parallel + 1, rank, std::string(".v"), [&] {
      var_[column_dim] = "%vb";
      values(k_.body, "w");
      stores(k_.stores);
      add_to_vector_sums("");
    });
    if (blocked) vector_wide_sums(Wide::finish);
    blocks_ = {};
    block_accumulators(false);
    lanes_ = 1;
    line("store i64 %vb.end, ptr %vb.addr");
    line("br label %vb.head");
    label("vb.rest");
    line("%vb.more = icmp slt i64 %vb, {}", last);
    line("br i1 %vb.more, label %vb.tail, label %vb.done");
    label("vb.tail");
    column_passes(parallel, rank, column_dim, "%vb");
    line("br label %vb.done");
    label("vb.done");
  }

  // One sweep over the inner dims per pass; a pass's reductions are final when it ends, and
  // later passes and the epilogue read them.
  void reduction_body(int parallel, int rank) {
    initialize_accumulators();
    if (vector_rows_) {
      for (int pass = 0; pass < k_.pass_count(); ++pass) vector_row_blocks(parallel, rank, pass);
      values(k_.epilogue, "e");
      stores(k_.epilogue_stores);
      return;
    }
    for (int pass = 0; pass < k_.pass_count(); ++pass) {
      std::string prefix = pass == 0 ? "v" : fmt::format("v{}.", pass);
      blocks_ = block_plan(pass, parallel, rank, row_block_terms(pass));
      blocks_.flush = [&] { wide_sums(Wide::add, pass); };
      if (blocks_.dim >= 0) wide_sums(Wide::start, pass);
      inner_loops(parallel, rank, pass, [&] {
        values(k_.pass_body(pass), prefix.c_str());
        stores(k_.pass_stores(pass));
        accumulate(pass);
      });
      if (blocks_.dim >= 0) wide_sums(Wide::finish, pass);
      blocks_ = {};
      for (size_t r = 0; r < k_.reductions.size(); ++r)
        if (k_.reductions[r].pass == pass) acc_value_[r] = load_final(r);
    }
    values(k_.epilogue, "e");
    stores(k_.epilogue_stores);
  }

  // vector_rows_, one pass of the kernel: every reduced dim but the last looped as usual, the
  // last column_lanes elements at a time, each lane a partial sum of the pass's reductions; then
  // the lanes added in order onto the accumulator, which later passes read.
  void vector_row_blocks(int parallel, int rank, int pass) {
    const int last = rank - 1;
    const int blocks = static_cast<int>(k_.dims[last] / column_lanes);
    const std::string t = fmt::format("<{} x float>", column_lanes);
    auto in_pass = [&](size_t r) { return k_.reductions[r].pass == pass; };
    for (size_t r = 0; r < k_.reductions.size(); ++r) {
      if (!in_pass(r)) continue;
      for (int b = 0; b < blocks; ++b)
        line("store {} zeroinitializer, ptr %vacc{}.{}.addr", t, r, b);
    }
    const std::string pass_name = pass == 0 ? "" : fmt::format("p{}", pass);
    // Blocked (long sums): every vector of a block's partial sums is added into one f64 vector
    // per reduction, whose lanes are added in order at the end.
    blocks_ = block_plan(pass, parallel, last, chain_terms);
    const bool blocked = blocks_.dim >= 0;
    auto vector_wide_sums = [&](Wide step, int b) {
      lanes_ = column_lanes;
      wide_sums(
          step, pass, [&](size_t r) { return fmt::format("%vacc{}.{}.addr", r, b); },
          [&](size_t r) { return fmt::format("%vwide{}.addr", r); });
      lanes_ = 1;
    };
    blocks_.flush = [&] {
      for (int b = 0; b < blocks; ++b) vector_wide_sums(Wide::add, b);
    };
    if (blocked) vector_wide_sums(Wide::start, 0);
    inner_loops(parallel, last, ".v" + pass_name, [&] {
      lanes_ = column_lanes;
      vector_dim_ = last;
      for (int b = 0; b < blocks; ++b) {
        var_[last] = std::to_string(b * column_lanes);
        values(k_.pass_body(pass), fmt::format("w{}{}.", b, pass_name).c_str());
        stores(k_.pass_stores(pass));
        add_to_vector_sums(fmt::format(".{}", b), pass);
      }
      lanes_ = 1;
    });
    blocks_ = {};
    const std::string reduce = fmt::format("llvm.vector.reduce.fadd.v{}f32", column_lanes);
    declare(fmt::format("declare float @{}(float, {})", reduce, t));
    const std::string reduce_wide = fmt::format("llvm.vector.reduce.fadd.v{}f64", column_lanes);
    if (blocked)
      declare(fmt::format("declare double @{}(double, <{} x double>)", reduce_wide, column_lanes));
    for (size_t r = 0; r < k_.reductions.size(); ++r) {
      if (!in_pass(r)) continue;
      if (blocked && widened(k_.reductions[r])) {  // the accumulator is 0: the sweep's first
        std::string wide = tmp(), sum = tmp(), rounded = tmp();
        line("{} = load <{} x double>, ptr %vwide{}.addr", wide, column_lanes, r);
        line("{} = call double @{}(double 0.0, <{} x double> {})", sum, reduce_wide, column_lanes,
             wide);
        line("{} = fptrunc double {} to float", rounded, sum);
        line("store float {}, ptr {}", rounded, acc_ptr_[r]);
        acc_value_[r] = load_final(r);
        continue;
      }
      std::string lanes_sum = tmp();
      line("{} = load {}, ptr %vacc{}.0.addr", lanes_sum, t, r);
      for (int b = 1; b < blocks; ++b) {
        std::string part = tmp(), next = tmp();
        line("{} = load {}, ptr %vacc{}.{}.addr", part, t, r, b);
        line("{} = fadd {} {}, {}", next, t, lanes_sum, part);
        lanes_sum = next;
      }
      // Without reassociation the intrinsic adds the lanes in order, onto the accumulator.
      std::string acc = tmp(), sum = tmp();
      line("{} = load float, ptr {}", acc, acc_ptr_[r]);
      line("{} = call float @{}(float {}, {} {})", sum, reduce, acc, t, lanes_sum);
      line("store float {}, ptr {}", sum, acc_ptr_[r]);
      acc_value_[r] = load_final(r);
    }
  }

  // kir::Kernel::multi_tensor's ABI: for each segment that meets [begin, end), load its
  // pointers and scalars, then run the pointwise loop over its part of the range, a loop of the
  // same shape as a rank-1 kernel's so that it vectorizes the same way. A reduction's range is
  // of segments: each is swept whole, then its epilogue stores the segment's result.
  void emit_multi_tensor() {
    const bool reduce = k_.is_reduction();
    if (k_.dims.size() != 1 || (reduce && (k_.reduce_from != 0 || k_.pass_count() != 1)))
      fail("llvm emitter: multi-tensor kernel {} is neither rank-1 pointwise nor a whole reduction",
           k_.name);
    size_t stride = k_.params.size() + (k_.scalars > 0 ? 1 : 0);
    out_ += fmt::format(
        "define void @{}(ptr noalias nocapture readonly %params, i64 %begin, i64 %end) #0 {{\n",
        k_.name);
    label("entry");
    line("%info = load ptr, ptr %params, !noalias !0");
    line("%segments = load i64, ptr %info, !noalias !0");
    line("%seg.addr = alloca i64");
    line("%o.addr = alloca i64");
    line("%blk0.addr = alloca i64");
    for (size_t r = 0; r < k_.reductions.size(); ++r) {
      line("%acc{}.addr = alloca {}", r, acc_type(k_.reductions[r]));
      line("%wide{}.addr = alloca double", r);
      acc_ptr_.push_back(fmt::format("%acc{}.addr", r));
      acc_value_.push_back(fmt::format("%acc{}", r));
      wide_ptr_.push_back(fmt::format("%wide{}.addr", r));
    }
    line("store i64 {}, ptr %seg.addr", reduce ? "%begin" : "0");
    line("br label %seg.head");
    label("seg.head");
    line("%seg = load i64, ptr %seg.addr");
    line("%seg.more = icmp slt i64 %seg, {}", reduce ? "%end" : "%segments");
    line("br i1 %seg.more, label %seg.check, label %exit");
    label("seg.check");
    line("%seg.1 = add nsw i64 %seg, 1");
    line("%seg.2 = add nsw i64 %seg, 2");
    line("%start.g = getelementptr inbounds i64, ptr %info, i64 %seg.1");
    line("%start = load i64, ptr %start.g, !noalias !0");
    line("%stop.g = getelementptr inbounds i64, ptr %info, i64 %seg.2");
    line("%stop = load i64, ptr %stop.g, !noalias !0");
    if (reduce) {
      line("br label %seg.body");
    } else {
      line("%seg.past = icmp sge i64 %start, %end");
      line("br i1 %seg.past, label %exit, label %seg.body");
    }
    label("seg.body");
    if (reduce) {
      line("%lo.rel = add i64 0, 0");
      line("%hi.rel = sub nsw i64 %stop, %start");
    } else {
      line("%lo.c = icmp sgt i64 %begin, %start");
      line("%lo = select i1 %lo.c, i64 %begin, i64 %start");
      line("%hi.c = icmp slt i64 %end, %stop");
      line("%hi = select i1 %hi.c, i64 %end, i64 %stop");
      line("%lo.rel = sub nsw i64 %lo, %start");
      line("%hi.rel = sub nsw i64 %hi, %start");
    }
    line("%seg.base0 = mul nsw i64 %seg, {}", stride);
    line("%seg.base = add nsw i64 %seg.base0, 1");
    for (size_t p = 0; p < k_.params.size(); ++p) {
      line("%pi{} = add nsw i64 %seg.base, {}", p, p);
      line("%pp{} = getelementptr inbounds ptr, ptr %params, i64 %pi{}", p, p);
      line("%p{} = load ptr, ptr %pp{}, !noalias !0", p, p);
    }
    if (k_.scalars > 0) {
      line("%si = add nsw i64 %seg.base, {}", k_.params.size());
      line("%sp = getelementptr inbounds ptr, ptr %params, i64 %si");
      line("%sa = load ptr, ptr %sp, !noalias !0");
      for (int32_t slot = 0; slot < k_.scalars; ++slot) {
        line("%sg{} = getelementptr inbounds double, ptr %sa, i64 {}", slot, slot);
        line("%s{} = load double, ptr %sg{}, !noalias !0", slot, slot);
      }
    }
    var_ = {"%i0"};
    initialize_accumulators();
    // A segment's sum in blocks (its extent is known only at the launch).
    const bool blocked = reduce && has_widened(0);
    std::string end = "%hi.rel";
    if (blocked) {
      blocks_ = {0, row_block_terms(0), [&] { wide_sums(Wide::add, 0); }};
      wide_sums(Wide::start, 0);
      end = open_block("seg", 0, "%hi.rel");
    }
    loop_head("outer", "%o.addr", "%o", blocked ? "%seg.lo" : "%lo.rel", end);
    line("%i0 = add i64 %o, 0");
    values(k_.body, "v");
    stores(k_.stores);
    accumulate(0);
    line("%o.next = add nsw i64 %o, 1");
    loop_end("outer", "%o.addr", "%o.next");
    if (blocked) {
      close_block("seg", 0);
      wide_sums(Wide::finish, 0);
      blocks_ = {};
    }
    line("br label %seg.next");
    label("seg.next");
    if (reduce) {
      for (size_t r = 0; r < k_.reductions.size(); ++r) acc_value_[r] = load_final(r);
      values(k_.epilogue, "e");
      stores(k_.epilogue_stores);
    }
    line("store i64 %seg.1, ptr %seg.addr");
    line("br label %seg.head");
    finish_function();
  }

  // Every parameter is a buffer of its own (the executor allocates each output afresh; inputs
  // are only read), so each gets an alias scope: the vectorizer then needs no runtime overlap
  // checks, which it cannot combine with a masked tail.
  std::string alias_tags(int param) const {
    int n = static_cast<int>(k_.params.size());
    return fmt::format(", !alias.scope !{}, !noalias !{}", 2 + n + param, 2 + 2 * n + param);
  }

  // The exit block, the end of the function and the attributes and metadata it names.
  void finish_function() {
    label("exit");
    line("ret void");
    out_ += "}\n\n";
    out_ +=
        "attributes #0 = { nounwind \"prefer-vector-width\"=\"512\" "
        "\"min-legal-vector-width\"=\"0\" }\n";
    out_ += "!0 = !{}\n";
    // !1 the domain, !(2 + p) param p's scope, then the scope lists alias_tags names.
    int n = static_cast<int>(k_.params.size());
    out_ += "!1 = distinct !{!1, !\"mixtape params\"}\n";
    for (int p = 0; p < n; ++p) out_ += fmt::format("!{} = distinct !{{!{}, !1}}\n", 2 + p, 2 + p);
    for (int p = 0; p < n; ++p) out_ += fmt::format("!{} = !{{!{}}}\n", 2 + n + p, 2 + p);
    for (int p = 0; p < n; ++p) {
      std::string others;
      for (int q = 0; q < n; ++q)
        if (q != p) others += fmt::format("{}!{}", others.empty() ? "" : ", ", 2 + q);
      out_ += fmt::format("!{} = !{{{}}}\n", 2 + 2 * n + p, others);
    }
    if (column_loops_ > 0) {
      const int hint = first_loop_metadata();
      out_ += fmt::format("!{} = !{{!\"llvm.loop.interleave.count\", i32 1}}\n", hint);
      out_ += fmt::format("!{} = !{{!\"llvm.loop.vectorize.width\", i32 16}}\n", hint + 1);
      for (int l = 0; l < column_loops_; ++l)
        out_ += fmt::format("!{} = distinct !{{!{}, !{}, !{}}}\n", hint + 2 + l, hint + 2 + l, hint,
                            hint + 1);
    }
  }

  void initialize_accumulators() {
    for (size_t r = 0; r < k_.reductions.size(); ++r) {
      const kir::Reduction& red = k_.reductions[r];
      std::string init_text;
      if (red.kind == kir::ReduceKind::Sum)
        init_text = constant(red.type, 0.0);
      else if (red.type == Type::f32)
        init_text = "-2139095041";  // the order key of -inf
      else if (red.type == Type::f64)
        init_text = "-9218868437227405313";
      else
        init_text = "-9223372036854775808";
      line("store {} {}, ptr {}", acc_type(red), init_text, acc_ptr_[r]);
    }
  }

  // What a reduction's accumulator holds: float maxima are kept as order keys.
  static const char* acc_type(const kir::Reduction& red) {
    if (red.kind == kir::ReduceKind::Max && is_float(red.type))
      return red.type == Type::f32 ? "i32" : "i64";
    return llvm_type(red.type);
  }

  // The float's bits with all but the sign flipped when it is negative, so that signed integer
  // order is ref_Max's order (-0 below +0), and every NaN the largest key.
  std::string order_key(Type type, const std::string& x) {
    const bool f32 = type == Type::f32;
    const char* it = f32 ? "i32" : "i64";
    std::string bits = tmp(), sign = tmp(), mask = tmp(), key = tmp(), nan = tmp(), out = tmp();
    line("{} = bitcast {} {} to {}", bits, llvm_type(type), x, it);
    line("{} = ashr {} {}, {}", sign, it, bits, f32 ? 31 : 63);
    line("{} = lshr {} {}, 1", mask, it, sign);
    line("{} = xor {} {}, {}", key, it, bits, mask);
    line("{} = fcmp uno {} {}, {}", nan, llvm_type(type), x, x);
    line("{} = select i1 {}, {} {}, {} {}", out, nan, it,
         f32 ? "2147483647" : "9223372036854775807", it, key);
    return out;
  }

  // Reduction r's final value, as a register of its type: a float max's key decoded (the key
  // map is its own inverse), the largest key being the quiet NaN.
  std::string load_final(size_t r) {
    const kir::Reduction& red = k_.reductions[r];
    std::string acc = tmp();
    line("{} = load {}, ptr {}", acc, acc_type(red), acc_ptr_[r]);
    if (red.kind != kir::ReduceKind::Max || !is_float(red.type)) return acc;
    const bool f32 = red.type == Type::f32;
    const char* it = f32 ? "i32" : "i64";
    const char* t = llvm_type(red.type);
    std::string sign = tmp(), mask = tmp(), bits = tmp(), value = tmp(), nan = tmp(), out = tmp();
    line("{} = ashr {} {}, {}", sign, it, acc, f32 ? 31 : 63);
    line("{} = lshr {} {}, 1", mask, it, sign);
    line("{} = xor {} {}, {}", bits, it, acc, mask);
    line("{} = bitcast {} {} to {}", value, it, bits, t);
    line("{} = icmp eq {} {}, {}", nan, it, acc, f32 ? "2147483647" : "9223372036854775807");
    line("{} = select i1 {}, {} {}, {} {}", out, nan, t, "0x7FF8000000000000", t, value);
    return out;
  }

  // Column reductions: the accumulators of the current point of dim d.
  void point_accumulators(int d) {
    for (size_t r = 0; r < k_.reductions.size(); ++r) {
      acc_ptr_[r] = tmp();
      line("{} = getelementptr inbounds {}, ptr %acc{}.addr, i64 {}", acc_ptr_[r],
           acc_type(k_.reductions[r]), r, var_[d]);
      if (!widened(k_.reductions[r])) continue;
      wide_ptr_[r] = tmp();
      line("{} = getelementptr inbounds double, ptr %wide{}.addr, i64 {}", wide_ptr_[r], r,
           var_[d]);
    }
  }

  // One loop over dim d around `body`, with its own labels and loop variable (a column
  // reduction loops over its column dim three times).
  template <typename F>
  void column_loop(int d, F body, const std::string& from = "") {
    const std::string name = fmt::format("c{}", loop_count_++), var = "%" + name + ".i";
    const std::string counter = fmt::format("%i{}.addr", d);
    const bool split = split_columns_ && d == 0;
    loop_head(name, counter, var,
              !from.empty() ? from
              : split       ? "%begin"
                            : "0",
              split ? std::string("%end") : std::to_string(k_.dims[d]));
    var_[d] = var;
    body();
    line("%{}.next = add nsw i64 {}, 1", name, var);
    // Vectorized 16 wide, not interleaved: the loop runs once per reduced row over a thread's
    // share of the columns (32 of 64 on two threads), which the vectorizer's cost model left
    // scalar (its trip count unknown), 60 us of a 4096-row bias gradient. Its iterations are
    // independent columns, so the bits stay.
    loop_end(name, counter, "%" + name + ".next",
             fmt::format(", !llvm.loop !{}", column_loop_metadata()));
  }

  // A loop's head: the counter at `counter` set to `start`, then the body (label <name>.body)
  // while the loop variable `var` read from it is below `end`, else <name>.exit (loop_end's).
  void loop_head(const std::string& name, const std::string& counter, const std::string& var,
                 const std::string& start, const std::string& end) {
    line("store i64 {}, ptr {}", start, counter);
    line("br label %{}.head", name);
    label(name + ".head");
    line("{} = load i64, ptr {}", var, counter);
    line("%{}.more = icmp slt i64 {}, {}", name, var, end);
    line("br i1 %{}.more, label %{}.body, label %{}.exit", name, name, name);
    label(name + ".body");
  }
  // Its end: the counter set to `next`, back to the head (the branch followed by `hint`, a loop
  // ID), and the exit label.
  void loop_end(const std::string& name, const std::string& counter, const std::string& next,
                const std::string& hint = "") {
    line("store i64 {}, ptr {}", next, counter);
    line("br label %{}.head{}", name, hint);
    label(name + ".exit");
  }

  // A distinct loop ID naming the column loops' hints (finish_function defines them).
  int column_loop_metadata() { return first_loop_metadata() + 2 + column_loops_++; }
  int first_loop_metadata() const { return 2 + 3 * static_cast<int>(k_.params.size()); }

  // Loops dims [from, to) around `body`, innermost last. Each pass of a multi-pass reduction
  // has its own labels and loop variables.
  template <typename F>
  void inner_loops(int from, int to, int pass, F body) {
    inner_loops(from, to, pass == 0 ? std::string() : fmt::format(".{}", pass), body);
  }
  // The same, the labels and loop variables named with `suffix`.
  template <typename F>
  void inner_loops(int from, int to, const std::string& suffix, F body) {
    if (from >= to) {
      body();
      return;
    }
    int d = from;
    std::string l = fmt::format("l{}{}", d, suffix);
    std::string i = fmt::format("%i{}{}", d, suffix);
    var_[d] = i;
    const bool blocked = d == blocks_.dim;
    const std::string extent = std::to_string(k_.dims[d]), counter = fmt::format("%i{}.addr", d);
    const std::string end = blocked ? open_block(l, d, extent) : extent;
    loop_head(l, counter, i, blocked ? "%" + l + ".lo" : "0", end);
    inner_loops(from + 1, to, suffix, body);
    line("{}.next = add nsw i64 {}, 1", i, i);
    loop_end(l, counter, i + ".next");
    if (blocked) close_block(l, d);
  }

  // ---- Blocked sums ----
  // A fast f32 sum adds its terms in one chain per vector lane, and a chain's error grows with
  // its length: 2^20 values of 0.1 summed 1.5e-4 off, 2^24 of them 2.5e-3, where PyTorch's
  // cascade sum keeps 1e-7. A long sum is therefore swept in blocks, each adding at most
  // chain_terms terms per chain in f32 as before, and each block's partial sums are added into
  // an f64 accumulator, a few adds per block, which rounds to f32 once when the sweep ends.
  // The error is then that of one block, whatever the count. Max, integer, f64 and 16-bit
  // accumulated sums keep their one chain.
  static constexpr int64_t chain_terms = sum_chain_terms;
  // How many terms a block of a row's loop (the vectorizer's lanes) takes: column_lanes chains
  // of chain_terms where the vectorizer splits it; one chain where a C library call in the pass
  // (fmod, atan2: LLVM has no vector form of them) keeps the loop scalar.
  int64_t row_block_terms(int pass) const {
    for (const Value& v : k_.pass_body(pass))
      if (kir::traits(v.op).form == kir::OpForm::Libm) return chain_terms;
    return chain_terms * column_lanes;
  }
  static bool widened(const kir::Reduction& r) {
    return r.kind == kir::ReduceKind::Sum && r.type == Type::f32 && !is_half(r.round_to);
  }
  bool has_widened(int pass) const {
    return std::any_of(k_.reductions.begin(), k_.reductions.end(),
                       [&](const kir::Reduction& r) { return r.pass == pass && widened(r); });
  }
  struct Blocks {
    int dim = -1;                 // the loop that the blocks split; -1: none
    int64_t chunk = 0;            // its iterations per block
    std::function<void()> flush;  // adds a block's partial sums into the f64 accumulators
  };

  // How blocks split a sweep of pass `pass` over dims [first, end), each point adding one term
  // to a chain: at the innermost dim whose loops from it inward add more than `limit` terms,
  // as many of its iterations as keep a block within the limit. No blocks for a short sweep.
  Blocks block_plan(int pass, int first, int end, int64_t limit) const {
    int64_t inner = 1;
    for (int d = end - 1; has_widened(pass) && d >= first; --d) {
      if (inner * k_.dims[d] > limit) return {d, std::max<int64_t>(1, limit / inner), {}};
      inner *= k_.dims[d];
    }
    return {};
  }

  // The loop over the blocks of dim d's [0, extent) (loop `l`'s): returns the current block's
  // end, which the loop over its iterations, from %<l>.lo, runs to.
  std::string open_block(const std::string& l, int d, const std::string& extent) {
    loop_head(l + ".blocks", fmt::format("%blk{}.addr", d), "%" + l + ".lo", "0", extent);
    line("%{}.hi.full = add nsw i64 %{}.lo, {}", l, l, blocks_.chunk);
    line("%{}.hi.fits = icmp slt i64 %{}.hi.full, {}", l, l, extent);
    line("%{}.hi = select i1 %{}.hi.fits, i64 %{}.hi.full, i64 {}", l, l, l, extent);
    return fmt::format("%{}.hi", l);
  }
  void close_block(const std::string& l, int d) {
    blocks_.flush();
    loop_end(l + ".blocks", fmt::format("%blk{}.addr", d), "%" + l + ".hi");
  }

  // wide += acc and acc = 0, or (start) wide = 0, or (finish) acc = wide rounded to f32, for
  // the widened sums of `pass`, whose accumulators acc(r) and wide(r) point to: scalars, or
  // vectors of lanes_ while the emitter writes column blocks.
  enum class Wide { start, add, finish };
  template <typename Acc, typename WidePtr>
  void wide_sums(Wide step, int pass, Acc acc, WidePtr wide) {
    const std::string f = lanes("float"), d = lanes("double");
    for (size_t r = 0; r < k_.reductions.size(); ++r) {
      if (k_.reductions[r].pass != pass || !widened(k_.reductions[r])) continue;
      if (step == Wide::start) {
        line("store {} {}, ptr {}", d, zero("0.0"), wide(r));
        continue;
      }
      std::string w = tmp();
      line("{} = load {}, ptr {}", w, d, wide(r));
      if (step == Wide::finish) {
        std::string rounded = tmp();
        line("{} = fptrunc {} {} to {}", rounded, d, w, f);
        line("store {} {}, ptr {}", f, rounded, acc(r));
        continue;
      }
      std::string a = tmp(), a_wide = tmp(), sum = tmp();
      line("{} = load {}, ptr {}", a, f, acc(r));
      line("{} = fpext {} {} to {}", a_wide, f, a, d);
      line("{} = fadd {} {}, {}", sum, d, w, a_wide);
      line("store {} {}, ptr {}", d, sum, wide(r));
      line("store {} {}, ptr {}", f, zero("0.0"), acc(r));
    }
  }
  // The same for the current accumulators (acc_ptr_, wide_ptr_).
  void wide_sums(Wide step, int pass) {
    wide_sums(
        step, pass, [&](size_t r) { return acc_ptr_[r]; }, [&](size_t r) { return wide_ptr_[r]; });
  }

  std::string offset(const Affine& map) {
    std::string sum = fmt::format("{}", map.base);
    for (size_t d = 0; d < map.coeff.size(); ++d) {
      if (map.coeff[d] == 0) continue;
      std::string term = tmp();
      line("{} = mul nsw i64 {}, {}", term, var_[d], map.coeff[d]);
      std::string next = tmp();
      line("{} = add nsw i64 {}, {}", next, sum, term);
      sum = next;
    }
    return sum;
  }

  void declare(const std::string& decl) { declarations_.insert(decl); }

  std::string call(const char* name, Type type, const std::string& args) {
    std::string fn = type == Type::f32 ? fmt::format("{}f", name) : name;
    const char* t = llvm_type(type);
    std::string params = args.find(',') != std::string::npos ? fmt::format("{}, {}", t, t) : t;
    // Pure functions to the optimizer (errno, which they may set, is never read): a call whose
    // argument does not change in a loop (the log of a row's sum) is hoisted out of it.
    declare(fmt::format("declare {} @{}({}) nounwind willreturn memory(none)", t, fn, params));
    return fmt::format("call {} @{}({})", t, fn, args);
  }

  // f32 `x` rounded to bf16 (as integer operations, DESIGN.md decision 8) and widened back.
  std::string round_bf16(const std::string& x) {
    std::string bits = tmp(), mag = tmp(), nan = tmp(), lsb = tmp(), lsb1 = tmp(), bias = tmp(),
                sum = tmp(), rounded = tmp(), hi = tmp(), quiet = tmp(), pick = tmp(), out = tmp(),
                result = tmp();
    const std::string i32 = lanes("i32"), f32 = ty(Type::f32);
    auto k = [&](const char* value) { return lit("i32", value); };
    line("{} = bitcast {} {} to {}", bits, f32, x, i32);
    line("{} = and {} {}, {}", mag, i32, bits, k("2147483647"));
    line("{} = icmp ugt {} {}, {}", nan, i32, mag, k("2139095040"));
    line("{} = lshr {} {}, {}", lsb, i32, bits, k("16"));
    line("{} = and {} {}, {}", lsb1, i32, lsb, k("1"));
    line("{} = add {} {}, {}", bias, i32, lsb1, k("32767"));
    line("{} = add {} {}, {}", sum, i32, bits, bias);
    line("{} = and {} {}, {}", rounded, i32, sum, k("-65536"));
    line("{} = and {} {}, {}", hi, i32, bits, k("-65536"));
    line("{} = or {} {}, {}", quiet, i32, hi, k("4194304"));
    line("{} = select {} {}, {} {}, {} {}", pick, ty(Type::i1), nan, i32, quiet, i32, rounded);
    line("{} = add {} {}, {}", out, i32, pick, k("0"));
    line("{} = bitcast {} {} to {}", result, i32, out, f32);
    return result;
  }

  // f64 `x` to f32 with round-to-odd, so that one more rounding to a 16-bit type is exact.
  std::string round_to_odd(const std::string& x) {
    std::string f = tmp(), back = tmp(), exact = tmp(), bits = tmp(), abs_back = tmp(),
                abs_x = tmp(), bigger = tmp(), down = tmp(), toward = tmp(), odd = tmp(),
                odd_f = tmp(), result = tmp();
    declare("declare double @llvm.fabs.f64(double)");
    line("{} = fptrunc double {} to float", f, x);
    line("{} = fpext float {} to double", back, f);
    line("{} = fcmp ueq double {}, {}", exact, back, x);
    line("{} = bitcast float {} to i32", bits, f);
    line("{} = call double @llvm.fabs.f64(double {})", abs_back, back);
    line("{} = call double @llvm.fabs.f64(double {})", abs_x, x);
    line("{} = fcmp ogt double {}, {}", bigger, abs_back, abs_x);
    line("{} = sub i32 {}, 1", down, bits);
    line("{} = select i1 {}, i32 {}, i32 {}", toward, bigger, down, bits);
    line("{} = or i32 {}, 1", odd, toward);
    line("{} = bitcast i32 {} to float", odd_f, odd);
    line("{} = select i1 {}, float {}, float {}", result, exact, f, odd_f);
    return result;
  }

  std::string round_to(const Value& v, const std::string& a, Type from) {
    if (v.dtype == DType::i32) {
      std::string narrow = tmp(), wide = tmp();
      line("{} = trunc {} {} to {}", narrow, ty(Type::i64), a, lanes("i32"));
      line("{} = sext {} {} to {}", wide, lanes("i32"), narrow, ty(Type::i64));
      return wide;
    }
    std::string x = from == Type::f64 ? round_to_odd(a) : a;
    if (v.dtype == DType::bf16) return round_bf16(x);
    std::string h = tmp(), back = tmp();
    line("{} = fptrunc {} {} to {}", h, ty(Type::f32), x, lanes("half"));
    line("{} = fpext {} {} to {}", back, lanes("half"), h, ty(Type::f32));
    return back;
  }

  std::string convert(const std::string& a, Type from, Type to) {
    std::string r = tmp();
    const std::string f = ty(from), t = ty(to);
    if (from == to) return a;
    if (from == Type::f32 && to == Type::f64)
      line("{} = fpext {} {} to {}", r, f, a, t);
    else if (from == Type::f64 && to == Type::f32)
      line("{} = fptrunc {} {} to {}", r, f, a, t);
    else if (is_float(from) && to == Type::i64) {
      // fptosi of NaN or of a value outside [-2^63, 2^63) is poison: INT64_MIN there, as the
      // reference executor converts (dsl/convert.h's to_int64).
      const char* element = llvm_type(from);
      std::string above = tmp(), below = tmp(), ok = tmp(), safe = tmp(), whole = tmp();
      line("{} = fcmp oge {} {}, {}", above, f, a, lit(element, constant(from, -0x1p63)));
      line("{} = fcmp olt {} {}, {}", below, f, a, lit(element, constant(from, 0x1p63)));
      line("{} = and {} {}, {}", ok, lanes("i1"), above, below);
      line("{} = select {} {}, {} {}, {} {}", safe, lanes("i1"), ok, f, a, f, zero("0.0"));
      line("{} = fptosi {} {} to {}", whole, f, safe, t);
      line("{} = select {} {}, {} {}, {} {}", r, lanes("i1"), ok, t, whole, t,
           lit("i64", "-9223372036854775808"));
    } else if (is_float(from) && to == Type::i1)
      line("{} = fcmp une {} {}, {}", r, f, a, zero("0.0"));
    else if (from == Type::i64 && is_float(to))
      line("{} = sitofp {} {} to {}", r, f, a, t);
    else if (from == Type::i64 && to == Type::i1)
      line("{} = icmp ne {} {}, {}", r, f, a, zero("0"));
    else if (from == Type::i1 && to == Type::i64)
      line("{} = zext {} {} to {}", r, f, a, t);
    else if (from == Type::i1 && is_float(to))
      line("{} = uitofp {} {} to {}", r, f, a, t);
    else
      fail("llvm emitter: no conversion from {} to {}", f, t);
    return r;
  }

  // The storage element as LLVM spells it in memory.
  static const char* memory_element(DType dtype) {
    switch (dtype) {
      case DType::f32:
        return "float";
      case DType::f64:
        return "double";
      case DType::f16:
        return "half";
      case DType::bf16:
        return "i16";
      case DType::i32:
        return "i32";
      case DType::i64:
        return "i64";
      case DType::boolean:
        return "i8";
    }
    return "i8";
  }
  // A vector access is aligned to its elements only.
  std::string alignment(DType dtype) const {
    return lanes_ == 1 ? std::string() : fmt::format(", align {}", size_of(dtype));
  }

  std::string load(const Value& v) {
    if (lanes_ > 1 && (v.map.coeff.size() != k_.dims.size() || v.map.coeff[vector_dim_] == 0)) {
      // The same element in every lane (column): loaded once, then broadcast.
      int vector_lanes = std::exchange(lanes_, 1);
      std::string scalar = load(v);
      lanes_ = vector_lanes;
      return broadcast(llvm_type(v.type), scalar);
    }
    DType dtype = k_.params[v.param].dtype;
    const char* element = memory_element(dtype);
    std::string off = offset(v.map), ptr = tmp(), raw = tmp(), r = tmp();
    const std::string memory = lanes(element);
    line("{} = getelementptr inbounds {}, ptr %p{}, i64 {}", ptr, element, v.param, off);
    line("{} = load {}, ptr {}{}{}", raw, memory, ptr, alignment(dtype), alias_tags(v.param));
    switch (dtype) {
      case DType::f32:
      case DType::f64:
      case DType::i64:
        return raw;
      case DType::f16:
        line("{} = fpext {} {} to {}", r, memory, raw, ty(Type::f32));
        return r;
      case DType::bf16: {
        std::string wide = tmp(), shifted = tmp();
        line("{} = zext {} {} to {}", wide, memory, raw, lanes("i32"));
        line("{} = shl {} {}, {}", shifted, lanes("i32"), wide, lit("i32", "16"));
        line("{} = bitcast {} {} to {}", r, lanes("i32"), shifted, ty(Type::f32));
        return r;
      }
      case DType::i32:
        line("{} = sext {} {} to {}", r, memory, raw, ty(Type::i64));
        return r;
      case DType::boolean:
        line("{} = icmp ne {} {}, {}", r, memory, raw, zero("0"));
        return r;
    }
    return raw;
  }

  void store(DType dtype, int param, const Affine& map, const std::string& value) {
    const char* element = memory_element(dtype);
    const std::string memory = lanes(element);
    std::string stored = value;
    switch (dtype) {
      case DType::f32:
      case DType::f64:
      case DType::i64:
        break;
      case DType::f16:  // the value is already rounded: the truncation is exact
        stored = tmp();
        line("{} = fptrunc {} {} to {}", stored, ty(Type::f32), value, memory);
        break;
      case DType::bf16: {
        std::string bits = tmp(), hi = tmp();
        stored = tmp();
        line("{} = bitcast {} {} to {}", bits, ty(Type::f32), value, lanes("i32"));
        line("{} = lshr {} {}, {}", hi, lanes("i32"), bits, lit("i32", "16"));
        line("{} = trunc {} {} to {}", stored, lanes("i32"), hi, memory);
        break;
      }
      case DType::i32:
        stored = tmp();
        line("{} = trunc {} {} to {}", stored, ty(Type::i64), value, memory);
        break;
      case DType::boolean:
        stored = tmp();
        line("{} = zext {} {} to {}", stored, ty(Type::i1), value, memory);
        break;
    }
    std::string off = offset(map), ptr = tmp();
    line("{} = getelementptr inbounds {}, ptr %p{}, i64 {}", ptr, element, param, off);
    line("store {} {}, ptr {}{}{}", memory, stored, ptr, alignment(dtype), alias_tags(param));
  }

  void values(const std::vector<Value>& list, const char* prefix) {
    names_.assign(list.size(), "");
    for (size_t i = 0; i < list.size(); ++i) names_[i] = value(list[i], prefix, i, list);
  }

  // Emits one value of a body as %<prefix><index> (or returns the name it already has).
  std::string value(const Value& v, const char* prefix, size_t index,
                    const std::vector<Value>& list) {
    std::string r = fmt::format("%{}{}", prefix, index);
    if (std::optional<std::string> done = table_value(v, r, list)) return *done;
    return special_value(v, r, list);
  }

  // The Arith, Compare and Libm ops, spelled as the op table (kir_ops.def) gives them; nullopt
  // for the others, and for an Arith op without an instruction for its operands' type.
  std::optional<std::string> table_value(const Value& v, const std::string& r,
                                         const std::vector<Value>& list) {
    const std::string t = ty(v.type);
    bool f = v.a >= 0 && is_float(list[v.a].type);
    const kir::OpTraits& op = kir::traits(v.op);
    switch (op.form) {
      case kir::OpForm::Arith:
        if (!*(f ? op.llvm_float : op.llvm_int)) break;
        line("{} = {} {} {}, {}", r, f ? op.llvm_float : op.llvm_int, t, names_[v.a], names_[v.b]);
        return r;
      case kir::OpForm::Compare: {
        Type ot = list[v.a].type;
        line("{} = {} {} {} {}, {}", r, is_float(ot) ? "fcmp" : "icmp",
             is_float(ot) ? op.llvm_float : op.llvm_int, ty(ot), names_[v.a], names_[v.b]);
        return r;
      }
      case kir::OpForm::Libm: {
        const kir::LibmTraits& fn = kir::traits(static_cast<kir::Libm>(v.param));
        std::string args = fmt::format("{} {}", t, names_[v.a]);
        if (fn.arity == 2) args += fmt::format(", {} {}", t, names_[v.b]);
        line("{} = {}", r, call(fn.name, v.type, args));
        return r;
      }
      case kir::OpForm::Special:
        break;
    }
    return std::nullopt;
  }

  // The ops with code of their own here.
  std::string special_value(const Value& v, const std::string& r, const std::vector<Value>& list) {
    const std::string t = ty(v.type);
    auto operand = [&](int32_t id) { return names_[id]; };
    auto operand_type = [&](int32_t id) { return list[id].type; };
    bool f = v.a >= 0 && is_float(operand_type(v.a));
    switch (v.op) {
      case Op::Const:
        return lit(llvm_type(v.type), constant(v.type, v.imm));
      case Op::Load:
        return load(v);
      case Op::Accumulated:
        return lanes_ == 1 ? acc_value_[v.param]
                           : broadcast(llvm_type(v.type), acc_value_[v.param]);
      case Op::Scalar: {
        // Lowering passes only float fills, exactly representable in their register type.
        std::string scalar = fmt::format("%s{}", v.param);
        if (v.type == Type::f32) {
          scalar = lanes_ == 1 ? r : r + ".s";
          line("{} = fptrunc double %s{} to float", scalar, v.param);
        }
        return lanes_ == 1 ? scalar : broadcast(llvm_type(v.type), scalar);
      }
      case Op::Neg:
        if (f)
          line("{} = fneg {} {}", r, t, operand(v.a));
        else
          line("{} = sub {} {}, {}", r, t, zero("0"), operand(v.a));
        return r;
      case Op::Or:
        line("{} = or {} {}, {}", r, ty(Type::i1), operand(v.a), operand(v.b));
        return r;
      case Op::Select:
        line("{} = select {} {}, {} {}, {} {}", r, ty(Type::i1), operand(v.a), t, operand(v.b), t,
             operand(v.c));
        return r;
      case Op::IsNan:
        line("{} = fcmp uno {} {}, {}", r, ty(operand_type(v.a)), operand(v.a), operand(v.a));
        return r;
      case Op::Sqrt: {
        std::string name =
            fmt::format("llvm.sqrt.{}{}", lanes_ == 1 ? "" : fmt::format("v{}", lanes_),
                        v.type == Type::f32 ? "f32" : "f64");
        declare(fmt::format("declare {} @{}({})", t, name, t));
        line("{} = call {} @{}({} {})", r, t, name, t, operand(v.a));
        return r;
      }
      case Op::Ldexp:
        return ldexp(v, operand(v.a), operand(v.b));
      case Op::Convert:
        return convert(operand(v.a), operand_type(v.a), v.type);
      case Op::RoundTo:
        return round_to(v, operand(v.a), operand_type(v.a));
      default:  // Arith, Compare and Libm ops: table_value
        break;
    }
    fail("llvm emitter: {} of {} is not supported", kir::op_name(v.op), t);
  }

  // math::ldexp(x, e): two exact power-of-two factors built from exponent bits, so that a
  // result that overflows or is subnormal rounds once, at the second product.
  std::string ldexp(const Value& v, const std::string& x, const std::string& e) {
    const char* t = llvm_type(v.type);
    const bool f32 = v.type == Type::f32;
    const char* it = f32 ? "i32" : "i64";
    std::string k = tmp(), half = tmp(), rest = tmp(), product = tmp();
    line("{} = fptosi {} {} to {}", k, t, e, it);
    line("{} = ashr {} {}, 1", half, it, k);
    line("{} = sub {} {}, {}", rest, it, k, half);
    std::string scaled = x;
    for (const std::string& part : {half, rest}) {
      std::string biased = tmp(), bits = tmp(), factor = tmp(), next = tmp();
      line("{} = add {} {}, {}", biased, it, part, f32 ? 127 : 1023);
      line("{} = shl {} {}, {}", bits, it, biased, f32 ? 23 : 52);
      line("{} = bitcast {} {} to {}", factor, it, bits, t);
      line("{} = fmul {} {}, {}", next, t, scaled, factor);
      scaled = next;
    }
    return scaled;
  }

  void stores(const std::vector<kir::Store>& list_stores) {
    for (const kir::Store& s : list_stores)
      store(k_.params[s.param].dtype, s.param, s.map, names_[s.value]);
  }

  // Adds this point's terms to the reductions of `pass`.
  void accumulate(int pass) {
    for (size_t r = 0; r < k_.reductions.size(); ++r) {
      const kir::Reduction& red = k_.reductions[r];
      if (red.pass != pass) continue;
      const char* t = acc_type(red);
      std::string acc = tmp(), next = tmp();
      std::string x = names_[red.value];
      line("{} = load {}, ptr {}", acc, t, acc_ptr_[r]);
      if (red.kind == kir::ReduceKind::Sum) {
        if (!is_float(red.type)) {
          line("{} = add i64 {}, {}", next, acc, x);
        } else if (is_half(red.round_to)) {
          std::string sum = tmp();
          line("{} = fadd {} {}, {}", sum, t, acc, x);
          Value round{Op::RoundTo, red.type};
          round.dtype = red.round_to;
          next = round_to(round, sum, red.type);
        } else {
          // Reassociation lets the vectorizer split the sum into lanes, as every fast
          // reduction does; results differ from a sequential sum within rounding.
          line("{} = fadd reassoc {} {}, {}", next, t, acc, x);
        }
      } else {
        // Floats compare by order key (the total order of reference_executor.cpp's ref_Max):
        // a signed integer max, which vectorizes where a NaN-propagating float max does not.
        std::string key = is_float(red.type) ? order_key(red.type, x) : x;
        std::string gt = tmp();
        line("{} = icmp sgt {} {}, {}", gt, t, key, acc);
        line("{} = select i1 {}, {} {}, {} {}", next, gt, t, key, t, acc);
      }
      line("store {} {}, ptr {}", t, next, acc_ptr_[r]);
    }
  }

  const kir::Kernel& k_;
  std::string out_;
  std::set<std::string> declarations_;
  std::vector<std::string> names_;
  int next_tmp_ = 0;
  int loop_count_ = 0;
  std::vector<std::string> var_;        // the SSA name of each dim's loop variable where used
  bool split_columns_ = false;          // kir::Kernel::column_split
  bool vector_columns_ = false;         // a column reduction with vector accumulators
  bool vector_rows_ = false;            // a sum over short rows with vector partial sums
  int lanes_ = 1;                       // values' lanes: column_lanes in a column block
  int vector_dim_ = -1;                 // the column dim a column block's lanes run along
  int column_loops_ = 0;                // column loops given a loop ID (column_loop_metadata)
  std::vector<std::string> acc_ptr_;    // where each reduction's accumulator is
  std::vector<std::string> wide_ptr_;   // and its f64 accumulator across blocks (widened sums)
  Blocks blocks_;                       // how the loops being written split into blocks
  std::vector<std::string> acc_value_;  // its final value, in the epilogue
};

}  // namespace

std::string emit_llvm(const kir::Kernel& kernel) { return Emitter(kernel).run(); }

}  // namespace mixtape

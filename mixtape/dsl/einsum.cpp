// mixtape/dsl/einsum.cpp -- einsum's equation parsed into integer labels, then lowered operand pair
// by operand pair to permute/reshape/matmul (or a broadcast multiply) and sums; no primitive of its
// own, so autograd, fusion and every back end take it as they take its parts.
#include "mixtape/dsl/einsum.h"

#include <algorithm>
#include <array>
#include <utility>

#include "mixtape/dsl/composites.h"
#include "mixtape/dsl/error.h"
#include "mixtape/dsl/graph.h"
#include "mixtape/dsl/ops.h"

namespace mixtape {
namespace {

constexpr int kLetters = 52;  // labels 0-25: 'A'-'Z', 26-51: 'a'-'z'; then broadcast dimensions

int letter_label(char c) {
  if (c >= 'A' && c <= 'Z') return c - 'A';
  if (c >= 'a' && c <= 'z') return c - 'a' + 26;
  return -1;
}

// One side of the equation: letters' labels, and where "..." stands (-1: absent).
struct Term {
  std::vector<int> letters;
  int ellipsis_at = -1;
};

// An operand during the lowering: the value and one label per axis.
struct Labeled {
  Tensor value;
  std::vector<int> labels;
};

class Lowering {
 public:
  Lowering(const std::string& equation, const Loc& loc) : equation_(equation), loc_(loc) {}

  Tensor run(const std::vector<Tensor>& operands) {
    parse();
    if (inputs_.size() != operands.size())
      fail("has {} operand term{} but got {} operand{}", inputs_.size(),
           inputs_.size() == 1 ? "" : "s", operands.size(), operands.size() == 1 ? "" : "s");
    for (size_t i = 0; i < operands.size(); ++i) {
      if (!operands[i].defined()) fail("operand {} is undefined", i);
      if (operands[i].dtype() != operands[0].dtype())
        fail("operand {} is {} but operand 0 is {} (PyTorch's einsum mixes no dtypes either)", i,
             name(operands[i].dtype()), name(operands[0].dtype()));
      const Term& term = inputs_[i];
      auto letters = static_cast<int64_t>(term.letters.size());
      if (term.ellipsis_at < 0 ? operands[i].dim() != letters : operands[i].dim() < letters)
        fail("operand {} has shape {}, which does not fit its term's {} subscript{}{}", i,
             to_string(operands[i].shape()), letters, letters == 1 ? "" : "s",
             term.ellipsis_at < 0 ? "" : " and '...'");
      broadcast_rank_ = std::max(broadcast_rank_, operands[i].dim() - letters);
    }
    label_count_ = kLetters + static_cast<size_t>(broadcast_rank_);
    std::vector<Labeled> ops;
    for (size_t i = 0; i < operands.size(); ++i) ops.push_back(label(i, operands[i]));
    check_sizes(ops);
    std::vector<int> output = output_labels();
    size_t count = ops.size();
    for (size_t i = 0; i < count; ++i) ops[i] = diagonals(std::move(ops[i]), i);
    Labeled current = std::move(ops[0]);
    for (size_t i = 1; i < count; ++i) {
      // Labels needed after this pair: the output's and those of the operands after it.
      std::vector<char> later(label_count_, 0);
      for (int l : output) later[static_cast<size_t>(l)] = 1;
      for (size_t j = i + 1; j < count; ++j)
        for (int l : ops[j].labels) later[static_cast<size_t>(l)] = 1;
      // Each side first sums what neither the other side nor anything later uses.
      std::vector<char> keep_a = later, keep_b = later;
      for (int l : ops[i].labels) keep_a[static_cast<size_t>(l)] = 1;
      for (int l : current.labels) keep_b[static_cast<size_t>(l)] = 1;
      current = sum_unless(std::move(current), keep_a);
      ops[i] = sum_unless(std::move(ops[i]), keep_b);
      current = contract(std::move(current), std::move(ops[i]), later);
    }
    std::vector<char> in_output(label_count_, 0);
    for (int l : output) in_output[static_cast<size_t>(l)] = 1;
    current = sum_unless(std::move(current), in_output);
    std::vector<int64_t> perm;
    for (int l : output) perm.push_back(position(current, l));
    return is_identity(perm) ? current.value : permute(current.value, perm, loc_);
  }

 private:
  template <typename... Args>
  [[noreturn]] void fail(fmt::format_string<Args...> format, Args&&... args) const {
    op_fail("einsum", loc_, "equation '{}': {}", equation_,
            fmt::format(format, std::forward<Args>(args)...));
  }

  Term parse_term(const std::string& text) {
    Term term;
    for (size_t k = 0; k < text.size(); ++k) {
      if (text[k] == '.') {
        if (text.compare(k, 3, "...") != 0 || term.ellipsis_at >= 0)
          fail("'.' only as one '...' per term, got '{}'", text);
        term.ellipsis_at = static_cast<int>(term.letters.size());
        k += 2;
        continue;
      }
      int l = letter_label(text[k]);
      if (l < 0) fail("subscripts are letters a-z and A-Z, got '{}'", text[k]);
      term.letters.push_back(l);
    }
    return term;
  }

  void parse() {
    std::string text;
    for (char c : equation_)
      if (c != ' ') text += c;
    size_t arrow = text.find("->");
    if (text.find('-') != arrow ||
        text.find('>') != (arrow == std::string::npos ? arrow : arrow + 1))
      fail("'-' and '>' only as one '->'");
    std::string lhs = text.substr(0, arrow);
    for (size_t start = 0;;) {
      size_t comma = lhs.find(',', start);
      inputs_.push_back(parse_term(lhs.substr(start, comma - start)));
      if (comma == std::string::npos) break;
      start = comma + 1;
    }
    if (arrow != std::string::npos) {
      explicit_output_ = true;
      output_ = parse_term(text.substr(arrow + 2));
    }
  }

  // The operand's labels, its "..." becoming broadcast labels aligned from the right.
  Labeled label(size_t i, const Tensor& x) {
    const Term& term = inputs_[i];
    auto letters = static_cast<int>(term.letters.size());
    int64_t extra = x.dim() - letters;
    int first = kLetters + static_cast<int>(broadcast_rank_ - extra);
    Labeled out{x, {}};
    for (int k = 0; k <= letters; ++k) {
      if (k == term.ellipsis_at)
        for (int e = 0; e < extra; ++e) out.labels.push_back(first + e);
      if (k < letters) {
        int l = term.letters[static_cast<size_t>(k)];
        out.labels.push_back(l);
        ++uses_[static_cast<size_t>(l)];
      }
    }
    return out;
  }

  // Every label's sizes agree across the operands, or are 1 (broadcast).
  void check_sizes(const std::vector<Labeled>& ops) const {
    std::vector<int64_t> size(label_count_, 1);
    std::vector<int> where(label_count_, -1);
    for (size_t i = 0; i < ops.size(); ++i)
      for (size_t d = 0; d < ops[i].labels.size(); ++d) {
        auto l = static_cast<size_t>(ops[i].labels[d]);
        int64_t n = ops[i].value.size(static_cast<int64_t>(d));
        if (n == 1 || n == size[l]) continue;
        if (size[l] != 1 && where[l] == static_cast<int>(i))
          fail("operand {} repeats '{}' over axes of sizes {} and {}", i, name_of(ops[i].labels[d]),
               size[l], n);
        if (size[l] != 1)
          fail("'{}' is {} in operand {} but {} in operand {} (shapes {})",
               name_of(ops[i].labels[d]), size[l], where[l], n, i, shapes(ops));
        size[l] = n;
        where[l] = static_cast<int>(i);
      }
  }

  static std::string shapes(const std::vector<Labeled>& ops) {
    std::string text;
    for (const Labeled& x : ops) text += (text.empty() ? "" : ", ") + to_string(x.value.shape());
    return text;
  }

  // An explicit output without "..." sums the broadcast dimensions, as PyTorch's does.
  std::vector<int> output_labels() const {
    std::vector<int> out;
    auto broadcast = [&] {
      for (int64_t e = 0; e < broadcast_rank_; ++e) out.push_back(kLetters + static_cast<int>(e));
    };
    if (!explicit_output_) {
      // PyTorch's implicit output: "..." first, then the letters used once, upper case first.
      broadcast();
      for (int l = 0; l < kLetters; ++l)
        if (uses_[static_cast<size_t>(l)] == 1) out.push_back(l);
      return out;
    }
    auto letters = static_cast<int>(output_.letters.size());
    for (int k = 0; k <= letters; ++k) {
      if (k == output_.ellipsis_at) broadcast();
      if (k < letters) out.push_back(output_.letters[static_cast<size_t>(k)]);
    }
    std::vector<int> seen(label_count_, 0);
    for (int l : out) {
      if (l >= kLetters) continue;
      if (seen[static_cast<size_t>(l)]++) fail("the output names '{}' twice", name_of(l));
      if (uses_[static_cast<size_t>(l)] == 0)
        fail("the output's '{}' is in no operand", name_of(l));
    }
    return out;
  }

  static std::string name_of(int l) {
    if (l >= kLetters) return "...";
    return std::string(1, static_cast<char>(l < 26 ? 'A' + l : 'a' + (l - 26)));
  }

  // A letter repeated within one operand: its diagonal, selected by a mask and summed over the
  // repeat.
  Labeled diagonals(Labeled x, size_t operand) {
    for (size_t p = 0; p < x.labels.size(); ++p)
      for (size_t q = p + 1; q < x.labels.size();) {
        if (x.labels[q] != x.labels[p]) {
          ++q;
          continue;
        }
        int64_t n = x.value.size(static_cast<int64_t>(p));
        if (x.value.size(static_cast<int64_t>(q)) != n)
          fail("operand {} repeats '{}' over axes of sizes {} and {}", operand,
               name_of(x.labels[p]), n, x.value.size(static_cast<int64_t>(q)));
        Shape mask_shape(x.labels.size(), 1);
        mask_shape[p] = mask_shape[q] = n;
        Tensor eye = eq(unsqueeze(arange(n, i64, loc_), 1, loc_),
                        unsqueeze(arange(n, i64, loc_), 0, loc_), loc_);
        // Selected, not multiplied: an infinity off the diagonal times 0 would be NaN.
        Tensor mask = reshape(eye, mask_shape, loc_);
        x.value = sum(where(mask, x.value, zeros_like(x.value, loc_), loc_),
                      {static_cast<int64_t>(q)}, false, loc_);
        x.labels.erase(x.labels.begin() + static_cast<std::ptrdiff_t>(q));
      }
    return x;
  }

  // Sums the axes whose label `keep` rejects.
  Labeled sum_unless(Labeled x, const std::vector<char>& keep) const {
    std::vector<int64_t> axes;
    std::vector<int> kept;
    for (size_t d = 0; d < x.labels.size(); ++d) {
      if (keep[static_cast<size_t>(x.labels[d])])
        kept.push_back(x.labels[d]);
      else
        axes.push_back(static_cast<int64_t>(d));
    }
    if (axes.empty()) return x;
    return {sum(x.value, axes, false, loc_), kept};
  }

  static bool is_identity(const std::vector<int64_t>& perm) {
    for (size_t i = 0; i < perm.size(); ++i)
      if (perm[i] != static_cast<int64_t>(i)) return false;
    return true;
  }

  // a and b over their shared labels: those needed later stay as batch axes, the rest are summed.
  Labeled contract(Labeled a, Labeled b, const std::vector<char>& later) {
    auto has = [](const Labeled& x, int l) {
      return std::find(x.labels.begin(), x.labels.end(), l) != x.labels.end();
    };
    std::vector<int> batch, summed, a_only, b_only;
    for (int l : a.labels) {
      if (!has(b, l))
        a_only.push_back(l);
      else if (later[static_cast<size_t>(l)])
        batch.push_back(l);
      else
        summed.push_back(l);
    }
    for (int l : b.labels)
      if (!has(a, l)) b_only.push_back(l);
    // A side's size where it is not 1 (a size-0 axis against a missing or size-1 one is 0).
    auto size_of = [&](int l) {
      int64_t sa = has(a, l) ? axis_size(a, l) : 1, sb = has(b, l) ? axis_size(b, l) : 1;
      return sa == 1 ? sb : sa;
    };
    // Each side permuted to `order`, with size-1 axes where it lacks a label, and broadcast to
    // the common sizes.
    auto arrange = [&](const Labeled& x, const std::vector<int>& order) {
      std::vector<int64_t> perm;
      for (int l : order)
        if (has(x, l)) perm.push_back(position(x, l));
      Tensor v = is_identity(perm) ? x.value : permute(x.value, perm, loc_);
      Shape with_ones, full;
      for (int l : order) {
        with_ones.push_back(has(x, l) ? axis_size(x, l) : 1);
        full.push_back(size_of(l));
      }
      if (with_ones != v.shape()) v = reshape(v, with_ones, loc_);
      return std::pair{v, full};
    };
    std::vector<int> result_labels = batch;
    result_labels.insert(result_labels.end(), a_only.begin(), a_only.end());
    result_labels.insert(result_labels.end(), b_only.begin(), b_only.end());
    if (summed.empty()) {
      // Nothing summed between them: a broadcast product over batch, a_only, b_only.
      Tensor va = arrange(a, result_labels).first, vb = arrange(b, result_labels).first;
      return {va * vb, result_labels};
    }
    if (!is_floating(promote(a.value.dtype(), b.value.dtype()))) {
      // Integers, which matmul does not take: the broadcast product summed over the summed
      // axes, in the operands' type as torch.einsum keeps it (sum widens i32 to i64).
      std::vector<int> labels = result_labels;
      labels.insert(labels.end(), summed.begin(), summed.end());
      Tensor product = arrange(a, labels).first * arrange(b, labels).first;
      std::vector<int64_t> axes;
      for (size_t i = result_labels.size(); i < labels.size(); ++i)
        axes.push_back(static_cast<int64_t>(i));
      return {cast(sum(product, axes, false, loc_), product.dtype(), loc_), result_labels};
    }
    auto product = [&](const std::vector<int>& labels) {
      int64_t n = 1;
      for (int l : labels) n *= size_of(l);
      return n;
    };
    std::vector<int> a_order = batch, b_order = batch;
    a_order.insert(a_order.end(), a_only.begin(), a_only.end());
    a_order.insert(a_order.end(), summed.begin(), summed.end());
    b_order.insert(b_order.end(), summed.begin(), summed.end());
    b_order.insert(b_order.end(), b_only.begin(), b_only.end());
    // Only the batch and summed axes need the common sizes; a side's own axes are its own.
    auto operand = [&](const Labeled& x, const std::vector<int>& order, Shape rows_cols) {
      auto [v, full] = arrange(x, order);
      if (v.shape() != full) v = broadcast_to(v, full, loc_);
      Shape matrix{product(batch)};
      matrix.insert(matrix.end(), rows_cols.begin(), rows_cols.end());
      return reshape(v, matrix, loc_);
    };
    Tensor ma = operand(a, a_order, {product(a_only), product(summed)});
    Tensor mb = operand(b, b_order, {product(summed), product(b_only)});
    Shape out_shape;
    for (int l : result_labels) out_shape.push_back(size_of(l));
    return {reshape(matmul(ma, mb, false, false, loc_), out_shape, loc_), result_labels};
  }

  static int64_t position(const Labeled& x, int l) {
    return std::find(x.labels.begin(), x.labels.end(), l) - x.labels.begin();
  }
  static int64_t axis_size(const Labeled& x, int l) { return x.value.size(position(x, l)); }

  const std::string& equation_;
  const Loc& loc_;
  std::vector<Term> inputs_;
  Term output_;
  bool explicit_output_ = false;
  int64_t broadcast_rank_ = 0;
  size_t label_count_ = kLetters;
  std::array<int, kLetters> uses_{};  // how often each letter appears in the operands
};

}  // namespace

Tensor einsum(const std::string& equation, const std::vector<Tensor>& operands, const Loc& loc) {
  CallSiteScope site(loc, composite::einsum);
  return Lowering(equation, loc).run(operands);
}

}  // namespace mixtape

// mixtape/precision_policy/policy.cpp -- the built-in policies and the override mechanism.
#include "mixtape/precision_policy/policy.h"

#include <algorithm>
#include <atomic>

#include "mixtape/dsl/composites.h"
#include "mixtape/dsl/error.h"

namespace mixtape {
namespace {

DType widest_input(const PrecisionQuery& q) {
  std::optional<DType> widest;
  for (size_t i = 0; i < q.input_storage.size(); ++i)
    if (!q.input_is_scalar[i])
      widest = widest ? promote(*widest, q.input_storage[i]) : q.input_storage[i];
  return widest.value_or(q.traced);
}

std::string subject(const PrecisionQuery& q) {
  std::string op = op_name(q.op);
  if (q.backward) op = fmt::format("{} (gradient of {})", op, op_name(q.forward_op));
  return op;
}

// The category-driven rules shared by autocast and pure policies.
class CategoryPolicy : public Policy {
 public:
  CategoryPolicy(std::string name, DType half, bool pure)
      : Policy(std::move(name)), half_(half), pure_(pure) {}

  bool pure() const override { return true; }
  Precision decide(const PrecisionQuery& q) const override {
    const std::string& who = name();
    // Inside an f32 composite a cast is the composite's own (to its statistics type and back to
    // its input's type, dsl/composites.h) and runs in f32 with the rest of it: the result of
    // softmax or a loss stays f32 under autocast whatever its input's type, as in PyTorch.
    const Category whole = composite::category(q.composite);
    // A float operand cast up by type promotion keeps its stored type, as PyTorch's autocast
    // sees a bf16 operand of an op as bf16; the op reading it then takes its widest input.
    if (q.op == OpCode::Cast && !q.backward && whole != Category::Fp32 && q.promotion &&
        !q.input_storage.empty()) {
      const DType kept = q.input_storage[0];
      return {kept, kept, f32,
              fmt::format("{}: a promotion keeps its input's stored type {}", who, name_of(kept))};
    }
    if (q.op == OpCode::Cast && !q.backward && whole != Category::Fp32)
      return {q.traced, q.traced, f32, fmt::format("{}: explicit cast keeps its dtype", who)};
    if (q.category == Category::Like && !q.backward) {
      DType like = q.input_storage.empty() ? q.traced : q.input_storage.back();
      return {
          like, like, f32,
          fmt::format("{}: {} stores as its last input: {}", who, op_name(q.op), name_of(like))};
    }
    if (op_info(q.op).kind == OpKind::Leaf)
      return {q.traced, q.traced, f32, fmt::format("{}: leaf keeps its traced dtype", who)};
    // Composites autocast runs as a whole (dsl/composites.def): PyTorch's fp32 list (softmax,
    // norms, every loss) in f32, and linear in the half type.
    if (whole == Category::Fp32)
      return {f32, f32, f32, fmt::format("{}: inside {}, which runs in f32", who, q.composite)};
    if (whole == Category::LowOk)
      return {half_, half_, f32,
              fmt::format("{}: inside {}, which runs in {} with f32 accumulation", who, q.composite,
                          name_of(half_))};
    Category category = q.backward ? op_info(q.forward_op).category : q.category;
    const char* why = q.backward ? " (the precision of the forward op)" : "";
    DType widest = widest_input(q);
    switch (category) {
      case Category::LowOk:
        return {half_, half_, f32,
                fmt::format("{}: {} is low-precision safe: {} inputs, f32 accumulation{}", who,
                            subject(q), name_of(half_), why)};
      case Category::Fp32:
        return {f32, f32, f32, fmt::format("{}: {} needs f32{}", who, subject(q), why)};
      case Category::Fp32Accum:
        return {f32, widest, f32,
                fmt::format("{}: {} accumulates and stores in f32{}", who, subject(q), why)};
      case Category::Promote:
      case Category::Follow:
      case Category::Like:  // the gradient of cast_like: as the gradient comes
        if (pure_)
          return {half_, half_, f32,
                  fmt::format("{}: {} runs in {}{}", who, subject(q), name_of(half_), why)};
        return {widest, widest, f32,
                fmt::format("{}: {} takes its widest input type {}{}", who, subject(q),
                            name_of(widest), why)};
    }
    return {q.traced, q.traced, f32, who};
  }

 private:
  static std::string name_of(DType t) { return std::string(mixtape::name(t)); }
  DType half_;
  bool pure_;
};

class Fp32Policy : public Policy {
 public:
  Fp32Policy() : Policy("fp32") {}
  bool pure() const override { return true; }
  Precision decide(const PrecisionQuery& q) const override {
    return {q.traced, q.traced, q.traced == f64 ? f64 : f32, "fp32: as traced"};
  }
};

DType check_half(DType half, const char* what) {
  if (!is_half(half))
    fail("{}: the low-precision type must be f16 or bf16, got {}", what, name(half));
  return half;
}

}  // namespace

PolicyPtr fp32_policy() {
  static PolicyPtr policy = std::make_shared<Fp32Policy>();
  return policy;
}

PolicyPtr autocast_policy(DType half) {
  check_half(half, "autocast_policy");
  static const PolicyPtr f16_policy = std::make_shared<CategoryPolicy>("autocast-f16", f16, false);
  static const PolicyPtr bf16_policy =
      std::make_shared<CategoryPolicy>("autocast-bf16", bf16, false);
  return half == f16 ? f16_policy : bf16_policy;
}

PolicyPtr pure_policy(DType half) {
  check_half(half, "pure_policy");
  static const PolicyPtr f16_policy = std::make_shared<CategoryPolicy>("pure-f16", f16, true);
  static const PolicyPtr bf16_policy = std::make_shared<CategoryPolicy>("pure-bf16", bf16, true);
  return half == f16 ? f16_policy : bf16_policy;
}

PolicyPtr policy_by_name(const std::string& text) {
  if (text == "fp32") return fp32_policy();
  if (text == "autocast-f16") return autocast_policy(f16);
  if (text == "autocast-bf16") return autocast_policy(bf16);
  if (text == "pure-f16") return pure_policy(f16);
  if (text == "pure-bf16") return pure_policy(bf16);
  fail("unknown policy '{}' (expected fp32, autocast-f16, autocast-bf16, pure-f16, pure-bf16)",
       text);
}

Policy::Policy(std::string name) : name_(std::move(name)) {
  static std::atomic<uint64_t> made{0};
  id_ = ++made;
}

namespace {
std::atomic<uint64_t> edit_count{0};
}

void Policy::edited() const {
  if (in_use()) ++edit_count;
}

void Policy::mark_in_use() const { in_use_.store(true, std::memory_order_relaxed); }

void OverridePolicy::mark_in_use() const {
  if (in_use()) return;  // its parts too: delegate() marks those added since
  Policy::mark_in_use();
  base_->mark_in_use();
  for (const auto& [decides, policy] : delegates_) policy->mark_in_use();
}
uint64_t policy_edits() { return edit_count.load(); }

OverridePolicy::OverridePolicy(PolicyPtr base)
    : Policy(base ? base->name() + "+overrides" : ""), base_(std::move(base)) {
  if (!base_) fail("OverridePolicy: the base policy is null");
}

bool OverridePolicy::pure() const {
  if (has_rule_ || !base_->pure()) return false;
  for (const auto& [decides, policy] : delegates_)
    if (!policy->pure()) return false;
  return true;
}

bool OverridePolicy::saves_narrower() const {
  if (!saved_.empty() || base_->saves_narrower()) return true;
  for (const auto& [decides, policy] : delegates_)
    if (policy->saves_narrower()) return true;
  return false;
}

OverridePolicy& OverridePolicy::module(const std::string& glob, PolicyPtr policy) {
  if (glob.empty() || !policy) fail("OverridePolicy::module: needs a pattern and a policy");
  std::string description = fmt::format("module '{}' -> {}", glob, policy->name());
  return delegate(
      std::move(description),
      [glob](const PrecisionQuery& q) { return module_path_matches(glob, q.module_path); },
      std::move(policy));
}

OverridePolicy& OverridePolicy::op(OpCode op, PolicyPtr policy) {
  if (!policy) fail("OverridePolicy::op: the policy is null");
  std::string description = fmt::format("op {} -> {}", op_name(op), policy->name());
  return delegate(
      std::move(description),
      [op](const PrecisionQuery& q) { return q.op == op || (q.backward && q.forward_op == op); },
      std::move(policy));
}

OverridePolicy& OverridePolicy::delegate(std::string description, Matcher decides,
                                         PolicyPtr policy) {
  if (in_use()) policy->mark_in_use();
  delegates_.emplace_back(decides, policy);
  return add(std::move(description),
             [decides = std::move(decides),
              policy = std::move(policy)](const PrecisionQuery& q) -> std::optional<Precision> {
               if (!decides(q)) return std::nullopt;
               return policy->decide(q);
             });
}

OverridePolicy& OverridePolicy::rule(std::string description, Rule rule) {
  add(std::move(description), std::move(rule));
  has_rule_ = true;
  return *this;
}

OverridePolicy& OverridePolicy::add(std::string description, Rule rule) {
  if (!rule) fail("OverridePolicy::rule: the rule '{}' is empty", description);
  rules_.push_back({std::move(description), std::move(rule)});
  edited();
  return *this;
}

OverridePolicy& OverridePolicy::save_activations(const std::string& glob, DType type) {
  if (glob.empty()) fail("OverridePolicy::save_activations: needs a module pattern");
  if (!is_floating(type))
    fail("OverridePolicy::save_activations: '{}' would keep values as {}, not a floating type",
         glob, mixtape::name(type));
  saved_.emplace_back(glob, type);
  edited();
  return *this;
}

std::optional<DType> OverridePolicy::saved_type(const PrecisionQuery& q) const {
  if (!in_use()) mark_in_use();
  for (const auto& [glob, type] : saved_)
    if (module_path_matches(glob, q.module_path)) return type;
  for (const auto& [decides, policy] : delegates_)
    if (decides(q)) return policy->saved_type(q);
  return base_->saved_type(q);
}

Precision OverridePolicy::decide(const PrecisionQuery& q) const {
  // In use from its first answer too: a policy another asks inside a rule() is never current.
  if (!in_use()) mark_in_use();
  for (const Override& o : rules_)
    if (std::optional<Precision> decided = o.rule(q)) {
      o.decided->store(true, std::memory_order_relaxed);
      decided->rule = fmt::format("override {}: {}", o.description, decided->rule);
      return *decided;
    }
  return base_->decide(q);
}

std::vector<std::string> OverridePolicy::unmatched_rules() const {
  std::vector<std::string> unmatched;
  for (const Override& o : rules_)
    if (!o.decided->load(std::memory_order_relaxed)) unmatched.push_back(o.description);
  std::vector<const Policy*> parts{base_.get()};
  for (const auto& [decides, policy] : delegates_) parts.push_back(policy.get());
  for (const Policy* part : parts)
    if (const auto* inner = dynamic_cast<const OverridePolicy*>(part))
      for (std::string& rule : inner->unmatched_rules())
        if (std::find(unmatched.begin(), unmatched.end(), rule) == unmatched.end())
          unmatched.push_back(std::move(rule));
  return unmatched;
}

autocast::autocast(DType half) : autocast(autocast_policy(half)) {}
autocast::autocast(PolicyPtr policy) {
  if (!policy) fail("autocast: the policy is null (use autocast(false) to disable)");
  policy->mark_in_use();
  previous_ = exchange_current_policy(std::move(policy));
}
autocast::autocast(bool enabled)
    : previous_(exchange_current_policy(enabled ? current_policy() : nullptr)) {}
autocast::~autocast() { exchange_current_policy(std::move(previous_)); }

}  // namespace mixtape

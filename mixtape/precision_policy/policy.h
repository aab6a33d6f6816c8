// mixtape/precision_policy/policy.h -- precision policies: the Policy interface, built-ins,
// overrides and the mt::autocast scope.
#pragma once

#include <atomic>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "mixtape/dsl/graph.h"
#include "mixtape/dsl/module_path.h"  // module_path_matches, which OverridePolicy::module uses
#include "mixtape/dsl/node.h"

namespace mixtape {

/// What a policy sees of one floating-point node when it decides its precision.
struct PrecisionQuery {
  OpCode op;
  Category category;                  // op_info(op).category
  DType traced;                       // the dtype tracing gave the node
  std::vector<DType> input_storage;   // storage of its floating data inputs, already decided
  std::vector<bool> input_is_scalar;  // inputs that are broadcast scalar constants (weak types)
  const std::string& module_path;
  const char* composite;  // the outermost composite op that made the node (softmax...), or null
  bool backward;          // made by autograd ...
  OpCode forward_op;      // ... to differentiate a node of this op
  /// A Cast that type promotion made for the op reading it (Node::promotion), not one the user
  /// asked for.
  bool promotion = false;
};

/// A node's precision: storage of its value, the type its float inputs are rounded to, the type
/// its reductions/matmuls accumulate in, and the rule that decided it (shown in reports).
struct Precision {
  DType storage;
  DType compute;
  DType accum;
  std::string rule;
};

/// Decides each node's precision. Users extend mixtape by implementing decide().
class Policy {
 public:
  explicit Policy(std::string name);
  virtual ~Policy() = default;
  virtual Precision decide(const PrecisionQuery& node) const = 0;
  /// True when decide() depends on its query alone (no state, no side effects): the precision
  /// pass then asks once per distinct query and reuses the answer, so that the loop traced every
  /// step does not format every node's rule again. mixtape's policies are; a user's may say so.
  virtual bool pure() const { return false; }
  /// Precision-aware saving: the type in which the backward pass keeps a value this policy typed
  /// (the query is the value's own). Where it is narrower than the value's storage, the
  /// gradient rules read a copy rounded to it, made in the forward pass, and the value itself
  /// dies with its last forward reader: memory for one rounding, which precision_report names.
  /// nullopt (the default) keeps the value as stored.
  virtual std::optional<DType> saved_type(const PrecisionQuery&) const { return std::nullopt; }
  /// Whether saved_type() may give a type: a backward pass asks it nothing when no policy may.
  virtual bool saves_narrower() const { return false; }
  const std::string& name() const { return name_; }
  /// Unique to this object for the process's life (caches key on it, not on an address).
  uint64_t id() const { return id_; }
  /// Called as the policy becomes the current one (mt::autocast), and by an OverridePolicy at its
  /// first answer (one another asks inside a rule() is never current): from then on its edits
  /// count (policy_edits()). An OverridePolicy marks the policies it delegates to too.
  virtual void mark_in_use() const;

 protected:
  /// A policy whose answers change after it was made (OverridePolicy's rules) calls this: the
  /// caches of answers and mt::compile's plans, keyed on ids, then ask again (policy_edits()).
  /// Only once it has been in use: a policy being built (or one never used) has no answers
  /// anywhere, and counting its edits made every mt::compile step trace anew.
  void edited() const;
  bool in_use() const { return in_use_.load(std::memory_order_relaxed); }

 private:
  std::string name_;
  uint64_t id_;
  mutable std::atomic<bool> in_use_{false};
};

using PolicyPtr = std::shared_ptr<const Policy>;

/// How many times a policy in use was changed: a key of an answer cached by a policy's id holds
/// this too, as a policy an answer came from may have changed since.
uint64_t policy_edits();

/// Every node as traced (f32 for a float model).
PolicyPtr fp32_policy();
/// PyTorch-style autocast (one object per type, so that a scope made every step is the same):
/// matmuls in `half` with f32 accumulation; exp/log/pow/tanh/erf/rsqrt, softmax, norms and losses
/// in f32; reductions accumulate in f32 and give f32; other ops take the widest type of their
/// inputs. Parameters stay f32 and are rounded to half where used.
PolicyPtr autocast_policy(DType half);
/// O2-style (one object per type): `half` everywhere except fp32-compute ops, reductions, norms,
/// softmax and losses; parameters stay f32 masters and are rounded to half where used.
PolicyPtr pure_policy(DType half);
/// "fp32", "autocast-f16", "autocast-bf16", "pure-f16", "pure-bf16"; mt::Error otherwise.
PolicyPtr policy_by_name(const std::string& name);

/// A base policy with overrides, tried in the order added; the first that matches decides.
class OverridePolicy : public Policy {
 public:
  using Rule = std::function<std::optional<Precision>(const PrecisionQuery&)>;
  explicit OverridePolicy(PolicyPtr base);
  /// Nodes made inside modules whose path matches `glob` use `policy`. `*` matches one path
  /// component, `**` any number; a pattern matches a module and everything inside it.
  OverridePolicy& module(const std::string& glob, PolicyPtr policy);
  /// Nodes of `op` (or gradient nodes of it) use `policy`.
  OverridePolicy& op(OpCode op, PolicyPtr policy);
  /// Any callable; returning nullopt passes the node on.
  OverridePolicy& rule(std::string description, Rule rule);
  /// Values made inside modules whose path matches `glob` ("**" for all) are kept for the
  /// backward pass in `type` where it is narrower than their storage (Policy::saved_type): e.g.
  /// bf16 copies of an f32 model's products. The first matching glob decides, then the policy
  /// of the first module()/op() override that matches, then the base.
  OverridePolicy& save_activations(const std::string& glob, DType type);
  Precision decide(const PrecisionQuery& node) const override;
  std::optional<DType> saved_type(const PrecisionQuery& value) const override;
  bool saves_narrower() const override;
  /// Pure when its base and every module()/op() policy are and no rule() was added.
  bool pure() const override;
  void mark_in_use() const override;
  /// The descriptions of the overrides (module(), op(), rule()) that have decided no node so far,
  /// those of the OverridePolicies this one delegates to included: a glob with a typo
  /// ("block.*" for "blocks.*") decides nothing, silently. precision_report lists them.
  std::vector<std::string> unmatched_rules() const;

 private:
  struct Override {
    std::string description;
    Rule rule;
    std::shared_ptr<std::atomic<bool>> decided = std::make_shared<std::atomic<bool>>(false);
  };
  OverridePolicy& add(std::string description, Rule rule);
  using Matcher = std::function<bool(const PrecisionQuery&)>;
  // An override by `policy` of the nodes `decides` says: its decide() and its saved_type().
  OverridePolicy& delegate(std::string description, Matcher decides, PolicyPtr policy);
  PolicyPtr base_;
  std::vector<Override> rules_;
  std::vector<std::pair<std::string, DType>> saved_;  // save_activations(glob, type)
  // The module() and op() overrides' policies, in order, with the nodes each decides. Asked
  // at each call of pure() and saves_narrower(): they may be changed after this one was made.
  std::vector<std::pair<Matcher, PolicyPtr>> delegates_;
  bool has_rule_ = false;  // a rule() was added: not pure
};

/// Scoped policy for the nodes made while it lives (DESIGN.md: `mt::autocast guard(mt::f16)`).
/// Scopes nest; autocast(false) turns mixed precision off inside an autocast region.
class autocast {
 public:
  explicit autocast(DType half);
  explicit autocast(PolicyPtr policy);
  explicit autocast(bool enabled);
  ~autocast();
  autocast(const autocast&) = delete;
  autocast& operator=(const autocast&) = delete;

 private:
  PolicyPtr previous_;
};

}  // namespace mixtape

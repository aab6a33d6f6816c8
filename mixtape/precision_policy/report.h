// mixtape/precision_policy/report.h -- mt::precision_report: every node's dtypes and the rule
// behind them.
#pragma once

#include <string>
#include <vector>

#include "mixtape/dsl/tensor.h"

namespace mixtape {

struct PrecisionRow {
  uint64_t id;
  std::string op;
  std::string module_path;
  Shape shape;
  DType traced, storage, compute, accum;
  bool backward;
  std::string rule;
};

struct PrecisionReport {
  std::vector<PrecisionRow> rows;  // in tape order
  /// "policy: override" for each OverridePolicy rule (module(), op(), rule()) of the graph's
  /// policies that has decided no node yet: a glob with a typo decides nothing, silently.
  /// table(), summary() and json() end with them.
  std::vector<std::string> unmatched_rules;
  /// A fixed-width table, one node a line.
  std::string table() const;
  /// A tally: one line per module (in order of first appearance; "-" for nodes outside any)
  /// and per (storage, compute) pair, with its forward and backward node counts, then the same
  /// over all modules as "(all)".
  std::string summary() const;
  /// {"nodes":[{"id":..,"op":..,"module":..,"shape":[..],"traced":..,"storage":..,...}],
  ///  "unmatched_rules":[..]}
  std::string json() const;
};

/// Decides (without running anything) the precision of every node the given tensors depend on
/// and reports it. Parts of the graph that were already evaluated and cannot receive gradients
/// are no longer recorded, so ask before evaluating (e.g. after backward(), before step()).
PrecisionReport precision_report(const std::vector<Tensor>& outputs);

}  // namespace mixtape

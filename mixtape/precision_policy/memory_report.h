// mixtape/precision_policy/memory_report.h -- mt::memory_report: what one training step under a
// precision policy keeps in memory (masters, half copies, gradients, optimizer state, saved
// activations) and its peak.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "mixtape/dsl/module.h"
#include "mixtape/dsl/optim.h"

namespace mixtape {

/// One parameter's share.
struct MemoryParamRow {
  std::string name;
  Shape shape;
  DType master = f32;  // how the parameter itself is stored
  int64_t master_bytes = 0;
  std::vector<DType> half_copies;  // the 16-bit types the step rounds it to (each once)
  int64_t half_copy_bytes = 0;
  bool has_grad = false;
  DType grad = f32;  // the gradient's storage type, when has_grad
  int64_t grad_bytes = 0;
  int64_t state_bytes = 0;  // optimizer state for it
};

/// One forward value that the backward pass reads (saved for backward).
struct SavedActivationRow {
  uint64_t id;  // the node that owns the buffer
  std::string op;
  std::string module_path;
  Shape shape;
  DType storage;
  int64_t bytes;
};

struct MemoryReport {
  std::string policy;  // the policies of the forward nodes, ", "-joined; "none" without autocast
  int64_t master_weights = 0;
  int64_t half_copies = 0;
  int64_t gradients = 0;
  int64_t optimizer_state = 0;
  /// The module's buffers (BatchNorm's running statistics): kept across steps, not parameters.
  int64_t buffers = 0;
  /// True when some state does not exist yet (before an optimizer's first step) and was counted
  /// from what the optimizer will create: SGD one f32 buffer with momentum, Adam/AdamW two.
  bool optimizer_state_estimated = false;
  int64_t saved_activations = 0;
  /// Checkpointed modules (mt::checkpoint): the bytes of the forward values backward() recomputes
  /// instead of keeping (each buffer once, alive only during the backward pass), and their nodes.
  int64_t recomputed_activations = 0;
  int64_t recomputed_nodes = 0;
  int64_t peak = 0;
  /// The compiled back end's own figure: the most bytes its memory plan for this graph keeps
  /// alive at once (stored values only; persistent memory and the inputs come on top). It is
  /// what execution_stats().peak_bytes reports when the loss and gradients are evaluated.
  int64_t compiled_peak = 0;
  uint64_t peak_node = 0;  // the node running when the peak is reached
  std::string peak_op;
  bool peak_backward = false;
  std::vector<MemoryParamRow> parameters;  // in named_parameters() order
  std::vector<SavedActivationRow> saved;   // in tape order

  /// Masters, optimizer state and module buffers: what lives across steps.
  int64_t persistent() const { return master_weights + optimizer_state + buffers; }
  /// The totals, then one line per parameter and per saved activation.
  std::string table() const;
  /// {"policy":..,"master_weights":..,"half_copies":..,"gradients":..,"optimizer_state":..,
  ///  "optimizer_state_estimated":..,"buffers":..,"saved_activations":..,"recomputed_activations":..,
  ///  "recomputed_nodes":..,"peak":..,"compiled_peak":..,
  ///  "peak_at":{"id":..,"op":..,"pass":..},"parameters":[..],"saved":[..]}
  std::string json() const;
};

/// The memory of the training step that produced `loss`, without running anything: call it after
/// loss.backward() and before opt->step(), like precision_report (it runs the precision pass on
/// the graph that the loss and the parameters' gradients depend on). `opt` may be null.
///
/// The model behind the figures, which is what a compiled program of that graph would need:
/// - Parameters (the f32 masters) and optimizer state live throughout; the optimizer's own update
///   program, built later by step(), is not included.
/// - A parameter read by a node whose compute type is 16-bit, directly or through views, gets one
///   16-bit copy per type and step ("cast once"), live from its first such reader to its last.
/// - Every other node in tape (creation) order owns a buffer of numel x its storage type, made
///   when it runs and freed after its last reader runs. The loss and the gradients are the
///   program's outputs and stay to the end. Leaf data (a batch) counts from when it was made. Views
///   that keep the storage type (reshape, broadcast_to, permute, stop_gradient) alias their input,
///   and fills (full, arange) are folded into their readers: neither takes memory, but for a fill
///   that a step other than a fused kernel reads (the zeros index_add adds an embedding's
///   gradient rows into), which is stored.
/// - While a node runs, its inputs and its output are all live; the peak is the largest such sum,
///   persistent memory included.
/// - Saved activations are the buffers of forward values that the forward pass reads and backward
///   nodes read too, each counted once: not parameters or their half copies, not the loss and not
///   a gradient passed to backward(). Under activation checkpointing the backward nodes of a
///   checkpointed module read its recomputation instead, which the backward pass makes: those
///   values are recomputed_activations, and only the module's inputs stay saved.
MemoryReport memory_report(const Module& model, const Optimizer* opt, const Tensor& loss);

/// One line per report (e.g. the same step under several policies), side by side.
std::string memory_comparison_table(const std::vector<MemoryReport>& reports);

}  // namespace mixtape

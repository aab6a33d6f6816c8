// mixtape/runtime/aot_plan.h -- an exported step's replay plan as a JSON document (NAME.plan),
// written at export and read back by the artifact runtime, which rebuilds its programs like the JIT
// does.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "mixtape/codegen/kernel_ir.h"
#include "mixtape/runtime/program.h"
#include "mixtape/runtime/step_plan.h"

namespace mixtape::aot {

inline constexpr const char* kPlanFormat = "mixtape-aot-plan-1";

/// Whether a kernel's machine code serves every extent of its dims[0] up to the one it was
/// compiled for: dims[0] then only bounds the range of parallel points the executor hands it
/// (codegen/emit_llvm.cpp), so the kernel of a dynamic-batch artifact's largest batch runs the
/// smaller ones. Not a multi-tensor kernel, nor one that reduces over dims[0].
bool serves_smaller_dim0(const kir::Kernel& kernel);

/// What an artifact's kernel table is searched by: the kernel's name (a hash of its whole
/// listing), or for serves_smaller_dim0 kernels a hash of the listing without dims[0].
std::string kernel_key(const kir::Kernel& kernel);

/// A buffer the plan reads or keeps up to date (weights, optimizer and scaler state,
/// constants), stored in the artifact's safetensors under `name`.
struct PlanBuffer {
  std::string name;
  DType dtype = f32;
  Shape shape;
};

/// One traced plan per batch size, equal but for the batch (one plan for a fixed batch).
struct TracedPlan {
  int64_t batch = 0;
  const Plan* plan = nullptr;
};

/// A parsed plan document. What it holds (nlohmann's JSON) stays in aot_plan.cpp, so that this
/// header needs no JSON library.
class PlanDocument {
 public:
  struct Tree;
  explicit PlanDocument(std::unique_ptr<const Tree> tree);
  PlanDocument(PlanDocument&&) noexcept;
  PlanDocument& operator=(PlanDocument&&) noexcept;
  ~PlanDocument();
  /// Reads a document strictly (dsl/json.h: at most max_values values); mt::Error when it is
  /// not JSON.
  static PlanDocument parse(std::string_view text, size_t max_values);
  /// The compact JSON text of the document.
  std::string text() const;
  const Tree& tree() const { return *tree_; }

 private:
  std::unique_ptr<const Tree> tree_;
};

/// The document for `traced` (the first is the export batch): every evaluation's nodes, with
/// each dim that differs between the traces written as base + per_batch * batch; how each
/// external input binds (a call argument or buffers[k]); which stored values are results and
/// which buffers they update. `buffers` lists the buffers in the order the document numbers them
/// (the caller names them); `buffer_of` gives each buffer's index, -1 for one nothing names yet
/// (added to `buffers` with an empty name). An mt::Error says why when the traces do not differ
/// by the batch alone.
PlanDocument plan_to_json(const std::vector<TracedPlan>& traced,
                          std::vector<std::pair<StoragePtr, PlanBuffer>>& buffers);

/// The plan of `doc` at `batch`, its buffers bound to `buffers` (one per document buffer) and its
/// programs built with `load` (kernels looked up, not compiled) to replay on `device` (cpu or
/// cuda: the same programs, each back end's kernels). An mt::Error for a document that does not
/// make a valid plan.
std::unique_ptr<Plan> plan_from_json(const PlanDocument& doc, int64_t batch,
                                     const std::vector<StoragePtr>& buffers,
                                     const KernelLoader& load, Device device = Device::cpu);

}  // namespace mixtape::aot

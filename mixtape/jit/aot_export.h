// mixtape/jit/aot_export.h -- mt::aot::export_function and export_step: trace a function or a
// training step as mt::compile does and write it as an artifact that runs without LLVM (a C
// library).
#pragma once

#include <concepts>
#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "mixtape/dsl/module.h"
#include "mixtape/dsl/optim.h"
#include "mixtape/dsl/tensor.h"

namespace mixtape {
class GradScaler;
}

namespace mixtape::aot {

/// An argument of the exported function: its name in the C API, its shape at the export batch
/// (dim 0 is the batch) and its dtype.
struct Input {
  std::string name;
  Shape shape;
  DType dtype = f32;
};
inline Input input(std::string name, Shape shape, DType dtype) {
  return {std::move(name), std::move(shape), dtype};
}

struct DynamicBatch {
  /// > 0: dim 0 of every input and output may be 1..max at run time (the export batch, the
  /// inputs' dim 0, must not exceed it). 0: shapes are fixed at the export batch. Functions
  /// only: a training step's batch is fixed.
  int64_t max = 0;
};

struct Options {
  std::string name;  // a C identifier: the prefix of everything the artifact defines
  DynamicBatch dynamic_batch{};
  /// What names the state the artifact keeps: its weights in NAME.safetensors, and for a step
  /// the checkpoints NAME_save writes, in save_checkpoint's layout (so mt::load_checkpoint reads
  /// them, and NAME_load reads what save_checkpoint wrote). export_step needs the module;
  /// export_function names its weights "constant.<k>" without one.
  const Module* module = nullptr;
  const Optimizer* optimizer = nullptr;
  const GradScaler* scaler = nullptr;
  /// The random generators the step draws from (dropout, rand, randn; mt::default_generator()
  /// when none is passed), by name as CheckpointOptions::generators names them: each one's
  /// offset is state the artifact keeps and NAME_save writes as metadata
  /// "generator.<name>.offset". Its seed is compiled into the step, saved as
  /// "generator.<name>.seed", and NAME_load refuses a checkpoint with another seed.
  std::vector<std::pair<std::string, Generator*>> generators{};
  /// The kernels are compiled for the export machine's CPU ("native"); each LLVM CPU name here
  /// ("x86-64-v3", "x86-64-v2", "x86-64" for any x86-64, "znver3", ...) adds a build of them for
  /// that CPU, best first. NAME_open takes the first build whose features the CPU has (or the one
  /// "cpu:TARGET" names).
  std::vector<std::string> cpu_targets{};
  /// Where the artifact runs: "cpu" (always built, so that it runs anywhere) and "cuda", which
  /// adds the GPU kernels compiled by NVRTC at export (NVRTC is not needed where it runs).
  std::vector<std::string> devices{"cpu"};
  /// For "cuda": a CUBIN per compute capability (80: sm_80, for every 8.x GPU; 90: sm_90), and
  /// PTX of the lowest, which the driver compiles for newer GPUs.
  std::vector<int> cuda_archs{80, 90};
};

/// The devices this machine exports for: "cpu", and "cuda" where NVRTC loads (a GPU is not
/// needed to export for one).
std::vector<std::string> exportable_devices();

/// What an export wrote.
struct Exported {
  std::string dir;
  std::string manifest_xxh3;       // what the library checks NAME.json against
  std::vector<std::string> files;  // relative to dir
  struct Kernel {
    std::string symbol, key, llvm_ir;
  };
  std::vector<Kernel> kernels;  // the CPU kernels the libraries hold
};

using Function = std::function<std::vector<Tensor>(const std::vector<Tensor>&)>;

/// The untyped form of export_function / export_step.
Exported export_artifact(const Function& fn, const std::vector<Input>& inputs,
                         const std::vector<std::string>& outputs, const std::string& dir,
                         const Options& options, bool step);

namespace detail {
template <typename F, size_t... I>
Function bind(F& fn, std::index_sequence<I...>) {
  return [&fn](const std::vector<Tensor>& a) -> std::vector<Tensor> {
    using Result = std::invoke_result_t<F&, decltype((void)I, std::declval<const Tensor&>())...>;
    if constexpr (std::is_same_v<Result, Tensor>)
      return {fn(a.at(I)...)};
    else
      return fn(a.at(I)...);
  };
}
// The function as one taking a vector: F takes as many Tensors as there are inputs (up to 8).
template <typename F>
Function untyped(F& fn, size_t arity) {
  Function out;
  auto try_arity = [&]<size_t N>(std::integral_constant<size_t, N>) {
    if constexpr (N > 0)
      if constexpr ([]<size_t... I>(std::index_sequence<I...>) {
                      return std::invocable<F&,
                                            decltype((void)I, std::declval<const Tensor&>())...>;
                    }(std::make_index_sequence<N>{}))
        if (arity == N) out = bind(fn, std::make_index_sequence<N>{});
  };
  [&]<size_t... N>(std::index_sequence<N...>) {
    (try_arity(std::integral_constant<size_t, N>{}), ...);
  }
  (std::make_index_sequence<9>{});
  if (!out)
    throw Error("aot: the function does not take " + std::to_string(arity) +
                " tensors, one per input");
  return out;
}
}  // namespace detail

/// Exports the inference function `fn` (it takes one Tensor per input and returns a Tensor or a
/// std::vector<Tensor>, one per name in `outputs`): traced in no-grad mode on zeros of the
/// inputs' shapes (put modules in eval mode first), with the precision policy in force, into
/// `dir` as NAME.h, libNAME.a, libNAME.so, NAME.safetensors, NAME.plan, NAME.json, NAME.pc and
/// NAMEConfig.cmake. README.md, "Deploy", describes them.
template <typename F>
Exported export_function(F fn, const std::vector<Input>& inputs,
                         const std::vector<std::string>& outputs, const std::string& dir,
                         const Options& options) {
  return export_artifact(detail::untyped(fn, inputs.size()), inputs, outputs, dir, options, false);
}

/// Exports a whole training step (forward, backward, loss scaling, optimizer update): each
/// NAME_run is one call of `fn`, updating the state the artifact keeps (parameters, optimizer
/// and scaler state, the offsets of Options::generators), which starts as the state before the
/// export. A step that draws random numbers (dropout) must name its generators there. The step is
/// traced by calling it twice on zeros, as mt::compile's first calls are, and the state those calls
/// changed is put back afterwards. A step whose first call differs from later ones (an
/// optimizer's first step creates its state) is called once more, and the model and the
/// artifact then start from the state after that first call: train a step before exporting.
template <typename F>
Exported export_step(F fn, const std::vector<Input>& inputs,
                     const std::vector<std::string>& outputs, const std::string& dir,
                     const Options& options) {
  return export_artifact(detail::untyped(fn, inputs.size()), inputs, outputs, dir, options, true);
}

}  // namespace mixtape::aot

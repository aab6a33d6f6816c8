// mixtape/runtime/compile.h -- mt::compile: trace a step function, then replay its compiled
// programs on new arguments without running the function (and its tracing) again.
#pragma once

#include <concepts>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "mixtape/dsl/tensor.h"
#include "mixtape/runtime/device.h"

namespace mixtape {

struct CompileStats {
  int64_t calls = 0;
  int64_t traces = 0;   // calls that ran the function
  int64_t replays = 0;  // calls that ran only the recorded programs
  int64_t plans = 0;    // replay plans made (a new argument signature, or after invalidation)
  /// Plans that took up the state a trace of other argument shapes left (a short last batch)
  /// instead of tracing twice again.
  int64_t rebinds = 0;
  /// Why the latest trace could not become a replay plan, or why the last plan was dropped;
  /// empty when the latest call replayed or made a plan.
  std::string reason;
};

/// The machinery behind mt::compile, for one step function. Per argument signature (the
/// arguments' shapes and dtypes, the device and eager mode) it traces the function on the
/// first calls, recording every evaluation it makes. Once two consecutive traces ran the same
/// programs on inputs it can account for, later calls only bind the new arguments and rerun
/// those programs. The function's results are fresh tensors on every call; everything else the
/// step wrote (parameters, optimizer and loss-scaler state, gradients) is updated in place, so
/// every handle to it (model.parameters(), opt.state(), p.grad()) sees the new values. Unlike
/// the uncompiled step, whose optimizer leaves a handle taken before it its old value, so does
/// an optimizer state entry held across a call and an evaluated view sharing a weight's or a
/// running statistic's buffer (w.reshape({-1}) after eval): copy what must keep the old value.
///
/// State includes buffers written with assign() and every random generator's offset: draws read
/// it as a graph input and advance it with graph code, so a replay draws the numbers tracing
/// would. Host work that a replay would skip but every call needs (the loss scaler's per-step
/// records) is registered during the trace (on_each_call, dsl/graph.h) and runs after the trace
/// and after each replay, on copies of the values it asked for, with no host sync; such work
/// can also report, before a replay, that state it depends on changed (a generator reseeded
/// outside the step), and the call then traces again.
///
/// As with jax.jit, the function must be a pure step: what it reads besides its arguments and
/// the state that earlier calls wrote is frozen at the trace. A trace that reads values on the
/// host (item(), to_vector()) or sets a learning rate or schedule cannot be replayed; such a
/// function still works, traced on every call (stats().reason says why). Changing state from
/// outside between calls is fine when it writes in place (set_lr, writing a storage); replacing
/// it (assign, load_state, a new optimizer, set_schedule, reseeding a generator) is detected and
/// makes the next calls trace again. Parameters, and the gradients a step adds to, are read
/// through their tensors, so the forward and backward compiled alone replay with the
/// optimizer's step and zero_grad outside, gradient accumulation included (a call finding no
/// gradient adds to -0, which leaves what a call making it afresh leaves, except that under
/// autocast it is stored in f32 where that call would store a bf16 or f16 gradient as the
/// backward made it). A schedule attached with Optimizer::set_schedule is graph
/// code over the step count, so replays advance it with no call between them.
/// Each signature has its own traces and plan. A trace replaces the state buffers that the
/// other signatures' plans update in place; the next call of such a plan takes up the buffers
/// that trace left (stats().rebinds) where each has a name: the value of a tensor (assign,
/// assign_later), or state kept by name (note_kept_state, dsl/graph.h: an optimizer's moments and
/// counts, a generator's offset). So with a short last batch each epoch the full batches keep
/// replaying, and from the third epoch on the short batch replays too. Where a buffer has no
/// name, the plan is dropped and made again from two traces (stats().reason says so). Not
/// thread-safe.
class StepReplayer {
 public:
  using Function = std::function<std::vector<Tensor>(const std::vector<Tensor>&)>;
  StepReplayer();
  ~StepReplayer();
  StepReplayer(StepReplayer&&) noexcept;
  StepReplayer& operator=(StepReplayer&&) noexcept;

  /// Runs `fn` on `args` (tracing), or replays what earlier traces of it recorded.
  std::vector<Tensor> call(const std::vector<Tensor>& args, const Function& fn);
  const CompileStats& stats() const;
  /// Forgets every trace and plan: the next calls trace again.
  void reset();

 private:
  struct State;
  std::unique_ptr<State> state_;
};

/// A compiled step function: call it like the function. `F` takes Tensors (by value or const
/// reference) and returns a Tensor, a std::vector<Tensor> or nothing.
///
///   auto train_step = mt::compile([&](const mt::Tensor& x, const mt::Tensor& y) {
///     opt.zero_grad();
///     mt::Tensor loss = mt::mse_loss(net(x), y);
///     loss.backward();
///     opt.step();
///     return loss;
///   });
///   for (auto [x, y] : loader) losses.push_back(train_step(x, y));
template <typename F>
class Compiled {
 public:
  explicit Compiled(F fn) : fn_(std::move(fn)) {}

  template <typename... Args>
  requires(std::convertible_to<const Args&, Tensor>&&...) auto operator()(const Args&... args) {
    using Result = std::invoke_result_t<F&, const Args&...>;
    std::vector<Tensor> results =
        replayer_.call({Tensor(args)...}, [&](const std::vector<Tensor>& a) {
          return call_with<Result>(a, std::index_sequence_for<Args...>{});
        });
    if constexpr (std::is_void_v<Result>)
      return;
    else if constexpr (std::is_same_v<Result, Tensor>)
      return results.at(0);
    else
      return results;
  }

  const CompileStats& stats() const { return replayer_.stats(); }
  void reset() { replayer_.reset(); }

 private:
  template <typename Result, size_t... I>
  std::vector<Tensor> call_with(const std::vector<Tensor>& a, std::index_sequence<I...>) {
    if constexpr (std::is_void_v<Result>) {
      fn_(a[I]...);
      return {};
    } else if constexpr (std::is_same_v<Result, Tensor>) {
      return {fn_(a[I]...)};
    } else {
      static_assert(std::is_same_v<Result, std::vector<Tensor>>,
                    "mt::compile: the function must return Tensor, std::vector<Tensor> or void");
      return fn_(a[I]...);
    }
  }

  F fn_;
  StepReplayer replayer_;
};

template <typename F>
Compiled<F> compile(F fn) {
  return Compiled<F>(std::move(fn));
}

struct Plan;             // runtime/step_plan.h
struct ExecutedProgram;  // runtime/program.h
/// For AOT export: calls `fn` on `args`, tracing, as mt::compile's first calls do, until two
/// consecutive calls show how to replay it (two calls, or three when the first differs, as an
/// optimizer's first step does), and returns the replay plan; each state binding's first_value
/// is the state before the last call. An mt::Error saying why when it cannot be replayed.
std::unique_ptr<Plan> plan_step(const std::vector<Tensor>& args, const StepReplayer::Function& fn);

/// For runtime/eval.cpp: hands an evaluation that just ran to the trace in progress on this
/// thread. False when nothing is being traced (the caller then tidies the graph as usual).
bool record_evaluation(const std::vector<Node*>& pending, ExecutedProgram&& executed,
                       Device device);
/// For runtime/eval.cpp: whether a trace is in progress on this thread.
bool tracing_step();

}  // namespace mixtape

// bench/timing.h -- the timing loop, command line and workload plumbing shared by the C++
// benchmark programs.
#pragma once

#include <mixtape/mixtape.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "mixtape/dsl/error.h"
#include "mixtape/dsl/json.h"
#include "mixtape/runtime/all_reduce.h"
#include "mixtape/runtime/device.h"

namespace bench {

namespace mt = mixtape;

/// How long to time one workload. The same rules as bench_common.measure in the Python peers.
struct TimingOptions {
  int warmup = 5;                // untimed steps first (at least one)
  int windows = 5;               // timed windows; the result is the median window rate
  double window_seconds = 1.0;   // steps per window are chosen to last about this long
  double budget_seconds = 60.0;  // fewer windows when the warm-up says they would take longer
  /// Maps this process's warm-up time to the one every process of a data-parallel run goes by
  /// (rank 0's), so that all of them run the same steps; unset: one process.
  std::function<double(double)> agree;
};

inline double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

/// The CPU time this process has used, every thread together: on a machine shared with other
/// work, steps/s moves with the load while CPU time per step (at one thread) does not.
inline double process_cpu_seconds() {
  timespec t{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) + static_cast<double>(t.tv_nsec) * 1e-9;
}

inline double median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  size_t n = values.size();
  return n % 2 ? values[n / 2] : (values[n / 2 - 1] + values[n / 2]) / 2;
}

/// measure() for steps that may return before their work has finished (the GPU back end queues
/// them): `wait` (optional) blocks until all queued work is done. It runs inside the clock after
/// every warm-up step and at the end of every window, so the steps of a window overlap as they
/// do in a training loop while every window still pays for all of its work.
inline mt::json::Value measure_queued(const std::function<void()>& step,
                                      const std::function<void()>& wait,
                                      const TimingOptions& options,
                                      const std::function<void()>& after_warmup = {}) {
  std::vector<double> warm_times;
  double first_step_cpu = 0;  // every thread's, background compiles included
  for (int i = 0; i < std::max(1, options.warmup); ++i) {
    auto start = std::chrono::steady_clock::now();
    double cpu_start = process_cpu_seconds();
    step();
    if (wait) wait();
    warm_times.push_back(seconds_since(start));
    if (i == 0) first_step_cpu = process_cpu_seconds() - cpu_start;
    // Slow steps: two warm-up steps (the first one compiles) are enough once the steps after the
    // first have taken half the budget.
    double after_first = 0;
    for (size_t w = 1; w < warm_times.size(); ++w) after_first += warm_times[w];
    if (options.agree) after_first = options.agree(after_first);
    if (warm_times.size() >= 2 && after_first > options.budget_seconds / 2) break;
  }
  // The fastest warm-up step after the first: mt::compile's second step still traces, and with
  // the median of three warm-up steps a 60 us step's windows lasted about 12 ms.
  double estimate = warm_times.size() > 1
                        ? *std::min_element(warm_times.begin() + 1, warm_times.end())
                        : warm_times[0];
  if (options.agree) estimate = options.agree(estimate);
  int64_t per_window =
      std::max<int64_t>(1, std::llround(options.window_seconds / std::max(estimate, 1e-9)));
  int windows = options.windows;
  double planned = estimate * static_cast<double>(per_window) * windows;
  if (planned > options.budget_seconds)
    windows = std::max(
        1, static_cast<int>(options.budget_seconds / (estimate * static_cast<double>(per_window))));
  if (after_warmup) after_warmup();
  std::vector<double> rates, cpu_per_step;
  mt::json::Value window_rates = mt::json::Value::array();
  for (int w = 0; w < windows; ++w) {
    auto start = std::chrono::steady_clock::now();
    double cpu_start = process_cpu_seconds();
    for (int64_t i = 0; i < per_window; ++i) step();
    if (wait) wait();
    double rate = static_cast<double>(per_window) / seconds_since(start);
    cpu_per_step.push_back((process_cpu_seconds() - cpu_start) / static_cast<double>(per_window));
    rates.push_back(rate);
    window_rates.push_back(std::round(rate * 1000) / 1000);
  }
  mt::json::Value result{{"steps_per_s", median(rates)},
                         {"window_steps_per_s", window_rates},
                         {"cpu_us_per_step", std::round(median(cpu_per_step) * 1e7) / 10},
                         {"steps_per_window", per_window},
                         {"windows", windows},
                         {"warmup_steps", static_cast<int64_t>(warm_times.size())},
                         {"first_step_s", warm_times[0]},
                         {"first_step_cpu_s", first_step_cpu}};
  if (windows < options.windows) result.emplace("windows_cut_by_budget", options.windows);
  return result;
}

/// Warm-up steps, then timed windows of K steps with K set from the warm-up step time (the same
/// rules, budget cuts included, as bench_common.measure in the Python peers). Work `step` leaves
/// queued (mt::set_async_evaluation) is waited for with mt::synchronize.
/// The result holds steps_per_s (median window) and how it was measured.
/// `after_warmup` (optional) runs between the warm-up and the first window, untimed.
inline mt::json::Value measure(const std::function<void()>& step, const TimingOptions& options,
                               const std::function<void()>& after_warmup = {}) {
  return measure_queued(step, mt::synchronize, options, after_warmup);
}

inline void append(mt::json::Value& into, const mt::json::Value& from) { into.update(from); }

inline void emit(const mt::json::Value& record) {
  std::printf("%s\n", mt::json::dump(record).c_str());
  std::fflush(stdout);
}

inline std::vector<std::string> split_list(const std::string& text) {
  std::vector<std::string> items;
  size_t start = 0;
  while (start <= text.size()) {
    size_t comma = text.find(',', start);
    if (comma == std::string::npos) comma = text.size();
    if (comma > start) items.push_back(text.substr(start, comma - start));
    start = comma + 1;
  }
  return items;
}

/// The flags every bench program takes; `extra` handles the program's own flags (returns false
/// for a flag it does not know).
struct CommandLine {
  std::vector<std::string> workloads;
  std::vector<std::string> precisions{"fp32", "bf16"};
  TimingOptions timing;
  // bench_training: traced (every step), compiled (the whole step through mt::compile) or
  // compiled-model (the forward and backward pass through it, the optimizer's update outside).
  std::string step = "traced";
  // Micro-batches whose gradients each optimizer step adds up (--accumulate): the gradients
  // zeroed and the update made outside the forward and backward pass, after the last.
  int micro_batches = 1;
};

[[noreturn]] inline void usage_error(const char* program, const std::string& problem,
                                     const char* usage) {
  std::fprintf(stderr, "%s: %s\n%s", program, problem.c_str(), usage);
  std::exit(2);
}

inline CommandLine parse_command_line(int argc, char** argv, const char* program,
                                      const char* usage) {
  CommandLine line;
  for (int i = 1; i < argc; ++i) {
    std::string flag = argv[i];
    if (flag == "--help" || flag == "-h") {
      std::printf("%s", usage);
      std::exit(0);
    }
    if (i + 1 >= argc) usage_error(program, "missing value for " + flag, usage);
    std::string value = argv[++i];
    auto number = [&] {
      char* end = nullptr;
      double v = std::strtod(value.c_str(), &end);
      if (value.empty() || *end != '\0' || !(v >= 0))
        usage_error(program, "not a non-negative number for " + flag + ": " + value, usage);
      return v;
    };
    if (flag == "--workloads")
      line.workloads = split_list(value);
    else if (flag == "--precisions")
      line.precisions = split_list(value);
    else if (flag == "--warmup")
      line.timing.warmup = static_cast<int>(number());
    else if (flag == "--windows")
      line.timing.windows = std::max(1, static_cast<int>(number()));
    else if (flag == "--window-seconds")
      line.timing.window_seconds = number();
    else if (flag == "--budget-seconds")
      line.timing.budget_seconds = number();
    else if (flag == "--step" &&
             (value == "traced" || value == "compiled" || value == "compiled-model"))
      line.step = value;
    else if (flag == "--accumulate")
      line.micro_batches = std::max(1, static_cast<int>(number()));
    else
      usage_error(program, "unknown flag " + flag, usage);
  }
  if (line.workloads.empty()) usage_error(program, "--workloads is required", usage);
  if (line.micro_batches > 1 && line.step == "compiled")
    usage_error(program,
                "--accumulate needs the optimizer outside the compiled function: --step traced "
                "or compiled-model",
                usage);
  for (const std::string& p : line.precisions)
    if (p != "fp32" && p != "bf16" && p != "fp16")
      usage_error(program, "precisions are fp32, bf16 and fp16", usage);
  return line;
}

/// The policy a precision names: fp32, autocast-bf16, or autocast-f16 (whose workloads scale
/// their loss with a dynamic GradScaler, as PyTorch's AMP loop does).
inline mt::PolicyPtr precision_policy(const std::string& precision) {
  return mt::policy_by_name(precision == "bf16"   ? "autocast-bf16"
                            : precision == "fp16" ? "autocast-f16"
                                                  : "fp32");
}

/// The back-end selection this process was started with (run.py sets these per child) and what
/// the library made of it, so each record says what it measured.
inline mt::json::Value backend() {
  auto get = [](const char* name) -> mt::json::Value {
    const char* value = std::getenv(name);
    return value ? mt::json::Value(value) : mt::json::Value(nullptr);
  };
  return {{"device", mt::device_name(mt::current_device())},
          {"eager", mt::eager_mode()},
          {"MIXTAPE_DEVICE", get("MIXTAPE_DEVICE")},
          {"MIXTAPE_EAGER", get("MIXTAPE_EAGER")}};
}

/// The compiled back end's counters as JSON; `per_step` divides the per-launch counts by `steps`.
inline mt::json::Value stats_json(const mt::ExecutionStats& s, int64_t steps = 1) {
  double n = static_cast<double>(std::max<int64_t>(1, steps));
  auto per = [&](int64_t count) { return static_cast<double>(count) / n; };
  return {{"evaluations", per(s.evaluations)},
          {"evaluations_queued", per(s.evaluations_queued)},
          {"kernels", per(s.kernels)},
          {"kernel_nodes", per(s.kernel_nodes)},
          {"gemms", per(s.gemms)},
          {"host_ops", per(s.host_ops)},
          {"bytes_read", per(s.bytes_read)},
          {"bytes_written", per(s.bytes_written)},
          {"outputs_in_place", per(s.outputs_in_place)},
          {"kernels_compiled", s.kernels_compiled},
          {"kernels_from_disk", s.kernels_from_disk},
          {"compile_seconds", s.compile_seconds},
          {"load_seconds", s.load_seconds}};
}

/// The seed of every workload's model, optimizer and data.
inline constexpr uint64_t kSeed = 0;

/// One workload, ready to step: the step closure owns the model, optimizer and data and returns
/// the step's loss (callers that time it drop the loss at once, as a training loop does).
struct Workload {
  std::function<mt::Tensor()> step;
  mt::json::Value facts;                            // shapes and settings reported with the result
  std::function<mt::CompileStats()> compile_stats;  // set for --step compiled
};

/// How a workload's steps run: traced on every call, or through mt::compile, the whole step or
/// (as torch.compile users compile a model) its forward and backward pass only; and how many
/// micro-batches each optimizer step adds up.
struct StepMode {
  enum Kind { traced, compiled, compiled_model } kind = traced;
  int micro_batches = 1;
};
inline StepMode step_mode(const CommandLine& line) {
  return {line.step == "traced"     ? StepMode::traced
          : line.step == "compiled" ? StepMode::compiled
                                    : StepMode::compiled_model,
          line.micro_batches};
}

/// A training step split where a user who compiles only the model splits it: zeroing the
/// gradients, the forward and backward pass (which adds to them), then the optimizer's update.
struct SplitStep {
  std::function<void()> zero_grad;
  std::function<mt::Tensor(const mt::Tensor&, const mt::Tensor&)> forward_backward;
  std::function<void()> update;
  mt::Tensor operator()(const mt::Tensor& inputs, const mt::Tensor& targets) const {
    zero_grad();
    mt::Tensor loss = forward_backward(inputs, targets);
    update();
    return loss;
  }
};

/// A training step as a function of one batch (`train`), fed by `next_batch`: traced on every
/// call, or through mt::compile as a user who wants to skip the tracing writes it.
template <typename Train, typename NextBatch>
Workload make_workload(Train train, NextBatch next_batch, StepMode mode, mt::json::Value facts) {
  if constexpr (std::is_same_v<Train, SplitStep>) {
    if (mode.micro_batches > 1) {
      // Gradient accumulation: zero_grad and the update outside, after the last micro-batch.
      facts["micro_batches"] = mode.micro_batches;
      using ForwardBackward = decltype(train.forward_backward);
      std::shared_ptr<mt::Compiled<ForwardBackward>> step;
      std::function<mt::CompileStats()> stats;
      if (mode.kind == StepMode::compiled_model) {
        step = std::make_shared<mt::Compiled<ForwardBackward>>(train.forward_backward);
        stats = [step] { return step->stats(); };
      }
      return {[step, train, next_batch, micro = mode.micro_batches]() mutable {
                mt::Tensor loss;
                for (int m = 0; m < micro; ++m) {
                  auto [inputs, targets] = next_batch();
                  loss = step ? (*step)(inputs, targets) : train.forward_backward(inputs, targets);
                }
                train.update();
                train.zero_grad();
                return loss;
              },
              std::move(facts), std::move(stats)};
    }
    if (mode.kind == StepMode::compiled_model) {
      auto pass = [zero_grad = train.zero_grad, forward_backward = train.forward_backward](
                      const mt::Tensor& inputs, const mt::Tensor& targets) {
        zero_grad();
        return forward_backward(inputs, targets);
      };
      auto step = std::make_shared<mt::Compiled<decltype(pass)>>(pass);
      return {[step, update = train.update, next_batch]() mutable {
                auto [inputs, targets] = next_batch();
                mt::Tensor loss = (*step)(inputs, targets);
                update();
                return loss;
              },
              std::move(facts), [step] { return step->stats(); }};
    }
  } else if (mode.kind == StepMode::compiled_model || mode.micro_batches > 1) {
    mt::fail(
        "--step compiled-model and --accumulate: this workload's step is not split into the "
        "model's pass and the optimizer's update");
  }
  if (mode.kind == StepMode::traced)
    return {[train, next_batch]() mutable {
              auto [inputs, targets] = next_batch();
              return mt::Tensor(train(inputs, targets));
            },
            std::move(facts), nullptr};
  auto step = std::make_shared<mt::Compiled<Train>>(std::move(train));
  return {[step, next_batch]() mutable {
            auto [inputs, targets] = next_batch();
            return mt::Tensor((*step)(inputs, targets));
          },
          std::move(facts), [step] { return step->stats(); }};
}

/// Trainable values, reported so that run.py can check every system trains the same model.
inline int64_t parameter_count(const mt::Module& module) {
  int64_t count = 0;
  for (const mt::Tensor& p : module.parameters()) count += p.numel();
  return count;
}

/// Host-generated N(0, 1) data, made once, so each step reads the same constant.
inline mt::Tensor random_normal(mt::Shape shape, std::mt19937_64& rng) {
  int64_t count = 1;
  for (int64_t d : shape) count *= d;
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> values(static_cast<size_t>(count));
  for (float& v : values) v = normal(rng);
  return mt::tensor(values, std::move(shape));
}

/// The digits examples' training rows (the first 1437 of digits.csv.gz, pixels scaled to [0, 1]),
/// as examples/digits_train.h splits them.
inline std::unique_ptr<mt::TensorDataset> digits_training_set() {
  mt::Digits digits = mt::load_digits(mt::default_data_dir() + "/digits.csv.gz");
  constexpr int64_t kTrainRows = 1437;
  if (digits.count() < kTrainRows) mt::fail("digits: expected 1797 rows, found {}", digits.count());
  std::vector<float> pixels(digits.pixels.begin(), digits.pixels.begin() + kTrainRows * 64);
  for (float& p : pixels) p /= 16.0f;
  std::vector<int64_t> labels(digits.labels.begin(), digits.labels.begin() + kTrainRows);
  return std::make_unique<mt::TensorDataset>(std::move(pixels), mt::Shape{64}, std::move(labels));
}

/// A workload's training step: the optimizer's gradients zeroed, the loss
/// `loss_of(*state, inputs, targets)` under `policy`'s autocast, backward, the optimizer's step.
/// Under autocast-f16 the loss is scaled by a dynamic GradScaler, whose step and update belong to
/// the optimizer's part (outside the function with --step compiled-model, as PyTorch's AMP loop
/// with a compiled model has them).
template <typename State, typename LossOf>
SplitStep autocast_train_step(std::shared_ptr<State> state, mt::PolicyPtr policy, LossOf loss_of) {
  auto scaler = std::make_shared<mt::GradScaler>(
      mt::GradScalerOptions{.enabled = policy->name() == "autocast-f16"});
  return {[state] { state->optimizer->zero_grad(); },
          [state, policy, loss_of, scaler](const mt::Tensor& inputs, const mt::Tensor& targets) {
            mt::Tensor loss;
            {
              mt::autocast guard(policy);
              loss = loss_of(*state, inputs, targets);
            }
            scaler->scale(loss).backward();
            return loss;
          },
          [state, scaler] {
            scaler->step(*state->optimizer);
            scaler->update();
          }};
}

/// The MLP workload (bench_training, bench_gpu_training): 32 -> width x4 hidden (ReLU) -> 16,
/// MSE, Adam 1e-3, on one batch of random inputs and targets made once and reused every step.
inline Workload mlp_workload(int64_t width, int64_t batch, const mt::PolicyPtr& policy,
                             StepMode mode) {
  struct State {
    mt::Generator gen{kSeed};
    std::unique_ptr<mt::MLP> net;
    std::unique_ptr<mt::Adam> optimizer;
    mt::Tensor inputs, targets;
  };
  auto state = std::make_shared<State>();
  state->net = std::make_unique<mt::MLP>(std::vector<int64_t>{32, width, width, width, width, 16},
                                         mt::Activation::Relu, &state->gen);
  state->optimizer =
      std::make_unique<mt::Adam>(state->net->parameters(), mt::AdamOptions{.lr = 1e-3});
  std::mt19937_64 rng(kSeed);
  state->inputs = random_normal({batch, 32}, rng);
  state->targets = random_normal({batch, 16}, rng);
  auto train = autocast_train_step(
      state, policy, [](auto& s, const mt::Tensor& inputs, const mt::Tensor& targets) {
        return mt::mse_loss((*s.net)(inputs), targets);
      });
  auto next_batch = [state] { return std::pair(state->inputs, state->targets); };
  return make_workload(train, next_batch, mode,
                       {{"width", width},
                        {"batch", batch},
                        {"hidden_layers", 4},
                        {"parameters", parameter_count(*state->net)}});
}

/// Times `workload` (measure_queued with `wait`: mt::synchronize by default) and returns its
/// record: what ran, the timing, the back end's counters for setup and warm-up and per timed step,
/// mt::compile's counters under --step compiled, and the loss of one more (untimed) step after the
/// windows. Call mt::reset_execution_stats() before making the workload so that its setup is
/// counted.
inline mt::json::Value measure_workload(Workload& workload, const std::string& name,
                                        const std::string& precision, const CommandLine& line,
                                        const std::function<void()>& wait = mt::synchronize) {
  // Setup and warm-up (tracing, compiling, first runs) apart from the timed windows, whose
  // counters are reported per step.
  mt::ExecutionStats warmup_stats;
  auto after_warmup = [&] {
    warmup_stats = mt::execution_stats();
    mt::reset_execution_stats();
  };
  mt::json::Value result =
      measure_queued([&] { workload.step(); }, wait, line.timing, after_warmup);
  mt::ExecutionStats timed_stats = mt::execution_stats();
  int64_t timed_steps =
      result.at("steps_per_window").get<int64_t>() * result.at("windows").get<int64_t>();
  mt::json::Value record{{"system", "mixtape"},    {"workload", name},
                         {"precision", precision}, {"backend", backend()},
                         {"step", line.step},      {"async", mt::async_evaluation()}};
  append(record, workload.facts);
  append(record, result);
  record.emplace("setup_and_warmup_stats", stats_json(warmup_stats));
  mt::json::Value per_step = stats_json(timed_stats, timed_steps);
  const mt::CollectiveStats collectives = mt::collective_stats();
  if (collectives.calls > 0) {  // data parallel: the all_reduce steps and their wall time
    const double n = static_cast<double>(std::max<int64_t>(1, timed_steps));
    per_step.update(
        {{"collectives", static_cast<double>(collectives.calls) / n},
         {"collective_bytes", static_cast<double>(collectives.bytes) / n},
         {"collective_seconds", collectives.seconds / n},
         {"collective_waited_seconds", collectives.waited_seconds / n},
         {"steps_beside_collectives", static_cast<double>(collectives.steps_beside) / n}});
  }
  record.emplace("per_step_stats", std::move(per_step));
  if (workload.compile_stats) {
    mt::CompileStats c = workload.compile_stats();
    record.emplace("compile", mt::json::Value{{"calls", c.calls},
                                              {"traces", c.traces},
                                              {"replays", c.replays},
                                              {"plans", c.plans},
                                              {"reason", c.reason}});
  }
  // JSON has no NaN: a diverged run says so in text.
  double loss = workload.step().item();
  record.emplace("final_loss", std::isfinite(loss) ? mt::json::Value(loss)
                                                   : mt::json::Value(std::to_string(loss)));
  return record;
}

}  // namespace bench

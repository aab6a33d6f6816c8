// bench/trace_phases.cpp -- bench_trace_phases: where the host time of a traced training step goes
// (graph building, autograd, the precision pass, signing, program lookup, running, teardown), in
// us per step, beside the same step through mt::compile; one JSON line per workload and precision.
#include <mixtape/dsl/error.h>
#include <mixtape/mixtape.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "bench/timing.h"
#include "examples/digits_model.h"
#include "mixtape/dsl/json.h"

namespace mt = mixtape;

namespace {

constexpr const char* kUsage =
    "usage: bench_trace_phases [--workloads digits_mlp,digits_cnn,mlp_w64_b256] [--precisions "
    "fp32,bf16]\n"
    "                          [--steps N] [--rounds N]\n"
    "  Runs N traced steps per round and as many through mt::compile, alternating, and prints\n"
    "  per workload and precision the best round's us per step of each phase (JSON lines).\n"
    "  Phases of a traced step: batch (the next inputs, outside the step), zero_grad, forward\n"
    "  (the model and loss under autocast), backward, optimizer (building the update graph),\n"
    "  pending, precision, sign, lookup, run (runtime/device.h's ExecutionStats), teardown\n"
    "  (dropping the step's graph), and wait (for work still queued at the round's end, under\n"
    "  MIXTAPE_ASYNC=1, where run is only the queuing and the other phases include waits for\n"
    "  the stream).\n";

using Clock = std::chrono::steady_clock;

/// One training setup: a model, its optimizer and its batches; the step is split into the calls
/// the phases time.
struct Setup {
  std::function<std::pair<mt::Tensor, mt::Tensor>()> next_batch;
  std::function<mt::Tensor(const mt::Tensor&, const mt::Tensor&)> loss;  // forward and loss
  std::unique_ptr<mt::Optimizer> optimizer;
  std::shared_ptr<void> keep;  // the model and data the functions use
};

Setup mlp_setup(int64_t width, int64_t batch, const mt::PolicyPtr& policy) {
  struct State {
    mt::Generator gen{bench::kSeed};
    std::unique_ptr<mt::MLP> net;
    mt::Tensor inputs, targets;
  };
  auto state = std::make_shared<State>();
  state->net = std::make_unique<mt::MLP>(std::vector<int64_t>{32, width, width, width, width, 16},
                                         mt::Activation::Relu, &state->gen);
  std::mt19937_64 rng(bench::kSeed);
  state->inputs = bench::random_normal({batch, 32}, rng);
  state->targets = bench::random_normal({batch, 16}, rng);
  Setup setup;
  setup.next_batch = [state] { return std::pair(state->inputs, state->targets); };
  setup.loss = [state, policy](const mt::Tensor& x, const mt::Tensor& y) {
    mt::autocast guard(policy);
    return mt::mse_loss((*state->net)(x), y);
  };
  setup.optimizer =
      std::make_unique<mt::Adam>(state->net->parameters(), mt::AdamOptions{.lr = 1e-3});
  setup.keep = state;
  return setup;
}

/// bench_training's digits_mlp and digits_cnn: examples/digits_mlp.cpp's and digits_cnn.cpp's
/// models and defaults (batch 64, SGD momentum 0.9 at `lr`, label smoothing 0.2, N(0, 0.2) input
/// noise drawn outside the step; digits_cnn's random shifts left out).
template <typename Model>
Setup digits_setup(const mt::PolicyPtr& policy, double lr) {
  struct State {
    mt::Generator noise{bench::kSeed};
    Model net;
    std::unique_ptr<mt::TensorDataset> train;
    std::unique_ptr<mt::DataLoader> loader;
  };
  auto state = std::make_shared<State>();
  constexpr int64_t kBatch = 64;
  state->train = bench::digits_training_set();
  state->loader = std::make_unique<mt::DataLoader>(*state->train, kBatch, true, bench::kSeed);
  Setup setup;
  setup.next_batch = [state] {
    mt::Batch batch = state->loader->next();
    mt::Tensor noise = mt::randn(batch.inputs.shape(), mt::f32, &state->noise, 0, 0.2);
    return std::pair(batch.inputs + noise, batch.targets);
  };
  setup.loss = [state, policy](const mt::Tensor& x, const mt::Tensor& y) {
    mt::autocast guard(policy);
    return mt::cross_entropy(state->net(x), y, mt::CrossEntropyOptions{.label_smoothing = 0.2});
  };
  setup.optimizer =
      std::make_unique<mt::SGD>(state->net.parameters(), mt::SGDOptions{.lr = lr, .momentum = 0.9});
  setup.keep = state;
  return setup;
}

Setup make_setup(const std::string& name, const mt::PolicyPtr& policy) {
  if (name == "digits_mlp") return digits_setup<DigitsMLP>(policy, 0.05);
  if (name == "digits_cnn") return digits_setup<DigitsCnn>(policy, 0.1);
  int64_t width = 0, batch = 0;
  if (std::sscanf(name.c_str(), "mlp_w%ld_b%ld", &width, &batch) == 2 && width > 0 && batch > 0)
    return mlp_setup(width, batch, policy);
  mt::fail("bench_trace_phases: unknown workload '{}'", name);
}

double since(Clock::time_point& last) {
  Clock::time_point now = Clock::now();
  double seconds = std::chrono::duration<double>(now - last).count();
  last = now;
  return seconds;
}

using Phases = std::map<std::string, double>;  // seconds per phase, summed over a round

// The id the next node made on this thread gets (ids are consecutive within a thread's block),
// through a node made for the purpose: counts the nodes a phase makes.
uint64_t next_node_id() {
  mt::NoGradGuard no_grad;
  return mt::zeros({}).node()->id + 1;
}

/// The nodes one traced step of `setup` makes, by phase.
mt::json::Value nodes_made(Setup& setup) {
  auto [inputs, targets] = setup.next_batch();
  uint64_t start = next_node_id();
  setup.optimizer->zero_grad();
  mt::Tensor loss = setup.loss(inputs, targets);
  uint64_t forward = next_node_id();
  loss.backward();
  uint64_t backward = next_node_id();
  setup.optimizer->step();
  uint64_t optimizer = next_node_id();
  return {{"forward", forward - start - 1},
          {"backward", backward - forward - 1},
          {"optimizer", optimizer - backward - 1}};
}

/// `steps` traced steps of `setup`, phase by phase.
Phases traced_round(Setup& setup, int steps) {
  Phases phases;
  mt::reset_execution_stats();
  for (int i = 0; i < steps; ++i) {
    Clock::time_point last = Clock::now();
    auto [inputs, targets] = setup.next_batch();
    phases["batch"] += since(last);
    setup.optimizer->zero_grad();
    phases["zero_grad"] += since(last);
    mt::Tensor loss = setup.loss(inputs, targets);
    phases["forward"] += since(last);
    loss.backward();
    phases["backward"] += since(last);
    setup.optimizer->step();  // its evaluation's phases are counted by the back end
    phases["step"] += since(last);
    loss = mt::Tensor();
    inputs = targets = mt::Tensor();
    phases["teardown"] += since(last);
  }
  Clock::time_point last = Clock::now();
  mt::synchronize();
  phases["wait"] = since(last);
  mt::ExecutionStats stats = mt::execution_stats();
  phases["pending"] = stats.pending_seconds;
  phases["precision"] = stats.precision_seconds;
  phases["sign"] = stats.sign_seconds;
  phases["lookup"] = stats.lookup_seconds;
  phases["run"] = stats.run_seconds;
  phases["optimizer"] = phases["step"] - stats.pending_seconds - stats.precision_seconds -
                        stats.sign_seconds - stats.lookup_seconds - stats.run_seconds;
  phases.erase("step");
  return phases;
}

/// `steps` steps of `setup` through mt::compile: the batch apart, the step whole.
Phases compiled_round(Setup& setup,
                      mt::Compiled<std::function<mt::Tensor(mt::Tensor, mt::Tensor)>>& step,
                      int steps) {
  Phases phases;
  for (int i = 0; i < steps; ++i) {
    Clock::time_point last = Clock::now();
    auto [inputs, targets] = setup.next_batch();
    phases["batch"] += since(last);
    step(inputs, targets);
    phases["step"] += since(last);
  }
  Clock::time_point last = Clock::now();
  mt::synchronize();
  phases["step"] += since(last);
  return phases;
}

double total(const Phases& phases) {
  double sum = 0;
  for (const auto& [name, seconds] : phases) sum += seconds;
  return sum;
}

/// Each phase's best round, in us per step.
mt::json::Value best_us(const std::vector<Phases>& rounds, int steps) {
  mt::json::Value out = mt::json::Value::object();
  for (const auto& [name, ignored] : rounds.front()) {
    double best = 1e30;
    for (const Phases& round : rounds) best = std::min(best, round.at(name));
    out[name] = std::round(best * 1e7 / steps) / 10;
  }
  return out;
}

mt::json::Value measure(const std::string& name, const std::string& precision, int steps,
                        int rounds) {
  mt::PolicyPtr policy = bench::precision_policy(precision);
  Setup traced = make_setup(name, policy);
  Setup compiled = make_setup(name, policy);
  std::function<mt::Tensor(mt::Tensor, mt::Tensor)> train = [&compiled](mt::Tensor x,
                                                                        mt::Tensor y) {
    compiled.optimizer->zero_grad();
    mt::Tensor loss = compiled.loss(x, y);
    loss.backward();
    compiled.optimizer->step();
    return loss;
  };
  mt::Compiled<std::function<mt::Tensor(mt::Tensor, mt::Tensor)>> step(train);
  traced_round(traced, 5);  // compiles the kernels
  compiled_round(compiled, step, 5);
  std::vector<Phases> traced_rounds, compiled_rounds;
  std::vector<double> traced_totals, compiled_totals;
  for (int r = 0; r < rounds; ++r) {
    traced_rounds.push_back(traced_round(traced, steps));
    compiled_rounds.push_back(compiled_round(compiled, step, steps));
    traced_totals.push_back(total(traced_rounds.back()) - traced_rounds.back().at("batch"));
    compiled_totals.push_back(compiled_rounds.back().at("step"));
  }
  const double traced_us = bench::median(traced_totals) * 1e6 / steps;
  const double compiled_us = bench::median(compiled_totals) * 1e6 / steps;
  mt::json::Value phases = best_us(traced_rounds, steps);
  double host_us = 0;  // what mt::compile skips: every phase but the batch and the run
  for (const auto& [phase, us] : phases.items())
    if (phase != "batch" && phase != "run" && phase != "wait") host_us += us.get<double>();
  return {{"workload", name},
          {"precision", precision},
          {"steps_per_round", steps},
          {"rounds", rounds},
          {"traced_phases_us", phases},
          {"nodes_made", nodes_made(traced)},
          {"traced_host_us", std::round(host_us * 10) / 10},
          {"traced_step_us", std::round(traced_us * 10) / 10},
          {"compiled_step_us", std::round(compiled_us * 10) / 10},
          {"traced_over_compiled", std::round(traced_us / compiled_us * 1000) / 1000},
          {"note",
           "phases and host (their sum but batch, run and wait): best round each; step totals: "
           "median round, without the batch (outside the step in both)"},
          {"async", mt::async_evaluation()}};
}

}  // namespace

int main(int argc, char** argv) {
  try {
    std::vector<std::string> workloads{"digits_mlp", "mlp_w64_b256"}, precisions{"fp32", "bf16"};
    int steps = 500, rounds = 5;
    for (int i = 1; i < argc; ++i) {
      std::string flag = argv[i];
      if (flag == "--help") {
        std::fputs(kUsage, stdout);
        return 0;
      }
      if (i + 1 >= argc) mt::fail("bench_trace_phases: {} needs a value\n{}", flag, kUsage);
      std::string value = argv[++i];
      if (flag == "--workloads")
        workloads = bench::split_list(value);
      else if (flag == "--precisions")
        precisions = bench::split_list(value);
      else if (flag == "--steps")
        steps = std::max(1, std::stoi(value));
      else if (flag == "--rounds")
        rounds = std::max(1, std::stoi(value));
      else
        mt::fail("bench_trace_phases: unknown flag {}\n{}", flag, kUsage);
    }
    for (const std::string& workload : workloads)
      for (const std::string& precision : precisions)
        bench::emit(measure(workload, precision, steps, rounds));
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_trace_phases: error: %s\n", e.what());
    return 1;
  }
}

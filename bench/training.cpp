// bench/training.cpp -- bench_training: mixtape training steps/s for the MLP, digits, char-GPT
// and vision (ResNet-18, digits CNN) workloads, one JSON line per workload and precision (run.py
// compares them with the peers).
#include <mixtape/dsl/error.h>
#include <mixtape/mixtape.h>

#include <chrono>
#include <cstdio>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "bench/gpt_step.h"
#include "bench/resnet_step.h"
#include "bench/timing.h"
#include "examples/char_gpt_model.h"
#include "examples/digits_model.h"
#include "examples/digits_train.h"
#include "mixtape/dsl/process_group.h"
#include "mixtape/jit/llvm_jit.h"

namespace mt = mixtape;

namespace {

constexpr const char* kUsage =
    "usage: bench_training --workloads LIST [--precisions fp32,bf16,fp16] [--warmup N]\n"
    "                      [--windows N] [--window-seconds S] [--budget-seconds S]\n"
    "                      [--step traced|compiled|compiled-model] [--accumulate N]\n"
    "  workloads: mlp_w<W>_b<B> (32 -> W x4 hidden -> 16, ReLU, MSE, Adam 1e-3), digits_mlp\n"
    "             (examples/digits_mlp's model and loop), digits_demo (the README's demo: the\n"
    "             same at batch 256 with AdamW), char_gpt (CharGpt 4x4x128, context 64,\n"
    "             batch 12, AdamW, clipping at 1), resnet18 (examples/resnet_model.h, 10\n"
    "             classes, synthetic [64, 3, 32, 32] batch, SGD momentum 0.9;\n"
    "             resnet18_b<B>_s<S> sets batch and image size), digits_cnn\n"
    "             (examples/digits_cnn's model and step)\n"
    "  --step compiled runs each step through mt::compile (traced once, then replayed); traced\n"
    "  (the default) builds the graph every step, as the plain training loop does;\n"
    "  compiled-model compiles the forward and backward pass and runs the optimizer's update\n"
    "  outside (mlp_w<W>_b<B>, digits_mlp, digits_demo, resnet18), as torch.compile users do.\n"
    "  --accumulate N (traced or compiled-model, the same workloads): each step adds up the\n"
    "  gradients of N micro-batches, then updates and zeroes them outside the compiled pass.\n"
    "  Under mpirun -np N, digits_mlp, digits_demo and char_gpt train data parallel\n"
    "  (dist::DataParallel, each process its shard at the batch above); rank 0 prints.\n"
    "  Precisions: fp32, bf16 (autocast-bf16) and fp16 (autocast-f16 with a dynamic GradScaler\n"
    "  in the mlp and digits workloads, stepped and updated with the optimizer).\n"
    "  The back end is chosen by the environment: MIXTAPE_DEVICE=cpu|reference, MIXTAPE_EAGER=1.\n";

using bench::kSeed;
using bench::make_workload;
using bench::mlp_workload;
using bench::parameter_count;
using bench::StepMode;
using bench::Workload;

/// dist::DataParallel over `net` when mpirun started several processes (rank 0's weights, the
/// gradients averaged in every step's graph); none in one process.
std::unique_ptr<mt::dist::DataParallel> data_parallel(mt::Module& net) {
  if (mt::dist::world_size() == 1) return nullptr;
  return std::make_unique<mt::dist::DataParallel>(net);
}

/// Rank 0's `seconds` on every process, so that every process times the same steps.
double rank0_seconds(double seconds) {
  mt::process_group()->broadcast(reinterpret_cast<std::byte*>(&seconds), sizeof seconds, 0);
  return seconds;
}

/// Each process's all_reduce wall time and CPU time per timed step (from `record`, this
/// process's), on rank 0: the process that waits least in all_reduce shows what the transfer
/// itself costs, the others add their wait for the slowest.
mt::json::Value by_rank(const mt::json::Value& record) {
  mt::ProcessGroup& group = *mt::process_group();
  const int n = group.size();
  const mt::json::Value& stats = record.at("per_step_stats");
  double mine[2] = {stats.value("collective_seconds", 0.0),
                    record.at("cpu_us_per_step").get<double>()};
  std::vector<double> all(2 * static_cast<size_t>(n));
  std::vector<int64_t> counts(n, sizeof mine), at(n);
  for (int q = 0; q < n; ++q) at[q] = q * static_cast<int64_t>(sizeof mine);
  group.all_gather(reinterpret_cast<const std::byte*>(mine), sizeof mine,
                   reinterpret_cast<std::byte*>(all.data()), counts, at);
  mt::json::Value ranks = mt::json::Value::array();
  for (int q = 0; q < n; ++q)
    ranks.push_back({{"rank", q},
                     {"collective_seconds_per_step", all[2 * q]},
                     {"cpu_us_per_step", all[2 * q + 1]}});
  return ranks;
}

/// The digits loop's batch and optimizer: examples/digits_mlp.cpp's defaults (digits_mlp: SGD
/// momentum 0.9 at 0.05, batch 64), or the README's demo (digits_demo: `--batch 256 --optimizer
/// adamw`, AdamW 2e-3 with weight decay 0.01).
struct DigitsLoop {
  int64_t batch;
  bool adamw;
};

/// examples/digits_mlp.cpp's model and training step (label smoothing 0.2, input noise 0.2,
/// shuffled loader), with `loop`'s batch and optimizer.
Workload digits_workload(const mt::PolicyPtr& policy, StepMode mode, DigitsLoop loop) {
  struct State {
    mt::Generator gen{kSeed}, noise{kSeed ^ 0x6e6f697365ULL};
    std::unique_ptr<mt::MLP> net;
    std::unique_ptr<mt::dist::DataParallel> data_parallel;  // under mpirun
    std::unique_ptr<mt::Optimizer> optimizer;
    std::unique_ptr<mt::TensorDataset> train;
    std::unique_ptr<mt::DataLoader> loader;
  };
  auto state = std::make_shared<State>();
  state->train = bench::digits_training_set();
  state->loader =
      std::make_unique<mt::DataLoader>(*state->train, loop.batch, true, kSeed, mt::dist::shard());
  state->net = std::make_unique<mt::MLP>(std::vector<int64_t>{64, 128, 128, 10},
                                         mt::Activation::Relu, &state->gen);
  state->data_parallel = data_parallel(*state->net);
  if (loop.adamw)
    state->optimizer = std::make_unique<mt::AdamW>(
        state->net->parameters(), mt::AdamOptions{.lr = 2e-3, .weight_decay = 0.01});
  else
    state->optimizer = std::make_unique<mt::SGD>(state->net->parameters(),
                                                 mt::SGDOptions{.lr = 0.05, .momentum = 0.9});
  auto train = bench::autocast_train_step(
      state, policy, [](auto& s, const mt::Tensor& inputs, const mt::Tensor& targets) {
        return mt::cross_entropy((*s.net)(inputs), targets,
                                 mt::CrossEntropyOptions{.label_smoothing = 0.2});
      });
  // The input noise is drawn outside the step, so that a compiled step replays.
  auto next_batch = [state] {
    mt::Batch batch = state->loader->next();
    mt::Tensor noise = mt::randn(batch.inputs.shape(), mt::f32, &state->noise, 0, 0.2);
    return std::pair(batch.inputs + noise, batch.targets);
  };
  return make_workload(train, next_batch, mode,
                       {{"batch", loop.batch},
                        {"optimizer", loop.adamw ? "adamw" : "sgd"},
                        {"hidden", 128},
                        {"parameters", parameter_count(*state->net)}});
}

/// CharGpt (examples/char_gpt_model.h) on fortunes.txt with nanoGPT's CPU settings: 4 layers,
/// 4 heads, width 128, context 64, batch 12, AdamW 1e-3 (beta2 0.99, weight decay 0.1) and
/// gradient clipping at 1. One optimizer over all parameters: the peers do the same.
Workload gpt_workload(const mt::PolicyPtr& policy, StepMode mode) {
  struct State {
    mt::Generator gen{kSeed};
    std::unique_ptr<CharGpt> model;
    std::unique_ptr<mt::dist::DataParallel> data_parallel;  // under mpirun
    std::unique_ptr<mt::AdamW> optimizer;
    std::unique_ptr<mt::TextWindows> windows;
    std::unique_ptr<mt::DataLoader> loader;
  };
  auto state = std::make_shared<State>();
  std::string text = mt::read_file(mt::default_data_dir() + "/fortunes.txt");
  mt::CharVocab vocab(text);
  GptConfig config{.vocab = vocab.size(), .layers = 4, .heads = 4, .width = 128, .context = 64};
  constexpr int64_t kBatch = 12;
  state->windows = std::make_unique<mt::TextWindows>(vocab.encode(text), config.context);
  state->loader =
      std::make_unique<mt::DataLoader>(*state->windows, kBatch, true, kSeed, mt::dist::shard());
  state->model = std::make_unique<CharGpt>(config, &state->gen);
  state->data_parallel = data_parallel(*state->model);
  state->optimizer = std::make_unique<mt::AdamW>(
      state->model->parameters(), mt::AdamOptions{.lr = 1e-3, .beta2 = 0.99, .weight_decay = 0.1});
  auto train = bench::gpt_train_step(state, policy);
  auto next_batch = [state] {
    mt::Batch batch = state->loader->next();
    return std::pair(batch.inputs, batch.targets);
  };
  return make_workload(train, next_batch, mode,
                       {{"batch", kBatch},
                        {"context", config.context},
                        {"layers", config.layers},
                        {"heads", config.heads},
                        {"width", config.width},
                        {"vocab", config.vocab},
                        {"parameters", parameter_count(*state->model)}});
}

/// examples/digits_cnn.cpp's model (DigitsCnn) and loop with its defaults
/// (examples/digits_train.h): batch 64 from a shuffled loader over the first 1437 digits, shifts of
/// up to a pixel and N(0, 0.2) noise drawn outside the step, SGD lr 0.1 momentum 0.9 on a cosine
/// schedule over 2500 steps (set outside the step; it repeats every 2500 steps here), cross-entropy
/// with label smoothing 0.2, and the example's GradScaler (disabled: the example's --loss-scale
/// none).
Workload digits_cnn_workload(const mt::PolicyPtr& policy, StepMode mode) {
  constexpr int64_t kBatch = 64, kSteps = 2500;
  constexpr double kLr = 0.1;
  struct State {
    mt::Generator noise{kSeed ^ 0x6e6f697365ULL};
    std::mt19937_64 shift{kSeed ^ 0x7368696674ULL};
    std::unique_ptr<DigitsCnn> net;
    std::unique_ptr<mt::SGD> optimizer;
    mt::GradScaler scaler{mt::GradScalerOptions{.enabled = false}};
    mt::CosineWithWarmup cosine{kLr, 0, kSteps};
    int64_t step = 0;
    std::unique_ptr<mt::TensorDataset> train;
    std::unique_ptr<mt::DataLoader> loader;
  };
  auto state = std::make_shared<State>();
  mt::Digits digits = mt::load_digits(mt::default_data_dir() + "/digits.csv.gz");
  if (digits.count() != 1797) mt::fail("digits: expected 1797 rows, found {}", digits.count());
  state->train = std::make_unique<mt::TensorDataset>(digits::split(digits, 0, 1437));
  state->loader = std::make_unique<mt::DataLoader>(*state->train, kBatch, true, kSeed);
  mt::manual_seed(kSeed);  // DigitsCnn's initial weights come from it, as in the example
  state->net = std::make_unique<DigitsCnn>();
  state->optimizer = std::make_unique<mt::SGD>(state->net->parameters(),
                                               mt::SGDOptions{.lr = kLr, .momentum = 0.9});
  auto train = [state, policy](const mt::Tensor& x, const mt::Tensor& y) {
    state->optimizer->zero_grad();
    mt::Tensor loss;
    {
      mt::autocast guard(policy);
      loss =
          mt::cross_entropy((*state->net)(x), y, mt::CrossEntropyOptions{.label_smoothing = 0.2});
    }
    state->scaler.scale(loss).backward();
    state->scaler.step(*state->optimizer);
    state->scaler.update();
    return loss;
  };
  auto next_batch = [state] {
    mt::Batch batch = state->loader->next();
    state->optimizer->set_lr(state->cosine.lr(state->step++ % kSteps));
    mt::Tensor inputs = digits::shifted(batch.inputs, 1, state->shift);
    inputs = inputs + mt::randn(inputs.shape(), mt::f32, &state->noise, 0, 0.2);
    return std::pair(inputs, batch.targets);
  };
  return make_workload(
      train, next_batch, mode,
      {{"batch", kBatch}, {"optimizer", "sgd"}, {"parameters", parameter_count(*state->net)}});
}

Workload workload_by_name(const std::string& name, const mt::PolicyPtr& policy, StepMode mode) {
  long long width = 0, batch = 0;
  int consumed = 0;
  if (std::sscanf(name.c_str(), "mlp_w%lld_b%lld%n", &width, &batch, &consumed) == 2 &&
      static_cast<size_t>(consumed) == name.size() && width > 0 && batch > 0)
    return mlp_workload(width, batch, policy, mode);
  if (name == "digits_mlp") return digits_workload(policy, mode, {.batch = 64, .adamw = false});
  if (name == "digits_demo") return digits_workload(policy, mode, {.batch = 256, .adamw = true});
  if (name == "char_gpt") return gpt_workload(policy, mode);
  int64_t images = 0, size = 0;  // 10 classes, by default batch 64 of 3x32x32 images
  if (bench::parse_resnet_name(name, "resnet18", 64, 32, images, size))
    return bench::resnet_workload<ResNet18>(images, 10, size, policy, mode);
  if (name == "digits_cnn") return digits_cnn_workload(policy, mode);
  mt::fail(
      "bench_training: unknown workload '{}' (mlp_w<W>_b<B>, digits_mlp, digits_demo, char_gpt, "
      "resnet18, resnet18_b<B>_s<S>, digits_cnn)",
      name);
}

/// The LLVM JIT's work between two snapshots (the workload's whole run, the setup's and first
/// steps' compiles with the tier-ups that follow): the cold JIT's CPU cost, which on a loaded
/// machine its wall time overstates.
mt::json::Value jit_json(const mt::LlvmJit::Stats& before, const mt::LlvmJit::Stats& after) {
  return {{"kernels_compiled", after.compiled - before.compiled},
          {"fast_compiled", after.fast_compiled - before.fast_compiled},
          {"tiered_up", after.tiered_up - before.tiered_up},
          {"compile_seconds", after.compile_seconds - before.compile_seconds},
          {"compile_cpu_seconds", after.compile_cpu_seconds - before.compile_cpu_seconds},
          {"tier_up_cpu_seconds", after.tier_up_cpu_seconds - before.tier_up_cpu_seconds}};
}

}  // namespace

int main(int argc, char** argv) {
  bench::CommandLine line = bench::parse_command_line(argc, argv, "bench_training", kUsage);
  try {
    const mt::dist::World world = mt::dist::init();
    if (world.size > 1) line.timing.agree = rank0_seconds;
    for (const std::string& name : line.workloads) {
      for (const std::string& precision : line.precisions) {
        mt::PolicyPtr policy = bench::precision_policy(precision);
        mt::reset_execution_stats();
        const mt::LlvmJit::Stats jit_before = mt::LlvmJit::instance().stats();
        auto setup_start = std::chrono::steady_clock::now();
        double setup_cpu_start = bench::process_cpu_seconds();
        Workload workload = workload_by_name(name, policy, bench::step_mode(line));
        mt::json::Value setup{{"setup_s", bench::seconds_since(setup_start)},
                              {"setup_cpu_s", bench::process_cpu_seconds() - setup_cpu_start}};
        mt::json::Value record = bench::measure_workload(workload, name, precision, line);
        bench::append(record, setup);
        record.emplace("jit", jit_json(jit_before, mt::LlvmJit::instance().stats()));
        record.emplace("world_size", world.size);
        if (world.size > 1) record.emplace("by_rank", by_rank(record));
        if (world.rank == 0) bench::emit(record);
      }
    }
  } catch (const mt::Error& e) {
    std::fprintf(stderr, "bench_training: error: %s\n", e.what());
    return 1;
  }
  return 0;
}

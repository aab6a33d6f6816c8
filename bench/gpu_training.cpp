// bench/gpu_training.cpp -- bench_gpu_training: training steps/s on the GPU (MIXTAPE_DEVICE=cuda's
// back end) for the MLP, a GPT-2-small-shaped model and ResNet-50, traced or mt::compile'd, one
// JSON line each.
#include <mixtape/mixtape.h>

#include <cstdio>
#include <cstdlib>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "bench/gpt_step.h"
#include "bench/resnet_step.h"
#include "bench/timing.h"
#include "examples/char_gpt_model.h"
#include "mixtape/dsl/error.h"
#include "mixtape/runtime/cuda_executor.h"

namespace mt = mixtape;

namespace {

constexpr const char* kUsage =
    "usage: bench_gpu_training --workloads LIST [--precisions fp32,bf16] [--warmup N]\n"
    "                          [--windows N] [--window-seconds S] [--budget-seconds S]\n"
    "                          [--step traced|compiled]\n"
    "  workloads: mlp_w<W>_b<B> (32 -> W x4 hidden -> 16, ReLU, MSE, Adam 1e-3; the GPU runs use\n"
    "             B = 65536), gpt2_small (GPT-2 small: 12 layers, 12 heads, width 768, context\n"
    "             1024, vocab 50257, batch 8, random tokens, AdamW 3e-4 and clipping at 1);\n"
    "             gpt2_l<L>_t<T>_b<B> overrides layers, context and batch (each part optional,\n"
    "             e.g. gpt2_l2_t64_b2); resnet50 (torchvision's ResNet-50, 1000 classes, batch\n"
    "             128 of 3x224x224 images, one synthetic batch, cross-entropy, SGD 0.01 momentum\n"
    "             0.9, batch norm in training mode); resnet50_b<B>_s<S> overrides batch and image\n"
    "             size (each part optional)\n"
    "  --step compiled runs each step through mt::compile (traced twice, then replayed); traced\n"
    "  (the default) builds the graph every step, as the plain training loop does.\n"
    "  Steps are queued on the GPU; the clock of each window stops after the GPU has finished.\n"
    "  Runs on the GPU (a {\"skipped\": reason} line without one) unless MIXTAPE_DEVICE is set:\n"
    "  MIXTAPE_DEVICE=cpu runs the same workloads on the CPU back end (a smoke test).\n";

/// The sizes a gpt2 workload name may override; the defaults are GPT-2 small's.
struct Gpt2Shape {
  int64_t layers = 12, context = 1024, batch = 8;
};

constexpr int64_t kGpt2Vocab = 50257, kGpt2Heads = 12, kGpt2Width = 768;
constexpr int kTokenBatches = 4;

/// GPT-2 small's shape (CharGpt: pre-norm blocks, 4x GELU(tanh) MLP, untied head with bias) on
/// uniformly random tokens, each row's targets its inputs shifted by one; nanoGPT's GPT-2
/// optimizer settings (AdamW lr 3e-4, betas 0.9/0.95, weight decay 0.1 on every parameter) and
/// gradient clipping at 1. Model FLOPs per token as nanoGPT and PaLM count them: 6 per weight
/// that multiplies (every parameter but the two embedding tables, whose lookups multiply nothing)
/// plus 12 * layers * context * width for the attention scores and their weighted sums.
bench::Workload gpt2_workload(const Gpt2Shape& shape, const mt::PolicyPtr& policy,
                              bench::StepMode mode) {
  struct State {
    mt::Generator gen{bench::kSeed};
    std::unique_ptr<CharGpt> model;
    std::unique_ptr<mt::AdamW> optimizer;
    std::vector<std::pair<mt::Tensor, mt::Tensor>> batches;
    size_t next = 0;
  };
  auto state = std::make_shared<State>();
  GptConfig config{.vocab = kGpt2Vocab,
                   .layers = shape.layers,
                   .heads = kGpt2Heads,
                   .width = kGpt2Width,
                   .context = shape.context};
  state->model = std::make_unique<CharGpt>(config, &state->gen);
  state->optimizer = std::make_unique<mt::AdamW>(
      state->model->parameters(),
      mt::AdamOptions{.lr = 3e-4, .beta1 = 0.9, .beta2 = 0.95, .weight_decay = 0.1});
  // A few distinct batches made once and cycled: drawing tokens on the host every step would
  // time the host's random numbers, and a single batch would be one constant.
  std::mt19937_64 rng(bench::kSeed);
  std::uniform_int_distribution<int64_t> token(0, kGpt2Vocab - 1);
  int64_t time = shape.context;
  for (int b = 0; b < kTokenBatches; ++b) {
    std::vector<int64_t> inputs, targets;
    for (int64_t row = 0; row < shape.batch; ++row) {
      std::vector<int64_t> stream(static_cast<size_t>(time + 1));
      for (int64_t& t : stream) t = token(rng);
      inputs.insert(inputs.end(), stream.begin(), stream.end() - 1);
      targets.insert(targets.end(), stream.begin() + 1, stream.end());
    }
    state->batches.emplace_back(mt::tensor(inputs, {shape.batch, time}),
                                mt::tensor(targets, {shape.batch, time}));
  }
  auto train = bench::gpt_train_step(state, policy);
  auto next_batch = [state] {
    std::pair<mt::Tensor, mt::Tensor> batch = state->batches[state->next];
    state->next = (state->next + 1) % state->batches.size();
    return batch;
  };
  int64_t parameters = bench::parameter_count(*state->model);
  int64_t embedding_parameters = state->model->token_embedding.weight.numel() +
                                 state->model->position_embedding.weight.numel();
  int64_t flops_per_token =
      6 * (parameters - embedding_parameters) + 12 * config.layers * config.context * config.width;
  return bench::make_workload(
      train, next_batch, mode,
      {{"batch", shape.batch},
       {"context", config.context},
       {"layers", config.layers},
       {"heads", config.heads},
       {"width", config.width},
       {"vocab", config.vocab},
       {"parameters", parameters},
       {"embedding_parameters", embedding_parameters},
       {"tokens_per_step", shape.batch * config.context},
       {"flops_per_token", flops_per_token},
       {"flops_formula",
        "flops_per_token = 6 * (parameters - embedding_parameters) + 12 * layers * context * "
        "width; model_tflops = tokens_per_s * flops_per_token / 1e12"}});
}

/// gpt2_small, or gpt2 followed by any of _l<layers>, _t<context>, _b<batch> (once each).
bool parse_gpt2_name(const std::string& name, Gpt2Shape& shape) {
  if (name == "gpt2_small") return true;
  if (name.rfind("gpt2", 0) != 0) return false;
  std::string seen;
  size_t at = 4;
  while (at < name.size()) {
    long long value = 0;
    char part = 0;
    int consumed = 0;
    if (std::sscanf(name.c_str() + at, "_%c%lld%n", &part, &value, &consumed) != 2 || value < 1 ||
        seen.find(part) != std::string::npos)
      return false;
    if (part == 'l')
      shape.layers = value;
    else if (part == 't')
      shape.context = value;
    else if (part == 'b')
      shape.batch = value;
    else
      return false;
    seen += part;
    at += static_cast<size_t>(consumed);
  }
  return true;
}

bench::Workload workload_by_name(const std::string& name, const mt::PolicyPtr& policy,
                                 bench::StepMode mode) {
  long long width = 0, batch = 0;
  int consumed = 0;
  if (std::sscanf(name.c_str(), "mlp_w%lld_b%lld%n", &width, &batch, &consumed) == 2 &&
      static_cast<size_t>(consumed) == name.size() && width > 0 && batch > 0)
    return bench::mlp_workload(width, batch, policy, mode);
  Gpt2Shape shape;
  if (parse_gpt2_name(name, shape)) return gpt2_workload(shape, policy, mode);
  int64_t images = 0, size = 0;
  if (bench::parse_resnet_name(name, "resnet50", 128, 224, images, size))
    return bench::resnet_workload<ResNet50>(images, 1000, size, policy, mode);
  mt::fail(
      "bench_gpu_training: unknown workload '{}' (mlp_w<W>_b<B>, gpt2_small, gpt2_l<L>_t<T>_b<B>, "
      "resnet50, resnet50_b<B>_s<S>)",
      name);
}

}  // namespace

int main(int argc, char** argv) {
  bench::CommandLine line = bench::parse_command_line(argc, argv, "bench_gpu_training", kUsage);
  try {
    if (!std::getenv("MIXTAPE_DEVICE")) {
      if (!mt::cuda_backend_available()) {
        bench::emit(
            {{"benchmark", "gpu_training"}, {"skipped", mt::cuda_backend_unavailable_reason()}});
        return 0;
      }
      mt::set_device(mt::Device::cuda);
    }
    for (const std::string& name : line.workloads) {
      for (const std::string& precision : line.precisions) {
        mt::PolicyPtr policy = bench::precision_policy(precision);
        mt::reset_execution_stats();
        bench::Workload workload = workload_by_name(name, policy, bench::step_mode(line));
        mt::json::Value record = {{"benchmark", "gpu_training"}};
        record.update(
            bench::measure_workload(workload, name, precision, line, mt::cuda_synchronize));
        double steps_per_s = record.at("steps_per_s").get<double>();
        record.emplace("ms_per_step", 1e3 / steps_per_s);
        if (const mt::json::Value* images = mt::json::find(record, "images_per_step"))
          record.emplace("images_per_s", steps_per_s * static_cast<double>(images->get<int64_t>()));
        if (const mt::json::Value* tokens = mt::json::find(record, "tokens_per_step")) {
          double tokens_per_s = steps_per_s * static_cast<double>(tokens->get<int64_t>());
          record.emplace("tokens_per_s", tokens_per_s);
          record.emplace("model_tflops",
                         tokens_per_s *
                             static_cast<double>(record.at("flops_per_token").get<int64_t>()) /
                             1e12);
        }
        bench::emit(record);
      }
    }
  } catch (const mt::Error& e) {
    std::fprintf(stderr, "bench_gpu_training: error: %s\n", e.what());
    return 1;
  }
  return 0;
}

// bench/memory.cpp -- bench_memory: the measured peak memory and speed of one AdamW training step
// of a GPT-2-small-shaped model under a precision policy, with or without checkpointing and with
// composite or fused attention (bench/memory.py runs it against the PyTorch peer).
#include <sys/resource.h>

#include <chrono>
#include <cstdio>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "bench/gpt_step.h"
#include "bench/timing.h"
#include "mixtape/dsl/attention.h"
#include "mixtape/dsl/error.h"

namespace {

namespace mt = mixtape;

constexpr uint64_t kSeed = 1234;
constexpr int64_t kHeads = 12, kWidth = 768;

/// A pre-norm GPT-2 block built from mixtape's layers, as TransformerBlock (no dropout) but with
/// the attention form chosen: the fused op (what CausalSelfAttention runs) or the materialized
/// composite, so that the bench can show what fused attention saves.
class Block : public mt::Module {
 public:
  Block(bool fused, mt::Generator* gen)
      : fused_(fused),
        ln1(kWidth),
        qkv(kWidth, 3 * kWidth, true, gen),
        proj(kWidth, kWidth, true, gen),
        ln2(kWidth),
        mlp({kWidth, 4 * kWidth, kWidth}, mt::Activation::GeluTanh, gen) {
    register_module("ln1", ln1);
    register_module("qkv", qkv);
    register_module("proj", proj);
    register_module("ln2", ln2);
    register_module("mlp", mlp);
  }

  mt::Tensor operator()(const mt::Tensor& x) const {
    mt::Tensor h = x + attend(ln1(x));
    return h + mlp(ln2(h));
  }

 private:
  mt::Tensor attend(const mt::Tensor& x) const {
    int64_t batch = x.size(0), time = x.size(1), head_dim = kWidth / kHeads;
    mt::Tensor projected = qkv(x);
    auto split_heads = [&](int64_t part) {
      mt::Tensor t = mt::slice(projected, 2, part * kWidth, (part + 1) * kWidth);
      return mt::permute(mt::reshape(t, {batch, time, kHeads, head_dim}), {0, 2, 1, 3});
    };
    mt::Tensor q = split_heads(0), k = split_heads(1), v = split_heads(2);
    mt::Tensor attended = mt::detail::attention(q, k, v, mt::Tensor(), true, std::nullopt, fused_,
                                                mt::Loc::current());
    return proj(mt::reshape(mt::permute(attended, {0, 2, 1, 3}), {batch, time, kWidth}));
  }

  bool fused_;

 public:
  mt::LayerNorm ln1;
  mt::Linear qkv, proj;
  mt::LayerNorm ln2;
  mt::MLP mlp;
};

/// Token and position embeddings, `layers` blocks, a final LayerNorm and the vocabulary head.
class Gpt : public mt::Module {
 public:
  Gpt(int64_t vocab, int64_t layers, int64_t context, bool fused, mt::Generator* gen)
      : token_embedding(vocab, kWidth, gen),
        position_embedding(context, kWidth, gen),
        ln_f(kWidth),
        head(kWidth, vocab, true, gen) {
    register_module("token_embedding", token_embedding);
    register_module("position_embedding", position_embedding);
    for (int64_t i = 0; i < layers; ++i) blocks.emplace_back(fused, gen);
    register_module("blocks", blocks);
    register_module("ln_f", ln_f);
    register_module("head", head);
  }

  mt::Tensor loss(const mt::Tensor& tokens, const mt::Tensor& targets) const {
    mt::Tensor x = token_embedding(tokens) + position_embedding(mt::arange(tokens.size(1)));
    for (size_t i = 0; i < blocks.size(); ++i) x = blocks[i](x);
    return mt::cross_entropy(head(ln_f(x)), targets);
  }

  mt::Embedding token_embedding, position_embedding;
  mt::ModuleList<Block> blocks;
  mt::LayerNorm ln_f;
  mt::Linear head;
};

struct State {
  mt::Generator gen{kSeed};
  std::unique_ptr<Gpt> model;
  std::unique_ptr<mt::AdamW> optimizer;
};

/// The process's resident high-water mark in bytes (Linux reports KiB).
int64_t max_rss_bytes() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return static_cast<int64_t>(usage.ru_maxrss) * 1024;
}

}  // namespace

int main(int argc, char** argv) {
  std::string policy_name = "fp32", attention = "fused";
  std::vector<int64_t> batches{1, 2};
  int64_t context = 1024, layers = 2, vocab = 8192, timed_steps = 1;
  bool checkpoint = false;
  std::string saved_as;
  CLI::App app{"bench_memory: the measured peak memory and speed of a GPT-2-shaped training step"};
  app.add_option("--policy", policy_name, "fp32 or autocast-bf16 (any policy by name)");
  app.add_option("--attention", attention)->check(CLI::IsMember({"fused", "composite"}));
  app.add_option("--checkpoint", checkpoint, "1: checkpoint every block");
  app.add_option("--save-activations", saved_as,
                 "bf16 or f16: every value the backward pass reads kept for it in that type "
                 "where narrower (OverridePolicy::save_activations)")
      ->check(CLI::IsMember({"bf16", "f16"}));
  app.add_option("--context", context)->check(CLI::PositiveNumber);
  app.add_option("--layers", layers)->check(CLI::PositiveNumber);
  app.add_option("--vocab", vocab)->check(CLI::Range(int64_t{2}, int64_t{1} << 40));
  app.add_option("--batches", batches, "ascending, comma-separated")
      ->delimiter(',')
      ->check(CLI::PositiveNumber);
  app.add_option("--timed-steps", timed_steps, "at the first batch")->check(CLI::NonNegativeNumber);
  CLI11_PARSE(app, argc, argv);
  try {
    mt::PolicyPtr policy = mt::policy_by_name(policy_name);
    if (!saved_as.empty()) {
      auto keeping = std::make_shared<mt::OverridePolicy>(policy);
      keeping->save_activations("**", saved_as == "bf16" ? mt::bf16 : mt::f16);
      policy = keeping;
    }
    const int64_t rss_before = max_rss_bytes();
    auto state = std::make_shared<State>();
    state->model = std::make_unique<Gpt>(vocab, layers, context, attention == "fused", &state->gen);
    state->optimizer = std::make_unique<mt::AdamW>(
        state->model->parameters(), mt::AdamOptions{.lr = 3e-4, .weight_decay = 0.1});
    if (checkpoint) mt::checkpoint("blocks.*");
    auto train = bench::gpt_train_step(state, policy);
    std::mt19937_64 tokens_rng(kSeed);
    std::uniform_int_distribution<int64_t> token(0, vocab - 1);
    auto random_tokens = [&](int64_t batch) {
      std::vector<int64_t> values(static_cast<size_t>(batch * context));
      for (int64_t& v : values) v = token(tokens_rng);
      return mt::tensor(values, {batch, context});
    };
    // Batches ascend, so the resident high-water mark read after each one is that batch's.
    for (int64_t batch : batches) {
      mt::Tensor inputs = random_tokens(batch), targets = random_tokens(batch);
      mt::reset_execution_stats();
      double loss = train(inputs, targets).item();  // builds this shape's programs
      const mt::ExecutionStats first = mt::execution_stats();
      // Timed steps at the first batch only: each step of this model costs seconds on a CPU.
      const int64_t timed = batch == batches.front() ? timed_steps : 0;
      std::vector<double> cpu_seconds, wall_seconds;
      for (int64_t i = 0; i < timed; ++i) {
        auto start = std::chrono::steady_clock::now();
        double cpu_start = bench::process_cpu_seconds();
        loss = train(inputs, targets).item();
        cpu_seconds.push_back(bench::process_cpu_seconds() - cpu_start);
        wall_seconds.push_back(bench::seconds_since(start));
      }
      const mt::ExecutionStats stats = mt::execution_stats();  // first and timed steps
      mt::json::Value record{{"bench", "memory"},
                             {"system", "mixtape"},
                             {"policy", policy_name},
                             {"attention", attention},
                             {"checkpoint", checkpoint},
                             {"save_activations", saved_as},
                             {"context", context},
                             {"layers", layers},
                             {"vocab", vocab},
                             {"batch", batch},
                             {"loss", loss},
                             {"peak_bytes", stats.memory_peak_bytes},
                             {"first_step_peak_bytes", first.memory_peak_bytes},
                             {"stored_peak_bytes", stats.peak_bytes},
                             {"rss_growth_bytes", max_rss_bytes() - rss_before}};
      if (timed > 0) {
        double cpu = bench::median(cpu_seconds), wall = bench::median(wall_seconds);
        record.emplace("cpu_s_per_step", cpu);
        record.emplace("wall_s_per_step", wall);
        record.emplace("tokens_per_cpu_s", static_cast<double>(batch * context) / cpu);
        record.emplace("tokens_per_s", static_cast<double>(batch * context) / wall);
      }
      bench::emit(record);
    }
    return 0;
  } catch (const mt::Error& e) {
    std::fprintf(stderr, "bench_memory: %s\n", e.what());
    return 1;
  }
}

// examples/char_gpt_model.h -- CharGpt, a nanoGPT-style character language model (header-only,
// shared by examples/char_gpt.cpp and the benchmarks).
#pragma once

#include <mixtape/dsl/error.h>
#include <mixtape/mixtape.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace mt = mixtape;

struct GptConfig {
  int64_t vocab = 0, layers = 4, heads = 4, width = 128, context = 64;
  double dropout = 0.0;

  /// mt::Error naming the first setting that cannot make a model.
  void validate() const {
    if (vocab < 1) mt::fail("GptConfig: vocab must be >= 1, got {}", vocab);
    if (layers < 1) mt::fail("GptConfig: layers must be >= 1, got {}", layers);
    if (heads < 1) mt::fail("GptConfig: heads must be >= 1, got {}", heads);
    if (width < 1 || width % heads != 0)
      mt::fail("GptConfig: width {} must be a positive multiple of heads ({})", width, heads);
    if (context < 1) mt::fail("GptConfig: context must be >= 1, got {}", context);
    if (!(dropout >= 0 && dropout < 1))
      mt::fail("GptConfig: dropout must be in [0, 1), got {}", dropout);
  }
};

/// Token + position embedding, `layers` pre-norm transformer blocks, a final LayerNorm and a
/// linear head to the vocabulary. Weights start as in nanoGPT: N(0, 0.02) for embeddings and
/// linear weights, with the residual projections (attn.proj, mlp.fc2) scaled by
/// 1/sqrt(2 * layers), and zero biases; so a fresh model predicts nearly uniformly and its loss
/// starts at about ln(vocab).
class CharGpt : public mt::Module {
 public:
  explicit CharGpt(const GptConfig& config, mt::Generator* gen = nullptr)
      : config_((config.validate(), config)),
        token_embedding(config.vocab, config.width, gen),
        position_embedding(config.context, config.width, gen),
        embed_dropout(config.dropout, gen),
        ln_f(config.width),
        head(config.width, config.vocab, true, gen) {
    register_module("token_embedding", token_embedding);
    register_module("position_embedding", position_embedding);
    register_module("embed_dropout", embed_dropout);
    for (int64_t i = 0; i < config.layers; ++i)
      blocks.emplace_back(config.width, config.heads, config.dropout, gen);
    register_module("blocks", blocks);
    register_module("ln_f", ln_f);
    register_module("head", head);

    constexpr double stddev = 0.02;
    double residual_stddev = stddev / std::sqrt(2.0 * static_cast<double>(config.layers));
    auto normal = [&](mt::Tensor& weight, double sd) {
      weight.assign(mt::init::normal(weight.shape(), 0, sd, gen));
    };
    auto zero = [](mt::Tensor& bias) { bias.assign(mt::zeros(bias.shape())); };
    normal(token_embedding.weight, stddev);
    normal(position_embedding.weight, stddev);
    for (size_t i = 0; i < blocks.size(); ++i) {
      mt::TransformerBlock& block = blocks[i];
      normal(block.attn.qkv.weight, stddev);
      zero(block.attn.qkv.bias);
      normal(block.attn.proj.weight, residual_stddev);
      zero(block.attn.proj.bias);
      normal(block.mlp.layers[0]->weight, stddev);
      zero(block.mlp.layers[0]->bias);
      normal(block.mlp.layers[1]->weight, residual_stddev);
      zero(block.mlp.layers[1]->bias);
    }
    normal(head.weight, stddev);
    zero(head.bias);
  }

  /// [B, T] integer tokens with T <= context -> logits [B, T, vocab].
  mt::Tensor operator()(const mt::Tensor& tokens) const {
    if (!tokens.defined() || tokens.dim() != 2 || !mt::is_integer(tokens.dtype()))
      mt::fail("CharGpt: expects [batch, time] integer tokens, got {}",
               tokens.defined()
                   ? mt::to_string(tokens.shape()) + " " + std::string(mt::name(tokens.dtype()))
                   : std::string("undefined"));
    int64_t time = tokens.size(1);
    if (time < 1 || time > config_.context)
      mt::fail("CharGpt: {} tokens per row, the model takes 1 to {} (its context)", time,
               config_.context);
    mt::Tensor positions = mt::arange(time);
    mt::Tensor x = embed_dropout(token_embedding(tokens) + position_embedding(positions));
    for (size_t i = 0; i < blocks.size(); ++i) x = blocks[i](x);
    return head(ln_f(x));
  }

  /// Mean next-token cross-entropy of the logits for `tokens` against `targets` ([B, T] each).
  mt::Tensor loss(const mt::Tensor& tokens, const mt::Tensor& targets) const {
    return mt::cross_entropy((*this)(tokens), targets);
  }

  /// `count` new tokens after `prompt` (not empty), each predicted from the last `context`
  /// tokens (there is no key/value cache, so every step runs the whole window). temperature 0
  /// picks the most likely token; otherwise tokens are drawn from softmax(logits / temperature)
  /// with the Gumbel-max trick on `gen`'s stream, so a seeded generator repeats the sample.
  /// Runs without gradients and in the caller's autocast policy; call eval() first to switch
  /// dropout off.
  std::vector<int64_t> generate(std::vector<int64_t> prompt, int64_t count, double temperature,
                                mt::Generator* gen = nullptr) const {
    if (prompt.empty()) mt::fail("CharGpt::generate: the prompt must hold at least one token");
    if (count < 0) mt::fail("CharGpt::generate: count must be >= 0, got {}", count);
    if (!(temperature >= 0)) mt::fail("CharGpt::generate: temperature must be >= 0");
    mt::NoGradGuard no_grad;
    std::vector<int64_t> tokens = std::move(prompt), generated;
    for (int64_t i = 0; i < count; ++i) {
      int64_t window = std::min<int64_t>(config_.context, static_cast<int64_t>(tokens.size()));
      std::vector<int64_t> last(tokens.end() - window, tokens.end());
      mt::Tensor logits = (*this)(mt::tensor(last, {1, window}));
      logits = mt::reshape(mt::slice(logits, 1, window - 1, window), {config_.vocab});
      logits = mt::cast(logits, mt::f64);
      if (temperature > 0) {
        // argmax(logits / T + gumbel) as argmax(logits + T gumbel): the same draw, and a tiny T
        // tends to the greedy pick instead of dividing the logits into infinities.
        mt::Tensor uniform = mt::cast(mt::rand({config_.vocab}, mt::f32, gen), mt::f64);
        logits = logits - mt::log(-mt::log(uniform)) * temperature;
      }
      int64_t next = mt::argmax(logits).to_vector<int64_t>().at(0);
      tokens.push_back(next);
      generated.push_back(next);
    }
    return generated;
  }

  /// Parameters that weight decay should shrink (matrices and embeddings) and those it should
  /// leave alone (biases, LayerNorm gains), as nanoGPT groups them.
  std::pair<std::vector<mt::Tensor>, std::vector<mt::Tensor>> decay_groups() const {
    std::pair<std::vector<mt::Tensor>, std::vector<mt::Tensor>> groups;
    for (const mt::Tensor& p : parameters())
      (p.dim() >= 2 ? groups.first : groups.second).push_back(p);
    return groups;
  }

  const GptConfig& config() const { return config_; }

 private:
  GptConfig config_;

 public:
  mt::Embedding token_embedding, position_embedding;
  mt::Dropout embed_dropout;
  mt::ModuleList<mt::TransformerBlock> blocks;
  mt::LayerNorm ln_f;
  mt::Linear head;
};

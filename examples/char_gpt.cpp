// examples/char_gpt.cpp -- a character-level GPT (nanoGPT's CPU configuration) trained on the
// BSD fortunes: progress, a held-out validation loss, a generated sample and a JSON line; --export
// writes the trained model as a C library that examples/deploy/sample_text.c samples from.
#include <mixtape/dsl/json.h>
#include <mixtape/mixtape.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "char_gpt_model.h"
#include "mixtape/jit/aot_export.h"
#include "mixtape/runtime/atomic_file.h"
#include "progress_line.h"

namespace {

struct Options {
  // nanoGPT's shakespeare_char settings for a CPU (4 layers, 4 heads, width 128, context 64,
  // batch 12, AdamW at 1e-3 with beta2 0.99, weight decay 0.1, clipping at 1, warmup then cosine
  // decay to lr / 10). nanoGPT trains 2000 steps; the default here takes about 7 minutes of one
  // core on the reference executor and reaches a validation loss near 2.6.
  int64_t steps = 200;
  int64_t batch = 12;
  GptConfig model{.layers = 4, .heads = 4, .width = 128, .context = 64, .dropout = 0.0};
  double lr = 1e-3;
  double weight_decay = 0.1;
  double clip = 1.0;
  std::string schedule = "cosine";  // or "constant"
  int64_t warmup = -1;              // default: min(100, steps / 10)
  int64_t eval_every = -1;          // default: steps / 10
  int64_t eval_batches = 10;
  int64_t sample = 200;
  double temperature = 0.8;
  std::string prompt = "\n";
  std::string policy = "fp32";
  std::string loss_scale = "none";  // none | static:N | dynamic
  uint64_t seed = 0;
  bool json_only = false;
  bool compile = true;     // the training step through mt::compile (traced twice, then replayed)
  std::string export_dir;  // --export: the trained model as a C library (examples/deploy/)
  std::string logdir;      // --logdir: TensorBoard event files of the run
};

// What --export writes: the artifact char_gpt (logits f32 [batch, context, vocab] for tokens i64
// [batch, context], batch 1..kExportMaxBatch) and kVocabFile, which maps token ids to bytes.
constexpr int64_t kExportMaxBatch = 256;
constexpr const char* kVocabFile = "char_gpt_vocab.txt";

constexpr const char* kUsage =
    "usage: char_gpt [--steps N] [--batch N] [--layers N] [--heads N] [--width N] [--context N]\n"
    "                [--dropout P] [--lr X] [--weight-decay X] [--clip X (0: off)]\n"
    "                [--schedule cosine|constant] [--warmup N]\n"
    "                [--eval-every N] [--eval-batches N] [--sample N] [--temperature X (0: "
    "greedy)]\n"
    "                [--prompt TEXT] [--seed N] [--json] [--no-compile] [--export DIR]\n"
    "                [--logdir DIR]\n"
    "                [--policy fp32|autocast-f16|autocast-bf16|pure-f16|pure-bf16]\n"
    "                [--loss-scale none|static:N|dynamic]\n";

[[noreturn]] void usage(const std::string& problem) {
  std::fprintf(stderr, "char_gpt: %s (see --help)\n", problem.c_str());
  std::exit(2);
}

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    std::string flag = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) usage("missing value for " + flag);
      return argv[++i];
    };
    auto number = [&]() {
      std::string text = value();
      char* end = nullptr;
      double v = std::strtod(text.c_str(), &end);
      if (text.empty() || *end != '\0' || !std::isfinite(v))
        usage("not a number for " + flag + ": " + text);
      return v;
    };
    auto integer = [&]() {
      double v = number();
      if (v != std::floor(v) || std::fabs(v) > 1e15) usage("not an integer for " + flag);
      return static_cast<int64_t>(v);
    };
    if (flag == "--steps")
      o.steps = integer();
    else if (flag == "--batch")
      o.batch = integer();
    else if (flag == "--layers")
      o.model.layers = integer();
    else if (flag == "--heads")
      o.model.heads = integer();
    else if (flag == "--width")
      o.model.width = integer();
    else if (flag == "--context")
      o.model.context = integer();
    else if (flag == "--dropout")
      o.model.dropout = number();
    else if (flag == "--lr")
      o.lr = number();
    else if (flag == "--weight-decay")
      o.weight_decay = number();
    else if (flag == "--clip")
      o.clip = number();
    else if (flag == "--schedule")
      o.schedule = value();
    else if (flag == "--warmup")
      o.warmup = integer();
    else if (flag == "--eval-every")
      o.eval_every = integer();
    else if (flag == "--eval-batches")
      o.eval_batches = integer();
    else if (flag == "--sample")
      o.sample = integer();
    else if (flag == "--temperature")
      o.temperature = number();
    else if (flag == "--prompt")
      o.prompt = value();
    else if (flag == "--seed")
      o.seed = static_cast<uint64_t>(integer());
    else if (flag == "--policy")
      o.policy = value();
    else if (flag == "--loss-scale")
      o.loss_scale = value();
    else if (flag == "--compile")
      o.compile = true;
    else if (flag == "--no-compile")
      o.compile = false;
    else if (flag == "--export")
      o.export_dir = value();
    else if (flag == "--json")
      o.json_only = true;
    else if (flag == "--logdir")
      o.logdir = value();
    else if (flag == "--help" || flag == "-h")
      std::printf("%s", kUsage), std::exit(0);
    else
      usage("unknown flag " + flag);
  }
  if (o.steps < 1) usage("--steps must be at least 1");
  if (o.batch < 1) usage("--batch must be at least 1");
  if (o.model.layers < 1) usage("--layers must be at least 1");
  if (o.model.heads < 1) usage("--heads must be at least 1");
  if (o.model.width < 1 || o.model.width % o.model.heads != 0)
    usage("--width must be a positive multiple of --heads");
  if (o.model.context < 1) usage("--context must be at least 1");
  if (!(o.model.dropout >= 0 && o.model.dropout < 1)) usage("--dropout must be in [0, 1)");
  if (!(o.lr > 0)) usage("--lr must be > 0");
  if (o.weight_decay < 0) usage("--weight-decay must be >= 0");
  if (o.clip < 0) usage("--clip must be >= 0");
  if (o.schedule != "cosine" && o.schedule != "constant")
    usage("--schedule must be cosine or constant");
  if (o.warmup < 0) o.warmup = std::min<int64_t>(100, o.steps / 10);
  if (o.warmup > o.steps) usage("--warmup must not exceed --steps");
  if (o.eval_every < 0) o.eval_every = std::max<int64_t>(1, o.steps / 10);
  if (o.eval_every < 1) usage("--eval-every must be at least 1");
  if (o.eval_batches < 1) usage("--eval-batches must be at least 1");
  if (o.sample < 0) usage("--sample must be >= 0");
  if (o.temperature < 0) usage("--temperature must be >= 0");
  if (o.prompt.empty()) usage("--prompt must not be empty");
  if (o.loss_scale != "none" && o.loss_scale != "dynamic" && !o.loss_scale.starts_with("static:"))
    usage("--loss-scale must be none, static:N or dynamic");
  return o;
}

mt::GradScalerOptions scaler_options(const std::string& loss_scale) {
  mt::GradScalerOptions scaling{.enabled = loss_scale != "none",
                                .dynamic = loss_scale == "dynamic"};
  if (loss_scale.starts_with("static:")) {
    std::string factor = loss_scale.substr(7);
    char* end = nullptr;
    scaling.init_scale = std::strtod(factor.c_str(), &end);
    if (factor.empty() || *end != '\0' || !(scaling.init_scale > 0))
      usage("--loss-scale static:N needs a positive number, got '" + factor + "'");
  }
  return scaling;
}

/// Mean loss over the first `batches` batches of a fixed shuffle of `windows`, so every
/// evaluation of a run (and of runs with the same seed) sees the same examples.
double estimate_loss(CharGpt& model, const mt::TextWindows& windows, int64_t batches,
                     int64_t batch_size, uint64_t seed, const mt::PolicyPtr& policy) {
  model.eval();
  mt::NoGradGuard no_grad;
  mt::autocast guard(policy);
  mt::DataLoader loader(windows, std::min(batch_size, windows.size()), true, seed);
  double total = 0;
  for (int64_t i = 0; i < batches; ++i) {
    mt::Batch batch = loader.next();
    total += model.loss(batch.inputs, batch.targets).item();
  }
  model.train();
  return total / static_cast<double>(batches);
}

/// Writes the trained model into `dir` as the artifact char_gpt: next-token logits at every
/// position of a window of `context` tokens (rows shorter than the context are padded at the
/// end: attention is causal, so logits before the padding do not depend on it), in the training
/// policy, for 1..kExportMaxBatch rows; and kVocabFile, a line "mixtape-char-vocab-1 CONTEXT
/// VOCAB" followed by the VOCAB bytes of the vocabulary in token id order.
void export_model(CharGpt& model, const mt::CharVocab& vocab, const mt::PolicyPtr& policy,
                  const std::string& dir) {
  model.eval();
  auto logits = [&](const mt::Tensor& tokens) {
    mt::autocast guard(policy);
    return mt::cast(model(tokens), mt::f32);
  };
  int64_t context = model.config().context;
  mt::aot::Options options{.name = "char_gpt",
                           .dynamic_batch = {.max = kExportMaxBatch},
                           .module = &model,
                           .devices = mt::aot::exportable_devices()};
  mt::aot::export_function(logits, {mt::aot::input("tokens", {kExportMaxBatch, context}, mt::i64)},
                           {"logits"}, dir, options);
  std::string path = dir + "/" + kVocabFile;
  std::string text = fmt::format("mixtape-char-vocab-1 {} {}\n", context, vocab.size());
  text += vocab.chars();
  mt::write_file_atomically(path,
                            [&](int fd) { mt::write_all(fd, text.data(), text.size(), path); });
}

/// The text with every byte that does not belong to a valid UTF-8 sequence replaced by U+FFFD:
/// a sample is drawn byte by byte and may cut a multi-byte character, but JSON needs UTF-8.
std::string valid_utf8(const std::string& text) {
  std::string out;
  size_t i = 0, n = text.size();
  auto byte = [&](size_t k) { return static_cast<unsigned char>(text[k]); };
  while (i < n) {
    unsigned char lead = byte(i);
    size_t length = lead < 0x80                    ? 1
                    : lead >= 0xC2 && lead <= 0xDF ? 2
                    : lead >= 0xE0 && lead <= 0xEF ? 3
                    : lead >= 0xF0 && lead <= 0xF4 ? 4
                                                   : 0;
    bool ok = length > 0 && i + length <= n;
    for (size_t k = 1; ok && k < length; ++k) {
      unsigned char c = byte(i + k), low = 0x80, high = 0xBF;
      if (k == 1 && lead == 0xE0) low = 0xA0;   // overlong
      if (k == 1 && lead == 0xED) high = 0x9F;  // surrogates
      if (k == 1 && lead == 0xF0) low = 0x90;   // overlong
      if (k == 1 && lead == 0xF4) high = 0x8F;  // above U+10FFFF
      ok = c >= low && c <= high;
    }
    if (ok) {
      out.append(text, i, length);
      i += length;
    } else {
      out += "\xEF\xBF\xBD";
      ++i;
    }
  }
  return out;
}

int run(const Options& o) {
  mt::PolicyPtr policy = mt::policy_by_name(o.policy);
  mt::GradScaler scaler(scaler_options(o.loss_scale));
  mt::manual_seed(o.seed);

  std::string text = mt::read_file(mt::default_data_dir() + "/fortunes.txt");
  mt::CharVocab vocab(text);
  std::vector<int64_t> ids = vocab.encode(text);
  // The last 10% of the text is held out; its fortunes are not seen in training.
  auto split_at = ids.begin() + static_cast<std::ptrdiff_t>(ids.size() * 9 / 10);
  mt::TextWindows train(std::vector<int64_t>(ids.begin(), split_at), o.model.context);
  mt::TextWindows validation(std::vector<int64_t>(split_at, ids.end()), o.model.context);
  if (o.batch > train.size()) usage("--batch is larger than the number of training windows");
  std::vector<int64_t> prompt = vocab.encode(o.prompt);

  GptConfig config = o.model;
  config.vocab = vocab.size();
  mt::Generator init_generator(o.seed);
  CharGpt model(config, &init_generator);
  int64_t parameter_count = 0;
  for (const mt::Tensor& p : model.parameters()) parameter_count += p.numel();

  auto [decayed, not_decayed] = model.decay_groups();
  mt::AdamW decay_optimizer(decayed, {.lr = o.lr, .beta2 = 0.99, .weight_decay = o.weight_decay});
  mt::AdamW plain_optimizer(not_decayed, {.lr = o.lr, .beta2 = 0.99, .weight_decay = 0.0});
  std::unique_ptr<mt::LRSchedule> schedule;
  if (o.schedule == "cosine")
    schedule = std::make_unique<mt::CosineWithWarmup>(o.lr, o.warmup, o.steps, o.lr / 10);
  else
    schedule = std::make_unique<mt::ConstantLR>(o.lr);
  mt::DataLoader loader(train, o.batch, true, o.seed);
  uint64_t eval_seed = o.seed ^ 0x6576616cULL;

  if (!o.json_only)
    std::printf(
        "char_gpt: %lld layers, %lld heads, width %lld, context %lld, vocab %lld, %lld "
        "parameters; %zu training and %zu validation characters; policy %s, loss scale %s\n",
        static_cast<long long>(config.layers), static_cast<long long>(config.heads),
        static_cast<long long>(config.width), static_cast<long long>(config.context),
        static_cast<long long>(config.vocab), static_cast<long long>(parameter_count),
        static_cast<size_t>(split_at - ids.begin()), static_cast<size_t>(ids.end() - split_at),
        o.policy.c_str(), o.loss_scale.c_str());

  using Clock = std::chrono::steady_clock;
  double train_seconds = 0, train_loss = 0, val_loss = 0, last_batch_loss = 0;
  examples::ProgressLine progress(o.steps, o.json_only);
  std::unique_ptr<mt::SummaryWriter> writer = examples::open_logdir(o.logdir);
  // gradient_health reads every gradient on the host: a few dozen times a run.
  int64_t health_every = std::max<int64_t>(1, o.steps / 30);
  // One training step as a function of the batch, so that mt::compile replays it (unless
  // --no-compile); the learning rate is set outside it (set_lr writes a graph input in place).
  auto train_step = [&](const mt::Tensor& inputs, const mt::Tensor& targets) {
    decay_optimizer.zero_grad();
    plain_optimizer.zero_grad();
    mt::Tensor loss;
    {
      mt::autocast guard(policy);
      loss = model.loss(inputs, targets);
    }
    scaler.scale(loss).backward();
    mt::Tensor norm;
    if (o.clip > 0) {
      scaler.unscale_(decay_optimizer);
      scaler.unscale_(plain_optimizer);
      norm = mt::clip_grad_norm(model.parameters(), o.clip);
    }
    scaler.step(decay_optimizer);
    scaler.step(plain_optimizer);
    if (writer) {  // graph values, read every 100 steps: no host sync in the step
      writer->add_scalar("loss", loss);
      writer->log_scaler(scaler);
      writer->log_learning_rate(decay_optimizer);
      // The norm before clipping, as clipping saw it (clip_grad_norm's own value).
      if (norm.defined())
        writer->add_scalar("grad_norm", norm);
      else
        writer->log_grad_norm(model.parameters());
    }
    scaler.update();
    return loss;
  };
  auto compiled_step = mt::compile(train_step);
  for (int64_t step = 1; step <= o.steps; ++step) {
    auto start = Clock::now();
    mt::Batch batch = loader.next();
    double lr = schedule->lr(step - 1);
    decay_optimizer.set_lr(lr);
    plain_optimizer.set_lr(lr);
    if (writer) writer->set_step(step);
    mt::Tensor loss = o.compile ? compiled_step(batch.inputs, batch.targets)
                                : train_step(batch.inputs, batch.targets);
    if (writer) writer->log_gradient_health(model, health_every);
    bool report = step % o.eval_every == 0 || step == o.steps;
    if (report) last_batch_loss = loss.item();
    train_seconds += std::chrono::duration<double>(Clock::now() - start).count();
    if (progress.due(step))
      progress.update(step, loss.item(), scaler.is_enabled() ? scaler.get_scale() : 0);
    if (!report) continue;
    progress.finish();
    train_loss = estimate_loss(model, train, o.eval_batches, o.batch, eval_seed, policy);
    val_loss = estimate_loss(model, validation, o.eval_batches, o.batch, eval_seed, policy);
    if (writer) {
      writer->add_scalar("eval/train_loss", train_loss, step);
      writer->add_scalar("eval/val_loss", val_loss, step);
    }
    double tokens_per_s =
        static_cast<double>(step * o.batch * config.context) / std::max(train_seconds, 1e-9);
    if (!o.json_only) {
      std::printf(
          "step %lld/%lld  batch loss %.4f  train loss %.4f  val loss %.4f  %.0f tokens/s\n",
          static_cast<long long>(step), static_cast<long long>(o.steps), last_batch_loss,
          train_loss, val_loss, tokens_per_s);
      std::fflush(stdout);
    }
  }
  double tokens_per_s =
      static_cast<double>(o.steps * o.batch * config.context) / std::max(train_seconds, 1e-9);
  if (writer) writer->flush();

  model.eval();
  mt::Generator sample_generator(o.seed ^ 0x73616d706c65ULL);
  std::string sample;
  {
    mt::autocast guard(policy);
    sample = vocab.decode(model.generate(prompt, o.sample, o.temperature, &sample_generator));
  }
  if (!o.json_only)
    std::printf("%lld steps in %.1f s of training; sample (temperature %g):\n%s%s\n",
                static_cast<long long>(o.steps), train_seconds, o.temperature, o.prompt.c_str(),
                sample.c_str());

  if (!o.export_dir.empty()) {
    export_model(model, vocab, policy, o.export_dir);
    if (!o.json_only)
      std::printf(
          "exported to %s: char_gpt (logits f32 [batch, %lld, %lld] from tokens i64 [batch, "
          "%lld], batch 1..%lld, policy %s) and %s; see examples/deploy/sample_text.c\n",
          o.export_dir.c_str(), static_cast<long long>(config.context),
          static_cast<long long>(config.vocab), static_cast<long long>(config.context),
          static_cast<long long>(kExportMaxBatch), o.policy.c_str(), kVocabFile);
  }

  mt::json::Object line{{"example", "char_gpt"},
                        {"policy", o.policy},
                        {"steps", o.steps},
                        {"train_loss", train_loss},
                        {"val_loss", val_loss},
                        {"tokens_per_s", tokens_per_s},
                        {"sample", valid_utf8(sample)},
                        {"loss_scale", o.loss_scale},
                        {"batch", o.batch},
                        {"layers", config.layers},
                        {"heads", config.heads},
                        {"width", config.width},
                        {"context", config.context},
                        {"vocab", config.vocab},
                        {"parameters", parameter_count},
                        {"train_seconds", train_seconds},
                        {"final_scale", scaler.get_scale()},
                        {"skipped_steps", scaler.skipped_steps()},
                        {"step", o.compile ? "compiled" : "traced"},
                        {"replayed_steps", compiled_step.stats().replays}};
  std::printf("%s\n", mt::json::dump(line).c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Options options = parse(argc, argv);
  try {
    return run(options);
  } catch (const mt::Error& e) {
    std::fprintf(stderr, "char_gpt: error: %s\n", e.what());
    return 1;
  }
}

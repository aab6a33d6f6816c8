// examples/char_gpt.cpp -- a character-level GPT (nanoGPT's CPU configuration) trained on the
// BSD fortunes: progress, a held-out validation loss, a generated sample and a JSON line; --export
// writes the trained model as a C library that examples/deploy/sample_text.c samples from.
#include <mixtape/mixtape.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "char_gpt_model.h"
#include "example_cli.h"
#include "mixtape/jit/aot_export.h"
#include "mixtape/runtime/atomic_file.h"
#include "progress_line.h"
#include "resumable.h"

namespace {

struct Options : examples::TrainingFlags, examples::ResumeFlags {
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
  bool checkpoint = false;          // --checkpoint: recompute each block's activations
  int64_t warmup = -1;              // default: min(100, steps / 10)
  int64_t eval_every = -1;          // default: steps / 10
  int64_t eval_batches = 10;
  int64_t sample = 200;
  double temperature = 0.8;
  std::string prompt = "\n";
  std::string export_dir;    // --export: the trained model as a C library (examples/deploy/)
  bool distributed = false;  // --distributed: data parallel over mpirun's processes
  bool zero = false;         // --zero: ZeRO-1, AdamW's state sharded over the processes
};

// What --export writes: the artifact char_gpt (logits f32 [batch, context, vocab] for tokens i64
// [batch, context], batch 1..kExportMaxBatch) and kVocabFile, which maps token ids to bytes.
constexpr int64_t kExportMaxBatch = 256;
constexpr const char* kVocabFile = "char_gpt_vocab.txt";

Options parse(int argc, char** argv) {
  Options o;
  CLI::App app("A character-level GPT trained on the BSD fortunes; samples text after training.",
               "char_gpt");
  auto positive = examples::at_least(1);
  examples::add_steps(app, o.steps);
  app.add_option("--batch", o.batch, "batch size")->check(positive)->capture_default_str();
  app.add_option("--layers", o.model.layers)->check(positive)->capture_default_str();
  app.add_option("--heads", o.model.heads)->check(positive)->capture_default_str();
  app.add_option("--width", o.model.width, "a multiple of --heads")
      ->check(positive)
      ->capture_default_str();
  app.add_option("--context", o.model.context)->check(positive)->capture_default_str();
  app.add_option("--dropout", o.model.dropout)
      ->check(examples::number_that("in [0, 1)", [](double p) { return p >= 0 && p < 1; }))
      ->capture_default_str();
  app.add_option("--lr", o.lr)
      ->check(examples::number_that("> 0", [](double v) { return v > 0; }))
      ->capture_default_str();
  app.add_option("--weight-decay", o.weight_decay)
      ->check(examples::at_least(0))
      ->capture_default_str();
  app.add_option("--clip", o.clip, "gradient norm clipping (0: off)")
      ->check(examples::at_least(0))
      ->capture_default_str();
  app.add_option("--schedule", o.schedule)
      ->check(CLI::IsMember({"cosine", "constant"}))
      ->capture_default_str();
  app.add_option("--warmup", o.warmup, "warmup steps (default: min(100, steps / 10))")
      ->check(examples::at_least(0));
  app.add_option("--eval-every", o.eval_every, "steps between evaluations (default: steps / 10)")
      ->check(positive);
  app.add_option("--eval-batches", o.eval_batches)->check(positive)->capture_default_str();
  app.add_option("--sample", o.sample, "characters to sample after training")
      ->check(examples::at_least(0))
      ->capture_default_str();
  app.add_option("--temperature", o.temperature, "sampling temperature (0: greedy)")
      ->check(examples::at_least(0))
      ->capture_default_str();
  app.add_option("--prompt", o.prompt, "text the sample starts from")
      ->check(CLI::Validator(
          [](std::string& text) { return text.empty() ? "must not be empty" : ""; }, ""));
  app.add_flag("--checkpoint", o.checkpoint,
               "activation checkpointing of every transformer block: backward recomputes their "
               "activations instead of keeping them");
  app.add_option("--export", o.export_dir, "export the trained model as a C library into DIR")
      ->check(examples::output_folder())
      ->type_name("DIR");
  examples::add_resume_flags(app, o,
                             "weights, AdamW's state, loss scale, data order, dropout's stream");
  examples::add_distributed(app, o.distributed);
  app.add_flag("--zero", o.zero,
               "with --distributed: ZeRO stage 1, each process keeps and updates its share of "
               "AdamW's state (mt::dist::ZeroAdamW)");
  examples::add_training_flags(app, o);
  examples::parse(app, argc, argv);
  if (o.zero && !o.distributed) examples::usage_error("char_gpt", "--zero needs --distributed");
  if (o.model.width % o.model.heads != 0)
    examples::usage_error("char_gpt", "--width must be a positive multiple of --heads");
  if (o.warmup < 0) o.warmup = std::min<int64_t>(100, o.steps / 10);
  if (o.warmup > o.steps) examples::usage_error("char_gpt", "--warmup must not exceed --steps");
  if (o.eval_every < 0) o.eval_every = std::max<int64_t>(1, o.steps / 10);
  return o;
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
  mt::GradScaler scaler(examples::scaler_options(o.loss_scale));
  mt::manual_seed(o.seed);

  std::string text = mt::read_file(mt::default_data_dir() + "/fortunes.txt");
  mt::CharVocab vocab(text);
  std::vector<int64_t> ids = vocab.encode(text);
  // The last 10% of the text is held out; its fortunes are not seen in training.
  auto split_at = ids.begin() + static_cast<std::ptrdiff_t>(ids.size() * 9 / 10);
  mt::TextWindows train(std::vector<int64_t>(ids.begin(), split_at), o.model.context);
  mt::TextWindows validation(std::vector<int64_t>(split_at, ids.end()), o.model.context);
  if (o.batch > train.size())
    examples::usage_error("char_gpt", "--batch is larger than the number of training windows");
  std::vector<int64_t> prompt = vocab.encode(o.prompt);

  GptConfig config = o.model;
  config.vocab = vocab.size();
  mt::Generator init_generator(o.seed);
  CharGpt model(config, &init_generator);
  if (o.checkpoint) mt::checkpoint("blocks.*");
  // --distributed: every process trains on its share of each batch (its own windows of the
  // same shuffled order), gradients averaged; rank 0 alone prints.
  std::optional<mt::dist::DataParallel> data_parallel;
  if (o.distributed) {
    examples::join_processes("char_gpt");
    data_parallel.emplace(model);
  }
  int64_t parameter_count = 0;
  for (const mt::Tensor& p : model.parameters()) parameter_count += p.numel();

  // AdamW with weight decay on the weight matrices only, as nanoGPT's two parameter groups.
  auto [decayed, not_decayed] = model.decay_groups();
  mt::AdamOptions decay{.lr = o.lr, .beta2 = 0.99, .weight_decay = o.weight_decay};
  mt::AdamOptions no_decay = decay;
  no_decay.weight_decay = 0;
  std::vector<mt::ParamGroup<mt::AdamOptions>> groups{{decayed, decay}, {not_decayed, no_decay}};
  std::unique_ptr<mt::Optimizer> optimizer;
  if (o.zero)
    optimizer = std::make_unique<mt::dist::ZeroAdamW>(std::move(groups));
  else
    optimizer = std::make_unique<mt::AdamW>(std::move(groups));
  std::unique_ptr<mt::LRSchedule> schedule;
  if (o.schedule == "cosine")
    schedule = std::make_unique<mt::CosineWithWarmup>(o.lr, o.warmup, o.steps, o.lr / 10);
  else
    schedule = std::make_unique<mt::ConstantLR>(o.lr);
  mt::DataLoader loader(train, o.batch, true, o.seed, mt::dist::shard());
  // The batch of all processes: what evaluation reads (so a run's losses do not depend on how
  // many processes share it) and what tokens/s counts.
  const int64_t global_batch = o.batch * mt::dist::world_size();
  uint64_t eval_seed = o.seed ^ 0x6576616cULL;

  // What a checkpoint holds besides the model, the optimizer and the scaler, so that a resumed run
  // draws the same batches and dropout masks (the model's stream, after its initialization) as
  // one never stopped; and the flags that shape the run after its start (the loader's state
  // checks --batch and --seed, the model's tensors its shape, the optimizer's state its kind).
  const mt::CheckpointOptions resumable{.generators = {{"model", &init_generator}},
                                        .loaders = {&loader}};
  auto number = [](double v) { return nlohmann::json(v).dump(); };
  const examples::RunFlags shaping = {
      {"policy", o.policy},
      {"loss-scale", o.loss_scale},
      {"heads", std::to_string(o.model.heads)},  // the parameters' shapes do not show it
      {"dropout", number(o.model.dropout)},
      {"lr", number(o.lr)},
      {"weight-decay", number(o.weight_decay)},
      {"clip", number(o.clip)},
      {"schedule", o.schedule},
      // The cosine's span, checked before the warmup, whose default it sets.
      {"steps", o.schedule == "cosine" ? std::to_string(o.steps) : "any"},
      {"warmup", o.schedule == "cosine" ? std::to_string(o.warmup) : "any"},
      {"zero", o.zero ? "on" : "off"}};
  // Every process calls it: ZeRO's shards are gathered, and rank 0 writes the file.
  auto save = [&](int64_t step) {
    mt::dist::save_checkpoint(o.save, model, optimizer.get(),
                              examples::resumable_metadata(step, shaping, {}), &scaler, resumable);
  };
  int64_t first_step = 1;
  if (!o.resume.empty()) {
    mt::Metadata meta;
    mt::dist::load_checkpoint(o.resume, model, optimizer.get(), &meta, &scaler, resumable);
    first_step = examples::resumed_step(o.resume, meta, shaping, loader, o.steps) + 1;
  }

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
  // Rank 0 alone exports (--distributed). Every rank logs, and rank 0's writer alone writes a
  // file: under ZeRO the gradients' norm and health are collectives (summary_writer.h).
  const bool root = mt::dist::rank() == 0;
  std::unique_ptr<mt::SummaryWriter> writer = examples::open_logdir(o.logdir);
  // gradient_health reads every gradient on the host: a few dozen times a run.
  int64_t health_every = std::max<int64_t>(1, o.steps / 30);
  // One training step as a function of the batch, so that mt::compile replays it (unless
  // --no-compile); the learning rate is set outside it (set_lr writes a graph input in place).
  auto train_step = [&](const mt::Tensor& inputs, const mt::Tensor& targets) {
    optimizer->zero_grad();
    mt::Tensor loss;
    {
      mt::autocast guard(policy);
      loss = model.loss(inputs, targets);
    }
    scaler.scale(loss).backward();
    mt::Tensor norm;
    if (o.clip > 0) {
      scaler.unscale_(*optimizer);
      norm = mt::clip_grad_norm(model.parameters(), o.clip);
    }
    scaler.step(*optimizer);
    if (writer) {  // graph values, read every 100 steps: no host sync in the step
      writer->add_scalar("loss", loss);
      writer->log_scaler(scaler);
      writer->log_learning_rate(*optimizer);
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
  for (int64_t step = first_step; step <= o.steps; ++step) {
    auto start = Clock::now();
    mt::Batch batch = loader.next();
    optimizer->set_lr(schedule->lr(step - 1));
    if (writer) writer->set_step(step);
    mt::Tensor loss = o.compile ? compiled_step(batch.inputs, batch.targets)
                                : train_step(batch.inputs, batch.targets);
    if (writer) writer->log_gradient_health(model, health_every);
    if (o.save_every > 0 && step % o.save_every == 0 && step < o.steps) save(step);
    bool report = step % o.eval_every == 0 || step == o.steps;
    if (report) last_batch_loss = loss.item();
    train_seconds += std::chrono::duration<double>(Clock::now() - start).count();
    if (progress.due(step))
      progress.update(step, loss.item(), scaler.is_enabled() ? scaler.get_scale() : 0);
    if (!report) continue;
    progress.finish();
    train_loss = estimate_loss(model, train, o.eval_batches, global_batch, eval_seed, policy);
    val_loss = estimate_loss(model, validation, o.eval_batches, global_batch, eval_seed, policy);
    if (writer) {
      writer->add_scalar("eval/train_loss", train_loss, step);
      writer->add_scalar("eval/val_loss", val_loss, step);
    }
    double tokens_per_s =
        static_cast<double>((step - first_step + 1) * global_batch * config.context) /
        std::max(train_seconds, 1e-9);
    if (!o.json_only) {
      std::printf(
          "step %lld/%lld  batch loss %.4f  train loss %.4f  val loss %.4f  %.0f tokens/s\n",
          static_cast<long long>(step), static_cast<long long>(o.steps), last_batch_loss,
          train_loss, val_loss, tokens_per_s);
      std::fflush(stdout);
    }
  }
  double tokens_per_s =
      static_cast<double>((o.steps - first_step + 1) * global_batch * config.context) /
      std::max(train_seconds, 1e-9);
  // The run as a session of a sweep, for TensorBoard's HParams dashboard: its flags and losses.
  if (writer) {
    writer->add_hparams({{"lr", o.lr},
                         {"batch", o.batch},
                         {"layers", config.layers},
                         {"heads", config.heads},
                         {"width", config.width},
                         {"context", config.context},
                         {"dropout", config.dropout},
                         {"weight_decay", o.weight_decay},
                         {"policy", o.policy},
                         {"loss_scale", o.loss_scale},
                         {"schedule", o.schedule},
                         {"checkpoint", o.checkpoint},
                         {"zero", o.zero}},
                        {{"hparam/train_loss", train_loss}, {"hparam/val_loss", val_loss}}, {},
                        "hparams");
    writer->flush();
  }
  // Saved first: an export that fails (no C compiler, a full disk) loses no trained weights.
  if (!o.save.empty()) save(o.steps);
  data_parallel.reset();  // training is over: the processes part

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

  if (!o.export_dir.empty() && root) {
    export_model(model, vocab, policy, o.export_dir);
    if (!o.json_only)
      std::printf(
          "exported to %s: char_gpt (logits f32 [batch, %lld, %lld] from tokens i64 [batch, "
          "%lld], batch 1..%lld, policy %s) and %s; see examples/deploy/sample_text.c\n",
          o.export_dir.c_str(), static_cast<long long>(config.context),
          static_cast<long long>(config.vocab), static_cast<long long>(config.context),
          static_cast<long long>(kExportMaxBatch), o.policy.c_str(), kVocabFile);
  }

  nlohmann::ordered_json line{{"example", "char_gpt"},
                              {"policy", o.policy},
                              {"steps", o.steps},
                              {"first_step", first_step},
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
                              {"checkpoint", o.checkpoint},
                              {"zero", o.zero},
                              {"train_seconds", train_seconds}};
  examples::print_json_line(std::move(line), scaler, o.compile, compiled_step.stats(),
                            o.distributed);
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

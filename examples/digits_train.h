// examples/digits_train.h -- the digits examples' shared trainer: flags, the train/test split,
// the training loop (mt::compile by default), export, evaluation and the JSON line. Each example
// (digits_mlp.cpp, digits_cnn.cpp) only brings its model.
#pragma once

#include <mixtape/dsl/error.h>
#include <mixtape/mixtape.h>
#include <unistd.h>
#include <nlohmann/json.hpp>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <utility>

#include "example_cli.h"
#include "progress_line.h"
#include "resumable.h"

namespace digits {

namespace mt = mixtape;

struct Options : examples::TrainingFlags, examples::ResumeFlags {
  std::string example;  // digits_mlp or digits_cnn: names the binary, its JSON line and exports
  // digits_mlp's defaults reach >= 95% on the last 360 digits (other writers than the training
  // rows): label smoothing and input noise are what close the gap to 1-nearest-neighbour
  // (95.6%). digits_cnn's reach >= 97%, with random shifts of a pixel and a cosine schedule.
  int64_t steps = 3000;
  int64_t batch = 64;
  double lr = -1;  // per-optimizer default below
  std::string optimizer = "sgd";
  double label_smoothing = 0.2;
  double noise = 0.2;
  int64_t shift = 0;  // random translations of up to this many pixels
  bool cosine = false;
  bool shuffle = true;
  std::string load;
  std::string export_dir;  // --export: the trained model as C libraries (examples/deploy/)
  // --distributed: data parallel over the processes mpirun started (--batch per process).
  bool distributed = false;
};

/// What an example changes of the flags' defaults.
struct Defaults {
  int64_t steps = 3000;
  int64_t shift = 0;
  double sgd_lr = 0.05;
  bool cosine = false;
};

inline Options parse(const std::string& example, const Defaults& defaults, int argc, char** argv) {
  Options o;
  o.example = example;
  o.steps = defaults.steps;
  o.shift = defaults.shift;
  o.cosine = defaults.cosine;
  CLI::App app("Trains a classifier of the UCI handwritten digits and tests it on the last 360.",
               example);
  examples::add_steps(app, o.steps);
  app.add_option("--batch", o.batch, "batch size")
      ->check(examples::in_range(1, 1437))
      ->capture_default_str();
  app.add_option("--lr", o.lr, "learning rate (default: 2e-3 for adamw, per example for sgd)")
      ->check(examples::at_least(0));
  app.add_option("--optimizer", o.optimizer)
      ->check(CLI::IsMember({"sgd", "adamw"}))
      ->capture_default_str();
  app.add_option("--label-smoothing", o.label_smoothing)
      ->check(examples::in_range(0, 1))
      ->capture_default_str();
  app.add_option("--noise", o.noise, "stddev of the noise added to the inputs")
      ->check(examples::at_least(0))
      ->capture_default_str();
  app.add_option("--shift", o.shift, "random shifts of up to this many pixels")
      ->check(examples::in_range(0, 3))
      ->capture_default_str();
  app.add_flag("--cosine,!--no-cosine", o.cosine, "cosine learning-rate schedule");
  app.add_flag("--shuffle,!--no-shuffle", o.shuffle, "shuffle the batches (default)");
  app.add_option("--load", o.load, "start from this checkpoint")
      ->check(examples::path_value())
      ->type_name("FILE");
  examples::add_resume_flags(app, o,
                             "weights, optimizer, loss scale, data order, input noise and shifts");
  app.get_option("--resume")->excludes("--load");
  app.add_option("--export", o.export_dir, "export the trained model as C libraries into DIR")
      ->check(examples::output_folder())
      ->type_name("DIR");
  examples::add_distributed(app, o.distributed);
  examples::add_training_flags(app, o);
  examples::parse(app, argc, argv);
  if (o.lr < 0) o.lr = o.optimizer == "sgd" ? defaults.sgd_lr : 2e-3;
  // Each process draws its own noise and shifts, which one file does not hold.
  if (o.distributed && (!o.resume.empty() || o.save_every > 0))
    examples::usage_error(example, "--resume and --save-every are for a run of one process");
  return o;
}

inline mt::TensorDataset split(const mt::Digits& digits, int64_t begin, int64_t end) {
  std::vector<float> pixels(digits.pixels.begin() + begin * 64, digits.pixels.begin() + end * 64);
  for (float& p : pixels) p /= 16.0f;
  std::vector<int64_t> labels(digits.labels.begin() + begin, digits.labels.begin() + end);
  return mt::TensorDataset(std::move(pixels), {64}, std::move(labels));
}

// Each 8x8 image moved by up to `shift` pixels along each axis, zeros coming in: the writers of
// the test rows place their digits differently from those of the training rows.
inline mt::Tensor shifted(const mt::Tensor& pixels, int64_t shift, std::mt19937_64& rng) {
  std::vector<float> in = pixels.to_vector<float>(), out(in.size(), 0.0f);
  std::uniform_int_distribution<int64_t> offset(-shift, shift);
  for (size_t image = 0; image < in.size() / 64; ++image) {
    const int64_t dy = offset(rng), dx = offset(rng);
    for (int64_t y = 0; y < 8; ++y)
      for (int64_t x = 0; x < 8; ++x) {
        const int64_t from_y = y - dy, from_x = x - dx;
        if (from_y >= 0 && from_y < 8 && from_x >= 0 && from_x < 8)
          out[image * 64 + static_cast<size_t>(y * 8 + x)] =
              in[image * 64 + static_cast<size_t>(from_y * 8 + from_x)];
      }
  }
  return mt::tensor(out, pixels.shape());
}

// Where stdout is not a terminal (a log file), a plain line now and then instead of the
// progress line.
inline void log_line(const Options& o, int64_t step, double loss, double rate) {
  if (!o.json_only)
    std::printf("step %lld loss %.4f steps/s %.1f\n", static_cast<long long>(step), loss, rate);
}

/// Trains `net` (digit logits [batch, 10] from pixels [batch, 64]) on the first 1437 digits and
/// tests it on the last 360, as the flags say; prints progress and one JSON line.
template <typename Model>
int run(const Options& o, Model& net) {
  mt::PolicyPtr policy = mt::policy_by_name(o.policy);
  mt::GradScaler scaler(examples::scaler_options(o.loss_scale));
  mt::Digits digits = mt::load_digits(mt::default_data_dir() + "/digits.csv.gz");
  if (digits.count() != 1797) mt::fail("digits: expected 1797 rows, found {}", digits.count());
  mt::TensorDataset train = split(digits, 0, 1437), test = split(digits, 1437, 1797);

  if (!o.load.empty()) mt::load_checkpoint(o.load, net);
  // --distributed: every process trains on its share of each batch, gradients averaged; rank 0
  // alone prints and saves.
  std::optional<mt::dist::DataParallel> data_parallel;
  if (o.distributed) {
    examples::join_processes(o.example);
    data_parallel.emplace(net);
  }
  std::unique_ptr<mt::Optimizer> optimizer;
  if (o.optimizer == "sgd")
    optimizer =
        std::make_unique<mt::SGD>(net.parameters(), mt::SGDOptions{.lr = o.lr, .momentum = 0.9});
  else
    optimizer = std::make_unique<mt::AdamW>(net.parameters(),
                                            mt::AdamOptions{.lr = o.lr, .weight_decay = 0.01});

  mt::DataLoader loader(train, o.batch, o.shuffle, o.seed, mt::dist::shard());
  // Each process its own augmentation (rank 0's is the single process's).
  const uint64_t rank_salt = static_cast<uint64_t>(mt::dist::rank()) << 48;
  mt::Generator noise_generator(o.seed ^ 0x6e6f697365ULL ^ rank_salt);
  std::mt19937_64 shift_generator(o.seed ^ 0x7368696674ULL ^ rank_salt);
  mt::CosineWithWarmup cosine(o.lr, 0, o.steps);
  // What a checkpoint holds besides the model, the optimizer and the scaler, so that a resumed
  // run draws the same batches, noise and shifts as one never stopped. The shifts' generator, a
  // standard one, goes into the metadata as the text its operator<< writes.
  const mt::CheckpointOptions resumable{.generators = {{"noise", &noise_generator}},
                                        .loaders = {&loader}};
  // The flags that shape the run after its start, saved as metadata "flag.<name>": a resume
  // under others would not go on as the saved run did (the loader's state checks --batch,
  // --no-shuffle and --seed; the optimizer's and scaler's state their kinds).
  auto number = [](double v) { return nlohmann::json(v).dump(); };
  const examples::RunFlags shaping = {
      {"policy", o.policy},
      {"loss-scale", o.loss_scale},
      {"optimizer", o.optimizer},
      {"lr", number(o.lr)},
      {"label-smoothing", number(o.label_smoothing)},
      {"noise", number(o.noise)},
      {"shift", std::to_string(o.shift)},
      {"cosine", o.cosine ? "on" : "off"},
      {"steps", o.cosine ? std::to_string(o.steps) : "any"}};  // the cosine schedule's span
  auto save = [&](int64_t step) {
    std::ostringstream shifts;
    shifts << shift_generator;
    mt::save_checkpoint(
        o.save, net, optimizer.get(),
        examples::resumable_metadata(step, shaping, {{"shift_generator", shifts.str()}}), &scaler,
        resumable);
  };
  int64_t first_step = 1;
  if (!o.resume.empty()) {
    mt::Metadata meta;
    mt::load_checkpoint(o.resume, net, optimizer.get(), &meta, &scaler, resumable);
    first_step = examples::resumed_step(o.resume, meta, shaping, loader, o.steps) + 1;
    std::istringstream shift_state(examples::metadata_entry(meta, "shift_generator"));
    shift_state >> shift_generator;
    if (shift_state.fail())
      mt::fail(
          "{}: not a checkpoint that --save wrote during training (it has no shifts' "
          "generator)",
          o.resume);
  }
  mt::CrossEntropyOptions loss_options{.label_smoothing = o.label_smoothing};
  bool terminal = isatty(STDOUT_FILENO) != 0;
  int64_t report_every = std::max<int64_t>(1, o.steps / 10);
  examples::ProgressLine progress(o.steps, o.json_only);
  // Rank 0 alone writes the event file (--distributed; every rank's parameters are the same).
  const bool root = mt::dist::rank() == 0;
  std::unique_ptr<mt::SummaryWriter> writer = examples::open_logdir(root ? o.logdir : "");
  bool log_in_step = writer != nullptr;  // not in the exported step
  // gradient_health reads every gradient on the host: a few dozen times a run.
  int64_t health_every = std::max<int64_t>(1, o.steps / 30);
  // One training step; the loop feeds it noisy batches, and --export writes it as
  // <example>_train (the noise, the learning-rate schedule and the data stay outside).
  auto train_step = [&](const mt::Tensor& x, const mt::Tensor& y) {
    optimizer->zero_grad();
    mt::Tensor loss;
    {
      mt::autocast guard(policy);
      loss = mt::cross_entropy(net(x), y, loss_options);
    }
    scaler.scale(loss).backward();
    scaler.step(*optimizer);
    if (log_in_step) {  // graph values, read every 100 steps: no host sync in the step
      writer->add_scalar("loss", loss);
      writer->log_scaler(scaler);
      writer->log_learning_rate(*optimizer);
      writer->log_grad_norm(net.parameters());
    }
    scaler.update();
    return loss;
  };
  // The loop as users write it, replayed: mt::compile traces the step twice, then runs its
  // programs without tracing (--no-compile traces every step; the results are the same bits).
  auto compiled_step = mt::compile(train_step);
  double loss_value = 0;
  auto start = std::chrono::steady_clock::now();
  for (int64_t step = first_step; step <= o.steps; ++step) {
    mt::Batch batch = loader.next();
    if (o.cosine) optimizer->set_lr(cosine.lr(step - 1));
    mt::Tensor inputs =
        o.shift > 0 ? shifted(batch.inputs, o.shift, shift_generator) : batch.inputs;
    if (o.noise > 0)
      inputs = inputs + mt::randn(inputs.shape(), mt::f32, &noise_generator, 0, o.noise);
    if (writer) writer->set_step(step);
    mt::Tensor loss =
        o.compile ? compiled_step(inputs, batch.targets) : train_step(inputs, batch.targets);
    if (writer) writer->log_gradient_health(net, health_every);
    if (step == o.steps) loss_value = loss.item();
    if (o.save_every > 0 && step % o.save_every == 0 && step < o.steps) save(step);
    if (progress.due(step)) {
      progress.update(step, loss.item(), scaler.is_enabled() ? scaler.get_scale() : 0);
    } else if (!terminal && (step % report_every == 0 || step == o.steps)) {
      double seconds =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      log_line(o, step, loss.item(), static_cast<double>(step - first_step + 1) / seconds);
    }
  }
  progress.finish();
  log_in_step = false;
  if (writer) writer->flush();
  double train_seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();

  // Training is over: the processes part (the step exported below is one process's, without the
  // gradients' all_reduce, which would wait for the others).
  data_parallel.reset();
  // Saved first: an export that fails (no C compiler, a full disk) loses no trained weights.
  if (!o.save.empty() && root) save(o.steps);
  // The step is exported while the model still trains; the export puts the state back.
  if (!o.export_dir.empty() && root) {
    mt::aot::Options step_options{.name = o.example + "_train",
                                  .module = &net,
                                  .optimizer = optimizer.get(),
                                  .scaler = &scaler,
                                  .devices = mt::aot::exportable_devices()};
    mt::aot::export_step(
        [&](const mt::Tensor& x, const mt::Tensor& y) { return train_step(x, y).reshape({1}); },
        {mt::aot::input("x", {o.batch, 64}, mt::f32), mt::aot::input("y", {o.batch}, mt::i64)},
        {"loss"}, o.export_dir, step_options);
  }

  net.eval();
  auto classify = [&](const mt::Tensor& x) {
    mt::autocast guard(policy);
    return mt::cast(net(x), mt::f32);
  };
  std::vector<int64_t> all(static_cast<size_t>(test.size()));
  for (size_t i = 0; i < all.size(); ++i) all[i] = static_cast<int64_t>(i);
  mt::Batch test_batch = test.get_batch(all);
  std::vector<int64_t> predicted;
  {
    mt::NoGradGuard no_grad;
    mt::Tensor logits = classify(test_batch.inputs);
    predicted = mt::argmax(logits, -1).to_vector<int64_t>();
  }
  std::vector<int64_t> labels = test_batch.targets.to_vector<int64_t>();
  int64_t correct = 0;
  for (size_t i = 0; i < labels.size(); ++i) correct += predicted[i] == labels[i];
  double accuracy = static_cast<double>(correct) / static_cast<double>(labels.size());

  if (!o.export_dir.empty() && root) {
    mt::aot::Options options{.name = o.example,
                             .dynamic_batch = {.max = 1024},
                             .module = &net,
                             .devices = mt::aot::exportable_devices()};
    mt::aot::export_function(classify, {mt::aot::input("x", {1024, 64}, mt::f32)}, {"logits"},
                             o.export_dir, options);
    if (!o.json_only)
      std::printf(
          "exported to %s: %s (logits f32 [batch, 10] from x f32 [batch, 64], batch 1..1024, "
          "policy %s) and %s_train (one training step, batch %lld); see examples/deploy/\n",
          o.export_dir.c_str(), o.example.c_str(), o.policy.c_str(), o.example.c_str(),
          static_cast<long long>(o.batch));
  }
  if (!o.json_only)
    std::printf("test accuracy %.2f%% (%lld/%zu), %lld steps in %.1f s\n", accuracy * 100,
                static_cast<long long>(correct), labels.size(), static_cast<long long>(o.steps),
                train_seconds);
  nlohmann::ordered_json line{{"example", o.example},     {"test_accuracy", accuracy},
                              {"final_loss", loss_value}, {"steps", o.steps},
                              {"first_step", first_step}, {"train_seconds", train_seconds},
                              {"optimizer", o.optimizer}, {"batch", o.batch},
                              {"policy", o.policy},       {"loss_scale", o.loss_scale}};
  examples::print_json_line(std::move(line), scaler, o.compile, compiled_step.stats(),
                            o.distributed);
  return 0;
}

/// main() of a digits example: parses the flags and trains a fresh Model.
template <typename Model>
int main_of(const char* example, const Defaults& defaults, int argc, char** argv) {
  Options options = parse(example, defaults, argc, argv);
  try {
    mt::manual_seed(options.seed);  // the model's initial weights come from it
    Model net;
    return run(options, net);
  } catch (const mt::Error& e) {
    std::fprintf(stderr, "%s: error: %s\n", example, e.what());
    return 1;
  }
}

}  // namespace digits

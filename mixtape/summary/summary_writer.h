// mixtape/summary/summary_writer.h -- mt::SummaryWriter: a training run's curves as TensorBoard
// event files (loss, loss scale and skipped steps, learning rates, gradient norms and health).
#pragma once

#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

#include "mixtape/dsl/module.h"
#include "mixtape/dsl/optim.h"
#include "mixtape/dsl/tensor.h"

namespace mixtape {

class GradScaler;

struct SummaryWriterOptions {
  /// Graph values (add_scalar of a Tensor) wait until they span this many steps, then are
  /// read together: one evaluation and host read per fetch_every steps, not one per step.
  int64_t fetch_every = 100;
  /// In a run of many processes: each process writes a file of its own (name it a folder of its
  /// own), where by default process 0 alone writes (see SummaryWriter).
  bool every_process = false;
};

/// A hyperparameter's value for SummaryWriter::add_hparams: a number (of any arithmetic type
/// but bool), a text or a flag.
struct HParam {
  template <typename T>
  requires std::is_arithmetic_v<T> HParam(
      T v) {  // NOLINT(google-explicit-constructor): {"lr", 3e-4} as in torch's dict
    if constexpr (std::is_same_v<T, bool>)
      value = v;
    else
      value = static_cast<double>(v);
  }
  HParam(std::string v) : value(std::move(v)) {}    // NOLINT(google-explicit-constructor)
  HParam(const char* v) : value(std::string(v)) {}  // NOLINT(google-explicit-constructor)
  std::variant<double, std::string, bool> value;
};

/// Writes TensorBoard event files, as torch.utils.tensorboard.SummaryWriter does: a new file
/// events.out.tfevents.<time>.<host>.<pid>.<n> in `dir` (created with its parents), which
/// `tensorboard --logdir` and tools/plot_run.py read. Host values are written at once; graph
/// values are kept, and read in batches every fetch_every steps, at flush() and at destruction.
///
/// Inside a step compiled by mt::compile, a graph value is captured on every call of the step
/// (a copy, with no host sync) and logged at the writer's step() at that time: call set_step()
/// before each call of the compiled step.
///
///   mt::SummaryWriter writer("runs/fp16");
///   for (int64_t step = 1; step <= steps; ++step) {
///     writer.set_step(step);
///     mt::Tensor loss = train_step(x, y);     // compiled or not
///     writer.add_scalar("loss", loss);        // read with the next batch, no sync now
///   }
///
/// Every file write is checked (an mt::Error naming the file); flush() also fsyncs, so what
/// was flushed survives a crash. Not thread-safe.
///
/// In a run of many processes (made after mt::dist::init), process 0 alone writes a file; on
/// the others the writer makes no file (path() is empty) and drops what it logs, unless
/// `every_process` is set. Every process
/// may make one and make the same calls, which is what keeps their collectives alike where a
/// logged value needs one: under ZeRO (dist/zero.h), log_grad_norm all-reduces and
/// log_gradient_health exchanges counts, so every process must log them at the same steps. A
/// writer on process 0 alone serves a plain data-parallel run.
class SummaryWriter {
 public:
  explicit SummaryWriter(const std::string& dir, SummaryWriterOptions options = {});
  /// Fetches the pending values and flushes; errors there are swallowed (use flush() to see them).
  ~SummaryWriter();
  SummaryWriter(const SummaryWriter&) = delete;
  SummaryWriter& operator=(const SummaryWriter&) = delete;

  /// A host value, written now (as f32, TensorBoard's simple_value).
  void add_scalar(const std::string& tag, double value, int64_t step);
  /// A single-element graph value, logged at step(); read later in a batch (see above).
  void add_scalar(const std::string& tag, const Tensor& value);
  /// A histogram of the values (any shape) over TensorBoard's default buckets. Reads `values`
  /// on the host now (a sync): for every N steps, not every step.
  void add_histogram(const std::string& tag, const Tensor& values, int64_t step);
  void add_histogram(const std::string& tag, const std::vector<double>& values, int64_t step);
  /// An image, as torch's add_image: `image` laid out as `dataformats` says, "CHW" (1, 3 or 4
  /// channels), "HWC" or "HW" (one channel). Values are scaled by 255, clipped to [0, 255] and
  /// truncated to bytes after a cast to f32, as torch's (for every dtype but uint8, which
  /// mixtape lacks; torch 1.13 wraps values past [0, 1] around, later versions clip), NaN as 0; one
  /// channel is shown as gray (torch widens it to RGB). Written now as a PNG (libpng): reads the
  /// values on the host (a sync). An mt::Error for another layout or channel count, or an empty
  /// image.
  void add_image(const std::string& tag, const Tensor& image, int64_t step,
                 const std::string& dataformats = "CHW");
  /// torch's add_images: a batch of images ("NCHW" or "NHWC"; N >= 1) as one image, a grid of up
  /// to 8 columns filled row by row (torch's make_grid, the cells past the last image black and,
  /// with 4 channels, transparent); each image's values as add_image makes them.
  void add_images(const std::string& tag, const Tensor& images, int64_t step,
                  const std::string& dataformats = "NCHW");
  /// A text (a note on the run, a sample the model wrote; TensorBoard renders it as Markdown),
  /// written now under "<tag>/text_summary", as torch's add_text names it. Any bytes that are
  /// valid UTF-8.
  void add_text(const std::string& tag, const std::string& text, int64_t step);

  /// torch's add_hparams: one run of a sweep for TensorBoard's HParams dashboard, written to a
  /// new event file in the folder `run_name` (default: the time in seconds, as torch names it)
  /// inside this writer's: the hparams plugin's summaries of the run's hyperparameters (with the
  /// discrete `domains` a hyperparameter takes in the sweep, where given) and metric tags, and
  /// each metric as a scalar at step 0. Names and texts must be valid UTF-8, hyperparameters
  /// distinct, a domain's values of its hyperparameter's type, and `run_name` a folder inside
  /// this writer's; each is an mt::Error otherwise. A flag is written as a bool, where torch's
  /// takes Python's True for the number 1.
  ///   writer.add_hparams({{"lr", 3e-4}, {"policy", "autocast-bf16"}, {"layers", 4}},
  ///                      {{"hparam/val_loss", val_loss}});
  void add_hparams(const std::vector<std::pair<std::string, HParam>>& hparams,
                   const std::vector<std::pair<std::string, double>>& metrics,
                   const std::vector<std::pair<std::string, std::vector<HParam>>>& domains = {},
                   const std::string& run_name = "");

  /// The step graph values are logged at. Steps need not be consecutive.
  void set_step(int64_t step);
  int64_t step() const;

  /// "loss_scale": the scale this step used (1 for a disabled scaler), and "skipped": 1 if its
  /// gradients held inf/NaN and the step was skipped. Graph values (no sync); call after
  /// scaler.step(opt) and before scaler.update().
  void log_scaler(const GradScaler& scaler, const std::string& prefix = "");
  /// "lr" (or prefix + "lr"): the rate the optimizer's next step uses, its schedule's included;
  /// each further parameter group's as "lr/group<g>" (g >= 1). Graph values. An mt::Error for an
  /// optimizer that computes its own rate (Adafactor's relative step), as current_lr() is.
  void log_learning_rate(const Optimizer& optimizer, const std::string& prefix = "");
  /// "grad_norm": the global L2 norm of the gradients of `params`, as clip_grad_norm computes
  /// it (mt::grad_norm). A graph value.
  void log_grad_norm(const std::vector<Tensor>& params);
  /// gradient_health of the model's gradients when step() is a multiple of `every` (a host
  /// sync then; nothing otherwise): per parameter "grad_amax/<name>",
  /// "grad_zero_fraction/<name>" (values that are exactly zero), "grad_f16_underflow/<name>"
  /// and "grad_bf16_underflow/<name>" (of the non-zero values, those that round to zero in
  /// that type, at `scale`), and the same with "total" as the name. Call it outside a compiled
  /// step (it reads values on the host), after backward. Under ZeRO a collective (see above).
  void log_gradient_health(const Module& model, int64_t every, double scale = 1);

  /// Reads every pending graph value, writes it, flushes and fsyncs the file. Nothing once
  /// closed.
  void flush();
  /// flush(), then closes the file: later logging is an mt::Error, a later flush() or close()
  /// does nothing, and a step compiled to log here is traced again when next called.
  void close();
  /// The event file's path; empty on a process other than 0 (see above).
  const std::string& path() const;

 private:
  struct State;
  std::shared_ptr<State> state_;
};

}  // namespace mixtape

// mixtape/summary/summary_writer.cpp -- the event file, the pending graph values and the logging
// helpers.
#include "mixtape/summary/summary_writer.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <set>
#include <variant>

#include "mixtape/dsl/error.h"
#include "mixtape/dsl/graph.h"
#include "mixtape/dsl/ops.h"
#include "mixtape/dsl/process_group.h"
#include "mixtape/precision_policy/grad_health.h"
#include "mixtape/precision_policy/grad_scaler.h"
#include "mixtape/runtime/atomic_file.h"
#include "mixtape/summary/png.h"
#include "mixtape/summary/tfevents.h"

namespace mixtape {

namespace {

constexpr size_t kMaxPending = 1 << 14;

double now_seconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

std::string host_name() {
  char name[256] = {};
  if (gethostname(name, sizeof name - 1) != 0) return "localhost";
  return name;
}

}  // namespace

struct SummaryWriter::State {
  struct Pending {
    std::string tag;
    int64_t step;
    double wall_time;  // when it was logged, not when it is read
    Tensor value;
  };
  std::string dir, path;
  int fd = -1;
  SummaryWriterOptions options;
  int64_t step = 0;
  std::vector<Pending> pending;
  std::string buffer;   // framed events not yet written
  int64_t written = 0;  // bytes of whole records in the file
  std::string broken;   // why the file takes no more events (a failed write not cut back)
  bool closed = false;  // close() was called

  void check_open(const char* who) const {
    if (closed) fail("{}: the SummaryWriter writing '{}' was closed", who, path);
  }

  ~State() {
    if (fd >= 0) ::close(fd);
  }

  // Taken out of the buffer first: after a failed write its events are lost, never written twice.
  // A write that fails part way (a full disk) is cut back to the last whole record, so that the
  // events written after it are read: a reader stops at the first record whose checksum fails.
  // Without a file (a process other than 0), the events are dropped. A write that cannot be cut
  // back leaves a torn record, after which a reader sees nothing: every later write and flush
  // is then an mt::Error, not events silently lost.
  void write_buffer() {
    std::string out = std::move(buffer);
    buffer.clear();
    if (!broken.empty())
      fail(
          "SummaryWriter: '{}' takes no more events since a write failed and could not be cut "
          "back ({})",
          path, broken);
    if (out.empty() || fd < 0) return;
    try {
      write_all(fd, out.data(), out.size(), "summary event file " + path);
    } catch (const Error& e) {
      if (::ftruncate(fd, written) != 0 || ::lseek(fd, written, SEEK_SET) != written) {
        broken = fmt::format("{}; then: {}", e.what(), std::strerror(errno));
        ::close(fd);
        fd = -1;
      }
      throw;
    }
    written += static_cast<int64_t>(out.size());
  }

  void append(int64_t event_step, const std::vector<tfevents::Value>& values,
              double wall_time = now_seconds()) {
    buffer += tfevents::frame_record(tfevents::encode_event(wall_time, event_step, "", values));
  }

  // Reads every pending value with one evaluation and writes them, a step's values in one event.
  void fetch() {
    if (pending.empty()) return;
    std::vector<Pending> batch = std::move(pending);
    pending.clear();
    std::vector<Tensor> values;
    for (const Pending& p : batch) values.push_back(p.value);
    eval(values);
    std::vector<tfevents::Value> event;
    for (size_t i = 0; i < batch.size(); ++i) {
      event.push_back(
          {.tag = batch[i].tag, .simple_value = static_cast<float>(batch[i].value.item())});
      if (i + 1 == batch.size() || batch[i + 1].step != batch[i].step) {
        append(batch[i].step, event, batch[i].wall_time);
        event.clear();
      }
    }
    write_buffer();
  }

  // Also when many values wait (many tags, or steps set backwards), to bound what is kept.
  void maybe_fetch() {
    if (!pending.empty() &&
        (step - pending.front().step >= options.fetch_every || pending.size() >= kMaxPending))
      fetch();
  }

  // Inside a step compiled by mt::compile: the value of every call, at the writer's step then.
  class CaptureEachCall final : public StepHook {
   public:
    CaptureEachCall(std::weak_ptr<State> state, std::string tag)
        : state_(std::move(state)), tag_(std::move(tag)) {}
    // A step replayed after its writer was destroyed would log nowhere: traced again, it logs to
    // the writer it names then (a new one for a resumed run, say).
    const char* stale() const override {
      std::shared_ptr<State> state = state_.lock();
      if (!state) return "the SummaryWriter it logs to was destroyed";
      return state->closed ? "the SummaryWriter it logs to was closed" : nullptr;
    }
    void ran(const std::vector<std::shared_ptr<Storage>>& values) override {
      if (std::shared_ptr<State> state = state_.lock())
        state->pending.push_back(
            {tag_, state->step, now_seconds(), from_storage(values.at(0), {})});
    }

   private:
    std::weak_ptr<State> state_;
    std::string tag_;
  };
};

SummaryWriter::SummaryWriter(const std::string& dir, SummaryWriterOptions options)
    : state_(std::make_shared<State>()) {
  if (dir.find('\0') != std::string::npos)
    fail("SummaryWriter: the folder's name holds a NUL byte, which no path can");
  if (options.fetch_every < 1)
    fail("SummaryWriter: fetch_every must be at least 1, got {}", options.fetch_every);
  state_->options = options;
  state_->dir = dir;
  // In a run of many processes, process 0 alone writes; the others log the same values without
  // a file, so that their collectives stay the ones process 0 makes (summary_writer.h).
  if (process_rank() != 0 && !options.every_process) return;
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec || !std::filesystem::is_directory(dir))
    fail("SummaryWriter: cannot create the log folder '{}': {}", dir,
         ec ? ec.message() : "it is not a folder");
  // torch.utils.tensorboard's name: the time, host, pid and a per-process counter.
  // A name taken (a restarted container in the same second, with the same host name and pid)
  // takes the next counter, as a new file must never append to another run's.
  static std::atomic<int64_t> counter{0};
  double start = now_seconds();
  for (int attempt = 0; attempt < 1000 && state_->fd < 0; ++attempt) {
    state_->path = fmt::format("{}/events.out.tfevents.{:010d}.{}.{}.{}", dir,
                               static_cast<int64_t>(start), host_name(), ::getpid(), counter++);
    state_->fd = ::open(state_->path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
    if (state_->fd < 0 && errno != EEXIST) break;
  }
  if (state_->fd < 0)
    fail("SummaryWriter: cannot create '{}': {}", state_->path, std::strerror(errno));
  // The first event names the format version, as every TensorFlow writer's does.
  state_->buffer = tfevents::frame_record(tfevents::encode_event(start, 0, "brain.Event:2", {}));
  flush();
  // The new name is durable once its folder is synced too.
  int dir_fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  bool synced = dir_fd >= 0 && ::fsync(dir_fd) == 0;
  if (dir_fd >= 0) ::close(dir_fd);
  if (!synced) fail("SummaryWriter: cannot sync the folder '{}': {}", dir, std::strerror(errno));
}

SummaryWriter::~SummaryWriter() {
  try {
    flush();
  } catch (...) {  // NOLINT(bugprone-empty-catch): a destructor must not throw; flush() reports
  }
}

void SummaryWriter::add_scalar(const std::string& tag, double value, int64_t step) {
  state_->check_open("SummaryWriter.add_scalar");
  tfevents::check_tag(tag, "SummaryWriter.add_scalar");
  state_->append(step, {{.tag = tag, .simple_value = static_cast<float>(value)}});
  state_->write_buffer();
}

void SummaryWriter::add_scalar(const std::string& tag, const Tensor& value) {
  state_->check_open("SummaryWriter.add_scalar");
  tfevents::check_tag(tag, "SummaryWriter.add_scalar");
  if (!value.defined()) fail("SummaryWriter.add_scalar('{}'): the value is undefined", tag);
  if (value.numel() != 1)
    fail("SummaryWriter.add_scalar('{}'): the value must have one element, got shape {}", tag,
         to_string(value.shape()));
  // A node of the writer's own, 0-d: mt::compile hands host work no value the step returns, and
  // a captured copy is then simply a scalar. A change of dtype always makes a new node, and
  // f64 (f32 for an f64 value) holds the value as exactly as the f32 written.
  NoGradGuard no_grad;
  Tensor scalar_value = value.shape().empty() ? value : reshape(value, {});
  scalar_value = cast(scalar_value, value.dtype() == f64 ? f32 : f64);
  if (on_each_call(std::make_shared<State::CaptureEachCall>(state_, tag), {scalar_value.node()}))
    return;
  // Outside a compiled step: computed by the next evaluation of anything (the next training
  // step's program), which then keeps only the value, not the graph that made it.
  Tensor holder = zeros({}, scalar_value.dtype());
  holder.assign_later(scalar_value);
  state_->pending.push_back({tag, state_->step, now_seconds(), holder});
  state_->maybe_fetch();
}

void SummaryWriter::add_histogram(const std::string& tag, const std::vector<double>& values,
                                  int64_t step) {
  state_->check_open("SummaryWriter.add_histogram");
  tfevents::check_tag(tag, "SummaryWriter.add_histogram");
  state_->append(step, {{.tag = tag, .histo = tfevents::make_histogram(values)}});
  state_->write_buffer();
}

namespace {

// An image summary of `image` laid out as `layout` ("CHW", "HWC", "HW", or a batch "NCHW",
// "NHWC"), as torch's image(): bytes of x * 255 in f32, clipped (torch 1.13 wraps) and
// truncated, NaN as 0; one channel repeated into three (convert_to_HWC); a batch tiled into a
// grid of up to 8 columns, row after row, the cells past the last image zero (its make_grid).
tfevents::Image image_summary(const std::string& tag, const Tensor& image,
                              const std::string& layout, const char* who) {
  if (!image.defined()) fail("{}('{}'): the image is undefined", who, tag);
  if (image.dim() != static_cast<int64_t>(layout.size()))
    fail("{}('{}'): an image laid out {} has {} axes, got shape {}", who, tag, layout,
         layout.size(), to_string(image.shape()));
  // Each named axis's size and stride (1 and 0 where the layout has none).
  auto axis = [&](char name) -> std::pair<int64_t, int64_t> {
    const size_t at = layout.find(name);
    if (at == std::string::npos) return {1, 0};
    int64_t stride = 1;
    for (size_t k = at + 1; k < layout.size(); ++k) stride *= image.size(static_cast<int64_t>(k));
    return {image.size(static_cast<int64_t>(at)), stride};
  };
  const auto [count, n_stride] = axis('N');
  const auto [channels, c_stride] = axis('C');
  const auto [height, y_stride] = axis('H');
  const auto [width, x_stride] = axis('W');
  if (channels != 1 && channels != 3 && channels != 4)
    fail("{}('{}'): an image has 1, 3 or 4 channels, got shape {} ({})", who, tag,
         to_string(image.shape()), layout);
  if (count < 1)
    fail("{}('{}'): no images in shape {} ({})", who, tag, to_string(image.shape()), layout);
  const int64_t columns = std::min<int64_t>(count, 8), rows = (count + columns - 1) / columns;
  if (height < 1 || width < 1 || height * rows > kMaxPngSide || width * columns > kMaxPngSide)
    fail("{}('{}'): an image's height and width must be in [1, {}], got shape {} ({})", who, tag,
         kMaxPngSide, to_string(image.shape()), layout);
  const std::vector<float> values = cast(image, f32).to_vector<float>();
  const int64_t shown = channels == 1 ? 3 : channels;
  const int64_t canvas_height = height * rows, canvas_width = width * columns;
  std::vector<uint8_t> pixels(static_cast<size_t>(canvas_height * canvas_width * shown), 0);
  for (int64_t n = 0; n < count; ++n)
    for (int64_t y = 0; y < height; ++y)
      for (int64_t x = 0; x < width; ++x)
        for (int64_t k = 0; k < shown; ++k) {
          const int64_t c = channels == 1 ? 0 : k;
          const float v = values[static_cast<size_t>(n * n_stride + c * c_stride + y * y_stride +
                                                     x * x_stride)] *
                          255.0f;
          const int64_t canvas_y = n / columns * height + y, canvas_x = n % columns * width + x;
          pixels[static_cast<size_t>((canvas_y * canvas_width + canvas_x) * shown + k)] =
              std::isnan(v) ? 0 : static_cast<uint8_t>(std::clamp(v, 0.0f, 255.0f));
        }
  return {canvas_height, canvas_width, shown,
          encode_png(pixels, canvas_height, canvas_width, shown, who)};
}

}  // namespace

void SummaryWriter::add_image(const std::string& tag, const Tensor& image, int64_t step,
                              const std::string& dataformats) {
  const char* who = "SummaryWriter.add_image";
  state_->check_open(who);
  tfevents::check_tag(tag, who);
  if (dataformats != "CHW" && dataformats != "HWC" && dataformats != "HW")
    fail("{}('{}'): dataformats must be \"CHW\", \"HWC\" or \"HW\", got \"{}\"", who, tag,
         dataformats);
  state_->append(step, {{.tag = tag, .image = image_summary(tag, image, dataformats, who)}});
  state_->write_buffer();
}

void SummaryWriter::add_images(const std::string& tag, const Tensor& images, int64_t step,
                               const std::string& dataformats) {
  const char* who = "SummaryWriter.add_images";
  state_->check_open(who);
  tfevents::check_tag(tag, who);
  if (dataformats != "NCHW" && dataformats != "NHWC")
    fail("{}('{}'): dataformats must be \"NCHW\" or \"NHWC\", got \"{}\"", who, tag, dataformats);
  state_->append(step, {{.tag = tag, .image = image_summary(tag, images, dataformats, who)}});
  state_->write_buffer();
}

void SummaryWriter::add_text(const std::string& tag, const std::string& text, int64_t step) {
  state_->check_open("SummaryWriter.add_text");
  tfevents::check_tag(tag, "SummaryWriter.add_text");
  // A protobuf string: TensorBoard's reader decodes it as UTF-8 too.
  tfevents::check_utf8(text, "SummaryWriter.add_text", "text");
  state_->append(step, {{.tag = tag + "/text_summary", .text = text}});
  state_->write_buffer();
}

void SummaryWriter::add_histogram(const std::string& tag, const Tensor& values, int64_t step) {
  if (!values.defined()) fail("SummaryWriter.add_histogram('{}'): the values are undefined", tag);
  add_histogram(tag, cast(values, f64).to_vector<double>(), step);
}

void SummaryWriter::add_hparams(
    const std::vector<std::pair<std::string, HParam>>& hparams,
    const std::vector<std::pair<std::string, double>>& metrics,
    const std::vector<std::pair<std::string, std::vector<HParam>>>& domains,
    const std::string& run_name) {
  const char* who = "SummaryWriter.add_hparams";
  state_->check_open(who);
  tfevents::HParamsRun run;
  std::set<std::string> names;
  for (const auto& [name, value] : hparams) {
    tfevents::check_utf8(name, who, "hyperparameter's name");
    if (const auto* text = std::get_if<std::string>(&value.value))
      tfevents::check_utf8(*text, who, "hyperparameter's text");
    if (!names.insert(name).second) fail("{}: the hyperparameter '{}' is given twice", who, name);
    run.hparams.emplace_back(name, value.value);
  }
  // torch's checks of hparam_domain_discrete: a domain of a hyperparameter given, its values of
  // the hyperparameter's type.
  std::set<std::string> domain_names;
  for (const auto& [name, values] : domains) {
    auto given = std::find_if(hparams.begin(), hparams.end(),
                              [&](const auto& entry) { return entry.first == name; });
    if (given == hparams.end())
      fail("{}: a domain for '{}', which is not a hyperparameter given", who, name);
    if (!domain_names.insert(name).second) fail("{}: the domain of '{}' is given twice", who, name);
    std::vector<tfevents::HParamValue> list;
    for (const HParam& v : values) {
      if (v.value.index() != given->second.value.index())
        fail("{}: the domain of '{}' holds a value of another type than its value", who, name);
      if (const auto* text = std::get_if<std::string>(&v.value))
        tfevents::check_utf8(*text, who, "domain's text");
      list.push_back(v.value);
    }
    run.domains.emplace_back(name, std::move(list));
  }
  std::set<std::string> tags;
  for (const auto& [tag, value] : metrics) {
    tfevents::check_tag(tag, who);
    if (!tags.insert(tag).second) fail("{}: the metric '{}' is given twice", who, tag);
    run.metrics.push_back(tag);
  }
  // torch's default: the time as the run's name, a folder in this writer's.
  std::string name = run_name.empty() ? fmt::format("{:.6f}", now_seconds()) : run_name;
  // A folder name TensorBoard's readers can walk: its Python reader stops at one that is not
  // UTF-8, dropping every run of the folder.
  tfevents::check_utf8(name, who, "run's name");
  if (name.find('\0') != std::string::npos)
    fail("{}: the run's name holds a NUL byte, which no path can", who);
  const std::filesystem::path relative(name);
  if (relative.is_absolute() ||
      std::any_of(relative.begin(), relative.end(), [](const auto& part) { return part == ".."; }))
    fail("{}: the run's name '{}' must be a folder inside the writer's", who, name);
  if (state_->path.empty()) return;  // a process that writes no file (see the class)
  SummaryWriter session((std::filesystem::path(state_->dir) / relative).string(), state_->options);
  session.state_->append(0, tfevents::hparams_values(run));
  for (const auto& [tag, value] : metrics)
    session.state_->append(0, {{.tag = tag, .simple_value = static_cast<float>(value)}});
  session.close();
}

void SummaryWriter::set_step(int64_t step) {
  state_->step = step;
  state_->maybe_fetch();
}

int64_t SummaryWriter::step() const { return state_->step; }

void SummaryWriter::log_scaler(const GradScaler& scaler, const std::string& prefix) {
  // A disabled scaler keeps its initial scale but scales by 1, as get_scale() says.
  add_scalar(prefix + "loss_scale", scaler.is_enabled() ? scaler.scale_tensor() : scalar(1.0));
  add_scalar(prefix + "skipped", scaler.found_inf());
}

void SummaryWriter::log_learning_rate(const Optimizer& optimizer, const std::string& prefix) {
  // Group 0's keeps its tag when groups are added (add_param_group), so its curve goes on.
  add_scalar(prefix + "lr", optimizer.current_lr());
  for (size_t g = 1; g < optimizer.group_count(); ++g)
    add_scalar(fmt::format("{}lr/group{}", prefix, g), optimizer.current_lr(g));
}

void SummaryWriter::log_grad_norm(const std::vector<Tensor>& params) {
  add_scalar("grad_norm", grad_norm(params));
}

void SummaryWriter::log_gradient_health(const Module& model, int64_t every, double scale) {
  if (every < 1) fail("SummaryWriter.log_gradient_health: every must be at least 1, got {}", every);
  if (state_->step % every != 0) return;
  state_->check_open("SummaryWriter.log_gradient_health");
  GradientHealth health = gradient_health(model, scale);
  std::vector<tfevents::Value> values;
  auto add = [&](const GradientHealthRow& row) {
    double zero = row.numel > 0 ? static_cast<double>(row.numel - row.nonzero - row.nonfinite) /
                                      static_cast<double>(row.numel)
                                : 0.0;
    for (auto [name, value] :
         {std::pair{"grad_amax/", row.amax}, std::pair{"grad_zero_fraction/", zero},
          std::pair{"grad_f16_underflow/", row.f16_zero_fraction()},
          std::pair{"grad_bf16_underflow/", row.bf16_zero_fraction()}})
      values.push_back({.tag = name + row.name, .simple_value = static_cast<float>(value)});
  };
  for (const GradientHealthRow& row : health.rows) add(row);
  add(health.total);
  for (const tfevents::Value& value : values)
    tfevents::check_tag(value.tag, "SummaryWriter.log_gradient_health");
  state_->append(state_->step, values);
  state_->write_buffer();
}

void SummaryWriter::flush() {
  if (state_->closed) return;
  state_->fetch();
  state_->write_buffer();
  if (state_->fd >= 0 && ::fsync(state_->fd) != 0)
    fail("SummaryWriter: cannot sync '{}': {}", state_->path, std::strerror(errno));
}

void SummaryWriter::close() {
  if (state_->closed) return;
  flush();
  state_->closed = true;
  if (state_->fd >= 0 && ::close(state_->fd) != 0)
    fail("SummaryWriter: cannot close '{}': {}", state_->path, std::strerror(errno));
  state_->fd = -1;
}

const std::string& SummaryWriter::path() const { return state_->path; }

}  // namespace mixtape

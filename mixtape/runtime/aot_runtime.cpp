// mixtape/runtime/aot_runtime.cpp -- opens an exported artifact (manifest, checksums, plan,
// weights) and replays its plan through the same executor as mt::compile, with the artifact's
// kernels.
#include "mixtape/runtime/aot_runtime.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <charconv>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <map>
#include <mutex>
#include <string>
#include <string_view>
#include <unordered_map>

#include "mixtape/dsl/convert.h"
#include "mixtape/dsl/error.h"
#include "mixtape/dsl/json.h"
#include "mixtape/dsl/optimizer_entries.h"
#include "mixtape/runtime/aot_cuda_image.h"
#include "mixtape/runtime/aot_plan.h"
#include "mixtape/runtime/checkpoint.h"
#include "mixtape/runtime/cpu_features.h"
#include "mixtape/runtime/cpu_kernels.h"
#include "mixtape/runtime/cublaslt.h"
#include "mixtape/runtime/cuda_attention.h"
#include "mixtape/runtime/cuda_driver.h"
#include "mixtape/runtime/cuda_executor.h"
#include "mixtape/runtime/cuda_fixed_kernels.h"
#include "mixtape/runtime/cuda_values.h"
#include "mixtape/runtime/device.h"
#include "mixtape/runtime/file_digest.h"
#include "mixtape/runtime/safetensors.h"
#include "mixtape/runtime/step_plan.h"

namespace mt = mixtape;

namespace {

using mt::json::Value;

constexpr const char* kManifestFormat = "mixtape-aot-1";
// Bounds on what a manifest and a plan may cost to parse: far above any real artifact's.
constexpr size_t kMaxManifestBytes = 64u << 20;
constexpr size_t kMaxJsonValues = 64u << 20;
// Plans kept for batch sizes a dynamic-batch model ran at (each is a few programs).
constexpr size_t kMaxCachedPlans = 8;

struct AotError {
  int code;
  std::string message;
};

[[noreturn]] void raise(int code, std::string message) { throw AotError{code, std::move(message)}; }

struct Argument {
  std::string name;
  mt::DType dtype;
  mt::Shape shape;  // at the export batch
};

struct KernelEntry {
  mt::KernelFunction function;
  int64_t dim0;  // the largest dims[0] it was compiled for
};

thread_local std::string thread_error;

// At most `limit` bytes of the file at path, from its start. Opened without waiting: a FIFO in
// the artifact's place (no writer ever) made a blocking open hang for good. A FIFO is read as it
// comes, while a writer sends within the wait; anything else but a regular file is refused.
std::string read_at_most(const std::string& path, size_t limit) {
  constexpr int kFifoWaitMs = 5'000;
  const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0)
    raise(MIXTAPE_AOT_ERROR_FILE, fmt::format("{}: cannot open: {}", path, std::strerror(errno)));
  struct Closer {
    int fd;
    ~Closer() { ::close(fd); }
  } closer{fd};
  struct stat status {};
  if (::fstat(fd, &status) != 0 || !(S_ISREG(status.st_mode) || S_ISFIFO(status.st_mode)))
    raise(MIXTAPE_AOT_ERROR_FILE, fmt::format("{}: not a regular file", path));
  const bool fifo = S_ISFIFO(status.st_mode);
  if (!fifo) ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) & ~O_NONBLOCK);
  std::string text;
  char chunk[1 << 16];
  while (text.size() < limit) {
    if (fifo) {
      pollfd ready{fd, POLLIN, 0};
      const int polled = ::poll(&ready, 1, kFifoWaitMs);
      if (polled == 0)
        raise(MIXTAPE_AOT_ERROR_FILE,
              fmt::format("{}: a FIFO that sent nothing for {} s", path, kFifoWaitMs / 1000));
      if (polled < 0 && errno != EINTR)
        raise(MIXTAPE_AOT_ERROR_FILE, fmt::format("{}: {}", path, std::strerror(errno)));
    }
    const ssize_t n = ::read(fd, chunk, std::min(sizeof chunk, limit - text.size()));
    if (n == 0) break;
    if (n < 0) {
      if (errno == EINTR || errno == EAGAIN) continue;
      raise(MIXTAPE_AOT_ERROR_FILE, fmt::format("{}: cannot read: {}", path, std::strerror(errno)));
    }
    text.append(chunk, static_cast<size_t>(n));
  }
  return text;
}

std::string read_text(const std::string& path, size_t limit) {
  std::string text = read_at_most(path, limit + 1);
  if (text.size() > limit)
    raise(MIXTAPE_AOT_ERROR_FILE, fmt::format("{}: larger than {} bytes", path, limit));
  return text;
}

// Whole decimal text, as load_checkpoint reads its integers.
uint64_t parse_uint64(const std::string& text, const char* what) {
  uint64_t value = 0;
  auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (text.empty() || ec != std::errc() || end != text.data() + text.size())
    raise(MIXTAPE_AOT_ERROR_FILE,
          fmt::format("{} '{}' is not a 64-bit unsigned integer", what, text));
  return value;
}

std::vector<Argument> arguments(const Value& list) {
  std::vector<Argument> out;
  for (const Value& v : list) {
    Argument a{
        v.at("name").get<std::string>(), mt::parse_dtype(v.at("dtype").get<std::string>()), {}};
    for (const Value& d : v.at("shape")) a.shape.push_back(d.get<int64_t>());
    out.push_back(std::move(a));
  }
  return out;
}

}  // namespace

struct mixtape_aot_model {
  std::mutex busy;  // held by each call on the handle (guarded)
  std::string dir, name, error;
  std::string cpu_target;  // the kernel variant in use
  mt::Device device = mt::Device::cpu;
  mt::cuda::CUmodule cuda_module = nullptr;  // cuda: the artifact's kernels, loaded
  std::vector<int64_t> cuda_batches;         // cuda: the batch sizes its kernels are for
  Value manifest;
  std::optional<mt::aot::PlanDocument> plan_doc;
  bool step = false;
  int64_t export_batch = 0, max_batch = 0;  // max_batch 0: the batch is fixed
  std::vector<Argument> inputs, outputs;
  std::vector<mt::StoragePtr> buffers;
  std::vector<mt::aot::PlanBuffer> buffer_info;
  std::vector<bool> checkpointed;  // per buffer: saved by NAME_save under its name
  int64_t steps_buffer = -1;       // the optimizer's step count, saved as metadata
  // Parameters that count their own steps: (parameter path, buffer), saved as metadata
  // "optimizer.<path>.steps" where it differs from the optimizer's.
  std::vector<std::pair<std::string, int64_t>> param_steps;
  std::vector<std::pair<std::string, std::string>> checkpoint_metadata;
  struct Generator {
    std::string name;
    uint64_t seed;   // compiled into the plan's draws
    int64_t buffer;  // its offset (the bits of a uint64 in an i64)
  };
  std::vector<Generator> generators;  // saved as metadata "generator.<name>.seed" / ".offset"
  struct Rate {
    size_t group;
    int64_t f64, f32;  // the rate's leaves (0-d f64 and f32 buffers), as set_lr() writes them
  };
  // The groups whose rate the step reads rather than computes (no schedule): saved as metadata
  // "optimizer.lr" or each group's "lr" of "optimizer.param_groups".
  std::vector<Rate> rates;
  std::unordered_map<std::string, KernelEntry> kernels;
  std::map<int64_t, std::unique_ptr<mt::Plan>> plans;  // by batch
  std::vector<int64_t> plan_order;                     // least recently used first

  std::string path(const std::string& file) const { return dir + "/" + file; }

  mt::KernelRef find_kernel(const mt::kir::Kernel& kernel) const {
    if (device == mt::Device::cuda) {
      try {
        return mt::prebuilt_cuda_kernel(cuda_module, kernel);
      } catch (const mt::Error& e) {
        raise(MIXTAPE_AOT_ERROR_RUN,
              fmt::format("{}: the artifact's CUDA module has no kernel {} ({})", name, kernel.name,
                          e.what()));
      }
    }
    auto found = kernels.find(mt::aot::kernel_key(kernel));
    if (found == kernels.end() ||
        (mt::aot::serves_smaller_dim0(kernel) && kernel.dims[0] > found->second.dim0))
      raise(MIXTAPE_AOT_ERROR_RUN,
            fmt::format("{}: the artifact has no kernel for {} at this batch size (its graph "
                        "fuses differently here than at the batch sizes traced at export)",
                        name, kernel.name));
    return mt::ready_cpu_kernel({found->second.function, nullptr});
  }

  mt::Plan& plan_for(int64_t batch) {
    auto found = plans.find(batch);
    if (found == plans.end()) {
      if (plans.size() >= kMaxCachedPlans) {
        release(*plans.at(plan_order.front()));
        plans.erase(plan_order.front());
        plan_order.erase(plan_order.begin());
      }
      auto plan = mt::aot::plan_from_json(
          *plan_doc, batch, buffers, [&](const mt::kir::Kernel& k) { return find_kernel(k); },
          device);
      found = plans.emplace(batch, std::move(plan)).first;
    } else {
      std::erase(plan_order, batch);
    }
    plan_order.push_back(batch);
    return *found->second;
  }

  // The batch the programs run at for `batch` rows: on cuda, the smallest batch the kernels
  // were compiled for that holds them (the rows beyond are zero).
  int64_t run_batch(int64_t batch) const {
    if (device != mt::Device::cuda) return batch;
    for (int64_t b : cuda_batches)
      if (b >= batch) return b;
    raise(MIXTAPE_AOT_ERROR_RUN,
          fmt::format("{}: no CUDA kernels for batch {} (the artifact has {})", name, batch,
                      fmt::join(cuda_batches, ", ")));
  }

  mt::Shape shape_at(const Argument& a, int64_t batch) const {
    mt::Shape shape = a.shape;
    if (max_batch > 0 && !shape.empty()) shape[0] = batch;
    return shape;
  }
};

namespace {

// The manifest's list of files: the ones an artifact needs are there, all in its directory.
void check_file_list(const mixtape_aot_model& m) {
  const Value& files = m.manifest.at("files");
  for (const std::string& needed : {m.name + ".plan", m.name + ".safetensors"})
    if (!mt::json::find(files, needed))
      raise(MIXTAPE_AOT_ERROR_FILE,
            fmt::format("{}: the manifest has no checksum for {}", m.name, needed));
  for (const auto& [file, info] : files.items())
    if (file.find('/') != std::string::npos || file == "..")
      raise(MIXTAPE_AOT_ERROR_FILE, fmt::format("{}: the manifest lists a file outside its "
                                                "directory: {}",
                                                m.name, file));
}

// A file of the artifact, read once and checked against the manifest's size and XXH3: the bytes
// returned are the bytes checked, so a file swapped after the check is never used.
std::string read_checked(const mixtape_aot_model& m, const std::string& file) {
  const Value* info = mt::json::find(m.manifest.at("files"), file);
  if (!info)
    raise(MIXTAPE_AOT_ERROR_FILE,
          fmt::format("{}: the manifest has no checksum for {}", m.name, file));
  int64_t recorded = info->at("bytes").get<int64_t>();
  if (recorded < 0)
    raise(MIXTAPE_AOT_ERROR_FILE,
          fmt::format("{}: the manifest records {} bytes for {}", m.name, recorded, file));
  // One byte more than recorded tells a longer file without reading all of it.
  std::string text = read_at_most(m.path(file), static_cast<size_t>(recorded) + 1);
  mt::FileDigest digest = mt::digest_bytes(text);
  const std::string& xxh3 = info->at("xxh3_64").get<std::string>();
  if (digest.bytes != recorded || digest.xxh3_64 != xxh3)
    raise(MIXTAPE_AOT_ERROR_FILE,
          fmt::format("{}: {} is corrupt or was replaced: {}{} bytes with xxh3_64 {}, the "
                      "manifest recorded {} bytes with {}",
                      m.name, m.path(file), digest.bytes > recorded ? "over " : "", digest.bytes,
                      digest.xxh3_64, recorded, xxh3));
  return text;
}

// The buffers from the weights file's checked bytes, which it consumes (one copy at a time).
void load_buffers(mixtape_aot_model& m, std::string&& weight_bytes) {
  std::string weights = m.path(m.name + ".safetensors");
  mt::safetensors::File file;
  try {
    file = mt::safetensors::parse(
        std::as_bytes(std::span<const char>(weight_bytes.data(), weight_bytes.size())), weights);
  } catch (const mt::Error& e) {
    raise(MIXTAPE_AOT_ERROR_FILE, e.what());
  }
  std::string().swap(weight_bytes);
  for (const Value& b : m.manifest.at("buffers")) {
    mt::aot::PlanBuffer info{
        b.at("name").get<std::string>(), mt::parse_dtype(b.at("dtype").get<std::string>()), {}};
    for (const Value& d : b.at("shape")) info.shape.push_back(d.get<int64_t>());
    mt::check_shape_size("artifact buffer", info.shape, info.dtype, mt::Loc::current());
    const mt::safetensors::TensorData* data = nullptr;
    if (b.at("saved").get<bool>()) {
      data = file.find(info.name);
      if (!data || data->dtype != info.dtype || data->shape != info.shape)
        raise(MIXTAPE_AOT_ERROR_FILE,
              fmt::format("{}: {} holds no {} tensor '{}' of shape {}", m.name, weights,
                          mt::name(info.dtype), info.name, mt::to_string(info.shape)));
    }
    mt::StoragePtr storage;
    if (const Value* same =
            mt::json::find(b, "same_as")) {  // a second name of one tensor (tied weights)
      int64_t first = same->get<int64_t>();
      if (first < 0 || first >= static_cast<int64_t>(m.buffers.size()) ||
          m.buffers[first]->dtype != info.dtype || m.buffers[first]->count != mt::numel(info.shape))
        raise(
            MIXTAPE_AOT_ERROR_FILE,
            fmt::format("{}: buffer '{}' is the same as a buffer it cannot be", m.name, info.name));
      storage = m.buffers[first];
    } else {
      storage = std::make_shared<mt::Storage>(info.dtype, mt::numel(info.shape));
      if (data) std::memcpy(storage->bytes.data(), data->bytes.data(), data->bytes.size());
    }
    m.checkpointed.push_back(b.at("checkpoint").get<bool>());
    m.buffers.push_back(std::move(storage));
    m.buffer_info.push_back(std::move(info));
  }
}

// The variant `device` asks for ("cpu": the first this CPU runs, "cpu:TARGET": that one).
const mixtape_aot_variant& choose_variant(const mixtape_aot_model& m, const std::string& device,
                                          const mixtape_aot_variant* variants, int64_t count) {
  std::string wanted = device.starts_with("cpu:") ? device.substr(4) : "";
  std::vector<std::string> refusals;
  for (int64_t v = 0; v < count; ++v) {
    const mixtape_aot_variant& variant = variants[v];
    if (!variant.target || (variant.feature_count > 0 && !variant.features) ||
        variant.feature_count < 0 || (variant.kernel_count > 0 && !variant.kernels) ||
        variant.kernel_count < 0)
      raise(MIXTAPE_AOT_ERROR_ARGUMENT,
            fmt::format("{}: kernel variant {} is malformed", m.name, v));
    if (!wanted.empty() && wanted != variant.target) continue;
    std::vector<std::string> features;
    for (int64_t f = 0; f < variant.feature_count; ++f) {
      if (!variant.features[f])
        raise(MIXTAPE_AOT_ERROR_ARGUMENT,
              fmt::format("{}: a feature of {} is NULL", m.name, variant.target));
      features.push_back(variant.features[f]);
    }
    std::vector<std::string> missing = mt::missing_cpu_features(features);
    if (missing.empty()) return variant;
    refusals.push_back(fmt::format("{} needs {}", variant.target, fmt::join(missing, ", ")));
  }
  if (!wanted.empty() && refusals.empty()) {
    std::vector<std::string> targets;
    for (int64_t v = 0; v < count; ++v) targets.push_back(variants[v].target);
    raise(MIXTAPE_AOT_ERROR_ARGUMENT, fmt::format("{}: no kernels for cpu target '{}' (the "
                                                  "artifact has: {})",
                                                  m.name, wanted, fmt::join(targets, ", ")));
  }
  raise(MIXTAPE_AOT_ERROR_DEVICE,
        fmt::format("{}: this CPU lacks features every kernel build of the artifact uses ({}); "
                    "export it again with a cpu target this CPU has (Options::cpu_targets)",
                    m.name, fmt::join(refusals, "; ")));
}

// Why the GPU cannot run an artifact's kernels ("" when it can): the driver, a device, and
// cuBLASLt for the matmuls. NVRTC is not needed: the kernels are compiled.
std::string gpu_unusable_reason() {
  if (!mt::cuda::available()) return mt::cuda::unavailable_reason();
  if (!mt::cuda::cublaslt_available()) return mt::cuda::cublaslt_unavailable_reason();
  return {};
}

// The manifest's CUDA images by arch, in its order.
std::vector<std::string> cuda_archs(const mixtape_aot_model& m) {
  std::vector<std::string> archs;
  for (const Value& image : m.manifest.at("cuda").at("images"))
    archs.push_back(image.at("arch").get<std::string>());
  return archs;
}

// The index of the manifest's image this GPU runs (aot::cuda_image_for), -1 when none.
int cuda_image(const mixtape_aot_model& m) {
  try {
    return mt::aot::cuda_image_for(cuda_archs(m), mt::cuda::compute_capability());
  } catch (const mt::Error& e) {
    raise(MIXTAPE_AOT_ERROR_FILE, fmt::format("{}: {}", m.name, e.what()));
  }
}

// The module for this GPU (aot::cuda_image_for), loaded once per process and image, as the JIT
// keeps its modules.
void open_cuda(mixtape_aot_model& m) {
  const Value& info = m.manifest.at("cuda");
  for (const Value& b : info.at("batches")) m.cuda_batches.push_back(b.get<int64_t>());
  if (m.cuda_batches.empty() || !std::is_sorted(m.cuda_batches.begin(), m.cuda_batches.end()))
    raise(MIXTAPE_AOT_ERROR_FILE, fmt::format("{}: the manifest's cuda batches are not a sorted "
                                              "list",
                                              m.name));
  int index = cuda_image(m);
  if (index < 0) {
    int cc = mt::cuda::compute_capability();
    raise(MIXTAPE_AOT_ERROR_DEVICE,
          fmt::format("{}: this GPU ({}, compute capability {}.{}) runs none of the artifact's "
                      "CUDA builds ({}); export it again with its arch in Options::cuda_archs",
                      m.name, mt::cuda::device_name(), cc / 10, cc % 10,
                      fmt::join(cuda_archs(m), ", ")));
  }
  const Value* chosen = &info.at("images").at(static_cast<size_t>(index));
  const std::string& file = chosen->at("file").get<std::string>();
  std::string image = read_checked(m, file);
  const std::string& digest = m.manifest.at("files").at(file).at("xxh3_64").get<std::string>();
  static std::mutex mutex;
  static std::map<std::string, mt::cuda::CUmodule> modules;  // by the image's XXH3
  std::lock_guard<std::mutex> lock(mutex);
  mt::cuda::CUmodule& module = modules[digest];
  if (!module) {
    try {
      module = mt::cuda::load_module(std::span<const char>(image.data(), image.size()));
    } catch (const mt::Error& e) {
      raise(MIXTAPE_AOT_ERROR_DEVICE, fmt::format("{}: {}: {}", m.name, m.path(file), e.what()));
    }
  }
  m.cuda_module = module;
  mt::use_prebuilt_fixed_kernels(module);
  mt::use_prebuilt_attention_kernels(module);
}

void open_model(mixtape_aot_model& m, const std::string& manifest_xxh3, const char* device,
                const mixtape_aot_variant* variants, int64_t variant_count) {
  std::string manifest_path = m.path(m.name + ".json");
  std::string manifest_text = read_text(manifest_path, kMaxManifestBytes);
  try {
    m.manifest = mt::json::parse(manifest_text, kMaxJsonValues);
  } catch (const mt::Error& e) {
    raise(MIXTAPE_AOT_ERROR_FILE, fmt::format("{}: not a manifest: {}", manifest_path, e.what()));
  }
  const Value& manifest = m.manifest;
  const Value* format = mt::json::find(manifest, "format");
  const Value* version = mt::json::find(manifest, "mixtape_version");
  if (!format || !format->is_string() || format->get<std::string>() != kManifestFormat ||
      !version || !version->is_string() || version->get<std::string>() != MIXTAPE_RUNTIME_VERSION)
    raise(MIXTAPE_AOT_ERROR_VERSION,
          fmt::format("{}: written by mixtape {} (format {}); this runtime is mixtape {} and reads "
                      "format {}: export the model again with this version",
                      manifest_path,
                      version && version->is_string() ? version->get<std::string>() : "?",
                      format && format->is_string() ? format->get<std::string>() : "?",
                      MIXTAPE_RUNTIME_VERSION, kManifestFormat));
  // After the version check, so that a manifest of another version says so.
  if (std::string digest = mt::digest_bytes(manifest_text).xxh3_64; digest != manifest_xxh3)
    raise(MIXTAPE_AOT_ERROR_FILE,
          fmt::format("{}: not the manifest this library was built with (xxh3_64 {}, the library "
                      "expects {}): the file was changed, or comes from another export of {}",
                      manifest_path, digest, manifest_xxh3, m.name));
  if (manifest.at("name").get<std::string>() != m.name)
    raise(MIXTAPE_AOT_ERROR_FILE,
          fmt::format("{}: the manifest is artifact '{}', not '{}'", manifest_path,
                      manifest.at("name").get<std::string>(), m.name));
  std::vector<std::string> devices;
  for (const Value& d : manifest.at("devices")) devices.push_back(d.get<std::string>());
  bool has_cuda = std::find(devices.begin(), devices.end(), "cuda") != devices.end();
  // NULL: the GPU where the artifact has kernels this GPU runs and the machine can run them.
  std::string wanted = device                                                            ? device
                       : has_cuda && gpu_unusable_reason().empty() && cuda_image(m) >= 0 ? "cuda"
                                                                                         : "cpu";
  std::string kind = wanted.substr(0, wanted.find(':'));
  if ((kind != "cpu" && kind != "cuda") || (kind == "cuda" && wanted != "cuda") || wanted == "cpu:")
    raise(MIXTAPE_AOT_ERROR_ARGUMENT,
          fmt::format("{}: unknown device '{}' (cpu, cpu:TARGET, cuda, or NULL for the best)",
                      m.name, wanted));
  if (std::find(devices.begin(), devices.end(), kind) == devices.end())
    raise(MIXTAPE_AOT_ERROR_DEVICE,
          fmt::format("{}: the artifact has no kernels for {} (it was exported for: {})", m.name,
                      kind, fmt::join(devices, ", ")));
  if (kind == "cuda") {
    if (std::string reason = gpu_unusable_reason(); !reason.empty())
      raise(MIXTAPE_AOT_ERROR_DEVICE, fmt::format("{}: device cuda: {}", m.name, reason));
    variant_count = 0;  // the programs run the artifact's CUDA kernels, and host ops
    m.device = mt::Device::cuda;
  }
  const mixtape_aot_variant* variant =
      kind == "cpu" ? &choose_variant(m, wanted, variants, variant_count) : nullptr;
  if (variant) m.cpu_target = variant->target;
  check_file_list(m);
  std::string plan_text = read_checked(m, m.name + ".plan");
  std::string weight_bytes = read_checked(m, m.name + ".safetensors");
  if (m.device == mt::Device::cuda) open_cuda(m);
  for (int64_t i = 0; variant && i < variant->kernel_count; ++i) {
    const mixtape_aot_kernel& kernel = variant->kernels[i];
    if (!kernel.key || !kernel.function)
      raise(MIXTAPE_AOT_ERROR_ARGUMENT,
            fmt::format("{}: kernel {} of the {} table is NULL", m.name, i, variant->target));
    m.kernels[kernel.key] = {kernel.function, 0};
  }
  for (const Value& k : manifest.at("kernels")) {
    if (!variant) break;
    auto found = m.kernels.find(k.at("key").get<std::string>());
    if (found == m.kernels.end())
      raise(MIXTAPE_AOT_ERROR_FILE,
            fmt::format("{}: the manifest lists kernel {}, which the library does not hold (a "
                        "manifest from another export?)",
                        m.name, k.at("key").get<std::string>()));
    found->second.dim0 = std::max(found->second.dim0, k.at("dim0").get<int64_t>());
  }
  m.step = manifest.at("kind").get<std::string>() == "step";
  m.export_batch = manifest.at("batch").at("export").get<int64_t>();
  m.max_batch = manifest.at("batch").at("max").get<int64_t>();
  m.inputs = arguments(manifest.at("inputs"));
  m.outputs = arguments(manifest.at("outputs"));
  if (m.step) {
    const Value& checkpoint = manifest.at("checkpoint");
    for (const Value& kv : checkpoint.at("metadata"))
      m.checkpoint_metadata.emplace_back(kv.at(0).get<std::string>(), kv.at(1).get<std::string>());
    m.steps_buffer = checkpoint.at("steps_buffer").get<int64_t>();
    for (const Value& e : checkpoint.at("param_steps"))
      m.param_steps.emplace_back(e.at(0).get<std::string>(), e.at(1).get<int64_t>());
    for (const Value& g : checkpoint.at("generators"))
      m.generators.push_back({g.at("name").get<std::string>(),
                              parse_uint64(g.at("seed").get<std::string>(), "generator seed"),
                              g.at("buffer").get<int64_t>()});
    if (const Value* rates = mt::json::find(checkpoint, "rates"))
      for (const Value& r : *rates)
        m.rates.push_back(
            {r.at("group").get<size_t>(), r.at("f64").get<int64_t>(), r.at("f32").get<int64_t>()});
  }
  try {
    m.plan_doc = mt::aot::PlanDocument::parse(plan_text, kMaxJsonValues);
  } catch (const mt::Error& e) {
    raise(MIXTAPE_AOT_ERROR_FILE, fmt::format("{}: {}", m.path(m.name + ".plan"), e.what()));
  }
  load_buffers(m, std::move(weight_bytes));
  if (m.steps_buffer >= static_cast<int64_t>(m.buffers.size()))
    raise(MIXTAPE_AOT_ERROR_FILE, fmt::format("{}: the manifest's step count buffer {} does not "
                                              "exist",
                                              m.name, m.steps_buffer));
  for (const auto& [param, k] : m.param_steps)
    if (m.steps_buffer < 0 || k < 0 || k >= static_cast<int64_t>(m.buffers.size()) ||
        m.buffers[k]->dtype != mt::f64 || m.buffers[k]->count != 1)
      raise(MIXTAPE_AOT_ERROR_FILE,
            fmt::format("{}: the manifest's step count buffer of parameter '{}' is not a 0-d f64 "
                        "buffer",
                        m.name, param));
  for (const auto& g : m.generators)
    if (g.buffer < 0 || g.buffer >= static_cast<int64_t>(m.buffers.size()) ||
        m.buffers[g.buffer]->dtype != mt::i64 || m.buffers[g.buffer]->count != 1)
      raise(MIXTAPE_AOT_ERROR_FILE,
            fmt::format("{}: the manifest's offset buffer of generator '{}' is not a 0-d i64 "
                        "buffer",
                        m.name, g.name));
  auto zero_d = [&](int64_t k, mt::DType dtype) {
    return k >= 0 && k < static_cast<int64_t>(m.buffers.size()) && m.buffers[k]->dtype == dtype &&
           m.buffers[k]->count == 1;
  };
  for (const auto& r : m.rates)
    if (!zero_d(r.f64, mt::f64) || !zero_d(r.f32, mt::f32))
      raise(MIXTAPE_AOT_ERROR_FILE,
            fmt::format("{}: the manifest's rate buffers of parameter group {} are not a 0-d f64 "
                        "and a 0-d f32 buffer",
                        m.name, r.group));
  m.plan_for(m.run_batch(m.export_batch));  // builds the programs now: the first run is a run
}

// The bytes of an argument the caller's buffer holds: `batch` rows of a dynamic batch, else
// the whole value.
size_t caller_bytes(const mixtape_aot_model& m, const Argument& a, int64_t batch) {
  mt::Shape shape = m.shape_at(a, batch);
  return static_cast<size_t>(mt::numel(shape)) * mt::size_of(a.dtype);
}

// `value` as `dtype`, exactly widened where a narrower type stored it (a bf16 matmul's result
// under autocast reaches the caller as the traced type, as to_vector() gives it in C++).
mt::StoragePtr as_dtype(mt::StoragePtr value, mt::DType dtype, bool on_device) {
  if (value->dtype == dtype) return value;
  bool gpu_types = (value->dtype == mt::f32 || mt::is_half(value->dtype)) &&
                   (dtype == mt::f32 || mt::is_half(dtype));
  if (on_device && gpu_types) return mt::convert_on_device(*value, dtype);
  return mt::store_all(dtype, mt::load_all<double>(*value));
}

// One call: `batch` rows of host buffers (or, `on_device`, device pointers of a cuda model),
// run at m.run_batch(batch) rows.
void run_model(mixtape_aot_model& m, int64_t batch, const void* const* inputs, void* const* outputs,
               bool on_device) {
  if (on_device && m.device != mt::Device::cuda)
    raise(MIXTAPE_AOT_ERROR_ARGUMENT,
          fmt::format("{}: run_device needs a model opened on cuda; this one runs on the cpu",
                      m.name));
  int64_t low = m.max_batch > 0 ? 1 : m.export_batch;
  int64_t high = m.max_batch > 0 ? m.max_batch : m.export_batch;
  if (batch < low || batch > high)
    raise(MIXTAPE_AOT_ERROR_ARGUMENT,
          low == high
              ? fmt::format("{}: batch {}: this artifact runs batch {} only", m.name, batch, low)
              : fmt::format("{}: batch {} is outside 1..{}", m.name, batch, high));
  if ((!inputs && !m.inputs.empty()) || (!outputs && !m.outputs.empty()))
    raise(MIXTAPE_AOT_ERROR_ARGUMENT, fmt::format("{}: the input or output array is NULL", m.name));
  int64_t rows = m.run_batch(batch);
  std::vector<mt::Tensor> args;
  for (size_t i = 0; i < m.inputs.size(); ++i) {
    if (!inputs[i])
      raise(MIXTAPE_AOT_ERROR_ARGUMENT,
            fmt::format("{}: input '{}' is NULL", m.name, m.inputs[i].name));
    mt::Shape shape = m.shape_at(m.inputs[i], rows);
    mt::DType dtype = m.inputs[i].dtype;
    size_t given = caller_bytes(m, m.inputs[i], batch);
    mt::StoragePtr storage;
    if (on_device) {
      storage = mt::device_value(dtype, mt::numel(shape));
      mt::cuda::CUdeviceptr address = mt::device_address(*storage);
      if (given > 0)
        mt::cuda::copy_device_to_device_async(address, mt::cuda::device_ptr(inputs[i]), given);
      if (static_cast<size_t>(storage->size_bytes()) > given)
        mt::cuda::memset_async(address + given, 0, storage->size_bytes() - given);
    } else {
      storage = rows == batch ? std::make_shared<mt::Storage>(dtype, mt::numel(shape),
                                                              mt::Storage::Uninitialized{})
                              : std::make_shared<mt::Storage>(dtype, mt::numel(shape));
      if (given > 0) std::memcpy(storage->bytes.data(), inputs[i], given);
    }
    args.push_back(mt::from_storage(std::move(storage), shape));
  }
  for (size_t o = 0; o < m.outputs.size(); ++o)
    if (!outputs[o])
      raise(MIXTAPE_AOT_ERROR_ARGUMENT,
            fmt::format("{}: output '{}' is NULL", m.name, m.outputs[o].name));
  std::vector<mt::Tensor> results = replay(m.plan_for(rows), args);
  for (size_t o = 0; o < m.outputs.size(); ++o) {
    const Argument& out = m.outputs[o];
    mt::Shape shape = m.shape_at(out, rows);
    mt::StoragePtr value = as_dtype(results.at(o).node()->value, out.dtype, on_device);
    if (value->dtype != out.dtype || value->count != mt::numel(shape))
      raise(MIXTAPE_AOT_ERROR_RUN,
            fmt::format("{}: output '{}' came out as {} {} values, the manifest says {} {}", m.name,
                        out.name, value->count, mt::name(value->dtype), mt::to_string(shape),
                        mt::name(out.dtype)));
    size_t bytes = caller_bytes(m, out, batch);
    if (bytes == 0) continue;
    if (on_device)
      mt::cuda::copy_device_to_device_async(mt::cuda::device_ptr(outputs[o]),
                                            mt::device_address(*value), bytes);
    else
      std::memcpy(outputs[o], value->host_data(), bytes);
  }
  if (on_device) mt::cuda_synchronize();
}

void require_step(const mixtape_aot_model& m, const char* what) {
  if (!m.step)
    raise(MIXTAPE_AOT_ERROR_ARGUMENT,
          fmt::format("{}: {} is for exported training steps; this artifact is a function", m.name,
                      what));
}

// A save over the artifact's own files (its weights, plan or manifest, which the library vouches
// for by their checksums, and the library, header and package files programs are built and
// linked with) would leave it refusing to open or its programs failing to load: such a path is
// refused, before anything is written. So is one over what an export beside it wrote (several
// artifacts share a folder): a library, header, package, manifest or plan file of the folder, or
// weights a manifest there names.
void refuse_own_file(const mixtape_aot_model& m, const std::string& path) {
  namespace fs = std::filesystem;
  std::error_code error;
  const fs::path target = fs::weakly_canonical(path, error);
  std::vector<std::string> own{m.name + ".json", "lib" + m.name + ".so", "lib" + m.name + ".a",
                               m.name + ".h",    m.name + ".pc",         m.name + "Config.cmake"};
  for (const auto& [file, info] : m.manifest.at("files").items()) own.push_back(file);
  for (const std::string& file : own) {
    std::error_code ignored;
    const bool same = (!error && fs::weakly_canonical(m.path(file), ignored) == target) ||
                      fs::equivalent(path, m.path(file), ignored);
    if (same)
      raise(MIXTAPE_AOT_ERROR_ARGUMENT,
            fmt::format("save: {} is the artifact's own {}, which it or the programs built "
                        "with it read: save the training state elsewhere",
                        path, file));
  }
  std::error_code folder_error;
  const fs::path folder = fs::weakly_canonical(m.dir, folder_error);
  if (!error && !folder_error && target.parent_path() == folder) {
    const std::string extension = target.extension().string();
    const bool exported = extension == ".so" || extension == ".a" || extension == ".h" ||
                          extension == ".pc" || extension == ".cmake" || extension == ".json" ||
                          extension == ".plan";
    std::error_code ignored;
    if (exported || (extension == ".safetensors" &&
                     fs::exists(folder / (target.stem().string() + ".json"), ignored)))
      raise(MIXTAPE_AOT_ERROR_ARGUMENT,
            fmt::format("save: {} is a file an export wrote into the artifacts' folder: save the "
                        "training state elsewhere, or under another name",
                        path));
  }
}

void save_model(const mixtape_aot_model& m, const std::string& path) {
  require_step(m, "save");
  refuse_own_file(m, path);
  mt::safetensors::File file;
  for (size_t k = 0; k < m.buffers.size(); ++k) {
    if (!m.checkpointed[k]) continue;
    const mt::Storage& value = *m.buffers[k];
    mt::safetensors::TensorData data{
        m.buffer_info[k].name, value.dtype, m.buffer_info[k].shape, {}};
    data.bytes.assign(value.host_data(), value.host_data() + value.size_bytes());
    file.tensors.push_back(std::move(data));
  }
  file.metadata = m.checkpoint_metadata;
  // The rates in force (NAME_load may have set others than the export's), as save_checkpoint
  // writes them.
  for (auto& [key, value] : file.metadata) {
    if (key == "optimizer.lr") {
      for (const auto& r : m.rates)
        if (r.group == 0) value = fmt::format("{}", m.buffers[r.f64]->as<double>()[0]);
    } else if (key == "optimizer.param_groups" && !m.rates.empty()) {
      Value groups = mt::json::parse(value);
      for (const auto& r : m.rates) groups.at(r.group)["lr"] = m.buffers[r.f64]->as<double>()[0];
      value = mt::json::dump(groups);
    }
  }
  if (m.steps_buffer >= 0) {
    const auto steps = static_cast<int64_t>(m.buffers[m.steps_buffer]->as<double>()[0]);
    file.metadata.emplace_back("optimizer.steps", std::to_string(steps));
    for (const auto& [param, k] : m.param_steps)
      if (const auto own = static_cast<int64_t>(m.buffers[k]->as<double>()[0]); own != steps)
        file.metadata.emplace_back("optimizer." + param + ".steps", std::to_string(own));
  }
  for (const auto& g : m.generators) {
    file.metadata.emplace_back("generator." + g.name + ".seed", std::to_string(g.seed));
    file.metadata.emplace_back(
        "generator." + g.name + ".offset",
        std::to_string(std::bit_cast<uint64_t>(m.buffers[g.buffer]->as<int64_t>()[0])));
  }
  mt::safetensors::write(path, file);
}

// The offset a checkpoint holds for generator `name`, whose seed must be `seed`: the draws of
// the plan have the seed compiled in, so a stream of another seed cannot be continued.
uint64_t generator_offset(const mixtape_aot_model& m,
                          const std::vector<std::pair<std::string, std::string>>& metadata,
                          const std::string& path, const std::string& name, uint64_t seed) {
  const std::string* seed_text = nullptr;
  const std::string* offset_text = nullptr;
  for (const auto& [key, value] : metadata) {
    if (key == "generator." + name + ".seed") seed_text = &value;
    if (key == "generator." + name + ".offset") offset_text = &value;
  }
  if (!seed_text || !offset_text)
    raise(MIXTAPE_AOT_ERROR_FILE,
          fmt::format("{}: {} holds no state for generator '{}' (metadata generator.{}.seed and "
                      "generator.{}.offset)",
                      m.name, path, name, name, name));
  auto number = [&](const std::string& text, const char* what) {
    try {
      return parse_uint64(text, what);
    } catch (const AotError& e) {
      raise(MIXTAPE_AOT_ERROR_FILE, fmt::format("{}: {}: {}", m.name, path, e.message));
    }
  };
  uint64_t saved_seed = number(*seed_text, "generator seed");
  if (saved_seed != seed)
    raise(MIXTAPE_AOT_ERROR_FILE,
          fmt::format("{}: {} holds generator '{}' with seed {}, but the artifact's draws were "
                      "compiled with seed {}: export the step again from a generator seeded {} "
                      "to continue that stream",
                      m.name, path, name, saved_seed, seed, saved_seed));
  return number(*offset_text, "generator offset");
}

// The checkpoint metadata the step was exported with under `key`, or null.
// Whether a file's optimizer options (one object per group) are the exported step's: every
// option the file names has the step's value. One the file lacks is an option added after it
// was written (amsgrad, maximize), which load_checkpoint leaves as it is too; a file's state that
// such an option would need is checked entry by entry.
bool options_agree(const std::string& file, const std::string& exported) {
  try {
    const mt::json::Value theirs = mt::json::parse(file, 4096), ours = mt::json::parse(exported);
    if (!theirs.is_array() || !ours.is_array() || theirs.size() != ours.size()) return false;
    for (size_t g = 0; g < theirs.size(); ++g) {
      if (!theirs[g].is_object() || !ours[g].is_object()) return false;
      for (const auto& [name, value] : theirs[g].items()) {
        const mt::json::Value* own = mt::json::find(ours[g], name);
        if (!own || *own != value) return false;
      }
    }
    return true;
  } catch (const mt::Error&) {
    return false;
  }
}

const std::string* exported_metadata(const mixtape_aot_model& m, std::string_view key) {
  for (const auto& [our_key, ours] : m.checkpoint_metadata)
    if (our_key == key) return &ours;
  return nullptr;
}

// The parameter paths of each group in checkpoint metadata "optimizer.param_groups" (`text`),
// each group's sorted; none for an optimizer of one group (no such metadata).
std::vector<std::vector<std::string>> group_members(const mixtape_aot_model& m,
                                                    const std::string& path,
                                                    const std::string* text) {
  std::vector<std::vector<std::string>> groups;
  if (!text) return groups;
  try {
    for (mt::SavedParamGroup& group :
         mt::parse_param_groups(fmt::format("{}: {}", m.name, path), *text)) {
      std::sort(group.params.begin(), group.params.end());
      groups.push_back(std::move(group.params));
    }
  } catch (const mt::Error& e) {
    raise(MIXTAPE_AOT_ERROR_FILE, e.what());
  }
  return groups;
}

// A checkpoint's state, checked whole before any of it replaces the model's.
void load_model(mixtape_aot_model& m, const std::string& path) {
  require_step(m, "load");
  mt::safetensors::File file;
  try {
    file = mt::safetensors::read(path);
  } catch (const mt::Error& e) {
    raise(MIXTAPE_AOT_ERROR_FILE, e.what());
  }
  std::vector<std::pair<size_t, const mt::safetensors::TensorData*>> entries;
  const std::string* kind = exported_metadata(m, "optimizer.kind");
  for (size_t k = 0; k < m.buffers.size(); ++k) {
    if (!m.checkpointed[k]) continue;
    const mt::aot::PlanBuffer& info = m.buffer_info[k];
    const mt::safetensors::TensorData* data = file.find(info.name);
    if (!data || data->dtype != info.dtype || data->shape != info.shape)
      raise(MIXTAPE_AOT_ERROR_FILE,
            fmt::format("{}: {} holds no {} tensor '{}' of shape {}", m.name, path,
                        mt::name(info.dtype), info.name, mt::to_string(info.shape)));
    // The values, checked as load_checkpoint checks them.
    mt::Storage values(info.dtype, m.buffers[k]->count, mt::Storage::Uninitialized{});
    std::memcpy(values.bytes.data(), data->bytes.data(), data->bytes.size());
    // The optimizer's entries out of their range, as its impossible_state() refuses them.
    mt::StateRange range;
    if (kind && info.name.starts_with("optimizer."))
      range = mt::state_range(*kind, info.name.substr(info.name.rfind('.') + 1));
    for (int64_t i = 0; mt::is_floating(info.dtype) && i < values.count; ++i) {
      double v = mt::load_element<double>(values, i);
      if (!std::isfinite(v))
        raise(MIXTAPE_AOT_ERROR_FILE,
              fmt::format("{}: {} holds {} in '{}'", m.name, path, v, info.name));
      if (info.name == "scaler.scale" && !(v > 0 && std::isnormal(v)))
        raise(MIXTAPE_AOT_ERROR_FILE,
              fmt::format("{}: {} holds the loss scale {}, not a normal positive number", m.name,
                          path, v));
      if (range.what && !range.holds(v))
        raise(MIXTAPE_AOT_ERROR_FILE, fmt::format("{}: {} holds {} in '{}': it is {}, {}", m.name,
                                                  path, v, info.name, range.what, range.range));
    }
    // The scaler's growth tracker counts finite steps since the last change of scale: a whole
    // number below the growth interval, as GradScaler::load_state_dict requires.
    if (info.name == "scaler.growth_tracker" && values.count == 1) {
      double tracker = mt::load_element<double>(values, 0);
      const std::string* interval = exported_metadata(m, "scaler.growth_interval");
      double limit = interval ? std::strtod(interval->c_str(), nullptr) : 0;
      if (!(tracker >= 0) || tracker != std::floor(tracker) || (limit > 0 && tracker >= limit))
        raise(MIXTAPE_AOT_ERROR_FILE,
              fmt::format("{}: {} holds the growth tracker {}, not a count below the growth "
                          "interval {}",
                          m.name, path, tracker, limit));
    }
    entries.emplace_back(k, data);
  }
  // A tensor the artifact has no buffer for is refused, as load_checkpoint refuses an entry the
  // module or the optimizer does not have (a checkpoint of a larger model, of other parameters):
  // taking the rest would run a model that was never trained. The scaler's and data loaders'
  // entries of a step exported without them are the state of what the artifact does not run.
  for (const mt::safetensors::TensorData& tensor : file.tensors) {
    const bool ours = std::any_of(entries.begin(), entries.end(),
                                  [&](const auto& entry) { return entry.second == &tensor; });
    const bool elsewhere = tensor.name.starts_with("scaler.") ||
                           tensor.name.starts_with("loader.") ||
                           (!kind && tensor.name.starts_with("optimizer."));
    if (!ours && !elsewhere)
      raise(MIXTAPE_AOT_ERROR_FILE,
            fmt::format("{}: {} holds '{}', which the artifact does not have", m.name, path,
                        tensor.name));
  }
  // Whole decimal text up to 2^53 (kept as an f64), as load_checkpoint reads it.
  auto step_count = [&](const std::string& key, const std::string& value) {
    int64_t count = -1;
    auto [end, ec] = std::from_chars(value.data(), value.data() + value.size(), count);
    if (value.empty() || ec != std::errc() || end != value.data() + value.size() || count < 0 ||
        count > (int64_t{1} << 53))
      raise(MIXTAPE_AOT_ERROR_FILE,
            fmt::format("{}: {} has {} '{}', not a step count", m.name, path, key, value));
    return count;
  };
  int64_t steps = -1;
  std::vector<std::pair<std::string, int64_t>> param_steps;  // a parameter's own, where given
  constexpr std::string_view prefix = "optimizer.", suffix = ".steps";
  for (const auto& [key, value] : file.metadata) {
    if (key == "optimizer.steps")
      steps = step_count(key, value);
    else if (m.steps_buffer >= 0 && key.starts_with(prefix) && key.ends_with(suffix))
      param_steps.emplace_back(
          key.substr(prefix.size(), key.size() - prefix.size() - suffix.size()),
          step_count(key, value));
    const std::string* ours = exported_metadata(m, key);
    if (key == "optimizer.kind" && ours && *ours != value)
      raise(MIXTAPE_AOT_ERROR_FILE,
            fmt::format("{}: {} holds {} state, the step runs {}", m.name, path, value, *ours));
    // So are the optimizer's options but the rate (load_checkpoint restores a file's).
    if (key == "optimizer.options" && ours && !options_agree(value, *ours))
      raise(MIXTAPE_AOT_ERROR_FILE,
            fmt::format("{}: {} holds optimizer options {}, the step was exported with {}", m.name,
                        path, value, *ours));
    // The loss scaler's settings are compiled into the step, which cannot take others (where
    // load_checkpoint adopts a file's, as PyTorch's GradScaler does).
    if (key.starts_with("scaler.") && ours &&
        std::strtod(ours->c_str(), nullptr) != std::strtod(value.c_str(), nullptr))
      raise(MIXTAPE_AOT_ERROR_FILE,
            fmt::format("{}: {} holds {} = {}, the step was exported with {}", m.name, path, key,
                        value, *ours));
  }
  if (m.steps_buffer >= 0 && steps < 0)
    raise(MIXTAPE_AOT_ERROR_FILE, fmt::format("{}: {} has no valid optimizer.steps", m.name, path));
  // The parameter groups, as load_checkpoint checks them: state saved under other groups would go
  // on under this step's options (their rates are taken below).
  const std::string* exported_list = exported_metadata(m, "optimizer.param_groups");
  const std::vector<std::vector<std::string>> exported_groups =
      group_members(m, path, exported_list);
  if (kind) {
    const std::string* theirs = nullptr;
    for (const auto& [key, value] : file.metadata)
      if (key == "optimizer.param_groups") theirs = &value;
    const std::vector<std::vector<std::string>> their_groups = group_members(m, path, theirs);
    // A file, or an artifact, of one group from before one group's parameters were listed
    // holds no list: as load_checkpoint, it matches one group.
    const bool older_single_group =
        (!theirs && exported_groups.size() == 1) || (!exported_list && their_groups.size() == 1);
    if (!older_single_group && exported_groups != their_groups)
      raise(MIXTAPE_AOT_ERROR_FILE,
            fmt::format("{}: {} holds optimizer state of other parameter groups than the step "
                        "was exported with (metadata optimizer.param_groups)",
                        m.name, path));
  }
  // Each parameter's count as load_checkpoint takes it (the optimizer's unless the file gives its
  // own), into the buffers the exported step reads: the step counts a parameter that took every
  // update with the optimizer, and parameters that shared a count at export share one buffer.
  std::vector<std::pair<int64_t, int64_t>> counts;  // (buffer, count)
  auto take_count = [&](const std::string& param, int64_t buffer, int64_t count) {
    for (const auto& [b, c] : counts)
      if (m.buffers[b] == m.buffers[buffer] && c != count)  // one storage (the manifest's same_as)
        raise(MIXTAPE_AOT_ERROR_FILE,
              fmt::format("{}: {} counts {} steps for parameter '{}', which the exported step "
                          "counts with {} (the parameters that skipped the same steps at export, "
                          "or the optimizer itself)",
                          m.name, path, count, param, c));
    counts.emplace_back(buffer, count);
  };
  if (m.steps_buffer >= 0) counts.emplace_back(m.steps_buffer, steps);
  for (const auto& [param, count] : param_steps) {
    // As load_checkpoint refuses it: a count for a parameter the optimizer does not update.
    if (!exported_groups.empty() &&
        std::none_of(exported_groups.begin(), exported_groups.end(), [&](const auto& group) {
          return std::binary_search(group.begin(), group.end(), param);
        }))
      raise(MIXTAPE_AOT_ERROR_FILE,
            fmt::format("{}: {} has a step count for parameter '{}', which the step does not "
                        "update",
                        m.name, path, param));
    if (count > steps)
      raise(MIXTAPE_AOT_ERROR_FILE,
            fmt::format("{}: {} counts {} steps for parameter '{}', more than the optimizer's {}",
                        m.name, path, count, param, steps));
    auto own = std::find_if(m.param_steps.begin(), m.param_steps.end(),
                            [&](const auto& e) { return e.first == param; });
    take_count(param, own == m.param_steps.end() ? m.steps_buffer : own->second, count);
  }
  for (const auto& [param, buffer] : m.param_steps)
    if (std::none_of(param_steps.begin(), param_steps.end(),
                     [&](const auto& e) { return e.first == param; }))
      take_count(param, buffer, steps);
  std::vector<uint64_t> offsets;
  for (const auto& g : m.generators)
    offsets.push_back(generator_offset(m, file.metadata, path, g.name, g.seed));
  // The file's rates, as load_checkpoint restores them into groups without a schedule (a group
  // the file gives none keeps its own).
  std::vector<std::pair<const mixtape_aot_model::Rate*, double>> rates;
  if (!m.rates.empty()) {
    std::vector<std::optional<double>> theirs;
    try {
      theirs = mt::metadata_rates(fmt::format("{}: {}", m.name, path), file.metadata);
    } catch (const mt::Error& e) {
      raise(MIXTAPE_AOT_ERROR_FILE, e.what());
    }
    for (const auto& r : m.rates) {
      if (r.group >= theirs.size())
        raise(MIXTAPE_AOT_ERROR_FILE,
              fmt::format("{}: {} holds the rates of {} parameter groups, the step has group {}",
                          m.name, path, theirs.size(), r.group));
      if (theirs[r.group]) rates.emplace_back(&r, *theirs[r.group]);
    }
  }
  for (const auto& [k, data] : entries) {
    std::memcpy(m.buffers[k]->host_data(), data->bytes.data(), data->bytes.size());
    m.buffers[k]->host_written();
  }
  for (const auto& [buffer, count] : counts) {
    m.buffers[buffer]->as<double>()[0] = static_cast<double>(count);
    m.buffers[buffer]->host_written();
  }
  for (size_t i = 0; i < offsets.size(); ++i) {
    mt::Storage& offset = *m.buffers[m.generators[i].buffer];
    offset.as<int64_t>()[0] = std::bit_cast<int64_t>(offsets[i]);
    offset.host_written();
  }
  for (const auto& [r, lr] : rates) {  // as Optimizer::set_lr writes them
    m.buffers[r->f64]->as<double>()[0] = lr;
    m.buffers[r->f64]->host_written();
    m.buffers[r->f32]->as<float>()[0] = static_cast<float>(lr);
    m.buffers[r->f32]->host_written();
  }
}

// Runs `body`, turning every failure into a code and the message both `m` and the thread keep.
template <typename F>
int guarded(mixtape_aot_model* m, F body) {
  // Calls on one handle from several threads take turns: a model's buffers and plans are one
  // state, which two runs at once would both write.
  std::unique_lock<std::mutex> turn;
  if (m) turn = std::unique_lock<std::mutex>(m->busy);
  std::string message;
  int code = MIXTAPE_AOT_OK;
  try {
    body();
  } catch (const AotError& e) {
    code = e.code;
    message = e.message;
  } catch (const mt::Error& e) {
    code = MIXTAPE_AOT_ERROR_RUN;
    message = e.what();
  } catch (const std::bad_alloc&) {
    code = MIXTAPE_AOT_ERROR_RUN;
    message = "out of memory";
  } catch (const std::exception& e) {
    code = MIXTAPE_AOT_ERROR_FILE;  // a malformed document (json lookups, numbers)
    message = e.what();
  }
  thread_error = message;
  if (m) m->error = message;
  return code;
}

}  // namespace

extern "C" {

int mixtape_aot_open(const char* dir, const char* name, const char* manifest_xxh3,
                     const char* device, const mixtape_aot_variant* variants, int64_t variant_count,
                     mixtape_aot_model** out) {
  if (out) *out = nullptr;
  auto model = std::make_unique<mixtape_aot_model>();
  int code = guarded(nullptr, [&] {
    if (!out || !dir || !name || !manifest_xxh3 || (!variants && variant_count > 0) ||
        variant_count < 0)
      raise(MIXTAPE_AOT_ERROR_ARGUMENT, "open: dir, name and out must not be NULL");
    if (!*dir)
      raise(MIXTAPE_AOT_ERROR_ARGUMENT, "open: dir is empty (\".\" is the current folder)");
    model->dir = dir;
    model->name = name;
    open_model(*model, manifest_xxh3, device, variants, variant_count);
  });
  if (code == MIXTAPE_AOT_OK) *out = model.release();
  return code;
}

int mixtape_aot_refuse_interface(const char* name, const char* header, const char* library) {
  return guarded(nullptr, [&] {
    raise(MIXTAPE_AOT_ERROR_VERSION,
          fmt::format("{0}: this program was built with the {0}.h of another export ({1}) than "
                      "the library it runs with ({2}): rebuild it against the header in the "
                      "artifact's directory",
                      name ? name : "(null)", header ? header : "no interface",
                      library ? library : "(null)"));
  });
}

int mixtape_aot_run(mixtape_aot_model* model, int64_t batch, const void* const* inputs,
                    void* const* outputs) {
  return guarded(model, [&] {
    if (!model) raise(MIXTAPE_AOT_ERROR_ARGUMENT, "run: the model is NULL");
    run_model(*model, batch, inputs, outputs, false);
  });
}

int mixtape_aot_run_device(mixtape_aot_model* model, int64_t batch, const void* const* inputs,
                           void* const* outputs) {
  return guarded(model, [&] {
    if (!model) raise(MIXTAPE_AOT_ERROR_ARGUMENT, "run_device: the model is NULL");
    run_model(*model, batch, inputs, outputs, true);
  });
}

int mixtape_aot_save(mixtape_aot_model* model, const char* path) {
  return guarded(model, [&] {
    if (!model || !path) raise(MIXTAPE_AOT_ERROR_ARGUMENT, "save: the model or path is NULL");
    save_model(*model, path);
  });
}

int mixtape_aot_load(mixtape_aot_model* model, const char* path) {
  return guarded(model, [&] {
    if (!model || !path) raise(MIXTAPE_AOT_ERROR_ARGUMENT, "load: the model or path is NULL");
    load_model(*model, path);
  });
}

const char* mixtape_aot_error(const mixtape_aot_model* model) {
  return model ? model->error.c_str() : thread_error.c_str();
}

void mixtape_aot_close(mixtape_aot_model* model) {
  if (!model) return;
  for (auto& [batch, plan] : model->plans) release(*plan);
  delete model;
}

}  // extern "C"

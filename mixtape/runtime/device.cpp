// mixtape/runtime/device.cpp -- the process-wide device, eager-mode and flush-to-zero settings.
#include "mixtape/runtime/device.h"

#if defined(__SSE__)
#include <immintrin.h>
#endif

#include <atomic>
#include <cstdlib>
#include <exception>
#include <optional>
#include <string>

#include "mixtape/dsl/error.h"
#include "mixtape/runtime/cpu_stream.h"
#include "mixtape/runtime/cuda_executor.h"

namespace mixtape {
namespace {

// An on/off environment variable: set, non-empty and not "0" is on.
bool env_flag(const char* name) {
  const char* env = std::getenv(name);
  return env && std::string(env) != "" && std::string(env) != "0";
}

// A setting that is on unless the variable says 0.
bool env_flag_unless_zero(const char* name) {
  const char* env = std::getenv(name);
  return !env || std::string(env) != "0";
}

std::optional<Device>& selected() {
  static std::optional<Device> device;
  return device;
}

std::optional<bool>& eager_setting() {
  static std::optional<bool> eager;
  return eager;
}

void require_cuda() {
  if (!cuda_backend_available())
    fail("device cuda: CUDA is not available: {}", cuda_backend_unavailable_reason());
}

// auto: the GPU when this machine can run the CUDA back end, else the CPU. A machine without an
// NVIDIA driver stays silent (the common CPU-only case); one whose driver or libraries fail says
// why once, since the user probably expected the GPU.
Device automatic_device() {
  if (cuda_backend_available()) return Device::cuda;
  std::string reason = cuda_backend_unavailable_reason();
  if (reason.rfind("cannot load the NVIDIA driver library", 0) != 0)
    fmt::print(stderr, "mixtape: no CUDA device ({}); running on the CPU\n", reason);
  return Device::cpu;
}

}  // namespace

Device current_device() {
  std::optional<Device>& device = selected();
  if (!device) {
    const char* env = std::getenv("MIXTAPE_DEVICE");
    std::string name = env ? env : "";
    if (name.empty() || name == "auto")
      device = automatic_device();
    else if (name == "cpu")
      device = Device::cpu;
    else if (name == "reference")
      device = Device::reference;
    else if (name == "cuda")
      device = Device::cuda;
    else
      fail("MIXTAPE_DEVICE={} is not a device (cpu, cuda, reference or auto)", name);
  }
  if (*device == Device::cuda) require_cuda();
  return *device;
}

void set_device(Device device) {
  if (device == Device::cuda) require_cuda();
  selected() = device;
}

const char* device_name(Device device) {
  switch (device) {
    case Device::reference:
      return "reference";
    case Device::cpu:
      return "cpu";
    case Device::cuda:
      return "cuda";
  }
  return "?";
}

bool eager_mode() {
  std::optional<bool>& eager = eager_setting();
  if (!eager) eager = env_flag("MIXTAPE_EAGER");
  return *eager;
}

void set_eager_mode(bool eager) { eager_setting() = eager; }

namespace {
std::atomic<bool>& flush_setting() {
  static std::atomic<bool> on{env_flag("MIXTAPE_FLUSH_DENORMAL")};
  return on;
}
std::atomic<bool>& async_setting() {
  static std::atomic<bool> on{env_flag_unless_zero("MIXTAPE_ASYNC")};
  return on;
}
std::atomic<bool>& tf32_setting() {
  static std::atomic<bool> on{env_flag("MIXTAPE_ALLOW_TF32")};
  return on;
}
std::atomic<bool>& cudnn_setting() {
  static std::atomic<bool> on{env_flag_unless_zero("MIXTAPE_CUDNN")};
  return on;
}
}  // namespace

void set_allow_tf32(bool allow) { tf32_setting().store(allow, std::memory_order_relaxed); }
bool allow_tf32() { return tf32_setting().load(std::memory_order_relaxed); }
void set_use_cudnn(bool use) { cudnn_setting().store(use, std::memory_order_relaxed); }
bool use_cudnn() { return cudnn_setting().load(std::memory_order_relaxed); }

void set_async_evaluation(bool on) {
  async_setting().store(on, std::memory_order_relaxed);
  // What was queued finishes: turning it off means nothing is left running. Set first, so that a
  // failure of that work, reported now, does not also leave the setting unchanged.
  if (!on) finish_cpu_stream();
}
bool async_evaluation() { return async_setting().load(std::memory_order_relaxed); }

void synchronize() {
  finish_cpu_stream();
  cuda_synchronize();
}

bool flush_denormal() { return flush_setting().load(std::memory_order_relaxed); }

void apply_flush_denormal() {
#if defined(__SSE__)
  constexpr unsigned ftz_daz = 0x8040;  // MXCSR bits 15 (flush to zero) and 6 (denormals are zero)
  unsigned csr = _mm_getcsr(), want = flush_denormal() ? csr | ftz_daz : csr & ~ftz_daz;
  if (want != csr) _mm_setcsr(want);
#endif
}

FlushDenormalScope::FlushDenormalScope() {
#if defined(__SSE__)
  saved_ = _mm_getcsr();
  apply_flush_denormal();
#endif
}

FlushDenormalScope::~FlushDenormalScope() {
#if defined(__SSE__)
  if (_mm_getcsr() != saved_) _mm_setcsr(saved_);
#endif
}

bool set_flush_denormal(bool on) {
#if defined(__SSE__)
  // Queued work keeps the mode it was queued under. A failure of it is reported once the mode
  // is set, not instead of setting it.
  std::exception_ptr failure;
  try {
    finish_cpu_stream();
  } catch (...) {
    failure = std::current_exception();
  }
  flush_setting().store(on);
  // Every thread of the OpenMP team (which oneDNN's matmuls use too) takes the mode now.
#pragma omp parallel
  apply_flush_denormal();
  apply_flush_denormal();
  if (failure) std::rethrow_exception(failure);
  return true;
#else
  return !on;
#endif
}

eager_scope::eager_scope(bool eager) : previous_(eager_mode()) { set_eager_mode(eager); }
eager_scope::~eager_scope() { set_eager_mode(previous_); }

}  // namespace mixtape

// runtime/device.cpp -- the process-wide device and eager-mode settings.
#include "runtime/device.h"

#include <cstdlib>
#include <optional>
#include <string>

#include "dsl/error.h"
#include "runtime/cuda_executor.h"

namespace mixtape {
namespace {

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
  if (!eager) {
    const char* env = std::getenv("MIXTAPE_EAGER");
    eager = env && std::string(env) != "" && std::string(env) != "0";
  }
  return *eager;
}

void set_eager_mode(bool eager) { eager_setting() = eager; }

eager_scope::eager_scope(bool eager) : previous_(eager_mode()) { set_eager_mode(eager); }
eager_scope::~eager_scope() { set_eager_mode(previous_); }

}  // namespace mixtape

// runtime/device.cpp -- the process-wide device and eager-mode settings.
#include "runtime/device.h"

#include <cstdlib>
#include <optional>
#include <string>

#include "dsl/error.h"

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

}  // namespace

Device current_device() {
  std::optional<Device>& device = selected();
  if (!device) {
    const char* env = std::getenv("MIXTAPE_DEVICE");
    std::string name = env ? env : "";
    // auto picks the fastest back end this build has: the compiled CPU one.
    if (name.empty() || name == "auto" || name == "cpu")
      device = Device::cpu;
    else if (name == "reference")
      device = Device::reference;
    else if (name == "cuda")
      device = Device::cuda;
    else
      fail("MIXTAPE_DEVICE={} is not a device (cpu, cuda, reference or auto)", name);
  }
  if (*device == Device::cuda)
    fail("device cuda: this build of mixtape has no CUDA back end; use cpu or reference");
  return *device;
}

void set_device(Device device) {
  if (device == Device::cuda)
    fail("device cuda: this build of mixtape has no CUDA back end; use cpu or reference");
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

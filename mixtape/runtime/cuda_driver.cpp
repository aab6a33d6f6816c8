// mixtape/runtime/cuda_driver.cpp -- loads libcuda.so.1, sets up the process's device, and wraps
// the driver calls.
#include "mixtape/runtime/cuda_driver.h"

#include <dlfcn.h>

#include <cstdlib>
#include <string_view>

#include "mixtape/dsl/error.h"
#include "mixtape/runtime/shared_library.h"

namespace mixtape::cuda {

namespace {

struct DriverState {
  DriverApi api{};
  bool ok = false;
  std::string reason;
  int ordinal = 0;
  CUdevice device = 0;
  CUcontext context = nullptr;
  CUstream stream = nullptr;
  int capability = 0;
  int multiprocessors = 0;
  int version = 0;
  std::string name;
};

// "cuInit failed: CUDA_ERROR_NO_DEVICE (no CUDA-capable device is detected)"; the table must
// already hold cuGetErrorName/String.
std::string describe(const DriverApi& api, CUresult result, std::string_view call) {
  const char* name = nullptr;
  const char* text = nullptr;
  if (api.cuGetErrorName == nullptr || api.cuGetErrorName(result, &name) != 0) name = nullptr;
  if (api.cuGetErrorString == nullptr || api.cuGetErrorString(result, &text) != 0) text = nullptr;
  return fmt::format("{} failed: {} ({})", call, name ? name : fmt::format("CUresult {}", result),
                     text ? text : "no description");
}

template <typename Fn>
bool bind(void* library, Fn*& slot, const char* symbol, std::string& reason) {
  return bind_symbol(library, slot, symbol, "the CUDA driver library", reason,
                     " (driver too old?)");
}

// The device this process uses: MIXTAPE_CUDA_DEVICE, else the process's rank on its host as an
// MPI launcher numbers them (one GPU per process, as NCCL needs), wrapped to the devices there.
bool pick_device(int count, int& ordinal, std::string& why) {
  if (const char* chosen = std::getenv("MIXTAPE_CUDA_DEVICE"); chosen && *chosen) {
    char* end = nullptr;
    const long value = std::strtol(chosen, &end, 10);
    if (*end != '\0' || value < 0 || value >= count) {
      why = fmt::format("MIXTAPE_CUDA_DEVICE={} is not a device number here (0 to {})", chosen,
                        count - 1);
      return false;
    }
    ordinal = static_cast<int>(value);
    return true;
  }
  ordinal = 0;
  for (const char* name : {"OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID"})
    if (const char* local = std::getenv(name); local && *local) {
      ordinal = static_cast<int>(std::strtol(local, nullptr, 10) % count);
      break;
    }
  return true;
}

// Fills `state`, stopping at the first failure with its reason; never throws.
void initialize(DriverState& state) {
  const char* override_path = std::getenv("MIXTAPE_CUDA_DRIVER");
  std::string path = override_path && *override_path ? override_path : "libcuda.so.1";
  // The toolkit's stubs/libcuda.so only fails every call; the versioned name is the driver's.
  void* library = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (library == nullptr) {
    const char* error = dlerror();
    state.reason = fmt::format("cannot load the NVIDIA driver library {} ({})", path,
                               error ? error : "unknown dlopen error");
    return;
  }
  DriverApi& api = state.api;
  std::string& why = state.reason;
  bool bound = true;
#define MIXTAPE_BIND(name) bound = bind(library, api.name, #name, why) && bound
  MIXTAPE_BIND(cuInit);
  MIXTAPE_BIND(cuDriverGetVersion);
  MIXTAPE_BIND(cuDeviceGetCount);
  MIXTAPE_BIND(cuDeviceGet);
  MIXTAPE_BIND(cuDeviceGetAttribute);
  MIXTAPE_BIND(cuDeviceGetName);
  // The _v2 symbol (CUDA 11.4) tells MIG instances apart; the older one names the whole GPU.
  api.cuDeviceGetUuid =
      reinterpret_cast<decltype(api.cuDeviceGetUuid)>(dlsym(library, "cuDeviceGetUuid_v2"));
  if (api.cuDeviceGetUuid == nullptr)
    bound = bind(library, api.cuDeviceGetUuid, "cuDeviceGetUuid", why) && bound;
  MIXTAPE_BIND(cuDevicePrimaryCtxRetain);
  MIXTAPE_BIND(cuCtxSetCurrent);
  MIXTAPE_BIND(cuModuleLoadData);
  MIXTAPE_BIND(cuModuleGetFunction);
  MIXTAPE_BIND(cuLaunchKernel);
  MIXTAPE_BIND(cuMemAlloc_v2);
  MIXTAPE_BIND(cuMemFree_v2);
  MIXTAPE_BIND(cuMemAllocHost_v2);
  MIXTAPE_BIND(cuMemFreeHost);
  MIXTAPE_BIND(cuMemGetInfo_v2);
  MIXTAPE_BIND(cuMemcpyHtoDAsync_v2);
  MIXTAPE_BIND(cuMemcpyDtoHAsync_v2);
  MIXTAPE_BIND(cuMemcpyDtoDAsync_v2);
  MIXTAPE_BIND(cuMemsetD8Async);
  MIXTAPE_BIND(cuStreamCreate);
  MIXTAPE_BIND(cuStreamSynchronize);
  MIXTAPE_BIND(cuEventCreate);
  MIXTAPE_BIND(cuEventDestroy_v2);
  MIXTAPE_BIND(cuEventRecord);
  MIXTAPE_BIND(cuEventQuery);
  MIXTAPE_BIND(cuEventSynchronize);
  MIXTAPE_BIND(cuGetErrorString);
  MIXTAPE_BIND(cuGetErrorName);
#undef MIXTAPE_BIND
  api.cuEventElapsedTime =
      reinterpret_cast<decltype(api.cuEventElapsedTime)>(dlsym(library, "cuEventElapsedTime_v2"));
  if (api.cuEventElapsedTime == nullptr)
    bound = bind(library, api.cuEventElapsedTime, "cuEventElapsedTime", why) && bound;
  if (!bound) return;

  // Each step's failure is the reason; `step` returns false after recording it.
  auto step = [&](CUresult result, const char* call) {
    if (result == driver_abi::kSuccess) return true;
    why = describe(api, result, call);
    return false;
  };
  if (!step(api.cuInit(0), "cuInit")) return;
  int count = 0;
  if (!step(api.cuDeviceGetCount(&count), "cuDeviceGetCount")) return;
  if (count < 1) {
    why = "cuDeviceGetCount found no CUDA device";
    return;
  }
  if (!step(api.cuDriverGetVersion(&state.version), "cuDriverGetVersion")) return;
  if (!pick_device(count, state.ordinal, why)) return;
  if (!step(api.cuDeviceGet(&state.device, state.ordinal), "cuDeviceGet")) return;
  int major = 0, minor = 0;
  if (!step(api.cuDeviceGetAttribute(&major, driver_abi::kAttributeComputeCapabilityMajor,
                                     state.device),
            "cuDeviceGetAttribute(COMPUTE_CAPABILITY_MAJOR)") ||
      !step(api.cuDeviceGetAttribute(&minor, driver_abi::kAttributeComputeCapabilityMinor,
                                     state.device),
            "cuDeviceGetAttribute(COMPUTE_CAPABILITY_MINOR)") ||
      !step(api.cuDeviceGetAttribute(&state.multiprocessors,
                                     driver_abi::kAttributeMultiprocessorCount, state.device),
            "cuDeviceGetAttribute(MULTIPROCESSOR_COUNT)"))
    return;
  state.capability = major * 10 + minor;
  char name[256] = {};
  if (!step(api.cuDeviceGetName(name, sizeof(name) - 1, state.device), "cuDeviceGetName")) return;
  state.name = name;
  if (!step(api.cuDevicePrimaryCtxRetain(&state.context, state.device),
            "cuDevicePrimaryCtxRetain") ||
      !step(api.cuCtxSetCurrent(state.context), "cuCtxSetCurrent"))
    return;
  // Non-blocking: the legacy default stream, which other libraries may use, does not serialize
  // with mixtape's work.
  if (!step(api.cuStreamCreate(&state.stream, driver_abi::kStreamNonBlocking), "cuStreamCreate"))
    return;
  state.ok = true;
}

// The library stays loaded and the context retained for the life of the process: kernels and
// buffers may be released by static destructors in any order.
DriverState& state() {
  static DriverState* instance = [] {
    auto* s = new DriverState;
    initialize(*s);
    return s;
  }();
  return *instance;
}

}  // namespace

bool available() { return state().ok; }

std::string unavailable_reason() { return state().ok ? std::string() : state().reason; }

void require_available() {
  if (!available()) fail("CUDA is not available: {}", state().reason);
}

const DriverApi& driver() {
  require_available();
  DriverState& s = state();
  // The context is current per thread; the thread that initialized has it already.
  thread_local bool context_current = false;
  if (!context_current) {
    check(s.api.cuCtxSetCurrent(s.context), "cuCtxSetCurrent");
    context_current = true;
  }
  return s.api;
}

void check(CUresult result, const char* call) {
  if (result == driver_abi::kSuccess) return;
  throw Error(describe(state().api, result, call));
}

int compute_capability() { return require_available(), state().capability; }
int multiprocessor_count() { return require_available(), state().multiprocessors; }
int device_ordinal() { return require_available(), state().ordinal; }

std::array<char, 16> device_uuid() {
  std::array<char, 16> uuid{};
  check(driver().cuDeviceGetUuid(uuid.data(), state().device), "cuDeviceGetUuid");
  return uuid;
}
std::string device_name() { return require_available(), state().name; }
int driver_version() { return require_available(), state().version; }

MemoryInfo memory_info() {
  MemoryInfo info;
  check(driver().cuMemGetInfo_v2(&info.free, &info.total), "cuMemGetInfo_v2");
  return info;
}

void Stream::synchronize() const {
  check(driver().cuStreamSynchronize(handle_), "cuStreamSynchronize");
}

Stream& compute_stream() {
  require_available();
  static Stream stream(state().stream);
  return stream;
}

Event::Event(bool timing) {
  check(driver().cuEventCreate(
            &event_, timing ? driver_abi::kEventDefault : driver_abi::kEventDisableTiming),
        "cuEventCreate");
}

Event::~Event() {
  // Never throws from a destructor; a failure here leaks one event.
  if (event_ != nullptr) state().api.cuEventDestroy_v2(event_);
}

void Event::record(const Stream& stream) {
  check(driver().cuEventRecord(event_, stream.handle()), "cuEventRecord");
}

bool Event::done() const {
  CUresult result = driver().cuEventQuery(event_);
  if (result == driver_abi::kErrorNotReady) return false;
  check(result, "cuEventQuery");
  return true;
}

void Event::synchronize() const {
  check(driver().cuEventSynchronize(event_), "cuEventSynchronize");
}

float Event::elapsed_ms(const Event& start, const Event& end) {
  float ms = 0;
  check(driver().cuEventElapsedTime(&ms, start.event_, end.event_), "cuEventElapsedTime");
  return ms;
}

CUmodule load_module(std::span<const char> image) {
  if (image.empty()) fail("load_module: empty CUDA module image");
  CUmodule module = nullptr;
  check(driver().cuModuleLoadData(&module, image.data()), "cuModuleLoadData");
  return module;
}

CUfunction get_function(CUmodule module, const std::string& name) {
  CUfunction function = nullptr;
  CUresult result = driver().cuModuleGetFunction(&function, module, name.c_str());
  if (result != driver_abi::kSuccess)
    throw Error(describe(state().api, result, fmt::format("cuModuleGetFunction(\"{}\")", name)));
  return function;
}

void launch(CUfunction function, Dim3 grid, Dim3 block, unsigned shared_bytes, void** args) {
  check(driver().cuLaunchKernel(function, grid.x, grid.y, grid.z, block.x, block.y, block.z,
                                shared_bytes, compute_stream().handle(), args, nullptr),
        "cuLaunchKernel");
}

void copy_to_device_async(CUdeviceptr dst, const void* src, size_t bytes) {
  if (bytes == 0) return;
  check(driver().cuMemcpyHtoDAsync_v2(dst, src, bytes, compute_stream().handle()),
        "cuMemcpyHtoDAsync_v2");
}

void copy_to_host_async(void* dst, CUdeviceptr src, size_t bytes) {
  if (bytes == 0) return;
  check(driver().cuMemcpyDtoHAsync_v2(dst, src, bytes, compute_stream().handle()),
        "cuMemcpyDtoHAsync_v2");
}

void copy_device_to_device_async(CUdeviceptr dst, CUdeviceptr src, size_t bytes) {
  if (bytes == 0) return;
  check(driver().cuMemcpyDtoDAsync_v2(dst, src, bytes, compute_stream().handle()),
        "cuMemcpyDtoDAsync_v2");
}

void memset_async(CUdeviceptr dst, unsigned char value, size_t bytes) {
  if (bytes == 0) return;
  check(driver().cuMemsetD8Async(dst, value, bytes, compute_stream().handle()), "cuMemsetD8Async");
}

}  // namespace mixtape::cuda

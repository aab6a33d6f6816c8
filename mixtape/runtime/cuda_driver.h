// mixtape/runtime/cuda_driver.h -- the CUDA driver API loaded with dlopen: device, context, stream,
// launch.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>

namespace mixtape::cuda {

// The driver's types and the few enum values mixtape uses, declared here so that nothing links
// against the toolkit; tests/test_cuda_runtime.cpp checks them against cuda.h where it exists.
using CUresult = int;
using CUdevice = int;
using CUdeviceptr = unsigned long long;
struct CUctx_st;
struct CUmod_st;
struct CUfunc_st;
struct CUstream_st;
struct CUevent_st;
using CUcontext = CUctx_st*;
using CUmodule = CUmod_st*;
using CUfunction = CUfunc_st*;
using CUstream = CUstream_st*;
using CUevent = CUevent_st*;

namespace driver_abi {
inline constexpr CUresult kSuccess = 0;           // CUDA_SUCCESS
inline constexpr CUresult kErrorOutOfMemory = 2;  // CUDA_ERROR_OUT_OF_MEMORY
inline constexpr CUresult kErrorNotReady = 600;   // CUDA_ERROR_NOT_READY
inline constexpr int kAttributeMultiprocessorCount =
    16;  // CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT
inline constexpr int kAttributeComputeCapabilityMajor = 75;
inline constexpr int kAttributeComputeCapabilityMinor = 76;
inline constexpr unsigned kStreamNonBlocking = 1;   // CU_STREAM_NON_BLOCKING
inline constexpr unsigned kEventDefault = 0;        // CU_EVENT_DEFAULT
inline constexpr unsigned kEventDisableTiming = 2;  // CU_EVENT_DISABLE_TIMING
}  // namespace driver_abi

/// The driver entry points, by the symbol names libcuda.so.1 exports (the _v2 ones where cuda.h
/// maps a name to them).
struct DriverApi {
  CUresult (*cuInit)(unsigned flags);
  CUresult (*cuDriverGetVersion)(int* version);
  CUresult (*cuDeviceGetCount)(int* count);
  CUresult (*cuDeviceGet)(CUdevice* device, int ordinal);
  CUresult (*cuDeviceGetAttribute)(int* value, int attribute, CUdevice device);
  CUresult (*cuDeviceGetName)(char* name, int length, CUdevice device);
  CUresult (*cuDeviceGetUuid)(char uuid[16], CUdevice device);  // cuDeviceGetUuid_v2 where there
  CUresult (*cuDevicePrimaryCtxRetain)(CUcontext* context, CUdevice device);
  CUresult (*cuCtxSetCurrent)(CUcontext context);
  CUresult (*cuModuleLoadData)(CUmodule* module, const void* image);
  CUresult (*cuModuleGetFunction)(CUfunction* function, CUmodule module, const char* name);
  CUresult (*cuLaunchKernel)(CUfunction f, unsigned grid_x, unsigned grid_y, unsigned grid_z,
                             unsigned block_x, unsigned block_y, unsigned block_z,
                             unsigned shared_bytes, CUstream stream, void** params, void** extra);
  CUresult (*cuMemAlloc_v2)(CUdeviceptr* ptr, size_t bytes);
  CUresult (*cuMemFree_v2)(CUdeviceptr ptr);
  CUresult (*cuMemAllocHost_v2)(void** ptr, size_t bytes);
  CUresult (*cuMemFreeHost)(void* ptr);
  CUresult (*cuMemGetInfo_v2)(size_t* free, size_t* total);
  CUresult (*cuMemcpyHtoDAsync_v2)(CUdeviceptr dst, const void* src, size_t bytes, CUstream s);
  CUresult (*cuMemcpyDtoHAsync_v2)(void* dst, CUdeviceptr src, size_t bytes, CUstream s);
  CUresult (*cuMemcpyDtoDAsync_v2)(CUdeviceptr dst, CUdeviceptr src, size_t bytes, CUstream s);
  CUresult (*cuMemsetD8Async)(CUdeviceptr dst, unsigned char value, size_t count, CUstream s);
  CUresult (*cuStreamCreate)(CUstream* stream, unsigned flags);
  CUresult (*cuStreamSynchronize)(CUstream stream);
  CUresult (*cuEventCreate)(CUevent* event, unsigned flags);
  CUresult (*cuEventDestroy_v2)(CUevent event);
  CUresult (*cuEventRecord)(CUevent event, CUstream stream);
  CUresult (*cuEventQuery)(CUevent event);
  CUresult (*cuEventSynchronize)(CUevent event);
  // cuEventElapsedTime_v2 since CUDA 12.8, the unversioned symbol before; same signature.
  CUresult (*cuEventElapsedTime)(float* milliseconds, CUevent start, CUevent end);
  CUresult (*cuGetErrorString)(CUresult error, const char** text);
  CUresult (*cuGetErrorName)(CUresult error, const char** text);
};

/// True when libcuda.so.1 loads, cuInit succeeds and there is at least one device; the
/// process's device's (device_ordinal()) primary context and the compute stream are then set up.
/// Decided once per process; never throws. MIXTAPE_CUDA_DRIVER names another driver library to load
/// (tests use it to simulate a machine without one).
bool available();
/// One line saying why available() is false: the library that was missing or the call that
/// failed. Empty when available.
std::string unavailable_reason();
/// Throws mt::Error "CUDA is not available: <reason>" unless available().
void require_available();

/// The driver table, with the device's primary context current on the calling thread. Throws like
/// require_available().
const DriverApi& driver();

/// Throws mt::Error "<call> failed: CUDA_ERROR_X (<cuGetErrorString's text>)" unless `result` is
/// CUDA_SUCCESS.
void check(CUresult result, const char* call);

int compute_capability();    // major * 10 + minor, e.g. 90 for an H100/H200
int multiprocessor_count();  // SMs
/// The device this process runs on: MIXTAPE_CUDA_DEVICE, else its rank on its host as the MPI
/// launcher numbers them (OMPI_COMM_WORLD_LOCAL_RANK, MPI_LOCALRANKID or SLURM_LOCALID) modulo
/// the devices there, else 0.
int device_ordinal();
/// The device's UUID, the same in every process whatever CUDA_VISIBLE_DEVICES numbers it.
std::array<char, 16> device_uuid();
std::string device_name();
int driver_version();  // e.g. 13000
struct MemoryInfo {
  size_t free = 0, total = 0;
};
MemoryInfo memory_info();

/// The one compute stream every kernel, copy and GEMM is queued on, so work is ordered without
/// explicit events.
class Stream {
 public:
  CUstream handle() const { return handle_; }
  void synchronize() const;

 private:
  friend Stream& compute_stream();
  explicit Stream(CUstream handle) : handle_(handle) {}
  CUstream handle_;
};
Stream& compute_stream();

/// A CUDA event for timing and for knowing when queued work has finished.
class Event {
 public:
  explicit Event(bool timing = true);
  ~Event();
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;
  void record(const Stream& stream = compute_stream());
  bool done() const;  // the recorded work has finished (true if never recorded)
  void synchronize() const;
  /// Milliseconds between two recorded, completed timing events.
  static float elapsed_ms(const Event& start, const Event& end);
  CUevent handle() const { return event_; }

 private:
  CUevent event_ = nullptr;
};

struct Dim3 {
  unsigned x = 1, y = 1, z = 1;
};

/// Loads a CUBIN or PTX image (PTX must be NUL-terminated) into the context.
CUmodule load_module(std::span<const char> image);
/// The kernel `name` of `module`; throws mt::Error naming it when it is missing.
CUfunction get_function(CUmodule module, const std::string& name);
/// Queues `function` on the compute stream; `args` points to one pointer per kernel parameter.
void launch(CUfunction function, Dim3 grid, Dim3 block, unsigned shared_bytes, void** args);

// Stream-ordered copies on the compute stream. Host memory must stay valid (and, for downloads,
// unread) until the stream has run them: synchronize or record an Event. Pinned host memory makes
// them truly asynchronous (cuda_allocator.h's staging does that for pageable memory).
void copy_to_device_async(CUdeviceptr dst, const void* src, size_t bytes);
void copy_to_host_async(void* dst, CUdeviceptr src, size_t bytes);
void copy_device_to_device_async(CUdeviceptr dst, CUdeviceptr src, size_t bytes);
void memset_async(CUdeviceptr dst, unsigned char value, size_t bytes);

inline CUdeviceptr device_ptr(const void* p) { return reinterpret_cast<uintptr_t>(p); }

}  // namespace mixtape::cuda

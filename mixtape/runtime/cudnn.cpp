// mixtape/runtime/cudnn.cpp -- loads cuDNN, plans convolutions (descriptors and a deterministic
// direct algorithm per problem, cached) and queues them on the compute stream.
#include "mixtape/runtime/cudnn.h"

#include <dlfcn.h>

#include <climits>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <vector>

#include "mixtape/dsl/error.h"
#include "mixtape/dsl/log.h"
#include "mixtape/runtime/cuda_allocator.h"
#include "mixtape/runtime/cuda_driver.h"

namespace mixtape::cuda {

namespace {

using Status = int;
using Handle = void*;  // cudnnHandle_t and the descriptors are pointers to opaque structures
using TensorDesc = void*;
using FilterDesc = void*;
using ConvolutionDesc = void*;
using cudnn_abi::AlgoPerf;

struct CudnnApi {
  size_t (*cudnnGetVersion)();
  const char* (*cudnnGetErrorString)(Status status);
  Status (*cudnnCreate)(Handle* handle);
  Status (*cudnnSetStream)(Handle handle, CUstream stream);
  Status (*cudnnCreateTensorDescriptor)(TensorDesc* desc);
  Status (*cudnnSetTensor4dDescriptor)(TensorDesc desc, int format, int type, int n, int c, int h,
                                       int w);
  Status (*cudnnDestroyTensorDescriptor)(TensorDesc desc);
  Status (*cudnnCreateFilterDescriptor)(FilterDesc* desc);
  Status (*cudnnSetFilter4dDescriptor)(FilterDesc desc, int type, int format, int k, int c, int h,
                                       int w);
  Status (*cudnnDestroyFilterDescriptor)(FilterDesc desc);
  Status (*cudnnCreateConvolutionDescriptor)(ConvolutionDesc* desc);
  Status (*cudnnSetConvolution2dDescriptor)(ConvolutionDesc desc, int pad_h, int pad_w, int u,
                                            int v, int dilation_h, int dilation_w, int mode,
                                            int compute_type);
  Status (*cudnnSetConvolutionGroupCount)(ConvolutionDesc desc, int groups);
  Status (*cudnnSetConvolutionMathType)(ConvolutionDesc desc, int math_type);
  Status (*cudnnDestroyConvolutionDescriptor)(ConvolutionDesc desc);
  Status (*cudnnGetConvolutionForwardAlgorithm_v7)(Handle, TensorDesc x, FilterDesc w,
                                                   ConvolutionDesc, TensorDesc y, int requested,
                                                   int* returned, AlgoPerf* results);
  Status (*cudnnGetConvolutionBackwardDataAlgorithm_v7)(Handle, FilterDesc w, TensorDesc dy,
                                                        ConvolutionDesc, TensorDesc dx,
                                                        int requested, int* returned,
                                                        AlgoPerf* results);
  Status (*cudnnGetConvolutionBackwardFilterAlgorithm_v7)(Handle, TensorDesc x, TensorDesc dy,
                                                          ConvolutionDesc, FilterDesc dw,
                                                          int requested, int* returned,
                                                          AlgoPerf* results);
  Status (*cudnnConvolutionForward)(Handle, const void* alpha, TensorDesc x_desc, const void* x,
                                    FilterDesc w_desc, const void* w, ConvolutionDesc, int algo,
                                    void* workspace, size_t workspace_bytes, const void* beta,
                                    TensorDesc y_desc, void* y);
  Status (*cudnnConvolutionBackwardData)(Handle, const void* alpha, FilterDesc w_desc,
                                         const void* w, TensorDesc dy_desc, const void* dy,
                                         ConvolutionDesc, int algo, void* workspace,
                                         size_t workspace_bytes, const void* beta,
                                         TensorDesc dx_desc, void* dx);
  Status (*cudnnConvolutionBackwardFilter)(Handle, const void* alpha, TensorDesc x_desc,
                                           const void* x, TensorDesc dy_desc, const void* dy,
                                           ConvolutionDesc, int algo, void* workspace,
                                           size_t workspace_bytes, const void* beta,
                                           FilterDesc dw_desc, void* dw);
};

// The library and its entry points: loaded without a GPU (cudnnGetVersion needs none).
struct Library {
  CudnnApi api{};
  bool ok = false;
  std::string reason;
};

void bind_library(Library& lib) {
  void* library = nullptr;
  std::string tried;
  for (const char* path : {"libcudnn.so.9", "libcudnn.so", "/usr/local/cuda/lib64/libcudnn.so.9",
                           "/usr/local/cuda/lib64/libcudnn.so"}) {
    library = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (library != nullptr) break;
    tried += tried.empty() ? path : std::string(", ") + path;
  }
  if (library == nullptr) {
    lib.reason = fmt::format("cannot load cuDNN (tried {})", tried);
    return;
  }
  CudnnApi& api = lib.api;
  bool bound = true;
  auto bind = [&](auto& slot, const char* symbol) {
    slot = reinterpret_cast<std::remove_reference_t<decltype(slot)>>(dlsym(library, symbol));
    if (slot == nullptr && bound) lib.reason = fmt::format("libcudnn lacks {}", symbol);
    bound = bound && slot != nullptr;
  };
#define MIXTAPE_BIND(name) bind(api.name, #name)
  MIXTAPE_BIND(cudnnGetVersion);
  MIXTAPE_BIND(cudnnGetErrorString);
  MIXTAPE_BIND(cudnnCreate);
  MIXTAPE_BIND(cudnnSetStream);
  MIXTAPE_BIND(cudnnCreateTensorDescriptor);
  MIXTAPE_BIND(cudnnSetTensor4dDescriptor);
  MIXTAPE_BIND(cudnnDestroyTensorDescriptor);
  MIXTAPE_BIND(cudnnCreateFilterDescriptor);
  MIXTAPE_BIND(cudnnSetFilter4dDescriptor);
  MIXTAPE_BIND(cudnnDestroyFilterDescriptor);
  MIXTAPE_BIND(cudnnCreateConvolutionDescriptor);
  MIXTAPE_BIND(cudnnSetConvolution2dDescriptor);
  MIXTAPE_BIND(cudnnSetConvolutionGroupCount);
  MIXTAPE_BIND(cudnnSetConvolutionMathType);
  MIXTAPE_BIND(cudnnDestroyConvolutionDescriptor);
  MIXTAPE_BIND(cudnnGetConvolutionForwardAlgorithm_v7);
  MIXTAPE_BIND(cudnnGetConvolutionBackwardDataAlgorithm_v7);
  MIXTAPE_BIND(cudnnGetConvolutionBackwardFilterAlgorithm_v7);
  MIXTAPE_BIND(cudnnConvolutionForward);
  MIXTAPE_BIND(cudnnConvolutionBackwardData);
  MIXTAPE_BIND(cudnnConvolutionBackwardFilter);
#undef MIXTAPE_BIND
  if (!bound) return;
  // The descriptors and algorithms used here are cuDNN 7's API, which 9 still has; the structure
  // layouts checked in tests/test_cuda_runtime.cpp are 9's.
  if (const size_t version = api.cudnnGetVersion(); version < 90000) {
    lib.reason = fmt::format("cuDNN {} is older than 9", version);
    return;
  }
  lib.ok = true;
}

const Library& library() {
  static const Library* instance = [] {
    auto* lib = new Library;  // never unloaded: the handle lives as long as the process
    bind_library(*lib);
    return lib;
  }();
  return *instance;
}

struct Context {
  bool ok = false;
  std::string reason;
  Handle handle = nullptr;
};

const Context& context() {
  static const Context* instance = [] {
    auto* c = new Context;
    try {
      if (!available()) {
        c->reason = "CUDA is not available: " + unavailable_reason();
      } else if (const Library& lib = library(); !lib.ok) {
        c->reason = lib.reason;
      } else {
        driver();  // the primary context, which cuDNN's runtime shares, current here
        if (Status s = lib.api.cudnnCreate(&c->handle); s != cudnn_abi::kStatusSuccess) {
          c->reason = fmt::format("cudnnCreate failed: {}", lib.api.cudnnGetErrorString(s));
        } else if (s = lib.api.cudnnSetStream(c->handle, compute_stream().handle());
                   s != cudnn_abi::kStatusSuccess) {
          c->reason = fmt::format("cudnnSetStream failed: {}", lib.api.cudnnGetErrorString(s));
        } else {
          c->ok = true;
        }
      }
    } catch (const std::exception& e) {
      c->reason = e.what();
    }
    return c;
  }();
  return *instance;
}

std::string describe(const CudnnConvDesc& d) {
  const ConvGeometry& g = d.geometry;
  const ConvWindow& w = g.window;
  return fmt::format(
      "{}(x [{}, {}, {}, {}], w [{}, {}, {}, {}], y [{}, {}, {}, {}], stride ({}, {}), padding "
      "({}, {}), dilation ({}, {}), groups {}, {})",
      op_name(d.op), g.n, g.c, g.h, g.w, g.o, g.c / w.groups, g.kh, g.kw, g.n, g.o, g.oh, g.ow,
      w.stride[0], w.stride[1], w.pad[0], w.pad[1], w.dil[0], w.dil[1], w.groups, name(d.dtype));
}

void check(Status status, const char* call, const CudnnConvDesc& d) {
  if (status == cudnn_abi::kStatusSuccess) return;
  fail("{} failed for {}: {}", call, describe(d), library().api.cudnnGetErrorString(status));
}

int cudnn_type(DType t) {
  return t == f16    ? cudnn_abi::kDataHalf
         : t == bf16 ? cudnn_abi::kDataBfloat16
                     : cudnn_abi::kDataFloat;
}

// Whether an algorithm computes the direct convolution's products (see cudnn_abi).
bool direct(OpCode op, int algo) {
  if (op == OpCode::Conv2d) return algo >= 0 && algo <= cudnn_abi::kFwdAlgoDirect;
  if (op == OpCode::Conv2dInputGrad) return algo >= 0 && algo <= cudnn_abi::kBwdDataAlgo1;
  return algo >= 0 && algo <= cudnn_abi::kBwdFilterAlgo3 && algo != cudnn_abi::kBwdFilterAlgoFft;
}

std::string algorithm_name(OpCode op, int algo, int math_type) {
  static const char* const forward[] = {"IMPLICIT_GEMM", "IMPLICIT_PRECOMP_GEMM", "GEMM", "DIRECT"};
  const std::string math = math_type == cudnn_abi::kTensorOpMath ? "tensor ops"
                           : math_type == cudnn_abi::kFmaMath    ? "FMA"
                                                                 : "default math";
  if (op == OpCode::Conv2d) return fmt::format("fwd {}, {}", forward[algo], math);
  return fmt::format("{} ALGO_{}, {}", op == OpCode::Conv2dInputGrad ? "bwd data" : "bwd filter",
                     algo, math);
}

// The most workspace an algorithm may ask for; a hungrier one is passed over for the next.
constexpr size_t kMaxWorkspaceBytes = size_t{1} << 30;

struct PlanKey {
  OpCode op;
  ConvGeometry geometry;
  DType dtype;
  bool tf32;
  auto operator<=>(const PlanKey&) const = default;
};

// One problem's descriptors and algorithm (algo < 0: none that may be used).
struct Plan {
  TensorDesc x = nullptr, y = nullptr;
  FilterDesc w = nullptr;
  ConvolutionDesc conv = nullptr;
  int algo = -1, math_type = cudnn_abi::kDefaultMath;
  size_t workspace = 0;
  ~Plan() {
    const CudnnApi& api = library().api;
    if (x) api.cudnnDestroyTensorDescriptor(x);
    if (y) api.cudnnDestroyTensorDescriptor(y);
    if (w) api.cudnnDestroyFilterDescriptor(w);
    if (conv) api.cudnnDestroyConvolutionDescriptor(conv);
  }
};

std::unique_ptr<Plan> make_plan(const CudnnConvDesc& d) {
  const CudnnApi& api = library().api;
  const ConvGeometry& g = d.geometry;
  const ConvWindow& win = g.window;
  const int type = cudnn_type(d.dtype);
  auto plan = std::make_unique<Plan>();
  auto i = [](int64_t v) { return static_cast<int>(v); };
  check(api.cudnnCreateTensorDescriptor(&plan->x), "cudnnCreateTensorDescriptor", d);
  check(api.cudnnSetTensor4dDescriptor(plan->x, cudnn_abi::kTensorNchw, type, i(g.n), i(g.c),
                                       i(g.h), i(g.w)),
        "cudnnSetTensor4dDescriptor", d);
  check(api.cudnnCreateTensorDescriptor(&plan->y), "cudnnCreateTensorDescriptor", d);
  check(api.cudnnSetTensor4dDescriptor(plan->y, cudnn_abi::kTensorNchw, type, i(g.n), i(g.o),
                                       i(g.oh), i(g.ow)),
        "cudnnSetTensor4dDescriptor", d);
  check(api.cudnnCreateFilterDescriptor(&plan->w), "cudnnCreateFilterDescriptor", d);
  check(api.cudnnSetFilter4dDescriptor(plan->w, type, cudnn_abi::kTensorNchw, i(g.o),
                                       i(g.c / win.groups), i(g.kh), i(g.kw)),
        "cudnnSetFilter4dDescriptor", d);
  check(api.cudnnCreateConvolutionDescriptor(&plan->conv), "cudnnCreateConvolutionDescriptor", d);
  check(api.cudnnSetConvolution2dDescriptor(
            plan->conv, i(win.pad[0]), i(win.pad[1]), i(win.stride[0]), i(win.stride[1]),
            i(win.dil[0]), i(win.dil[1]), cudnn_abi::kCrossCorrelation, cudnn_abi::kDataFloat),
        "cudnnSetConvolution2dDescriptor", d);
  check(api.cudnnSetConvolutionGroupCount(plan->conv, i(win.groups)),
        "cudnnSetConvolutionGroupCount", d);
  // f32 without TF32 asks for FMA kernels only (cuDNN's default math allows TF32 on Ampere and
  // later); f32 with it for the default; half operands for tensor cores.
  const bool fma_only = d.dtype == f32 && !d.allow_tf32;
  const int math = d.dtype != f32 ? cudnn_abi::kTensorOpMath
                   : fma_only     ? cudnn_abi::kFmaMath
                                  : cudnn_abi::kDefaultMath;
  check(api.cudnnSetConvolutionMathType(plan->conv, math), "cudnnSetConvolutionMathType", d);
  constexpr int kRequested = 16;
  AlgoPerf results[kRequested] = {};
  int returned = 0;
  Handle h = context().handle;
  if (d.op == OpCode::Conv2d)
    check(api.cudnnGetConvolutionForwardAlgorithm_v7(h, plan->x, plan->w, plan->conv, plan->y,
                                                     kRequested, &returned, results),
          "cudnnGetConvolutionForwardAlgorithm_v7", d);
  else if (d.op == OpCode::Conv2dInputGrad)
    check(api.cudnnGetConvolutionBackwardDataAlgorithm_v7(h, plan->w, plan->y, plan->conv, plan->x,
                                                          kRequested, &returned, results),
          "cudnnGetConvolutionBackwardDataAlgorithm_v7", d);
  else
    check(api.cudnnGetConvolutionBackwardFilterAlgorithm_v7(
              h, plan->x, plan->y, plan->conv, plan->w, kRequested, &returned, results),
          "cudnnGetConvolutionBackwardFilterAlgorithm_v7", d);
  // The heuristic's order is its expected speed: the first usable one.
  for (int r = 0; r < std::min(returned, kRequested); ++r) {
    const AlgoPerf& p = results[r];
    if (p.status != cudnn_abi::kStatusSuccess || p.determinism != cudnn_abi::kDeterministic ||
        !direct(d.op, p.algo) || p.memory > kMaxWorkspaceBytes ||
        (fma_only && p.math_type != cudnn_abi::kFmaMath))
      continue;
    plan->algo = p.algo, plan->math_type = p.math_type, plan->workspace = p.memory;
    check(api.cudnnSetConvolutionMathType(plan->conv, p.math_type), "cudnnSetConvolutionMathType",
          d);
    break;
  }
  if (log_enabled("profile"))
    log_line("profile", "{}: cuDNN {}", describe(d),
             plan->algo < 0 ? "has no deterministic direct algorithm"
                            : algorithm_name(d.op, plan->algo, plan->math_type));
  return plan;
}

struct PlanCache {
  std::mutex mutex;
  std::map<PlanKey, std::unique_ptr<Plan>> plans;
};

PlanCache& plan_cache() {
  static PlanCache* cache = new PlanCache;  // descriptors live as long as the process
  return *cache;
}

const Plan& plan_for(const CudnnConvDesc& d) {
  if (!cudnn_available()) fail("cuDNN is not available: {}", cudnn_unavailable_reason());
  if (!cudnn_conv_supported(d)) fail("{}: not a problem cuDNN takes", describe(d));
  driver();  // the context must be current on this thread too
  PlanCache& cache = plan_cache();
  std::lock_guard lock(cache.mutex);
  std::unique_ptr<Plan>& plan = cache.plans[{d.op, d.geometry, d.dtype, d.allow_tf32}];
  if (!plan) {
    try {
      plan = make_plan(d);
    } catch (...) {
      cache.plans.erase({d.op, d.geometry, d.dtype, d.allow_tf32});
      throw;
    }
  }
  return *plan;
}

}  // namespace

size_t cudnn_library_version() {
  const Library& lib = library();
  return lib.ok ? lib.api.cudnnGetVersion() : 0;
}

bool cudnn_available() { return context().ok; }

std::string cudnn_unavailable_reason() { return context().reason; }

bool cudnn_conv_supported(const CudnnConvDesc& d) {
  const ConvGeometry& g = d.geometry;
  const ConvWindow& w = g.window;
  if (d.dtype != f32 && d.dtype != f16 && d.dtype != bf16) return false;
  if (d.op != OpCode::Conv2d && d.op != OpCode::Conv2dInputGrad && d.op != OpCode::Conv2dWeightGrad)
    return false;
  // cuDNN's 4-d descriptors hold ints, and its tensors at most INT_MAX elements; its output size is
  // the floor that PyTorch's (and ConvGeometry's) is.
  for (int64_t v : {g.n, g.c, g.h, g.w, g.o, g.kh, g.kw, g.oh, g.ow, w.groups})
    if (v <= 0 || v > INT_MAX) return false;
  for (int64_t count : {g.n * g.c * g.h * g.w, g.n * g.o * g.oh * g.ow, g.o * g.c * g.kh * g.kw})
    if (count > INT_MAX) return false;
  for (int axis = 0; axis < 2; ++axis) {
    const int64_t size = axis == 0 ? g.h : g.w, kernel = axis == 0 ? g.kh : g.kw;
    const int64_t out = axis == 0 ? g.oh : g.ow;
    if (w.stride[axis] <= 0 || w.dil[axis] <= 0 || w.pad[axis] < 0 || w.pad[axis] > INT_MAX ||
        w.stride[axis] > INT_MAX || w.dil[axis] > INT_MAX)
      return false;
    const int64_t extent = w.dil[axis] * (kernel - 1) + 1;
    if ((size + 2 * w.pad[axis] - extent) / w.stride[axis] + 1 != out) return false;
  }
  return g.c % w.groups == 0 && g.o % w.groups == 0;
}

std::optional<std::string> cudnn_conv_algorithm(const CudnnConvDesc& d) {
  const Plan& plan = plan_for(d);
  if (plan.algo < 0) return std::nullopt;
  return algorithm_name(d.op, plan.algo, plan.math_type);
}

void cudnn_conv(const CudnnConvDesc& d, const void* a, const void* b, void* out) {
  const Plan& plan = plan_for(d);
  if (plan.algo < 0) fail("{}: cuDNN has no deterministic direct algorithm for it", describe(d));
  const CudnnApi& api = library().api;
  Handle h = context().handle;
  DeviceBuffer workspace = plan.workspace > 0 ? DeviceBuffer(plan.workspace) : DeviceBuffer();
  const float alpha = 1, beta = 0;  // alpha and beta are floats for every dtype but f64
  if (d.op == OpCode::Conv2d)
    check(api.cudnnConvolutionForward(h, &alpha, plan.x, a, plan.w, b, plan.conv, plan.algo,
                                      workspace.data(), plan.workspace, &beta, plan.y, out),
          "cudnnConvolutionForward", d);
  else if (d.op == OpCode::Conv2dInputGrad)
    check(api.cudnnConvolutionBackwardData(h, &alpha, plan.w, b, plan.y, a, plan.conv, plan.algo,
                                           workspace.data(), plan.workspace, &beta, plan.x, out),
          "cudnnConvolutionBackwardData", d);
  else
    check(api.cudnnConvolutionBackwardFilter(h, &alpha, plan.x, a, plan.y, b, plan.conv, plan.algo,
                                             workspace.data(), plan.workspace, &beta, plan.w, out),
          "cudnnConvolutionBackwardFilter", d);
}

}  // namespace mixtape::cuda

// mixtape/runtime/cudnn.cpp -- loads cuDNN, plans convolutions (descriptors and a deterministic
// direct algorithm per problem, cached) and queues them on the compute stream.
#include "mixtape/runtime/cudnn.h"

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
#include "mixtape/runtime/shared_library.h"

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
  void (*cudnnGetLastErrorString)(char* message, size_t max_size);
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
  void* library =
      open_first_library({"libcudnn.so.9", "libcudnn.so", "/usr/local/cuda/lib64/libcudnn.so.9",
                          "/usr/local/cuda/lib64/libcudnn.so"},
                         "cuDNN", lib.reason);
  if (library == nullptr) return;
  CudnnApi& api = lib.api;
  bool bound = true;
#define MIXTAPE_BIND(name) \
  bound = bind_symbol(library, api.name, #name, "libcudnn", lib.reason) && bound
  MIXTAPE_BIND(cudnnGetVersion);
  MIXTAPE_BIND(cudnnGetErrorString);
  MIXTAPE_BIND(cudnnGetLastErrorString);
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
          // cuDNN 9 loads its sub-libraries at their first call: a convolution descriptor needs
          // libcudnn_cnn, whose absence would otherwise surface only at the first convolution.
          ConvolutionDesc probe = nullptr;
          s = lib.api.cudnnCreateConvolutionDescriptor(&probe);
          if (s != cudnn_abi::kStatusSuccess)
            c->reason = fmt::format("cudnnCreateConvolutionDescriptor failed: {}",
                                    lib.api.cudnnGetErrorString(s));
          else
            lib.api.cudnnDestroyConvolutionDescriptor(probe), c->ok = true;
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
  return fmt::format("{}, {}", d.geometry.describe(d.op), name(d.dtype));
}

// The status's name and cuDNN's account of the last failure, which says why.
std::string error_text(Status status) {
  const CudnnApi& api = library().api;
  char why[512] = {};
  api.cudnnGetLastErrorString(why, sizeof why);
  return why[0] ? fmt::format("{} ({})", api.cudnnGetErrorString(status), why)
                : std::string(api.cudnnGetErrorString(status));
}

// One line on stderr, the first time cuDNN fails at something it said it could do (the
// fallback is correct, only slower; MIXTAPE_LOG=profile lists each problem's choice).
void warn_once(const std::string& line) {
  static std::once_flag once;
  std::call_once(once, [&] { std::fprintf(stderr, "mixtape: %s\n", line.c_str()); });
}

void check(Status status, const char* call, const CudnnConvDesc& d) {
  if (status == cudnn_abi::kStatusSuccess) return;
  fail("{} failed for {}: {}", call, describe(d), error_text(status));
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

// One problem's descriptors and the algorithms that may run it, in the heuristic's order (its
// expected speed): the first is tried first, the next where one fails (PyTorch's try_all).
struct Plan {
  TensorDesc x = nullptr, y = nullptr;
  FilterDesc w = nullptr;
  ConvolutionDesc conv = nullptr;
  std::vector<CudnnAlgorithm> candidates;
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
  plan->candidates =
      cudnn_usable_algorithms(d.op, std::span(results, std::min(returned, kRequested)), fma_only);
  if (log_enabled("profile"))
    log_line("profile", "{}: cuDNN {}", describe(d),
             plan->candidates.empty()
                 ? std::string("has no deterministic direct algorithm")
                 : algorithm_name(d.op, plan->candidates[0].algo, plan->candidates[0].math_type));
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

// The problem's plan, made on first use; `cache.mutex` held (it also serializes every use of
// the one handle, which cuDNN allows one thread at a time).
Plan& plan_for(const CudnnConvDesc& d, PlanCache& cache) {
  if (!cudnn_available()) fail("cuDNN is not available: {}", cudnn_unavailable_reason());
  if (!cudnn_conv_supported(d)) fail("{}: not a problem cuDNN takes", describe(d));
  driver();  // the context must be current on this thread too
  const PlanKey key{d.op, d.geometry, d.dtype, d.allow_tf32};
  std::unique_ptr<Plan>& plan = cache.plans[key];
  if (!plan) {
    try {
      plan = make_plan(d);
    } catch (...) {
      cache.plans.erase(key);
      throw;
    }
  }
  return *plan;
}

// Queues candidate `c` of `plan`: nothing on success, else why it could not (a failed call, or
// no device memory for its workspace, where another candidate may need less).
std::optional<std::string> run_candidate(const CudnnConvDesc& d, const Plan& plan,
                                         const CudnnAlgorithm& c, const void* a, const void* b,
                                         void* out) {
  const CudnnApi& api = library().api;
  Handle h = context().handle;
  Status status = api.cudnnSetConvolutionMathType(plan.conv, c.math_type);
  if (status != cudnn_abi::kStatusSuccess) return error_text(status);
  DeviceBuffer workspace;
  try {
    if (c.workspace > 0) workspace = DeviceBuffer(c.workspace);
  } catch (const Error& e) {
    return fmt::format("its {} bytes of workspace: {}", c.workspace, e.what());
  }
  const float alpha = 1, beta = 0;  // alpha and beta are floats for every dtype but f64
  if (d.op == OpCode::Conv2d)
    status = api.cudnnConvolutionForward(h, &alpha, plan.x, a, plan.w, b, plan.conv, c.algo,
                                         workspace.data(), c.workspace, &beta, plan.y, out);
  else if (d.op == OpCode::Conv2dInputGrad)
    status = api.cudnnConvolutionBackwardData(h, &alpha, plan.w, b, plan.y, a, plan.conv, c.algo,
                                              workspace.data(), c.workspace, &beta, plan.x, out);
  else
    status = api.cudnnConvolutionBackwardFilter(h, &alpha, plan.x, a, plan.y, b, plan.conv, c.algo,
                                                workspace.data(), c.workspace, &beta, plan.w, out);
  if (status != cudnn_abi::kStatusSuccess) return error_text(status);
  return std::nullopt;
}

}  // namespace

std::vector<CudnnAlgorithm> cudnn_usable_algorithms(OpCode op,
                                                    std::span<const cudnn_abi::AlgoPerf> results,
                                                    bool fma_only) {
  std::vector<CudnnAlgorithm> usable;
  for (const AlgoPerf& p : results)
    if (p.status == cudnn_abi::kStatusSuccess && p.determinism == cudnn_abi::kDeterministic &&
        direct(op, p.algo) && p.memory <= kMaxWorkspaceBytes &&
        (!fma_only || p.math_type == cudnn_abi::kFmaMath))
      usable.push_back({p.algo, p.math_type, p.memory});
  return usable;
}

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
  if (g.c % w.groups != 0 || g.o % w.groups != 0) return false;
  for (int64_t count :
       {g.n * g.c * g.h * g.w, g.n * g.o * g.oh * g.ow, g.o * (g.c / w.groups) * g.kh * g.kw})
    if (count > INT_MAX) return false;
  for (int axis = 0; axis < 2; ++axis) {
    const int64_t size = axis == 0 ? g.h : g.w, kernel = axis == 0 ? g.kh : g.kw;
    const int64_t out = axis == 0 ? g.oh : g.ow;
    if (w.stride[axis] <= 0 || w.dil[axis] <= 0 || w.pad[axis] < 0 || w.pad[axis] > INT_MAX ||
        w.stride[axis] > INT_MAX || w.dil[axis] > INT_MAX)
      return false;
    const int64_t span = size + 2 * w.pad[axis] - (w.dil[axis] * (kernel - 1) + 1);
    if (span < 0 || span / w.stride[axis] + 1 != out) return false;
  }
  return true;
}

std::optional<std::string> cudnn_conv_algorithm(const CudnnConvDesc& d) {
  PlanCache& cache = plan_cache();
  std::lock_guard lock(cache.mutex);
  const Plan& plan = plan_for(d, cache);
  if (plan.candidates.empty()) return std::nullopt;
  return algorithm_name(d.op, plan.candidates[0].algo, plan.candidates[0].math_type);
}

bool cudnn_conv(const CudnnConvDesc& d, const void* a, const void* b, void* out) {
  PlanCache& cache = plan_cache();
  std::lock_guard lock(cache.mutex);
  Plan& plan = plan_for(d, cache);
  // A candidate that fails is dropped, so later calls start at one that ran.
  while (!plan.candidates.empty()) {
    const CudnnAlgorithm c = plan.candidates.front();
    const std::optional<std::string> failure = run_candidate(d, plan, c, a, b, out);
    if (!failure) return true;
    warn_once(
        fmt::format("cuDNN's {} failed for {}: {}; its next algorithm, or the direct loops, "
                    "run it instead",
                    algorithm_name(d.op, c.algo, c.math_type), describe(d), *failure));
    plan.candidates.erase(plan.candidates.begin());
  }
  return false;
}

}  // namespace mixtape::cuda

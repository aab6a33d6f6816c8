// mixtape/runtime/cublaslt.cpp -- loads cuBLASLt, plans row-major matmuls, caches heuristic plans.
#include "mixtape/runtime/cublaslt.h"

#include <algorithm>
#include <compare>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>

#include "mixtape/dsl/error.h"
#include "mixtape/runtime/cuda_allocator.h"
#include "mixtape/runtime/cuda_driver.h"
#include "mixtape/runtime/shared_library.h"

namespace mixtape::cuda {

namespace {

using Status = int;
struct LtContext;
struct LtOpaque;
using Handle = LtContext*;
using OpDesc = LtOpaque*;
using Layout = LtOpaque*;
using Preference = LtOpaque*;
struct alignas(8) HeuristicResult {
  unsigned char bytes[lt_abi::kHeuristicResultBytes];
};

struct LtApi {
  Status (*cublasLtCreate)(Handle* handle);
  size_t (*cublasLtGetVersion)();
  const char* (*cublasLtGetStatusName)(Status status);
  const char* (*cublasLtGetStatusString)(Status status);
  Status (*cublasLtMatmulDescCreate)(OpDesc* desc, int compute_type, int scale_type);
  Status (*cublasLtMatmulDescDestroy)(OpDesc desc);
  Status (*cublasLtMatmulDescSetAttribute)(OpDesc desc, int attribute, const void* value,
                                           size_t bytes);
  Status (*cublasLtMatrixLayoutCreate)(Layout* layout, int type, uint64_t rows, uint64_t cols,
                                       int64_t ld);
  Status (*cublasLtMatrixLayoutDestroy)(Layout layout);
  Status (*cublasLtMatrixLayoutSetAttribute)(Layout layout, int attribute, const void* value,
                                             size_t bytes);
  Status (*cublasLtMatmulPreferenceCreate)(Preference* preference);
  Status (*cublasLtMatmulPreferenceDestroy)(Preference preference);
  Status (*cublasLtMatmulPreferenceSetAttribute)(Preference preference, int attribute,
                                                 const void* value, size_t bytes);
  Status (*cublasLtMatmulAlgoGetHeuristic)(Handle handle, OpDesc desc, Layout a, Layout b, Layout c,
                                           Layout d, Preference preference, int requested,
                                           HeuristicResult* results, int* returned);
  Status (*cublasLtMatmul)(Handle handle, OpDesc desc, const void* alpha, const void* a,
                           Layout a_layout, const void* b, Layout b_layout, const void* beta,
                           const void* c, Layout c_layout, void* d, Layout d_layout,
                           const void* algo, void* workspace, size_t workspace_bytes,
                           CUstream stream);
};

struct LtState {
  LtApi api{};
  bool ok = false;
  std::string reason;
  Handle handle = nullptr;
};

void load(LtState& state) {
  if (!available()) {
    state.reason = "CUDA is not available: " + unavailable_reason();
    return;
  }
  void* library = open_first_library(
      {"libcublasLt.so.13", "libcublasLt.so.12", "libcublasLt.so",
       "/usr/local/cuda/lib64/libcublasLt.so.13", "/usr/local/cuda/lib64/libcublasLt.so.12",
       "/usr/local/cuda/lib64/libcublasLt.so"},
      "cuBLASLt", state.reason);
  if (library == nullptr) return;
  LtApi& api = state.api;
  bool bound = true;
#define MIXTAPE_BIND(name) \
  bound = bind_symbol(library, api.name, #name, "libcublasLt", state.reason) && bound
  MIXTAPE_BIND(cublasLtCreate);
  MIXTAPE_BIND(cublasLtGetVersion);
  MIXTAPE_BIND(cublasLtGetStatusName);
  MIXTAPE_BIND(cublasLtGetStatusString);
  MIXTAPE_BIND(cublasLtMatmulDescCreate);
  MIXTAPE_BIND(cublasLtMatmulDescDestroy);
  MIXTAPE_BIND(cublasLtMatmulDescSetAttribute);
  MIXTAPE_BIND(cublasLtMatrixLayoutCreate);
  MIXTAPE_BIND(cublasLtMatrixLayoutDestroy);
  MIXTAPE_BIND(cublasLtMatrixLayoutSetAttribute);
  MIXTAPE_BIND(cublasLtMatmulPreferenceCreate);
  MIXTAPE_BIND(cublasLtMatmulPreferenceDestroy);
  MIXTAPE_BIND(cublasLtMatmulPreferenceSetAttribute);
  MIXTAPE_BIND(cublasLtMatmulAlgoGetHeuristic);
  MIXTAPE_BIND(cublasLtMatmul);
#undef MIXTAPE_BIND
  if (!bound) return;
  driver();  // makes the primary context, which cuBLASLt's runtime shares, current here
  Status status = api.cublasLtCreate(&state.handle);
  if (status != lt_abi::kStatusSuccess) {
    state.reason = fmt::format("cublasLtCreate failed: {}", api.cublasLtGetStatusString(status));
    return;
  }
  state.ok = true;
}

LtState& lt_state() {
  static LtState* instance = [] {
    auto* s = new LtState;  // the handle lives as long as the process
    try {
      load(*s);
    } catch (const std::exception& e) {
      s->reason = e.what();
    }
    return s;
  }();
  return *instance;
}

const LtApi& lt() {
  if (!cublaslt_available()) fail("cuBLASLt is not available: {}", lt_state().reason);
  driver();  // the context must be current on this thread too
  return lt_state().api;
}

void lt_check(Status status, const char* call) {
  if (status == lt_abi::kStatusSuccess) return;
  const LtApi& api = lt_state().api;
  fail("{} failed: {} ({})", call, api.cublasLtGetStatusName(status),
       api.cublasLtGetStatusString(status));
}

int data_type(DType t) {
  switch (t) {
    case DType::f32:
      return lt_abi::kDataF32;
    case DType::f16:
      return lt_abi::kDataF16;
    case DType::bf16:
      return lt_abi::kDataBf16;
    default:
      return -1;
  }
}

uint32_t lt_epilogue(Epilogue e) {
  switch (e) {
    case Epilogue::none:
      return lt_abi::kEpilogueDefault;
    case Epilogue::bias:
      return lt_abi::kEpilogueBias;
    case Epilogue::relu_bias:
      return lt_abi::kEpilogueReluBias;
    case Epilogue::gelu_bias:
      return lt_abi::kEpilogueGeluBias;
    case Epilogue::relu_aux_bias:
      return lt_abi::kEpilogueReluAuxBias;
    case Epilogue::gelu_aux_bias:
      return lt_abi::kEpilogueGeluAuxBias;
    case Epilogue::drelu_bgrad:
      return lt_abi::kEpilogueDreluBgrad;
    case Epilogue::dgelu_bgrad:
      return lt_abi::kEpilogueDgeluBgrad;
  }
  return lt_abi::kEpilogueDefault;
}

bool uses_bias(Epilogue e) { return e != Epilogue::none; }
bool uses_aux(Epilogue e) {
  return e == Epilogue::relu_aux_bias || e == Epilogue::gelu_aux_bias ||
         e == Epilogue::drelu_bgrad || e == Epilogue::dgelu_bgrad;
}
bool relu_mask(Epilogue e) { return e == Epilogue::relu_aux_bias || e == Epilogue::drelu_bgrad; }

std::string describe(const MatmulDesc& d) {
  return fmt::format("matmul batch {} m {} n {} k {}{}{} {}->{}{} epilogue {}", d.batch, d.m, d.n,
                     d.k, d.transpose_a ? " A^T" : "", d.transpose_b ? " B^T" : "", name(d.input),
                     name(d.output), d.allow_tf32 ? " tf32" : "", name(d.epilogue));
}

// The largest power of two (at most 256) dividing the address and every batch offset: what
// cuBLASLt's heuristic may assume about a matrix's alignment.
uint32_t alignment(const void* ptr, int64_t stride_elements, size_t element_bytes, int64_t batch) {
  uintptr_t bits = reinterpret_cast<uintptr_t>(ptr) | 256;
  if (batch > 1) bits |= static_cast<uintptr_t>(stride_elements) * element_bytes;
  return static_cast<uint32_t>(bits & (~bits + 1));
}

struct MatmulPlanKey {
  int64_t batch, m, n, k, stride_a, stride_b, stride_c;
  bool transpose_a, transpose_b, tf32;
  DType input, output;
  Epilogue epilogue;
  uint32_t align_a, align_b, align_c, align_bias, align_aux;
  auto operator<=>(const MatmulPlanKey&) const = default;
};

// One problem's descriptors and the heuristic's algorithm; pointers are set per call.
struct MatmulPlan {
  OpDesc desc = nullptr;
  Layout a = nullptr, b = nullptr, c = nullptr;  // cuBLASLt's A, B and C=D
  HeuristicResult result{};
};

constexpr size_t kWorkspaceBytes = size_t{32} << 20;

struct MatmulPlanCache {
  std::mutex mutex;
  std::map<MatmulPlanKey, std::unique_ptr<MatmulPlan>> plans;
  DeviceBuffer workspace;
};

MatmulPlanCache& plan_cache() {
  static MatmulPlanCache* cache = new MatmulPlanCache;  // descriptors live as long as the process
  return *cache;
}

template <typename T>
void set_desc(OpDesc desc, int attribute, const T& value, const char* what) {
  Status status = lt().cublasLtMatmulDescSetAttribute(desc, attribute, &value, sizeof(value));
  if (status != lt_abi::kStatusSuccess) {
    const LtApi& api = lt_state().api;
    fail("cublasLtMatmulDescSetAttribute({}) failed: {}", what,
         api.cublasLtGetStatusString(status));
  }
}

Layout make_layout(DType type, int64_t rows, int64_t cols, int64_t ld, int64_t batch,
                   int64_t stride) {
  const LtApi& api = lt();
  Layout layout = nullptr;
  lt_check(api.cublasLtMatrixLayoutCreate(&layout, data_type(type), rows, cols, ld),
           "cublasLtMatrixLayoutCreate");
  if (batch > 1) {
    int32_t count = static_cast<int32_t>(batch);
    lt_check(api.cublasLtMatrixLayoutSetAttribute(layout, lt_abi::kLayoutBatchCount, &count,
                                                  sizeof(count)),
             "cublasLtMatrixLayoutSetAttribute(BATCH_COUNT)");
    lt_check(api.cublasLtMatrixLayoutSetAttribute(layout, lt_abi::kLayoutStridedBatchOffset,
                                                  &stride, sizeof(stride)),
             "cublasLtMatrixLayoutSetAttribute(STRIDED_BATCH_OFFSET)");
  }
  return layout;
}

// Row-major C = op(A) op(B) is column-major C^T = op(B)^T op(A)^T, and a row-major matrix is its
// transpose in column-major: so cuBLASLt's A is our B, its B is our A, with the same transpose
// flags, and its D is n x m with leading dimension n.
std::unique_ptr<MatmulPlan> build_plan(const MatmulDesc& d, const MatmulPlanKey& key,
                                       const MatmulArgs& args) {
  const LtApi& api = lt();
  auto plan = std::make_unique<MatmulPlan>();
  int compute = d.input == f32 && d.allow_tf32 ? lt_abi::kComputeF32FastTf32 : lt_abi::kComputeF32;
  lt_check(api.cublasLtMatmulDescCreate(&plan->desc, compute, lt_abi::kDataF32),
           "cublasLtMatmulDescCreate");
  int32_t op_a = d.transpose_b ? lt_abi::kOpT : lt_abi::kOpN;
  int32_t op_b = d.transpose_a ? lt_abi::kOpT : lt_abi::kOpN;
  set_desc(plan->desc, lt_abi::kDescTransA, op_a, "TRANSA");
  set_desc(plan->desc, lt_abi::kDescTransB, op_b, "TRANSB");
  set_desc(plan->desc, lt_abi::kDescEpilogue, lt_epilogue(d.epilogue), "EPILOGUE");
  if (uses_bias(d.epilogue)) {
    set_desc(plan->desc, lt_abi::kDescBiasPointer, args.bias, "BIAS_POINTER");
    set_desc(plan->desc, lt_abi::kDescBiasBatchStride, int64_t{0}, "BIAS_BATCH_STRIDE");
  }
  if (uses_aux(d.epilogue)) {
    int64_t ld = matmul_aux_ld(d);
    set_desc(plan->desc, lt_abi::kDescEpilogueAuxPointer, args.aux, "EPILOGUE_AUX_POINTER");
    set_desc(plan->desc, lt_abi::kDescEpilogueAuxLd, ld, "EPILOGUE_AUX_LD");
    set_desc(plan->desc, lt_abi::kDescEpilogueAuxBatchStride, int64_t{ld * d.m},
             "EPILOGUE_AUX_BATCH_STRIDE");
  }
  plan->a = d.transpose_b ? make_layout(d.input, d.k, d.n, d.k, d.batch, key.stride_b)
                          : make_layout(d.input, d.n, d.k, d.n, d.batch, key.stride_b);
  plan->b = d.transpose_a ? make_layout(d.input, d.m, d.k, d.m, d.batch, key.stride_a)
                          : make_layout(d.input, d.k, d.m, d.k, d.batch, key.stride_a);
  plan->c = make_layout(d.output, d.n, d.m, d.n, d.batch, key.stride_c);

  Preference preference = nullptr;
  lt_check(api.cublasLtMatmulPreferenceCreate(&preference), "cublasLtMatmulPreferenceCreate");
  auto set_pref = [&](int attribute, auto value) {
    lt_check(api.cublasLtMatmulPreferenceSetAttribute(preference, attribute, &value, sizeof(value)),
             "cublasLtMatmulPreferenceSetAttribute");
  };
  set_pref(lt_abi::kPrefMaxWorkspaceBytes, uint64_t{kWorkspaceBytes});
  // Split-K kernels that keep partial sums in a half output type round every partial sum (seen
  // on an H200: several ulps off for small m*n); only f32 partial sums keep "accumulate in f32".
  set_pref(lt_abi::kPrefReductionSchemeMask,
           d.output == f32 ? lt_abi::kReductionInplace | lt_abi::kReductionComputeType
                           : lt_abi::kReductionComputeType);
  set_pref(lt_abi::kPrefMinAlignmentA, key.align_b);  // cuBLASLt's A is our B
  set_pref(lt_abi::kPrefMinAlignmentB, key.align_a);
  set_pref(lt_abi::kPrefMinAlignmentC, key.align_c);
  set_pref(lt_abi::kPrefMinAlignmentD, key.align_c);
  int returned = 0;
  Status status =
      api.cublasLtMatmulAlgoGetHeuristic(lt_state().handle, plan->desc, plan->a, plan->b, plan->c,
                                         plan->c, preference, 1, &plan->result, &returned);
  api.cublasLtMatmulPreferenceDestroy(preference);
  int state = 0;
  std::memcpy(&state, plan->result.bytes + lt_abi::kHeuristicStateOffset, sizeof(state));
  if (status == lt_abi::kStatusNotSupported || (status == lt_abi::kStatusSuccess && returned == 0))
    fail("cuBLASLt has no kernel for {} on {}", describe(d), device_name());
  lt_check(status, "cublasLtMatmulAlgoGetHeuristic");
  lt_check(state, "cublasLtMatmulAlgoGetHeuristic (result state)");
  return plan;
}

void validate(const MatmulDesc& d, const MatmulArgs& args) {
  auto bad = [&](std::string_view why) { fail("{}: {}", describe(d), why); };
  if (d.batch < 1 || d.m < 0 || d.n < 0 || d.k < 1) bad("needs batch >= 1, m, n >= 0 and k >= 1");
  if (data_type(d.input) < 0 || data_type(d.output) < 0) bad("dtypes must be f16, bf16 or f32");
  if (d.input == f32 && d.output != f32) bad("f32 inputs give an f32 output");
  if (is_half(d.input) && d.output != f32 && d.output != d.input)
    bad("half inputs give their own dtype or f32");
  if (d.allow_tf32 && d.input != f32) bad("TF32 applies to f32 inputs only");
  if (d.stride_c == 0 && d.batch > 1) bad("the output cannot be broadcast over batches");
  if (!args.a || !args.b || !args.c) bad("a, b and c must be device pointers");
  if (uses_bias(d.epilogue) && !args.bias) bad("the epilogue needs a bias pointer");
  if (uses_aux(d.epilogue) && !args.aux) bad("the epilogue needs an aux pointer");
  if ((d.epilogue == Epilogue::drelu_bgrad || d.epilogue == Epilogue::dgelu_bgrad) && d.batch > 1)
    bad("bias gradient epilogues take one matrix (batch 1)");
}

}  // namespace

const char* name(Epilogue epilogue) {
  switch (epilogue) {
    case Epilogue::none:
      return "none";
    case Epilogue::bias:
      return "bias";
    case Epilogue::relu_bias:
      return "relu_bias";
    case Epilogue::gelu_bias:
      return "gelu_bias";
    case Epilogue::relu_aux_bias:
      return "relu_aux_bias";
    case Epilogue::gelu_aux_bias:
      return "gelu_aux_bias";
    case Epilogue::drelu_bgrad:
      return "drelu_bgrad";
    case Epilogue::dgelu_bgrad:
      return "dgelu_bgrad";
  }
  return "?";
}

int64_t matmul_aux_ld(const MatmulDesc& desc) {
  if (!uses_aux(desc.epilogue)) return 0;
  // The ReLU mask is in bits with ld a multiple of 128; the GELU input a multiple of 8 elements.
  int64_t multiple = relu_mask(desc.epilogue) ? 128 : 8;
  return (desc.n + multiple - 1) / multiple * multiple;
}

size_t matmul_aux_bytes(const MatmulDesc& desc) {
  int64_t ld = matmul_aux_ld(desc);
  if (ld == 0) return 0;
  size_t elements = static_cast<size_t>(ld * desc.m * desc.batch);
  return relu_mask(desc.epilogue) ? elements / 8 : elements * size_of(desc.output);
}

bool cublaslt_available() { return lt_state().ok; }

std::string cublaslt_unavailable_reason() { return lt_state().ok ? "" : lt_state().reason; }

void matmul(const MatmulDesc& d, const MatmulArgs& args) {
  validate(d, args);
  if (d.m == 0 || d.n == 0) return;
  const LtApi& api = lt();
  const size_t in_bytes = size_of(d.input), out_bytes = size_of(d.output);
  MatmulPlanKey key{d.batch,
                    d.m,
                    d.n,
                    d.k,
                    d.stride_a < 0 ? d.m * d.k : d.stride_a,
                    d.stride_b < 0 ? d.k * d.n : d.stride_b,
                    d.stride_c < 0 ? d.m * d.n : d.stride_c,
                    d.transpose_a,
                    d.transpose_b,
                    d.allow_tf32,
                    d.input,
                    d.output,
                    d.epilogue,
                    0,
                    0,
                    0,
                    0,
                    0};
  key.align_a = alignment(args.a, key.stride_a, in_bytes, d.batch);
  key.align_b = alignment(args.b, key.stride_b, in_bytes, d.batch);
  key.align_c = alignment(args.c, key.stride_c, out_bytes, d.batch);
  key.align_bias = uses_bias(d.epilogue) ? alignment(args.bias, 0, 0, 1) : 0;
  key.align_aux = uses_aux(d.epilogue) ? alignment(args.aux, 0, 0, 1) : 0;

  MatmulPlanCache& cache = plan_cache();
  std::lock_guard lock(cache.mutex);
  if (cache.workspace.size() == 0) cache.workspace = DeviceBuffer(kWorkspaceBytes);
  std::unique_ptr<MatmulPlan>& plan = cache.plans[key];
  if (!plan) {
    try {
      plan = build_plan(d, key, args);
    } catch (...) {
      cache.plans.erase(key);
      throw;
    }
  }
  if (uses_bias(d.epilogue))
    set_desc(plan->desc, lt_abi::kDescBiasPointer, args.bias, "BIAS_POINTER");
  if (uses_aux(d.epilogue))
    set_desc(plan->desc, lt_abi::kDescEpilogueAuxPointer, args.aux, "EPILOGUE_AUX_POINTER");
  // cuBLASLt's A is our B and its B our A (see build_plan).
  Status status =
      api.cublasLtMatmul(lt_state().handle, plan->desc, &args.alpha, args.b, plan->a, args.a,
                         plan->b, &args.beta, args.c, plan->c, args.c, plan->c, plan->result.bytes,
                         cache.workspace.data(), kWorkspaceBytes, compute_stream().handle());
  if (status != lt_abi::kStatusSuccess)
    fail("cublasLtMatmul failed for {}: {} ({})", describe(d), api.cublasLtGetStatusName(status),
         api.cublasLtGetStatusString(status));
}

size_t matmul_plan_cache_size() {
  std::lock_guard lock(plan_cache().mutex);
  return plan_cache().plans.size();
}

}  // namespace mixtape::cuda

/* mixtape/runtime/aot_runtime.h -- the C ABI under every exported artifact: open, run, save, load
   and close a model from its directory; each artifact's generated NAME.h wraps it with typed
   functions. C and C++. Calls on one model handle from several threads take turns (each holds
   the handle while it runs); mixtape_aot_close must come after every other call on it. */
#ifndef MIXTAPE_AOT_RUNTIME_H
#define MIXTAPE_AOT_RUNTIME_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* A compiled kernel of the artifact: its entry point (codegen/emit_llvm.h) and the key the
   runtime finds it by (runtime/aot_plan.h, kernel_key). */
typedef void (*mixtape_aot_kernel_fn)(void* const* params, int64_t begin, int64_t end);
typedef struct {
  const char* key;
  mixtape_aot_kernel_fn function;
} mixtape_aot_kernel;

/* One build of the artifact's CPU kernels, for CPUs that have every feature in `features`
   (LLVM's names: "avx2", "avx512bf16", ...): `target` names it ("native", "x86-64-v3", ...). */
typedef struct {
  const char* target;
  const char* const* features;
  int64_t feature_count;
  const mixtape_aot_kernel* kernels;
  int64_t kernel_count;
} mixtape_aot_variant;

typedef struct mixtape_aot_model mixtape_aot_model;

enum {
  MIXTAPE_AOT_OK = 0,
  MIXTAPE_AOT_ERROR_ARGUMENT = 1, /* a NULL pointer, a batch out of range, an unknown device */
  MIXTAPE_AOT_ERROR_FILE = 2,     /* a missing, unreadable or corrupt file (checksum, format) */
  MIXTAPE_AOT_ERROR_VERSION = 3,  /* written by another mixtape version or artifact format */
  MIXTAPE_AOT_ERROR_DEVICE = 4,   /* the device is not there, or this CPU lacks kernel features */
  MIXTAPE_AOT_ERROR_RUN = 5       /* anything else while running, saving or loading */
};

/* Opens artifact `name` in `dir` (NAME.json, NAME.plan, NAME.safetensors) on `device`: "cpu"
   (the first of `variants`, best first, whose features this CPU has), "cpu:TARGET" (that
   variant), "cuda", or NULL for the best the artifact and machine allow. `manifest_xxh3` is the
   XXH3-64 (16 hex digits) of the NAME.json the library was built with: the manifest holds the
   other files' checksums, so the library vouches for every file it reads. *out is the model, or
   NULL on failure; mixtape_aot_error(NULL) then says why. */
int mixtape_aot_open(const char* dir, const char* name, const char* manifest_xxh3,
                     const char* device, const mixtape_aot_variant* variants, int64_t variant_count,
                     mixtape_aot_model** out);
/* What NAME_open_interface returns where the program's NAME.h (`header`, its NAME_INTERFACE;
   NULL allowed) is another export's than the library's (`library`): MIXTAPE_AOT_ERROR_VERSION,
   with mixtape_aot_error(NULL) naming both. */
int mixtape_aot_refuse_interface(const char* name, const char* header, const char* library);
/* One call of the exported function (or one training step): inputs and outputs are host
   buffers in the manifest's order and dtypes, at `batch` rows. */
int mixtape_aot_run(mixtape_aot_model* model, int64_t batch, const void* const* inputs,
                    void* const* outputs);
/* mixtape_aot_run on a model opened on "cuda", with device pointers of device 0 (its primary
   context) for the inputs and outputs; returns once the outputs are written. */
int mixtape_aot_run_device(mixtape_aot_model* model, int64_t batch, const void* const* inputs,
                           void* const* outputs);
/* Steps only: the state, as mixtape's save_checkpoint writes it (and load_checkpoint reads).
   A load refuses a checkpoint whose generator seeds differ from those compiled into the step. */
int mixtape_aot_save(mixtape_aot_model* model, const char* path);
int mixtape_aot_load(mixtape_aot_model* model, const char* path);
/* The last error of `model`, or with NULL the calling thread's last error; "" when none. With
   a handle several threads use, ask with NULL: another thread's call may replace the model's. */
const char* mixtape_aot_error(const mixtape_aot_model* model);
void mixtape_aot_close(mixtape_aot_model* model);

#ifdef __cplusplus
}
#endif

#endif

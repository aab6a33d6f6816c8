/* bench/deploy_driver.c -- a plain C program built against an exported artifact, as a user builds
   one (cc deploy_driver.c $(pkg-config --cflags --libs NAME)); bench_deploy compiles it per model
   and prints what it measures: NAME_open to the first result, batch-1 latency, batch-max
   throughput and this process's peak RSS (VmHWM), as one JSON line.

   Compiled with -DDEPLOY_NAME=<artifact name> -DDEPLOY_HEADER=<NAME.h> -DDEPLOY_IN_T=<float or
   int64_t> -DDEPLOY_IN_ROW=<input values per row> -DDEPLOY_OUT_ROW=<output values per row>
   -DDEPLOY_TOKENS=<vocabulary size for integer inputs, 0 for float inputs>.

   deploy_driver DIR cold
       opens DIR, runs batch 1 once, prints the times and exits (a new process: the cold start)
   deploy_driver DIR warm MAX_BATCH LATENCY_SECONDS WINDOW_SECONDS WINDOWS [INPUT OUTPUT]
       batch-1 latency (each call timed, median) and batch-MAX_BATCH throughput (median of
       WINDOWS windows of about WINDOW_SECONDS); with INPUT and OUTPUT, writes the batch-MAX_BATCH
       input and output there (raw, native order) so the caller can check them against the JIT */
#define _POSIX_C_SOURCE 200809L /* clock_gettime in C11 */
#include "deploy_driver.h"

#include DEPLOY_HEADER

typedef DEPLOY_IN_T input_t;

/* Deterministic inputs: pixels in [0, 1) or tokens in [0, DEPLOY_TOKENS). */
static void fill(input_t* x, size_t n) {
#if DEPLOY_TOKENS > 0
  fill_tokens(x, n, DEPLOY_TOKENS, 12345);
#else
  fill_pixels(x, n, 12345);
#endif
}

static void die(const char* what, int code, const DEPLOY_NAME* m) {
  fprintf(stderr, "deploy_driver: %s failed (%d): %s\n", what, code, FN(_error)(m));
  exit(1);
}

static int write_file(const char* path, const void* data, size_t bytes) {
  FILE* f = fopen(path, "wb");
  if (!f || fwrite(data, 1, bytes, f) != bytes || fclose(f) != 0) {
    fprintf(stderr, "deploy_driver: cannot write %s\n", path);
    return 1;
  }
  return 0;
}

int main(int argc, char** argv) {
  if (argc < 3 || (strcmp(argv[2], "cold") != 0 && (strcmp(argv[2], "warm") != 0 || argc < 7))) {
    fprintf(stderr, "usage: %s DIR cold | DIR warm MAX_BATCH LATENCY_S WINDOW_S WINDOWS [IN OUT]\n",
            argv[0]);
    return 2;
  }
  const char* dir = argv[1];
  int64_t max_batch = argc > 3 ? atoll(argv[3]) : 1;
  if (max_batch < 1) max_batch = 1;
  input_t* x = malloc(sizeof(input_t) * DEPLOY_IN_ROW * (size_t)max_batch);
  float* y = malloc(sizeof(float) * DEPLOY_OUT_ROW * (size_t)max_batch);
  if (!x || !y) return 1;
  fill(x, (size_t)DEPLOY_IN_ROW * (size_t)max_batch);

  DEPLOY_NAME* m = NULL;
  double start = now_s();
  int code = FN(_open)(dir, "cpu", &m);
  if (code != 0) die("open", code, NULL);
  double opened = now_s();
  code = FN(_run)(m, 1, x, y);
  if (code != 0) die("run", code, m);
  double first = now_s();
  printf(
      "{\"system\": \"mixtape_artifact\", \"mode\": \"%s\", \"open_ms\": %.4f, "
      "\"first_run_ms\": %.4f, \"open_to_first_result_ms\": %.4f",
      argv[2], 1e3 * (opened - start), 1e3 * (first - opened), 1e3 * (first - start));

  if (strcmp(argv[2], "warm") == 0) {
    double latency_s = atof(argv[4]), window_s = atof(argv[5]);
    int windows = atoi(argv[6]);
    if (windows < 1) windows = 1;
    /* Batch 1: every call timed on its own, for at least LATENCY_S and 50 calls. */
    for (int i = 0; i < 20; ++i)
      if ((code = FN(_run)(m, 1, x, y)) != 0) die("run", code, m);
    size_t capacity = 1 << 20, calls = 0;
    double* times = malloc(sizeof(double) * capacity);
    if (!times) return 1;
    double began = now_s();
    while (calls < capacity && (calls < 50 || now_s() - began < latency_s)) {
      double t0 = now_s();
      if ((code = FN(_run)(m, 1, x, y)) != 0) die("run", code, m);
      times[calls++] = now_s() - t0;
    }
    qsort(times, calls, sizeof(double), compare_doubles);
    printf(
        ", \"batch1_calls\": %zu, \"batch1_latency_us\": %.3f, \"batch1_p10_us\": %.3f, "
        "\"batch1_p90_us\": %.3f",
        calls, 1e6 * times[calls / 2], 1e6 * times[calls / 10], 1e6 * times[calls * 9 / 10]);
    free(times);
    /* Batch max: warm-up calls set the calls per window; the rate is the median window. */
    double warm = 0;
    for (int i = 0; i < 3; ++i) {
      double t0 = now_s();
      if ((code = FN(_run)(m, max_batch, x, y)) != 0) die("run", code, m);
      warm = now_s() - t0;
    }
    long per_window = (long)(window_s / (warm > 1e-9 ? warm : 1e-9) + 0.5);
    if (per_window < 1) per_window = 1;
    double rates[64];
    if (windows > 64) windows = 64;
    for (int w = 0; w < windows; ++w) {
      double t0 = now_s();
      for (long i = 0; i < per_window; ++i)
        if ((code = FN(_run)(m, max_batch, x, y)) != 0) die("run", code, m);
      rates[w] = (double)per_window * (double)max_batch / (now_s() - t0);
    }
    double rows_per_s = median_of(rates, (size_t)windows);
    printf(
        ", \"max_batch\": %lld, \"calls_per_window\": %ld, \"windows\": %d, "
        "\"batch_max_rows_per_s\": %.2f, \"batch_max_ms_per_call\": %.4f",
        (long long)max_batch, per_window, windows, rows_per_s,
        1e3 * (double)max_batch / rows_per_s);
    if (argc >= 9) {
      if ((code = FN(_run)(m, max_batch, x, y)) != 0) die("run", code, m);
      if (write_file(argv[7], x, sizeof(input_t) * DEPLOY_IN_ROW * (size_t)max_batch) ||
          write_file(argv[8], y, sizeof(float) * DEPLOY_OUT_ROW * (size_t)max_batch))
        return 1;
    }
  }
  FN(_close)(m);
  printf(", \"peak_rss_kb\": %ld}\n", peak_rss_kb());
  free(x);
  free(y);
  return 0;
}

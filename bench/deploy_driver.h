/* bench/deploy_driver.h -- what the deployment benchmark's C drivers (deploy_driver.c for
   functions, deploy_step_driver.c for training steps) share: a clock, medians, the peak RSS and
   the seeded inputs bench_deploy reproduces in C++ (deploy.cpp's lcg_values). */
#ifndef MIXTAPE_BENCH_DEPLOY_DRIVER_H
#define MIXTAPE_BENCH_DEPLOY_DRIVER_H

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* FN(_run) is DEPLOY_NAME_run: the artifact's functions, named after -DDEPLOY_NAME. */
#define DEPLOY_CAT2(a, b) a##b
#define DEPLOY_CAT(a, b) DEPLOY_CAT2(a, b)
#define FN(suffix) DEPLOY_CAT(DEPLOY_NAME, suffix)

static inline double now_s(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static inline int compare_doubles(const void* a, const void* b) {
  double x = *(const double*)a, y = *(const double*)b;
  return (x > y) - (x < y);
}

/* The median of n values (sorts them). */
static inline double median_of(double* values, size_t n) {
  qsort(values, n, sizeof(double), compare_doubles);
  return n % 2 ? values[n / 2] : (values[n / 2 - 1] + values[n / 2]) / 2;
}

/* The peak resident set of this process image: VmHWM, the high-water mark of the address space
   exec made. (getrusage's ru_maxrss is no good here: Linux carries it over from the parent across
   a vfork and exec, so a child spawned by a big program reports the parent's peak.) */
static inline long peak_rss_kb(void) {
  FILE* f = fopen("/proc/self/status", "r");
  char line[256];
  long kb = -1;
  while (f && fgets(line, sizeof line, f))
    if (strncmp(line, "VmHWM:", 6) == 0) kb = atol(line + 6);
  if (f) fclose(f);
  return kb;
}

/* A seeded LCG's next 31 bits: the inputs are pixels bits / 2^31 in [0, 1) or tokens and labels
   bits % count, so bench_deploy can make the same ones in C++. */
static inline uint32_t lcg_next(uint64_t* state) {
  *state = *state * 6364136223846793005ULL + 1442695040888963407ULL;
  return (uint32_t)(*state >> 33);
}

static inline void fill_pixels(float* x, size_t n, uint64_t seed) {
  for (size_t i = 0; i < n; ++i) x[i] = (float)((double)lcg_next(&seed) / 2147483648.0);
}

static inline void fill_tokens(int64_t* x, size_t n, int64_t count, uint64_t seed) {
  for (size_t i = 0; i < n; ++i) x[i] = (int64_t)(lcg_next(&seed) % (uint32_t)count);
}

#endif

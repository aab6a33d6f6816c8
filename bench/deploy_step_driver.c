/* bench/deploy_step_driver.c -- a plain C program that trains through an exported training step
   (mt::aot::export_step), built as a user builds one (cc deploy_step_driver.c $(pkg-config
   --cflags --libs NAME)); bench_deploy compiles it per step and prints what it measures: NAME_open
   to the first step's loss, steps/s at the export batch, the first steps' losses (to check them
   against mt::compile's) and this process's peak RSS (VmHWM), as one JSON line.

   Compiled with -DDEPLOY_NAME=<artifact name> -DDEPLOY_HEADER=<NAME.h> -DDEPLOY_BATCH=<the
   export batch> -DDEPLOY_IN_T=<float or int64_t> -DDEPLOY_IN_ROW=<input values per row>
   -DDEPLOY_TOKENS=<vocabulary size for integer inputs, 0 for float inputs>
   -DDEPLOY_TARGET_ROW=<int64 targets per row> -DDEPLOY_CLASSES=<targets lie in [0, this)>.
   Every step trains on the same batch (inputs seeded 12345, targets 54321: deploy.cpp makes the
   same ones for mt::compile).

   deploy_step_driver DIR cold
       opens DIR, runs one step, prints the times and exits (a new process: the cold start)
   deploy_step_driver DIR warm CHECK_STEPS WARMUP WINDOW_SECONDS WINDOWS
       CHECK_STEPS steps whose losses are printed (as f32 bits), then bench::measure's rules
       (bench/timing.h): WARMUP steps each timed, steps per window from their median (the first
       left out), and steps/s as the median of WINDOWS windows of about WINDOW_SECONDS */
#define _POSIX_C_SOURCE 200809L /* clock_gettime in C11 */
#include "deploy_driver.h"

#include DEPLOY_HEADER

typedef DEPLOY_IN_T input_t;

static input_t x[(size_t)DEPLOY_BATCH * DEPLOY_IN_ROW];
static int64_t y[(size_t)DEPLOY_BATCH * DEPLOY_TARGET_ROW];

static void die(const char* what, int code, const DEPLOY_NAME* m) {
  fprintf(stderr, "deploy_step_driver: %s failed (%d): %s\n", what, code, FN(_error)(m));
  exit(1);
}

static float step(DEPLOY_NAME* m) {
  float loss = 0;
  int code = FN(_run)(m, DEPLOY_BATCH, x, y, &loss);
  if (code != 0) die("run", code, m);
  return loss;
}

int main(int argc, char** argv) {
  if (argc < 3 || (strcmp(argv[2], "cold") != 0 && (strcmp(argv[2], "warm") != 0 || argc < 7))) {
    fprintf(stderr, "usage: %s DIR cold | DIR warm CHECK_STEPS WARMUP WINDOW_S WINDOWS\n", argv[0]);
    return 2;
  }
#if DEPLOY_TOKENS > 0
  fill_tokens(x, sizeof x / sizeof x[0], DEPLOY_TOKENS, 12345);
#else
  fill_pixels(x, sizeof x / sizeof x[0], 12345);
#endif
  fill_tokens(y, sizeof y / sizeof y[0], DEPLOY_CLASSES, 54321);

  DEPLOY_NAME* m = NULL;
  int code;
  if (strcmp(argv[2], "cold") == 0) {
    double start = now_s();
    if ((code = FN(_open)(argv[1], "cpu", &m)) != 0) die("open", code, NULL);
    double opened = now_s();
    float loss = step(m);
    double first = now_s();
    printf(
        "{\"system\": \"mixtape_artifact\", \"mode\": \"step_cold\", \"open_ms\": %.4f, "
        "\"first_step_ms\": %.4f, \"open_to_first_step_ms\": %.4f, \"first_loss\": %.9g",
        1e3 * (opened - start), 1e3 * (first - opened), 1e3 * (first - start), (double)loss);
  } else {
    int check_steps = atoi(argv[3]), warmup = atoi(argv[4]), windows = atoi(argv[6]);
    double window_s = atof(argv[5]);
    if (warmup < 1) warmup = 1;
    if (windows < 1) windows = 1;
    if (windows > 64) windows = 64;
    if ((code = FN(_open)(argv[1], "cpu", &m)) != 0) die("open", code, NULL);
    printf("{\"system\": \"mixtape_artifact\", \"mode\": \"step_warm\", \"check_loss_bits\": [");
    for (int i = 0; i < check_steps; ++i) {
      float loss = step(m);
      uint32_t bits;
      memcpy(&bits, &loss, sizeof bits);
      printf("%s%u", i ? ", " : "", bits);
    }
    double warm[64];
    int warm_count = warmup < 64 ? warmup : 64;
    for (int i = 0; i < warm_count; ++i) {
      double t0 = now_s();
      step(m);
      warm[i] = now_s() - t0;
    }
    double first_warm = warm[0];
    double estimate = warm_count > 1 ? median_of(warm + 1, (size_t)(warm_count - 1)) : warm[0];
    long per_window = (long)(window_s / (estimate > 1e-9 ? estimate : 1e-9) + 0.5); /* llround */
    if (per_window < 1) per_window = 1;
    double rates[64];
    printf("], \"window_steps_per_s\": [");
    for (int w = 0; w < windows; ++w) {
      double t0 = now_s();
      for (long i = 0; i < per_window; ++i) step(m);
      rates[w] = (double)per_window / (now_s() - t0);
      printf("%s%.3f", w ? ", " : "", rates[w]);
    }
    printf(
        "], \"steps_per_s\": %.4f, \"steps_per_window\": %ld, \"windows\": %d, "
        "\"warmup_steps\": %d, \"first_warmup_step_s\": %.6f, \"batch\": %d",
        median_of(rates, (size_t)windows), per_window, windows, warm_count, first_warm,
        (int)DEPLOY_BATCH);
  }
  FN(_close)(m);
  printf(", \"peak_rss_kb\": %ld}\n", peak_rss_kb());
  return 0;
}

/* tools/aot_fuzz/driver.c -- opens the artifact copy in argv[1] (digits_mlp, or digits_mlp_train
 * with argv[2] "train"), runs it, and for a step saves, loads and runs again: fuzz.py's target. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "digits_mlp.h"
#include "digits_mlp_train.h"
int main(int argc, char** argv) {
  const char* dir = argv[1];
  int train = argc > 2 && !strcmp(argv[2], "train");
  long batch = argc > 3 ? atol(argv[3]) : 7;
  float* x = calloc((size_t)1024 * 64, sizeof(float));
  float* out = calloc((size_t)1024 * 10, sizeof(float));
  int64_t* y = calloc(1024, sizeof(int64_t));
  if (!train) {
    digits_mlp* m = NULL;
    int rc = digits_mlp_open(dir, "cpu", &m);
    printf("open %d %s\n", rc, digits_mlp_error(m));
    if (rc) return 0;
    rc = digits_mlp_run(m, batch, x, out);
    printf("run %d %s\n", rc, digits_mlp_error(m));
    digits_mlp_close(m);
  } else {
    digits_mlp_train* m = NULL;
    int rc = digits_mlp_train_open(dir, "cpu", &m);
    printf("open %d %s\n", rc, digits_mlp_train_error(m));
    if (rc) return 0;
    rc = digits_mlp_train_run(m, 64, x, y, out);
    printf("run %d %s\n", rc, digits_mlp_train_error(m));
    char path[4096];
    snprintf(path, sizeof path, "%s/ck.safetensors", dir);
    rc = digits_mlp_train_save(m, path);
    printf("save %d %s\n", rc, digits_mlp_train_error(m));
    rc = digits_mlp_train_load(m, path);
    printf("load %d %s\n", rc, digits_mlp_train_error(m));
    rc = digits_mlp_train_run(m, 64, x, y, out);
    printf("run2 %d %s\n", rc, digits_mlp_train_error(m));
    digits_mlp_train_close(m);
  }
  return 0;
}

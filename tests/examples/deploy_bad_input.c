/* tests/examples/deploy_bad_input.c -- an exported artifact, used wrongly from C, answers each
   mistake with its error code and a message from NAME_error, and keeps working afterwards.
   Usage: deploy_bad_input GOOD MISSING CORRUPT VERSION, four artifact directories that
   deploy_test.sh prepares: as exported; without digits_mlp.safetensors; with a wrong checksum
   in digits_mlp.json; and with another mixtape version in it. */
#include <stdio.h>
#include <string.h>

#include "digits_mlp.h"
#include "digits_mlp_train.h"

static int failures = 0;

/* The call returned `want`, and the error message holds `words`. */
static void expect(const char* what, int got, int want, const char* message, const char* words) {
  if (got != want || !message || !*message || !strstr(message, words)) {
    printf("FAIL: %s: code %d (want %d), message \"%s\" (want it to say \"%s\")\n", what, got, want,
           message ? message : "(NULL)", words);
    ++failures;
  } else {
    printf("ok: %s: code %d: %s\n", what, got, message);
  }
}

/* C leaves the order of a call's arguments open: the call must run before its error is read. */
#define EXPECT(what, call, want, error_of, words) \
  do {                                            \
    int code_ = (call);                           \
    expect(what, code_, want, error_of, words);   \
  } while (0)

static void expect_ok(const char* what, int got, const char* message) {
  if (got != 0) {
    printf("FAIL: %s: code %d: %s\n", what, got, message);
    ++failures;
  } else {
    printf("ok: %s\n", what);
  }
}

static void expect_open_fails(const char* what, const char* dir, const char* device, int want,
                              const char* words) {
  digits_mlp* m = (digits_mlp*)&failures; /* not NULL: open must set it to NULL */
  int code = digits_mlp_open(dir, device, &m);
  expect(what, code, want, digits_mlp_error(NULL), words);
  if (m != NULL) {
    printf("FAIL: %s: *out is not NULL after a failed open\n", what);
    ++failures;
    if (code == digits_mlp_OK) digits_mlp_close(m);
  }
}

int main(int argc, char** argv) {
  if (argc != 5) {
    fprintf(stderr, "usage: deploy_bad_input GOOD MISSING CORRUPT VERSION\n");
    return 2;
  }
  const char *good = argv[1], *missing = argv[2], *corrupt = argv[3], *version = argv[4];

  expect_open_fails("a directory that does not exist", "/nonexistent/digits", "cpu",
                    digits_mlp_ERROR_FILE, "/nonexistent/digits");
  expect_open_fails("a missing weights file", missing, "cpu", digits_mlp_ERROR_FILE,
                    "digits_mlp.safetensors");
  expect_open_fails("a wrong checksum in the manifest", corrupt, "cpu", digits_mlp_ERROR_FILE,
                    "corrupt");
  expect_open_fails("a manifest from another mixtape version", version, "cpu",
                    digits_mlp_ERROR_VERSION, "version");
  expect_open_fails("the cuda device", good, "cuda", digits_mlp_ERROR_DEVICE, "cuda");
  expect_open_fails("a NULL directory", NULL, "cpu", digits_mlp_ERROR_ARGUMENT, "NULL");
  EXPECT("a NULL out pointer", digits_mlp_open(good, "cpu", NULL), digits_mlp_ERROR_ARGUMENT,
         digits_mlp_error(NULL), "NULL");

  digits_mlp* m = NULL;
  if (digits_mlp_open(good, "cpu", &m) != digits_mlp_OK) {
    printf("FAIL: cannot open %s: %s\n", good, digits_mlp_error(NULL));
    return 1;
  }
  static float x[1025 * 64], logits[1025 * 10];
  EXPECT("batch 0", digits_mlp_run(m, 0, x, logits), digits_mlp_ERROR_ARGUMENT, digits_mlp_error(m),
         "1..1024");
  EXPECT("batch 1025", digits_mlp_run(m, 1025, x, logits), digits_mlp_ERROR_ARGUMENT,
         digits_mlp_error(m), "1..1024");
  EXPECT("a negative batch", digits_mlp_run(m, -1, x, logits), digits_mlp_ERROR_ARGUMENT,
         digits_mlp_error(m), "1..1024");
  EXPECT("a NULL model", digits_mlp_run(NULL, 1, x, logits), digits_mlp_ERROR_ARGUMENT,
         digits_mlp_error(NULL), "NULL");
  EXPECT("a NULL input", digits_mlp_run(m, 1, NULL, logits), digits_mlp_ERROR_ARGUMENT,
         digits_mlp_error(m), "'x'");
  EXPECT("a NULL output", digits_mlp_run(m, 1, x, NULL), digits_mlp_ERROR_ARGUMENT,
         digits_mlp_error(m), "'logits'");
  /* After all that, the model still runs, at both ends of the batch range. */
  for (int64_t batch = 1; batch <= 1024; batch += 1023) {
    int code = digits_mlp_run(m, batch, x, logits);
    expect_ok(batch == 1 ? "batch 1 after the errors" : "batch 1024 after the errors", code,
              digits_mlp_error(m));
  }
  digits_mlp_close(m);
  digits_mlp_close(NULL);

  /* The training step: its batch is fixed, and its checkpoints are files too. */
  digits_mlp_train* t = NULL;
  if (digits_mlp_train_open(good, "cpu", &t) != digits_mlp_train_OK) {
    printf("FAIL: cannot open the step in %s: %s\n", good, digits_mlp_train_error(NULL));
    return 1;
  }
  static int64_t y[1025];
  float loss = 0;
  EXPECT("a step at another batch than exported", digits_mlp_train_run(t, 7, x, y, &loss),
         digits_mlp_train_ERROR_ARGUMENT, digits_mlp_train_error(t), "7");
  EXPECT("saving to a NULL path", digits_mlp_train_save(t, NULL), digits_mlp_train_ERROR_ARGUMENT,
         digits_mlp_train_error(t), "NULL");
  EXPECT("loading a NULL path", digits_mlp_train_load(t, NULL), digits_mlp_train_ERROR_ARGUMENT,
         digits_mlp_train_error(t), "NULL");
  EXPECT("loading a checkpoint that does not exist",
         digits_mlp_train_load(t, "/nonexistent/checkpoint.safetensors"),
         digits_mlp_train_ERROR_FILE, digits_mlp_train_error(t), "/nonexistent/checkpoint");
  EXPECT("saving into a directory that does not exist",
         digits_mlp_train_save(t, "/nonexistent/checkpoint.safetensors"),
         digits_mlp_train_ERROR_RUN, digits_mlp_train_error(t), "/nonexistent/checkpoint");
  digits_mlp_train_close(t);

  if (failures) {
    printf("%d of the bad-input checks failed\n", failures);
    return 1;
  }
  printf("every bad input got its code and a message\n");
  return 0;
}

/* examples/deploy/classify_digits.c -- classifies the 360 test digits with the exported
   digits_mlp, all at once and one at a time, in plain C: no mixtape, no LLVM, no C++ compiler. */
#include <stdio.h>
#include <stdlib.h>

#include "digits_data.h"
#include "digits_mlp.h"

static int argmax10(const float* logits) {
  int best = 0;
  for (int k = 1; k < 10; ++k)
    if (logits[k] > logits[best]) best = k;
  return best;
}

int main(int argc, char** argv) {
  if (argc != 3) {
    fprintf(stderr,
            "usage: classify_digits DIR DIGITS_CSV_GZ\n"
            "  DIR: what digits_mlp --export DIR wrote; DIGITS_CSV_GZ: "
            "examples/data/digits.csv.gz\n");
    return 2;
  }
  digits_data* data = malloc(sizeof *data);
  if (!data || digits_read(argv[2], data)) {
    free(data);
    return 1;
  }
  digits_mlp* model = NULL;
  if (digits_mlp_open(argv[1], NULL, &model) != digits_mlp_OK) {
    fprintf(stderr, "classify_digits: %s\n", digits_mlp_error(NULL));
    free(data);
    return 1;
  }
  const float* test = &data->pixels[DIGITS_TRAIN][0];
  const int64_t* labels = &data->labels[DIGITS_TRAIN];
  static float logits[DIGITS_TEST][10];
  int status = 0, correct_batch = 0, correct_single = 0, disagree = 0;
  int predicted[DIGITS_TEST];

  /* All 360 in one call. */
  if (digits_mlp_run(model, DIGITS_TEST, test, &logits[0][0]) != digits_mlp_OK) {
    fprintf(stderr, "classify_digits: batch %d: %s\n", DIGITS_TEST, digits_mlp_error(model));
    status = 1;
    goto done;
  }
  for (int i = 0; i < DIGITS_TEST; ++i) {
    predicted[i] = argmax10(logits[i]);
    correct_batch += predicted[i] == labels[i];
  }

  /* One at a time: a server answering single requests. */
  for (int i = 0; i < DIGITS_TEST; ++i) {
    float one[10];
    if (digits_mlp_run(model, 1, test + (size_t)i * DIGITS_PIXELS, one) != digits_mlp_OK) {
      fprintf(stderr, "classify_digits: digit %d: %s\n", i, digits_mlp_error(model));
      status = 1;
      goto done;
    }
    int single = argmax10(one);
    correct_single += single == labels[i];
    disagree += single != predicted[i];
  }
  printf("batch %d: accuracy %.4f (%d/%d)\n", DIGITS_TEST, (double)correct_batch / DIGITS_TEST,
         correct_batch, DIGITS_TEST);
  printf("one at a time: accuracy %.4f (%d/%d)\n", (double)correct_single / DIGITS_TEST,
         correct_single, DIGITS_TEST);
  if (disagree) {
    printf("the two disagree on %d digits\n", disagree);
    status = 1;
  } else {
    printf("the two agree on every digit\n");
  }
done:
  digits_mlp_close(model);
  free(data);
  return status;
}

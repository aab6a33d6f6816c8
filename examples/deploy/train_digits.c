/* examples/deploy/train_digits.c -- continues training digits_mlp from the exported training step
   (forward, backward, loss scaling and optimizer inside the artifact), in plain C, and saves a
   checkpoint that mixtape's load_checkpoint (digits_mlp --load) reads. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "digits_data.h"
#include "digits_mlp_train.h"

/* xorshift64*: a shuffled pass over the training rows per epoch. */
static uint64_t next_random(uint64_t* state) {
  *state ^= *state >> 12;
  *state ^= *state << 25;
  *state ^= *state >> 27;
  return *state * 0x2545F4914F6CDD1DULL;
}

static void shuffle(int* order, int n, uint64_t* state) {
  for (int i = n - 1; i > 0; --i) {
    int j = (int)(next_random(state) % (uint64_t)(i + 1));
    int t = order[i];
    order[i] = order[j];
    order[j] = t;
  }
}

int main(int argc, char** argv) {
  if (argc != 5 && argc != 6) {
    fprintf(stderr,
            "usage: train_digits DIR DIGITS_CSV_GZ STEPS OUT.safetensors [BATCH]\n"
            "  BATCH: the --batch digits_mlp exported with (default 64; the step's shapes "
            "are fixed)\n");
    return 2;
  }
  const char* dir = argv[1];
  long steps = strtol(argv[3], NULL, 10);
  const char* out = argv[4];
  long batch = argc == 6 ? strtol(argv[5], NULL, 10) : 64;
  if (steps < 1 || batch < 1 || batch > DIGITS_TRAIN) {
    fprintf(stderr, "train_digits: STEPS must be >= 1 and BATCH in 1..%d\n", DIGITS_TRAIN);
    return 2;
  }
  digits_data* data = malloc(sizeof *data);
  float* x = malloc(sizeof(float) * (size_t)batch * DIGITS_PIXELS);
  int64_t* y = malloc(sizeof(int64_t) * (size_t)batch);
  int order[DIGITS_TRAIN];
  digits_mlp_train* model = NULL;
  int status = 1;
  if (!data || !x || !y) {
    fprintf(stderr, "train_digits: out of memory\n");
    goto done;
  }
  if (digits_read(argv[2], data)) goto done;
  /* The state (weights, optimizer, loss scaler) starts where digits_mlp --export left it. */
  if (digits_mlp_train_open(dir, NULL, &model) != digits_mlp_train_OK) {
    fprintf(stderr, "train_digits: %s\n", digits_mlp_train_error(NULL));
    goto done;
  }
  for (int i = 0; i < DIGITS_TRAIN; ++i) order[i] = i;
  uint64_t random_state = 0x9e3779b97f4a7c15ULL;
  int position = DIGITS_TRAIN;
  /* The mean loss of the first and the last tenth of the steps shows the progress. */
  long window = steps / 10 > 0 ? steps / 10 : 1;
  double first = 0, last = 0;
  for (long step = 1; step <= steps; ++step) {
    for (long row = 0; row < batch; ++row) {
      if (position == DIGITS_TRAIN) {
        shuffle(order, DIGITS_TRAIN, &random_state);
        position = 0;
      }
      int source = order[position++];
      memcpy(x + row * DIGITS_PIXELS, data->pixels[source], sizeof(float) * DIGITS_PIXELS);
      y[row] = data->labels[source];
    }
    float loss = 0;
    if (digits_mlp_train_run(model, batch, x, y, &loss) != digits_mlp_train_OK) {
      fprintf(stderr, "train_digits: step %ld: %s\n", step, digits_mlp_train_error(model));
      goto done;
    }
    if (step <= window) first += loss / (double)window;
    if (step > steps - window) last += loss / (double)window;
    if (step % window == 0 || step == steps) printf("step %ld loss %.4f\n", step, loss);
  }
  printf("mean loss: first %ld steps %.4f, last %ld steps %.4f\n", window, first, window, last);
  if (digits_mlp_train_save(model, out) != digits_mlp_train_OK) {
    fprintf(stderr, "train_digits: %s\n", digits_mlp_train_error(model));
    goto done;
  }
  printf("saved %s\n", out);
  status = 0;
done:
  digits_mlp_train_close(model);
  free(y);
  free(x);
  free(data);
  return status;
}

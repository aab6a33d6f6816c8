/* examples/deploy/digits_data.h -- reads the UCI digits (examples/data/digits.csv.gz) in plain C,
   split as digits_mlp splits them: rows 0..1436 train, the last 360 rows test. */
#ifndef DIGITS_DATA_H
#define DIGITS_DATA_H

#include <stdint.h>

enum { DIGITS_ROWS = 1797, DIGITS_TRAIN = 1437, DIGITS_TEST = 360, DIGITS_PIXELS = 64 };

typedef struct {
  float pixels[DIGITS_ROWS][DIGITS_PIXELS]; /* scaled to 0..1, as digits_mlp feeds them */
  int64_t labels[DIGITS_ROWS];
} digits_data;

/* Reads the gzip'd CSV at path (64 pixels 0..16 and a label 0..9 per line) into *out. Returns 0,
   or 1 after printing what is wrong (file, line) to stderr. */
int digits_read(const char* path, digits_data* out);

#endif

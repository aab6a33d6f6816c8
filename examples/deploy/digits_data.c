/* examples/deploy/digits_data.c -- the digits CSV reader shared by the deploy examples (zlib). */
#include "digits_data.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <zlib.h>

/* One line: 64 pixels and a label, comma-separated integers. Returns 0 or 1 (bad line). */
static int parse_line(const char* line, float* pixels, int64_t* label) {
  const char* at = line;
  for (int field = 0; field <= DIGITS_PIXELS; ++field) {
    char* end = NULL;
    errno = 0;
    long value = strtol(at, &end, 10);
    if (end == at || errno != 0) return 1;
    if (field < DIGITS_PIXELS) {
      if (value < 0 || value > 16) return 1;
      pixels[field] = (float)value / 16.0f;
    } else {
      if (value < 0 || value > 9) return 1;
      *label = value;
    }
    at = end;
    if (field < DIGITS_PIXELS) {
      if (*at != ',') return 1;
      ++at;
    }
  }
  while (*at == '\r' || *at == '\n' || *at == ' ') ++at;
  return *at != '\0';
}

int digits_read(const char* path, digits_data* out) {
  gzFile file = gzopen(path, "rb");
  if (!file) {
    fprintf(stderr, "%s: cannot open: %s\n", path, errno ? strerror(errno) : "zlib error");
    return 1;
  }
  char line[1024];
  int rows = 0, status = 0;
  while (gzgets(file, line, sizeof line)) {
    if (rows == DIGITS_ROWS) {
      fprintf(stderr, "%s: more than %d rows\n", path, DIGITS_ROWS);
      status = 1;
      break;
    }
    if (parse_line(line, out->pixels[rows], &out->labels[rows])) {
      fprintf(stderr, "%s:%d: expected 64 pixels (0..16) and a label (0..9)\n", path, rows + 1);
      status = 1;
      break;
    }
    ++rows;
  }
  int zerror = 0;
  const char* message = gzerror(file, &zerror);
  if (status == 0 && zerror != Z_OK && zerror != Z_STREAM_END) {
    fprintf(stderr, "%s: %s\n", path, message);
    status = 1;
  }
  gzclose(file);
  if (status == 0 && rows != DIGITS_ROWS) {
    fprintf(stderr, "%s: %d rows, expected %d\n", path, rows, DIGITS_ROWS);
    status = 1;
  }
  return status;
}

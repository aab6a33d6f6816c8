/* examples/deploy/sample_text.c -- samples text from the character GPT that `char_gpt --export DIR`
   wrote: a plain C11 program built against the artifact alone (no mixtape, no LLVM).

     cc -std=c11 -O2 sample_text.c -o sample_text \
        $(PKG_CONFIG_PATH=DIR pkg-config --cflags --libs char_gpt)
     ./sample_text DIR [--prompt TEXT] [--count N] [--temperature X] [--seed N]

   Prints the prompt and `count` characters, each drawn from the model's next-character
   distribution at `temperature` (0: the most likely one) with a seeded PRNG, so a seed repeats
   its text. The model sees the last CONTEXT characters; a shorter window is padded at its end,
   which the causal attention keeps from the positions before it. */
#include <errno.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "char_gpt.h"

/* DIR/char_gpt_vocab.txt: "mixtape-char-vocab-1 CONTEXT VOCAB\n", then the VOCAB bytes of the
   vocabulary in token id order. */
typedef struct {
  int64_t context, size;
  unsigned char chars[256];
  int id_of[256]; /* byte -> token id, -1 when absent */
} Vocab;

static int read_vocab(const char* dir, Vocab* v) {
  char path[4096];
  if (snprintf(path, sizeof path, "%s/char_gpt_vocab.txt", dir) >= (int)sizeof path) {
    fprintf(stderr, "sample_text: the directory name is too long\n");
    return 0;
  }
  FILE* f = fopen(path, "rb");
  if (!f) {
    fprintf(stderr, "sample_text: cannot open %s: %s\n", path, strerror(errno));
    return 0;
  }
  long long context = 0, size = 0;
  int ok = fscanf(f, "mixtape-char-vocab-1 %lld %lld", &context, &size) == 2 && fgetc(f) == '\n' &&
           context >= 1 && size >= 1 && size <= 256;
  if (ok) {
    v->context = context;
    v->size = size;
    ok = fread(v->chars, 1, (size_t)size, f) == (size_t)size && fgetc(f) == EOF;
  }
  fclose(f);
  if (!ok) {
    fprintf(stderr, "sample_text: %s is not a char_gpt vocabulary (char_gpt --export writes it)\n",
            path);
    return 0;
  }
  for (int b = 0; b < 256; ++b) v->id_of[b] = -1;
  for (int64_t i = 0; i < v->size; ++i) v->id_of[v->chars[i]] = (int)i;
  return 1;
}

/* splitmix64: a tiny, well-mixed generator; uniform() gives [0, 1) with 53 random bits. */
static uint64_t next_random(uint64_t* state) {
  uint64_t z = (*state += 0x9E3779B97F4A7C15ULL);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}
static double uniform(uint64_t* state) { return (double)(next_random(state) >> 11) * 0x1.0p-53; }

/* The next token from `logits` (vocab values): the most likely at temperature 0, else a draw
   from softmax(logits / temperature). */
static int64_t pick(const float* logits, int64_t vocab, double temperature, uint64_t* rng) {
  int64_t best = 0;
  for (int64_t i = 1; i < vocab; ++i)
    if (logits[i] > logits[best]) best = i;
  if (temperature == 0) return best;
  double total = 0;
  for (int64_t i = 0; i < vocab; ++i) total += exp((logits[i] - logits[best]) / temperature);
  double target = uniform(rng) * total;
  for (int64_t i = 0; i < vocab; ++i) {
    target -= exp((logits[i] - logits[best]) / temperature);
    if (target < 0) return i;
  }
  return best; /* rounding left a sliver past the last token */
}

static int usage(const char* problem) {
  fprintf(stderr,
          "sample_text: %s\nusage: sample_text DIR [--prompt TEXT] [--count N] "
          "[--temperature X] [--seed N]\n",
          problem);
  return 2;
}

static int number(const char* text, double* out) {
  char* end = NULL;
  errno = 0;
  *out = strtod(text, &end);
  return *text != '\0' && *end == '\0' && errno == 0 && isfinite(*out);
}

int main(int argc, char** argv) {
  if (argc < 2 || argv[1][0] == '-') return usage("the first argument is the export directory");
  const char* dir = argv[1];
  const char* prompt = "\n";
  double count = 200, temperature = 0.8, seed = 0;
  for (int i = 2; i < argc; i += 2) {
    if (i + 1 >= argc) return usage("a flag lacks its value");
    const char *flag = argv[i], *value = argv[i + 1];
    if (strcmp(flag, "--prompt") == 0) {
      prompt = value;
    } else if (strcmp(flag, "--count") == 0) {
      if (!number(value, &count) || count < 0 || count > 1e9 || count != floor(count))
        return usage("--count needs a whole number >= 0");
    } else if (strcmp(flag, "--temperature") == 0) {
      if (!number(value, &temperature) || temperature < 0)
        return usage("--temperature needs a number >= 0");
    } else if (strcmp(flag, "--seed") == 0) {
      if (!number(value, &seed) || seed < 0 || seed > 9e15 || seed != floor(seed))
        return usage("--seed needs a whole number >= 0");
    } else {
      return usage("unknown flag");
    }
  }
  if (prompt[0] == '\0') return usage("--prompt must not be empty");

  Vocab vocab;
  if (!read_vocab(dir, &vocab)) return 1;
  /* The buffers below are sized from the vocabulary file: it must be the model's, whose shapes
     the header gives (tokens [batch, context], logits [batch, context, vocab]). */
  static const int64_t tokens_shape[] = char_gpt_tokens_SHAPE;
  static const int64_t logits_shape[] = char_gpt_logits_SHAPE;
  if (char_gpt_tokens_RANK != 2 || char_gpt_logits_RANK != 3 ||
      vocab.context != tokens_shape[1] || vocab.context != logits_shape[1] ||
      vocab.size != logits_shape[2]) {
    fprintf(stderr,
            "sample_text: %s/char_gpt_vocab.txt (context %lld, %lld characters) is not the "
            "vocabulary of the model this program was built for (context %lld, %lld characters)\n",
            dir, (long long)vocab.context, (long long)vocab.size, (long long)tokens_shape[1],
            (long long)logits_shape[2]);
    return 1;
  }
  size_t prompt_length = strlen(prompt), total = prompt_length + (size_t)count;
  int64_t* tokens = malloc(total * sizeof *tokens);
  int64_t* window = malloc((size_t)vocab.context * sizeof *window);
  float* logits = malloc((size_t)(vocab.context * vocab.size) * sizeof *logits);
  char_gpt* model = NULL;
  int status = 1;
  if (!tokens || !window || !logits) {
    fprintf(stderr, "sample_text: out of memory\n");
    goto done;
  }
  for (size_t i = 0; i < prompt_length; ++i) {
    int id = vocab.id_of[(unsigned char)prompt[i]];
    if (id < 0) {
      fprintf(stderr,
              "sample_text: the prompt's character %zu (byte 0x%02x) is not in the model's "
              "vocabulary\n",
              i, (unsigned char)prompt[i]);
      goto done;
    }
    tokens[i] = id;
  }
  if (char_gpt_open(dir, "cpu", &model) != char_gpt_OK) {
    fprintf(stderr, "sample_text: %s\n", char_gpt_error(NULL));
    goto done;
  }

  uint64_t rng = (uint64_t)seed;
  size_t length = prompt_length;
  fwrite(prompt, 1, prompt_length, stdout);
  while (length < total) {
    size_t n = length < (size_t)vocab.context ? length : (size_t)vocab.context;
    memset(window, 0, (size_t)vocab.context * sizeof *window);
    memcpy(window, tokens + (length - n), n * sizeof *window);
    if (char_gpt_run(model, 1, window, logits) != char_gpt_OK) {
      fprintf(stderr, "\nsample_text: %s\n", char_gpt_error(model));
      goto done;
    }
    int64_t next = pick(logits + (n - 1) * (size_t)vocab.size, vocab.size, temperature, &rng);
    tokens[length++] = next;
    fputc(vocab.chars[next], stdout);
  }
  fputc('\n', stdout);
  status = 0;
done:
  char_gpt_close(model);
  free(tokens);
  free(window);
  free(logits);
  return status;
}

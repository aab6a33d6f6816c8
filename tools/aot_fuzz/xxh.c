/* tools/aot_fuzz/xxh.c -- prints a file's size and xxh3_64, as an artifact manifest records them. */
#include <stdio.h>
#include <stdlib.h>
#include <xxhash.h>
int main(int argc, char** argv) {
  FILE* f = fopen(argv[1], "rb"); fseek(f, 0, SEEK_END); long n = ftell(f); fseek(f, 0, SEEK_SET);
  char* b = malloc(n + 1); fread(b, 1, n, f);
  printf("%ld %016llx\n", n, (unsigned long long)XXH3_64bits(b, n));
  return 0;
}

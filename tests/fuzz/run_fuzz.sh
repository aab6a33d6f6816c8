#!/usr/bin/env bash
# tests/fuzz/run_fuzz.sh -- builds the safetensors fuzz target with clang's libFuzzer under
# ASan+UBSan, seeds it with files the library writes, and fuzzes for a while.
# Usage: run_fuzz.sh WORK_DIR [SECONDS]   (CTest runs it as the test fuzz_safetensors)
# The library itself is built with GCC, whose sanitizer runtime cannot be mixed with clang's, so
# the few sources the reader needs are compiled here with clang.
set -euo pipefail
src=$(cd "$(dirname "$0")/../.." && pwd)
work=$1
seconds=${2:-60}
cxx=${MIXTAPE_FUZZ_CXX:-clang++-16}
mkdir -p "$work"
"$cxx" -std=c++20 -O1 -g -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=all \
  -fno-omit-frame-pointer -I"$src" \
  "$src/tests/fuzz/fuzz_safetensors.cpp" "$src/mixtape/runtime/safetensors.cpp" \
  "$src/mixtape/runtime/atomic_file.cpp" "$src/mixtape/dsl/json.cpp" "$src/mixtape/dsl/dtype.cpp" "$src/mixtape/dsl/host_memory.cpp" \
  "$src/mixtape/dsl/byte_count.cpp" \
  -lfmt -o "$work/fuzz_safetensors"
rm -rf "$work/seeds" "$work/corpus"
mkdir -p "$work/seeds" "$work/corpus"
MIXTAPE_FUZZ_WRITE_SEEDS="$work/seeds" "$work/fuzz_safetensors"
# Leaks are real findings too; crashes leave their input in $work for reproduction.
export ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1
cd "$work"
"$work/fuzz_safetensors" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 \
  -print_final_stats=1 "$work/corpus" "$work/seeds"

#!/usr/bin/env bash
# tools/test.sh -- installs what the tests need, builds everything and runs the whole test suite.
# MIXTAPE_SANITIZE=1 builds and runs it under AddressSanitizer + UndefinedBehaviorSanitizer
# in build-asan/ instead.
set -euo pipefail
cd "$(dirname "$0")/.."
tools/install_deps.sh --test
if [[ "${MIXTAPE_SANITIZE:-0}" == 1 ]]; then
  dir=build-asan
  # -O1 and line tables only (-g1): compiling under ASan+UBSan at -O2 -g took 3x as long for the
  # large test files (tests/test_ops.cpp: 213 s of CPU against 72 s), and the stack traces keep
  # their file:line. The benchmarks measure speed, which an instrumented build cannot: not built.
  flags=(-DCMAKE_BUILD_TYPE=RelWithDebInfo "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O1 -g1 -DNDEBUG"
    -DMIXTAPE_SANITIZE=ON -DMIXTAPE_BUILD_BENCHMARKS=OFF)
  # The kernels the plain suite compiled (LLVM and NVRTC, not instrumented) serve this one too.
  if [[ -d build ]]; then flags+=("-DMIXTAPE_TEST_KERNEL_CACHE=$PWD/build/kernel-cache"); fi
  # allocator_may_return_null: a failed allocation is a null pointer, as from the OS, which
  # mixtape reports as an mt::Error (tests ask for terabytes on purpose).
  export ASAN_OPTIONS=detect_leaks=1:abort_on_error=1:allocator_may_return_null=1
  export UBSAN_OPTIONS=print_stacktrace=1
else
  dir=build
  flags=(-DCMAKE_BUILD_TYPE=Release)
fi
cmake -S . -B "$dir" -DMIXTAPE_WERROR=ON -DMIXTAPE_BUILD_TESTS=ON "${flags[@]}" >/dev/null
cmake --build "$dir" -j"$(nproc)"
ctest --test-dir "$dir" --output-on-failure -j"$(nproc)"

#!/usr/bin/env bash
# tools/demo.sh -- installs what is missing, builds mixtape and runs the digits_mlp demo.
set -euo pipefail
cd "$(dirname "$0")/.."
tools/install_deps.sh
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release -DMIXTAPE_BUILD_TESTS=OFF >/dev/null
cmake --build build -j"$(nproc)" --target digits_mlp
./build/digits_mlp "$@"

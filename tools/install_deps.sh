#!/usr/bin/env bash
# tools/install_deps.sh -- installs the Debian packages mixtape needs (only those missing).
# Usage: tools/install_deps.sh [--test]   (--test adds what the test suite needs: GoogleTest,
# PyTorch and numpy for the oracle tests, Python's xxhash to check checkpoint checksums, clang
# 16's libFuzzer for tests/fuzz: clang 14 cannot compile GCC 12's <source_location>, pkg-config
# for the deploy test's C builds, python3-venv for the venv tools/reference_venv.sh fills with
# PyPI's tensorboard and safetensors, python3-matplotlib for tools/plot_run.py). libisal-dev: CRC32C for the
# TensorBoard event files, libpng-dev the PNG of their images. nlohmann-json3-dev: the JSON of checkpoints, artifacts and reports;
# libcli11-dev: the examples' command lines (both header-only). gcc and binutils: an AOT export
# compiles and links the artifact's libraries with cc, ld, objcopy, ar and nm. libopenmpi-dev
# and openmpi-bin: dist/'s data-parallel training (mpirun -np N) and the tests labelled mpi; a
# build without them trains in one process.
# Safe to run again: installs nothing when all is there.
set -euo pipefail
packages=(g++ gcc binutils cmake make libfmt-dev zlib1g-dev libssl-dev llvm-16-dev libdnnl-dev
  libxxhash-dev libjemalloc-dev libisal-dev libpng-dev nlohmann-json3-dev libcli11-dev libopenmpi-dev
  openmpi-bin)
if [[ "${1:-}" == "--test" ]]; then
  packages+=(libgtest-dev libgmock-dev python3 python3-torch python3-numpy python3-xxhash
    clang-16 libclang-rt-16-dev pkgconf python3-venv python3-matplotlib)
fi
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]} == 0)); then
  exit 0
fi
if [[ $(id -u) -ne 0 ]]; then
  echo "install_deps: missing Debian packages: ${missing[*]} (run as root, or install them)" >&2
  exit 1
fi
echo "install_deps: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null

#!/usr/bin/env bash
# bench/setup_peers.sh -- installs the peers' extras: JAX in bench/.venv, ONNX Runtime in
# bench/.venv-deploy, OpenBLAS for torch.
# Idempotent; run as root on Debian 12. PyTorch itself is Debian's python3-torch.
#
# - JAX (CPU) from PyPI into bench/.venv (its own venv: JAX wants a newer numpy than Debian's,
#   which python3-torch is built against).
# - ONNX Runtime and safetensors from PyPI into bench/.venv-deploy, for bench/peer_deploy.py: a
#   venv on Debian's python3 with --system-site-packages, so that one interpreter has Debian's
#   torch (for the twin models, TorchScript and torch.onnx.export) and ONNX Runtime. numpy is
#   pinned to Debian's, which torch is built against, so pip cannot replace it in the venv.
# - Debian's torch calls whatever libblas.so.3 the system selects; with only libblas3 installed that
#   is the netlib reference BLAS (about 2 GFLOP/s). run.py gives torch its best setting by putting
#   OpenBLAS first on its library path; this unpacks Debian's libopenblas0-pthread into
#   bench/.openblas without installing it, so the system's BLAS choice is left as it is.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

if ! /usr/bin/python3 -c 'import torch' 2>/dev/null; then
  echo "setup_peers: /usr/bin/python3 cannot import torch; apt-get install python3-torch" >&2
fi

if [ -x "$here/.venv/bin/python" ] && "$here/.venv/bin/python" -c 'import jax' 2>/dev/null; then
  echo "setup_peers: JAX already in bench/.venv"
else
  /usr/bin/python3 -m venv "$here/.venv"
  "$here/.venv/bin/pip" install --quiet jax
  version="$("$here/.venv/bin/python" -c 'import jax; print(jax.__version__)')"
  echo "setup_peers: installed JAX $version"
fi

if [ -x "$here/.venv-deploy/bin/python" ] &&
  "$here/.venv-deploy/bin/python" -c 'import onnxruntime, safetensors, torch' 2>/dev/null; then
  echo "setup_peers: ONNX Runtime already in bench/.venv-deploy"
elif /usr/bin/python3 -c 'import torch, numpy' 2>/dev/null; then
  /usr/bin/python3 -m venv --system-site-packages "$here/.venv-deploy"
  pin="$(mktemp)"
  /usr/bin/python3 -c 'import numpy; print("numpy==" + numpy.__version__)' >"$pin"
  "$here/.venv-deploy/bin/pip" install --quiet -c "$pin" onnxruntime safetensors
  rm -f "$pin"
  version="$("$here/.venv-deploy/bin/python" -c 'import onnxruntime; print(onnxruntime.__version__)')"
  echo "setup_peers: installed ONNX Runtime $version in bench/.venv-deploy"
else
  echo "setup_peers: skipping bench/.venv-deploy: /usr/bin/python3 lacks torch or numpy" >&2
fi

openblas_dir="$here/.openblas/usr/lib/x86_64-linux-gnu/openblas-pthread"
if [ -e "$openblas_dir/libblas.so.3" ]; then
  echo "setup_peers: OpenBLAS already in bench/.openblas"
else
  work="$(mktemp -d)"
  trap 'rm -rf "$work"' EXIT
  (cd "$work" && apt-get download libopenblas0-pthread >/dev/null 2>&1 ||
    { apt-get update >/dev/null && apt-get download libopenblas0-pthread >/dev/null; })
  rm -rf "$here/.openblas"
  dpkg -x "$work"/libopenblas0-pthread_*.deb "$here/.openblas"
  echo "setup_peers: unpacked OpenBLAS into bench/.openblas"
fi
if ldd "$openblas_dir/libopenblas.so.0" | grep -q "not found"; then
  echo "setup_peers: OpenBLAS misses a library (apt-get install libgfortran5):" >&2
  ldd "$openblas_dir/libopenblas.so.0" | grep "not found" >&2
fi

#!/usr/bin/env bash
# tools/reference_venv.sh -- makes a Python venv holding PyPI's reference readers, tensorboard (its
# event reader checks mixtape's event files) and safetensors (the format's own reader and writer
# check mixtape's checkpoints both ways), and prints the venv's python. Usage: reference_venv.sh
# VENV_DIR. Safe to run again and from tests running at once: a lock serializes the runs, and a
# venv that already imports both is reused. Exit 3 (with the reason on stderr) when the venv
# cannot be made, e.g. without python3-venv or without network.
set -euo pipefail
venv=${1:?usage: reference_venv.sh VENV_DIR}
python=$venv/bin/python
mkdir -p "$(dirname "$venv")"
exec 9>>"$venv.lock"
flock 9
readers_import='import tensorboard, safetensors.torch'
if [[ -x $python ]] && "$python" -c "$readers_import" 2>/dev/null; then
  echo "$python"
  exit 0
fi
# Debian's interpreter, which python3-venv, python3-torch and python3-matplotlib
# (tools/install_deps.sh) serve; the venv sees their packages and adds the two readers.
system_python=/usr/bin/python3
[[ -x $system_python ]] || system_python=python3
if [[ ! -x $python ]] && ! "$system_python" -m venv --clear --system-site-packages "$venv" >&2; then
  echo "reference_venv: python3 -m venv failed (install python3-venv: tools/install_deps.sh --test)" >&2
  exit 3
fi
# tensorboard's event reader runs without TensorFlow; setuptools gives it pkg_resources.
# safetensors below 0.9 still supports Debian 12's torch 1.13.
if ! "$python" -m pip install --quiet --disable-pip-version-check tensorboard setuptools \
  'safetensors<0.9' >&2; then
  echo "reference_venv: pip could not install tensorboard and safetensors from PyPI" >&2
  exit 3
fi
echo "$python"

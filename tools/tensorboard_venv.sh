#!/usr/bin/env bash
# tools/tensorboard_venv.sh -- makes a Python venv holding PyPI's tensorboard (its event reader
# checks mixtape's event files) and prints the venv's python. Usage: tensorboard_venv.sh VENV_DIR
# Safe to run again: a venv that already imports tensorboard is reused. Exit 3 (with the reason
# on stderr) when the venv cannot be made, e.g. without python3-venv or without network.
set -euo pipefail
venv=${1:?usage: tensorboard_venv.sh VENV_DIR}
python=$venv/bin/python
if [[ -x $python ]] && "$python" -c 'import tensorboard' 2>/dev/null; then
  echo "$python"
  exit 0
fi
# Debian's interpreter, which python3-venv and python3-matplotlib (tools/install_deps.sh) serve;
# the venv sees its packages (matplotlib for tools/plot_run.py) and adds tensorboard.
system_python=/usr/bin/python3
[[ -x $system_python ]] || system_python=python3
if ! "$system_python" -m venv --clear --system-site-packages "$venv" >&2; then
  echo "tensorboard_venv: python3 -m venv failed (install python3-venv: tools/install_deps.sh --test)" >&2
  exit 3
fi
# tensorboard's event reader runs without TensorFlow; setuptools gives it pkg_resources.
if ! "$python" -m pip install --quiet --disable-pip-version-check tensorboard setuptools >&2; then
  echo "tensorboard_venv: pip could not install tensorboard from PyPI" >&2
  exit 3
fi
echo "$python"

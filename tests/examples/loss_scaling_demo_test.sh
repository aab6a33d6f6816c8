#!/usr/bin/env bash
# tests/examples/loss_scaling_demo_test.sh -- the loss-scaling experiment shows what it claims:
# fp16 without scaling loses at least half of the gradient values and its loss stays behind
# fp32's; fp16 with dynamic scaling and bf16 end within 2% (relative) of fp32's loss. The run
# also writes --logdir event files, which must not change the numbers, and tools/plot_run.py
# draws them into a PNG.
set -euo pipefail
logdir=$(mktemp -d)
trap 'rm -rf "$logdir"' EXIT
# The measured memory peak ("peak_bytes") is left out: the writer's own buffers count in it.
line=$("$1" 300 --logdir "$logdir/runs" | tail -n 1 | sed 's/,"peak_bytes":[0-9]*//')
plain=$("$1" 300 | tail -n 1 | sed 's/,"peak_bytes":[0-9]*//')
if [[ "$line" != "$plain" || "$line" != *'"runs":'* ]]; then
  echo "FAIL: --logdir changed the results: $line vs $plain" >&2
  exit 1
fi
echo "ok: --logdir leaves the results unchanged"
for run in fp32 fp16 fp16_dynamic_scaling bf16; do
  if ! ls "$logdir/runs/$run"/events.out.tfevents.* > /dev/null 2>&1; then
    echo "FAIL: no event file for run $run" >&2
    exit 1
  fi
done
# Debian's interpreter, where python3-matplotlib (tools/install_deps.sh --test) is installed.
python=/usr/bin/python3
[[ -x $python ]] || python=python3
"$python" "$(dirname "$0")/../../tools/plot_run.py" "$logdir/runs" -o "$logdir/plot.png"
size=$(stat -c %s "$logdir/plot.png")
if ((size < 20000)); then
  echo "FAIL: plot_run.py wrote only $size bytes" >&2
  exit 1
fi
echo "ok: plot_run.py drew the four runs ($size bytes)"
# The progress line: off when stdout is not a terminal, redrawn with \r on one (script(1) gives
# the run a pseudo-terminal).
if "$1" 20 | grep -q $'\r'; then
  echo "FAIL: a progress line was drawn into a pipe" >&2
  exit 1
fi
if command -v script > /dev/null; then
  drawn=$(script -qec "$1 20" /dev/null)
  if ! grep -q $'\rfp32: step 20/20  loss [0-9.]*  [0-9.]* steps/s  ETA 0:00  scale 1' <<< "$drawn"; then
    echo "FAIL: no progress line on a terminal: $drawn" >&2
    exit 1
  fi
  echo "ok: the progress line is drawn on a terminal only"
fi
python3 - "$line" <<'PY'
import json, sys
runs = {r["run"]: r for r in json.loads(sys.argv[1])["runs"]}
fp32 = runs["fp32"]["final_loss"]
checks = [
    (runs["fp16 (no scaling)"]["underflow_fraction"] >= 0.5,
     "fp16 without scaling loses at least half of the gradient values"),
    (runs["fp16 (no scaling)"]["final_loss"] > fp32 + 0.5,
     "fp16 without scaling stays measurably behind fp32"),
    (abs(runs["fp16 + dynamic scaling"]["final_loss"] - fp32) <= 0.02 * fp32 + 1e-3,
     "fp16 with dynamic scaling ends within 2% of fp32's loss"),
    (abs(runs["bf16 (no scaling)"]["final_loss"] - fp32) <= 0.02 * fp32 + 1e-3,
     "bf16 ends within 2% of fp32's loss"),
    (runs["fp16 + dynamic scaling"]["underflow_fraction"] < 0.05,
     "dynamic scaling keeps the gradients"),
]
failed = False
for ok, what in checks:
    print(("ok: " if ok else "FAIL: ") + what)
    failed |= not ok
print(json.dumps(runs, indent=1))
sys.exit(1 if failed else 0)
PY

#!/usr/bin/env bash
# tests/examples/digits_mlp_test.sh -- runs the digits_mlp demo as a user would and checks what it
# promises: >= 95% test accuracy with the defaults, reproducible runs, --save/--load round trip,
# --resume as a run never stopped, --no-shuffle order, mt::compile by default (the same run as
# --no-compile), and one clear line plus a non-zero exit for bad flags or files.
set -euo pipefail
bin="$1"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

source "$(dirname "$0")/checks.sh"

line=$("$bin" --json | tail -n 1)
echo "$line"
accuracy=$(field test_accuracy "$line")
check "$accuracy >= 0.95" "default settings reach >= 95% test accuracy (got $accuracy)"
check "'$(field example "$line")' == 'digits_mlp'" "the JSON line names the example"

# Mixed precision keeps the accuracy: within 1 point of fp32's.
for args in "--policy autocast-f16 --loss-scale dynamic" "--policy autocast-bf16"; do
  mixed=$("$bin" --json $args | tail -n 1)
  echo "$mixed"
  check "abs($(field test_accuracy "$mixed") - $accuracy) <= 0.01" \
    "$args ends within 1 point of fp32's test accuracy"
  check "$(field skipped_steps "$mixed") >= 0 and $(field final_scale "$mixed") > 0" \
    "$args reports its final scale and skipped steps"
done

# The loop runs through mt::compile by default; tracing every step (--no-compile) is the same run.
compiled=$("$bin" --json --steps 60 --cosine | tail -n 1)
traced=$("$bin" --json --steps 60 --cosine --no-compile | tail -n 1)
check "'$(field step "$compiled")' == 'compiled' and $(field replayed_steps "$compiled") >= 57" \
  "the default loop replays the step through mt::compile"
check "$(field final_loss "$compiled") == $(field final_loss "$traced") and \
  $(field test_accuracy "$compiled") == $(field test_accuracy "$traced")" \
  "--no-compile (traced every step) gives the same loss and accuracy"

a=$("$bin" --json --steps 30 --seed 7 | tail -n 1)
b=$("$bin" --json --steps 30 --seed 7 | tail -n 1)
check "$(field final_loss "$a") == $(field final_loss "$b")" "the same seed gives the same loss"

"$bin" --json --steps 30 --no-shuffle --save "$work/ckpt.safetensors" > "$work/save.txt"
check "$(test -s "$work/ckpt.safetensors" && echo 1 || echo 0) == 1" "--save writes a checkpoint"
# Loading the trained weights and training 0 further steps is not possible (steps >= 1), so load
# them, train one more step with lr 0 and compare the accuracy with the saved run's.
saved=$(tail -n 1 "$work/save.txt")
loaded=$("$bin" --json --steps 1 --lr 0 --load "$work/ckpt.safetensors" | tail -n 1)
check "$(field test_accuracy "$saved") == $(field test_accuracy "$loaded")" \
  "--load restores the weights that --save wrote"

# --resume: a run stopped at step 40 goes on to step 60 as the run never stopped, to the bytes of
# its last checkpoint (weights, AdamW's moments, the dynamic loss scale, the data order, the noise
# and shift generators). --save-every's checkpoints on the way leave the run as it was.
run=(--json --optimizer adamw --shift 1 --policy autocast-f16 --loss-scale dynamic)
whole=$("$bin" "${run[@]}" --steps 60 --save "$work/whole.safetensors" | tail -n 1)
"$bin" "${run[@]}" --steps 40 --save "$work/stopped.safetensors" > /dev/null
resumed=$("$bin" "${run[@]}" --steps 60 --resume "$work/stopped.safetensors" \
  --save "$work/resumed.safetensors" | tail -n 1)
check "$(field final_loss "$whole") == $(field final_loss "$resumed") and \
  $(field first_step "$resumed") == 41" "--resume goes on to the uninterrupted run's loss"
check "$(cmp -s "$work/whole.safetensors" "$work/resumed.safetensors" && echo 1 || echo 0) == 1" \
  "--resume ends with the uninterrupted run's checkpoint bytes"
"$bin" "${run[@]}" --steps 60 --save "$work/every.safetensors" --save-every 25 > /dev/null
check "$(cmp -s "$work/whole.safetensors" "$work/every.safetensors" && echo 1 || echo 0) == 1" \
  "--save-every's checkpoints leave the run as it was"
if "$bin" "${run[@]}" --steps 60 --resume "$work/whole.safetensors" > "$work/out.txt" \
  2> "$work/err.txt"; then
  echo "FAIL: resuming past --steps was accepted"; exit 1
fi
check "$(wc -l < "$work/err.txt") == 1 and 'step 60' in open('$work/err.txt').read()" \
  "resuming a run that already reached --steps exits with one line saying so"

# A resume under other flags that shape the run is refused, and a damaged step is found (the
# header's checksum covers the metadata).
if "$bin" --json --optimizer adamw --shift 1 --policy autocast-f16 --loss-scale static:1024 \
  --steps 60 --resume "$work/stopped.safetensors" > "$work/out.txt" 2> "$work/err.txt"; then
  echo "FAIL: a resume under another --loss-scale was accepted"; exit 1
fi
check "$(wc -l < "$work/err.txt") == 1 and 'saved with --loss-scale dynamic' in \
  open('$work/err.txt').read()" "a resume under another --loss-scale names the flag"
python3 - "$work/stopped.safetensors" "$work/damaged.safetensors" <<'EOF_PY'
import sys
data = open(sys.argv[1], "rb").read()
assert data.count(b'"step":"40"') == 1
open(sys.argv[2], "wb").write(data.replace(b'"step":"40"', b'"step":"41"'))
EOF_PY
if "$bin" "${run[@]}" --steps 60 --resume "$work/damaged.safetensors" > "$work/out.txt" \
  2> "$work/err.txt"; then
  echo "FAIL: a checkpoint with a damaged step was accepted"; exit 1
fi
check "$(wc -l < "$work/err.txt") == 1 and 'the header is corrupt' in open('$work/err.txt').read()" \
  "a checkpoint with a damaged step is refused"

if "$bin" --steps 0 > "$work/out.txt" 2> "$work/err.txt"; then
  echo "FAIL: --steps 0 was accepted"; exit 1
fi
check "$(wc -l < "$work/err.txt") <= 3 and 'steps' in open('$work/err.txt').read()" \
  "a bad flag value exits non-zero with a message naming it"

echo "garbage" > "$work/bad.safetensors"
if "$bin" --steps 1 --load "$work/bad.safetensors" > "$work/out.txt" 2> "$work/err.txt"; then
  echo "FAIL: a corrupt checkpoint was accepted"; exit 1
fi
check "$(wc -l < "$work/err.txt") == 1 and 'bad.safetensors' in open('$work/err.txt').read()" \
  "a corrupt checkpoint exits non-zero with one line naming the file"

if MIXTAPE_DATA_DIR="$work/nowhere" "$bin" --steps 1 > "$work/out.txt" 2> "$work/err.txt"; then
  echo "FAIL: a missing data directory was accepted"; exit 1
fi
check "$(wc -l < "$work/err.txt") == 1 and 'nowhere' in open('$work/err.txt').read()" \
  "a missing data file exits non-zero with one line naming it"
echo "digits_mlp: all checks passed"

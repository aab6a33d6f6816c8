#!/usr/bin/env bash
# tests/examples/char_gpt_test.sh -- runs a short char_gpt training as a user would and checks what
# it promises: a held-out loss well below the uniform guess ln(vocab) in fp32 and in mixed
# precision, a non-empty sample, reproducible runs for a seed, and clear errors for bad flags.
set -euo pipefail
bin="$1"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
sized="--layers 1 --width 32 --context 16 --batch 4 --lr 3e-3 --eval-batches 4 --sample 20 --json"
small="--steps 30 $sized"

source "$(dirname "$0")/checks.sh"
# A model that has learned nothing predicts uniformly: loss ln(vocab) (4.70 for the fortunes'
# 110 bytes). 30 steps of this small model get 0.8 below that (to about 3.3).
learned() {  # learned JSONLINE LABEL
  local val vocab
  val=$(field val_loss "$1")
  vocab=$(field vocab "$1")
  check "math.isfinite($val) and $val < math.log($vocab) - 0.8" \
    "$2: validation loss $val is below ln($vocab) - 0.8"
  check "math.isfinite($(field train_loss "$1"))" "$2: the train loss is finite"
}

line=$("$bin" $small | tail -n 1)
echo "$line"
check "'$(field example "$line")' == 'char_gpt' and $(field steps "$line") == 30" \
  "the JSON line names the example and the steps"
learned "$line" "fp32"
check "$(python3 -c "import json,sys; print(len(json.loads(sys.argv[1])['sample']))" "$line") > 0" \
  "the sample is not empty"
check "$(field tokens_per_s "$line") > 0" "the throughput is reported"

again=$("$bin" $small | tail -n 1)
same="import json,sys; a,b=(json.loads(x) for x in sys.argv[1:]); keys=('train_loss','val_loss','sample')"
same="$same; print(all(a[k] == b[k] for k in keys))"
check "$(python3 -c "$same" "$line" "$again")" "the same seed gives the same losses and sample"
# The step runs through mt::compile by default, replayed from the fourth call on; tracing every
# step (--no-compile) must give the very same run.
traced=$("$bin" $small --no-compile | tail -n 1)
check "$(python3 -c "$same" "$line" "$traced")" "--no-compile gives the same losses and sample"
check "$(field replayed_steps "$line") >= 20 and $(field replayed_steps "$traced") == 0" \
  "the default loop replays the step, --no-compile traces it"
# With dropout too: each replay draws fresh masks, the very ones tracing every step draws.
dropped=$("$bin" $small --dropout 0.1 | tail -n 1)
traced=$("$bin" $small --dropout 0.1 --no-compile | tail -n 1)
check "$(python3 -c "$same" "$dropped" "$traced")" "--no-compile with dropout gives the same run"
check "$(field replayed_steps "$dropped") >= 20" "the default loop with dropout replays the step"
check "$(field peak_bytes "$dropped") > 0" "the measured memory peak is reported"
# --checkpoint: every block's activations are recomputed; the replayed step is the traced one.
kept=$("$bin" $small --dropout 0.1 --checkpoint | tail -n 1)
traced=$("$bin" $small --dropout 0.1 --checkpoint --no-compile | tail -n 1)
learned "$kept" "--checkpoint"
check "$(python3 -c "$same" "$kept" "$traced")" "--checkpoint replays what tracing computes"
check "$(field replayed_steps "$kept") >= 20" "the checkpointed step replays"
# --resume: a run stopped at step 20 goes on to step 30 as the run never stopped, with dropout
# (the model's generator), AdamW's two groups and dynamic f16 loss scaling: the same
# losses, sample and final checkpoint bytes. --save-every's checkpoints on the way leave the run
# as it was. (A constant rate: the cosine schedule's span is --steps, checked below.)
run="$sized --schedule constant --dropout 0.1 --policy autocast-f16 --loss-scale dynamic"
whole=$("$bin" $run --steps 30 --save "$work/whole.safetensors" | tail -n 1)
"$bin" $run --steps 20 --save "$work/stopped.safetensors" > /dev/null
if "$bin" $run --steps 20 --resume "$work/stopped.safetensors" > "$work/out.txt" \
  2> "$work/err.txt"; then
  echo "FAIL: resuming at the step it was saved was accepted"; exit 1
fi
check "$(wc -l < "$work/err.txt") == 1 and 'step 20' in open('$work/err.txt').read()" \
  "resuming a run that already reached --steps exits with one line saying so"
if "$bin" $sized --policy autocast-f16 --loss-scale dynamic --steps 30 \
  --resume "$work/stopped.safetensors" > "$work/out.txt" 2> "$work/err.txt"; then
  echo "FAIL: a resume under another --dropout was accepted"; exit 1
fi
check "$(wc -l < "$work/err.txt") == 1 and 'saved with --dropout 0.1' in \
  open('$work/err.txt').read()" "a resume under another --dropout names the flag"
# Two heads of width 16 have the parameters four of width 8 have: only the flag tells.
if "$bin" $run --steps 30 --heads 2 --resume "$work/stopped.safetensors" > "$work/out.txt" \
  2> "$work/err.txt"; then
  echo "FAIL: a resume under another --heads was accepted"; exit 1
fi
check "'saved with --heads 4, resumed with --heads 2' in open('$work/err.txt').read()" \
  "a resume under another --heads names the flag"
resumed=$("$bin" $run --steps 30 --resume "$work/stopped.safetensors" \
  --save "$work/resumed.safetensors" | tail -n 1)
check "$(python3 -c "$same" "$whole" "$resumed") and $(field first_step "$resumed") == 21" \
  "--resume goes on to the uninterrupted run's losses and sample"
check "$(cmp -s "$work/whole.safetensors" "$work/resumed.safetensors" && echo 1 || echo 0) == 1" \
  "--resume ends with the uninterrupted run's checkpoint bytes"
"$bin" $run --steps 30 --save "$work/every.safetensors" --save-every 7 > /dev/null
check "$(cmp -s "$work/whole.safetensors" "$work/every.safetensors" && echo 1 || echo 0) == 1" \
  "--save-every's checkpoints leave the run as it was"
"$bin" $sized --steps 20 --save "$work/cosine.safetensors" > /dev/null
if "$bin" $sized --steps 30 --resume "$work/cosine.safetensors" > "$work/out.txt" \
  2> "$work/err.txt"; then
  echo "FAIL: a cosine schedule resumed over another span was accepted"; exit 1
fi
check "$(wc -l < "$work/err.txt") == 1 and 'saved with --steps 20' in \
  open('$work/err.txt').read()" "a cosine schedule resumed over another --steps names the flag"

other=$("$bin" $small --seed 1 --logdir "$work/runs" | tail -n 1)
# --logdir: the curves, and the run as a session of a sweep (add_hparams) in runs/hparams.
for run in "$work/runs" "$work/runs/hparams"; do
  events=$(find "$run" -maxdepth 1 -name 'events.out.tfevents.*' -size +0 | wc -l)
  check "$events == 1" "--logdir writes one event file in $run"
done
check "$(field val_loss "$line") != $(field val_loss "$other")" "another seed gives another run"

for args in "--policy autocast-bf16" "--policy autocast-f16 --loss-scale dynamic" \
  "--policy pure-bf16"; do
  mixed=$("$bin" $small $args | tail -n 1)
  echo "$mixed"
  learned "$mixed" "$args"
  check "'$(field policy "$mixed")' == '${args#--policy }'.split()[0]" "$args is reported"
  check "abs($(field val_loss "$mixed") - $(field val_loss "$line")) <= 0.1" \
    "$args ends within 0.1 of fp32's validation loss"
done

if "$bin" --heads 3 --width 32 > "$work/out.txt" 2> "$work/err.txt"; then
  echo "FAIL: a width that heads do not divide was accepted"; exit 1
fi
check "$(wc -l < "$work/err.txt") == 1 and '--width' in open('$work/err.txt').read()" \
  "a bad model shape exits non-zero with one line naming the flag"

if "$bin" --policy fp8 > "$work/out.txt" 2> "$work/err.txt"; then
  echo "FAIL: an unknown policy was accepted"; exit 1
fi
check "$(wc -l < "$work/err.txt") == 1 and 'fp8' in open('$work/err.txt').read()" \
  "an unknown policy exits non-zero with one line naming it"

if MIXTAPE_DATA_DIR="$work/nowhere" "$bin" $small > "$work/out.txt" 2> "$work/err.txt"; then
  echo "FAIL: a missing data directory was accepted"; exit 1
fi
check "$(wc -l < "$work/err.txt") == 1 and 'nowhere' in open('$work/err.txt').read()" \
  "a missing data file exits non-zero with one line naming it"
echo "char_gpt: all checks passed"

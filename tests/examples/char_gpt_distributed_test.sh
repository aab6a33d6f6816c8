#!/usr/bin/env bash
# tests/examples/char_gpt_distributed_test.sh -- char_gpt --distributed on two processes under
# mpirun: rank 0 alone prints one JSON line with "world_size": 2, and two processes at batch 6
# train the model one process trains at batch 12 (each rank's windows are its share of the same
# shuffled batch), so the evaluated losses agree to f32 reduction-order rounding; rank 0 alone
# writes --logdir's event file and --export's artifacts, while the others log the same values
# without a file and make the same collectives (MIXTAPE_DIST_DEBUG checks each against the other
# process's); --zero (ZeroAdamW) trains the same model.
# Usage: char_gpt_distributed_test.sh CHAR_GPT MPIRUN
set -euo pipefail
bin="$1"
mpirun=("$2" --allow-run-as-root --oversubscribe -np 2 -x OMP_NUM_THREADS=1)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

source "$(dirname "$0")/checks.sh"

sized=(--json --layers 1 --heads 2 --width 32 --context 16 --sample 10 --seed 3)
small=(--steps 20 "${sized[@]}")
out=$("${mpirun[@]}" -x MIXTAPE_DIST_DEBUG=1 "$bin" --distributed --batch 6 "${small[@]}" \
  --logdir "$work/runs" --export "$work/export")
events=$(find "$work/runs" -maxdepth 1 -name 'events.out.tfevents.*' -size +0 | wc -l)
check "$events == 1" "one event file, rank 0's ($events)"
events=$(find "$work/runs/hparams" -name 'events.out.tfevents.*' -size +0 | wc -l)
check "$events == 1" "one hparams session, rank 0's ($events)"
for f in libchar_gpt.so char_gpt.json; do
  [[ -s "$work/export/$f" ]] || fail "--distributed --export wrote $f"
done
ok "rank 0 exported the model"
check "$(grep -c '"example"' <<<"$out") == 1" "one JSON line, from rank 0 alone"
two=$(grep '"example"' <<<"$out")
echo "$two"
one=$(OMP_NUM_THREADS=1 "$bin" --batch 12 "${small[@]}" | tail -n 1)
echo "$one"
check "$(field world_size "$two") == 2" "the JSON line says world_size 2"
for loss in train_loss val_loss; do
  a=$(field $loss "$two") b=$(field $loss "$one")
  check "abs($a - $b) <= 1e-4 * abs($b)" "$loss at 2 x 6 equals 1 x 12 ($a vs $b)"
done

# --zero: AdamW's state sharded (ZeRO-1). Every rank logs, rank 0's writer alone writes: the
# gradients' norm (all-reduced under ZeRO) and health (counts exchanged) are collectives, which
# MIXTAPE_DIST_DEBUG checks the ranks make alike.
zero=$("${mpirun[@]}" -x MIXTAPE_DIST_DEBUG=1 "$bin" --distributed --zero --batch 6 "${small[@]}" \
  --logdir "$work/zero_runs" | grep '"example"')
echo "$zero"
events=$(find "$work/zero_runs" -maxdepth 1 -name 'events.out.tfevents.*' | wc -l)
check "$events == 1" "--zero: one event file, rank 0's ($events)"
check "'$(field zero "$zero")' == 'True'" "the JSON line says zero"
for loss in train_loss val_loss; do
  a=$(field $loss "$zero") b=$(field $loss "$one")
  check "abs($a - $b) <= 1e-4 * abs($b)" "--zero: $loss at 2 x 6 equals 1 x 12 ($a vs $b)"
done
set +e
OMP_NUM_THREADS=1 "$bin" --zero "${small[@]}" 2>"$work/usage"
status=$?
set -e
check "$status == 2" "--zero without --distributed is a usage error ($(cat "$work/usage"))"

# --save and --resume under --zero: the shards are gathered into one ordinary checkpoint, which
# the two processes take up again (each its shard), ending as the run never stopped did.
zrun=("${mpirun[@]}" "$bin" --distributed --zero --batch 6 "${sized[@]}" --dropout 0.1
  --schedule constant)
"${zrun[@]}" --steps 12 --save "$work/whole.safetensors" > /dev/null
"${zrun[@]}" --steps 8 --save "$work/stopped.safetensors" > /dev/null
resumed=$("${zrun[@]}" --steps 12 --resume "$work/stopped.safetensors" \
  --save "$work/resumed.safetensors" | grep '"example"')
check "$(field first_step "$resumed") == 9" "--zero --resume goes on from step 9"
check "$(cmp -s "$work/whole.safetensors" "$work/resumed.safetensors" && echo 1 || echo 0) == 1" \
  "--zero --resume ends with the uninterrupted run's checkpoint bytes"

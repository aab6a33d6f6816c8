#!/usr/bin/env bash
# tests/examples/digits_mlp_distributed_test.sh -- digits_mlp --distributed on two processes under
# mpirun: rank 0 alone prints, one JSON line with "world_size": 2, and the run learns; rank 0
# alone writes --logdir's event file and --export's artifacts, and the exported classifier, built
# into the C program of examples/deploy, classifies as the trained model did; a rank that dies
# ends the job (mpirun's default) instead of leaving the other waiting.
# Usage: digits_mlp_distributed_test.sh DIGITS_MLP MPIRUN SOURCE_DIR SANITIZE(ON|OFF)
set -euo pipefail
bin="$1" source="$3" sanitize="$4"
mpirun=("$2" --allow-run-as-root --oversubscribe -np 2 -x OMP_NUM_THREADS=1)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

source "$(dirname "$0")/checks.sh"

out=$("${mpirun[@]}" "$bin" --distributed --json --steps 400 --batch 32 \
  --logdir "$work/runs" --export "$work/export")
echo "$out"
check "$(grep -c '"example"' <<<"$out") == 1" "one JSON line, from rank 0 alone"
line=$(grep '"example"' <<<"$out")
check "$(field world_size "$line") == 2" "the JSON line says world_size 2"
accuracy=$(field test_accuracy "$line")
check "$accuracy >= 0.85" "two processes at batch 32 learn (accuracy $accuracy)"

events=$(find "$work/runs" -name 'events.out.tfevents.*' -size +0 | wc -l)
check "$events == 1" "one event file, rank 0's ($events)"
for f in libdigits_mlp.so digits_mlp.json libdigits_mlp_train.so; do
  [[ -s "$work/export/$f" ]] || fail "--distributed --export wrote $f"
done
ok "rank 0 exported the classifier and a training step"
# The classifier, in C, against what digits_mlp measured with the JIT.
cflags=$(deploy_cflags "$sanitize" "-O2 -Wall -Wextra -Werror")
make -s -C "$work" -f "$source/examples/deploy/Makefile" DIR="$work/export" CC="${CC:-cc}" \
  CFLAGS="$cflags" classify_digits > "$work/build.log" 2>&1 ||
  { cat "$work/build.log"; fail "classify_digits builds against the export"; }
"$work/classify_digits" "$work/export" "$source/examples/data/digits.csv.gz" > "$work/classify.txt" ||
  { cat "$work/classify.txt"; fail "classify_digits runs"; }
cat "$work/classify.txt"
awk -v jit="$accuracy" \
  '{ for (i = 1; i < NF; i++) if ($i == "accuracy") {
       n++; a = $(i + 1) + 0; if (a - jit > 1e-4 || jit - a > 1e-4) bad = 1 } }
   END { exit !(n == 2 && !bad) }' "$work/classify.txt" ||
  fail "the exported classifier's accuracy is the trained model's ($accuracy)"
ok "the exported classifier classifies as the trained model did"

# Rank 1 is killed mid-run: the job must end, not hang (the limit leaves room on a slow machine).
start=$(date +%s)
status=0
timeout 60 "${mpirun[@]}" bash -c \
  'if [[ $OMPI_COMM_WORLD_RANK == 1 ]]; then (sleep 2; kill -9 $$) & fi; exec "$0" "$@"' \
  "$bin" --distributed --json --steps 100000 --batch 32 >/dev/null 2>&1 || status=$?
elapsed=$(( $(date +%s) - start ))
check "$status != 0 and $status != 124" "a killed rank ends the job with an error (status $status)"
check "$elapsed < 60" "within a minute ($elapsed s)"

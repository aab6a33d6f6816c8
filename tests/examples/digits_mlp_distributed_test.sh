#!/usr/bin/env bash
# tests/examples/digits_mlp_distributed_test.sh -- digits_mlp --distributed on two processes under
# mpirun: rank 0 alone prints, one JSON line with "world_size": 2, and the run learns; a rank
# that dies ends the job (mpirun's default) instead of leaving the other waiting.
# Usage: digits_mlp_distributed_test.sh DIGITS_MLP MPIRUN
set -euo pipefail
bin="$1"
mpirun=("$2" --allow-run-as-root --oversubscribe -np 2 -x OMP_NUM_THREADS=1)

source "$(dirname "$0")/checks.sh"

out=$("${mpirun[@]}" "$bin" --distributed --json --steps 400 --batch 32)
echo "$out"
check "$(grep -c '"example"' <<<"$out") == 1" "one JSON line, from rank 0 alone"
line=$(grep '"example"' <<<"$out")
check "$(field world_size "$line") == 2" "the JSON line says world_size 2"
check "$(field test_accuracy "$line") >= 0.85" "two processes at batch 32 learn (accuracy $(field test_accuracy "$line"))"

# Rank 1 is killed mid-run: the job must end, not hang (the limit leaves room on a slow machine).
start=$(date +%s)
status=0
timeout 60 "${mpirun[@]}" bash -c \
  'if [[ $OMPI_COMM_WORLD_RANK == 1 ]]; then (sleep 2; kill -9 $$) & fi; exec "$0" "$@"' \
  "$bin" --distributed --json --steps 100000 --batch 32 >/dev/null 2>&1 || status=$?
elapsed=$(( $(date +%s) - start ))
check "$status != 0 and $status != 124" "a killed rank ends the job with an error (status $status)"
check "$elapsed < 60" "within a minute ($elapsed s)"

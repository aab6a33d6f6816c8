#!/usr/bin/env bash
# tests/mpi/stalled_rank_test.sh -- a rank that stops joining collectives makes the other fail
# with an mt::Error after dist::set_timeout's limit (1 s), and the job ends rather than hangs.
# Usage: stalled_rank_test.sh STALLED_RANK MPIRUN
set -uo pipefail
start=$(date +%s)
out=$(timeout 60 "$2" --allow-run-as-root --oversubscribe -np 2 -x OMP_NUM_THREADS=1 "$1" 2>&1)
status=$?
elapsed=$(( $(date +%s) - start ))
echo "$out"
if grep -q '^skipped:' <<<"$out"; then exit 0; fi
fail() { echo "FAIL: $1"; exit 1; }
[[ $status != 124 ]] || fail "the job hung"
grep -Eq '^rank 0: mt::Error after (1|2)\.[0-9] s: dist: MPI_Alltoallv waited 1 s' <<<"$out" ||
  fail "rank 0 gave no mt::Error after the 1 s timeout"
grep -q '^rank 0: then: dist: an earlier collective timed out' <<<"$out" ||
  fail "a later collective was not refused"
(( elapsed < 30 )) || fail "the job took $elapsed s to end"
echo "ok: rank 0 failed after the timeout, the job ended in $elapsed s"

#!/usr/bin/env bash
# tests/examples/example_flags_test.sh -- every example's command line (CLI11): --help lists the
# flags and exits 0; an unknown flag, a bad value and a bad pairing each exit 2 with one line on
# stderr that names the problem. Nothing trains.
# Usage: example_flags_test.sh DIGITS_MLP DIGITS_CNN CHAR_GPT LOSS_SCALING_DEMO CUSTOM_POLICY
set -euo pipefail
err=$(mktemp)
trap 'rm -f "$err"' EXIT

fails() {  # fails FRAGMENT COMMAND...: exit status 2, one stderr line holding FRAGMENT
  local fragment=$1
  shift
  local status=0
  "$@" > /dev/null 2> "$err" || status=$?
  if ((status != 2)) || [[ $(wc -l < "$err") != 1 ]] || ! grep -qF -- "$fragment" "$err"; then
    echo "FAIL: '$*' exited $status with: $(cat "$err")"
    exit 1
  fi
  echo "ok: '$*' -> $(cat "$err")"
}

helps() {  # helps FLAG COMMAND...: --help exits 0 and lists FLAG
  local flag=$1
  shift
  if ! "$@" --help | grep -qF -- "$flag"; then
    echo "FAIL: '$* --help' does not list $flag"
    exit 1
  fi
  echo "ok: '$* --help' lists $flag"
}

for bin in "$1" "$2"; do
  for flag in --steps --batch --optimizer --no-shuffle --load --save --export --policy \
    --loss-scale --json --no-compile --logdir --cosine --shift; do
    helps "$flag" "$bin"
  done
  fails "--bogus" "$bin" --bogus
  fails "--steps" "$bin" --steps 0
  fails "--steps" "$bin" --steps many
  fails "--batch" "$bin" --batch 2000
  fails "--optimizer" "$bin" --optimizer adam
  fails "fp8" "$bin" --policy fp8
  fails "static:N" "$bin" --loss-scale static:0
  fails "--logdir" "$bin" --logdir
  fails "static:N" "$bin" --loss-scale static:1e999
  fails "in decimal" "$bin" --steps 010
  fails "in decimal" "$bin" --batch 0x10
  fails "finite" "$bin" --noise inf
  fails "--seed" "$bin" --seed -1
  fails "--seed" "$bin" --seed 18446744073709551616
  for flag in --load --save --export --logdir; do
    fails "empty" "$bin" "$flag" ""
  done
  # A tiny static scale is no normal float (GradScaler's range); a count past int64 was clamped.
  fails "static:N" "$bin" --loss-scale static:1e-40
  fails "below 2^63" "$bin" --steps 99999999999999999999
  # Where the run writes at its end is checked before it trains (a bad one lost the model).
  fails "is not a folder" "$bin" --export "$err/export"
  fails "is not a folder" "$bin" --logdir "$err/log"
  fails "does not exist" "$bin" --save /nonexistent_folder_of_mixtape/x.safetensors
  fails "is a folder" "$bin" --save /tmp
done
for flag in --layers --heads --width --context --prompt --temperature --policy --loss-scale \
  --json --no-compile --export --logdir; do
  helps "$flag" "$3"
done
fails "--width" "$3" --heads 3 --width 32
fails "--warmup" "$3" --steps 10 --warmup 20
fails "--dropout" "$3" --dropout 1
fails "--prompt" "$3" --prompt ""
fails "empty" "$3" --export ""
fails "fp8" "$3" --policy fp8
helps "--growth-interval" "$4"
helps "--logdir" "$4"
fails "steps" "$4" 10
fails "--growth-interval" "$4" --growth-interval 0
fails "400" "$4" 300 400
helps "--steps" "$5"
fails "--steps" "$5" --steps 0
fails "--bogus" "$5" --bogus
echo "example flags: all checks passed"

#!/usr/bin/env bash
# tests/examples/digits_cnn_test.sh -- runs the digits_cnn example (a small ResNet) as a user
# would and checks what it promises: >= 97% test accuracy with its defaults in fp32, autocast
# bf16 and autocast f16 with dynamic loss scaling; the step replayed through mt::compile, batch
# norm's running statistics included (the same run as --no-compile); eval mode reads them. Under
# the sanitizers (second argument ON) one policy trains a shorter cosine schedule (300 steps:
# 95.6% in bf16), as the suite's time allows: the full 3,000-step run took 300 s of a CI core
# there and checks nothing more for the sanitizers.
set -euo pipefail
bin="$1"
sanitized="${2:-OFF}"  # MIXTAPE_SANITIZE: the sanitizer build checks one short run (about 5x slower)
# One thread: the runs' bits (and so the accuracies checked) do not depend on the machine's core
# count, and a loaded CI machine does not stall an OpenMP team on every small kernel (a 2,500-step
# run took 10 s on one thread and 550 s on two cores shared with a compiler).
export OMP_NUM_THREADS=1

source "$(dirname "$0")/checks.sh"

policies=("" "--policy autocast-bf16" "--policy autocast-f16 --loss-scale dynamic")
accuracy=0.97
if [[ "$sanitized" == ON || "$sanitized" == 1 ]]; then
  policies=("--policy autocast-bf16 --steps 300")
  accuracy=0.93
fi
for args in "${policies[@]}"; do
  line=$("$bin" --json $args | tail -n 1)
  echo "$line"
  check "$(field test_accuracy "$line") >= $accuracy" "'$args' reaches >= $accuracy test accuracy"
  check "'$(field example "$line")' == 'digits_cnn'" "the JSON line names the example"
done

compiled=$("$bin" --json --steps 40 | tail -n 1)
traced=$("$bin" --json --steps 40 --no-compile | tail -n 1)
check "'$(field step "$compiled")' == 'compiled' and $(field replayed_steps "$compiled") >= 37" \
  "the step replays through mt::compile, batch norm's running statistics included"
check "$(field final_loss "$compiled") == $(field final_loss "$traced") and \
  $(field test_accuracy "$compiled") == $(field test_accuracy "$traced")" \
  "--no-compile (traced every step) gives the same loss and the same eval-mode accuracy"
echo "digits_cnn: all checks passed"

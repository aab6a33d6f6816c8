#!/usr/bin/env bash
# tests/gpu/run.sh -- on a machine with an NVIDIA GPU: builds mixtape with its CUDA back end (or
# unpacks a bundle made by tools/gpu_bundle.sh), runs the gpu-labelled tests and the GPU
# benchmarks, and writes logs and JSON to OUTDIR: gpu_tests.log, summary.json,
# bench_gpu_gemm.json, bench_gpu_training.jsonl and peer_torch_gpu.jsonl (JSON lines),
# nvidia-smi.txt, and profile_mlp_w64_b65536_bf16.txt (MIXTAPE_LOG=profile: the host's and the
# device's time per step kind). Exits non-zero when a test or a mixtape benchmark fails. The
# benchmarks keep the whole run within about 7.5 minutes after the build: each runs under a
# timeout cut to what is left of that, and is skipped (said in the log) when less than 20 s are
# left (MIXTAPE_GPU_BUDGET_SECONDS sets the budget, the tests' time included; default 450).
# usage: tests/gpu/run.sh OUTDIR        (MIXTAPE_GPU_BUNDLE=path/bundle.tar.xz: use prebuilt)
set -uo pipefail
out=${1:?usage: tests/gpu/run.sh OUTDIR}
mkdir -p "$out"
out=$(cd "$out" && pwd)
cd "$(dirname "$0")/../.."
log="$out/gpu_tests.log"
: > "$log"
nvidia-smi > "$out/nvidia-smi.txt" 2>&1 || echo "nvidia-smi failed" >> "$out/nvidia-smi.txt"

if [[ -n "${MIXTAPE_GPU_BUNDLE:-}" ]]; then
  bundle=$(mktemp -d)
  tar -C "$bundle" -xJf "$MIXTAPE_GPU_BUNDLE"
  bin="$bundle/bin"
  export LD_LIBRARY_PATH="$bundle/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  # AOT exports link the bundle's runtime archive (the build tree's path is not there) and its
  # libraries (the target may lack oneDNN's and fmt's).
  [[ -f "$bundle/lib/libmixtape_runtime.a" ]] &&
    export MIXTAPE_RUNTIME_ARCHIVE="$bundle/lib/libmixtape_runtime.a"
  export LIBRARY_PATH="$bundle/lib${LIBRARY_PATH:+:$LIBRARY_PATH}"
  # The target's C++ runtime is used unless it is older than the one the binaries were built with.
  if ! "$bin/test_gpu_runtime" --gtest_list_tests > /dev/null 2>&1; then
    export LD_LIBRARY_PATH="$bundle/lib/compat:$LD_LIBRARY_PATH"
  fi
else
  bin=build-gpu
  cmake -S . -B "$bin" -DCMAKE_BUILD_TYPE=Release -DMIXTAPE_BUILD_TESTS=ON >> "$log" 2>&1 &&
    cmake --build "$bin" -j"$(nproc)" >> "$log" 2>&1 || { echo "build failed, see $log"; exit 1; }
fi
export MIXTAPE_CACHE_DIR="$(mktemp -d)" OMP_WAIT_POLICY=passive
SECONDS=0  # the time budget below starts after the build

status=0
summary=()
# test_compile and test_memory_report run on the default device, cuda here: mt::compile's
# replay and the planned peak of the CUDA programs.
for test in "$bin"/test_gpu_* "$bin"/test_nvrtc "$bin"/test_compile "$bin"/test_memory_report; do
  [[ -x "$test" ]] || continue
  name=$(basename "$test")
  echo "=== $name" | tee -a "$log"
  start=$(date +%s%N)
  timeout 300 "$test" --gtest_output="json:$out/.$name.json" >> "$log" 2>&1
  rc=$?
  milliseconds=$((($(date +%s%N) - start) / 1000000))
  tail -n 3 "$log"
  ((rc != 0)) && status=1
  summary+=("{\"test\":\"$name\",\"exit\":$rc,\"milliseconds\":$milliseconds}")
done
# `timeout` for a benchmark: its own limit, cut to what is left of the budget (0: skip it).
budget_seconds=${MIXTAPE_GPU_BUDGET_SECONDS:-450}
limit() {
  local left=$((budget_seconds - SECONDS))
  ((left < 20)) && left=0
  echo $(($1 < left ? $1 : left))
}
# run_bench LIMIT OUTFILE PROGRAM ARGS...: appends the program's JSON to OUTFILE.
run_bench() {
  local seconds file=$2 label="$(basename "$3") ${*:4}"
  seconds=$(limit "$1")
  shift 2
  echo "=== $label" | tee -a "$log"
  if ((seconds == 0)); then
    echo "$label skipped: out of time" | tee -a "$log"
    return 0
  fi
  timeout "$seconds" "$@" >> "$file" 2>> "$log" || { echo "$label failed" | tee -a "$log"; return 1; }
}
for bench in "$bin"/bench_gpu_*; do
  [[ -x "$bench" && $(basename "$bench") != bench_gpu_training ]] || continue
  name=$(basename "$bench")
  : > "$out/$name.json"
  run_bench 300 "$out/$name.json" "$bench" || status=1
  cat "$out/$name.json"
done
# bench_gpu_training: the MLPs at batch 65536 traced and through mt::compile (0.5 s windows, a
# few seconds per configuration), then GPT-2 small (batch 8, context 1024) through mt::compile
# once per precision: 3 warm-up steps (the first compiles every kernel), three 1 s windows, fewer
# when a step is slow (--budget-seconds).
training="$bin/bench_gpu_training"
if [[ -x "$training" ]]; then
  file="$out/bench_gpu_training.jsonl"
  : > "$file"
  mlp=(--workloads mlp_w64_b65536,mlp_w128_b65536 --warmup 3 --windows 3 --window-seconds 0.5
    --budget-seconds 5)
  for step in traced compiled; do
    run_bench 90 "$file" "$training" "${mlp[@]}" --step "$step" || status=1
  done
  # Where the tiny MLP's compiled bf16 step spends its time, on the host and on the device.
  seconds=$(limit 30)
  if ((seconds > 0)); then
    echo "=== profile of mlp_w64_b65536 bf16 (profile_mlp_w64_b65536_bf16.txt)" | tee -a "$log"
    MIXTAPE_LOG=profile timeout "$seconds" "$training" --workloads mlp_w64_b65536 \
      --precisions bf16 --step compiled --warmup 3 --windows 1 --window-seconds 0.5 \
      > /dev/null 2> "$out/profile_mlp_w64_b65536_bf16.txt" || echo "profile run failed" | tee -a "$log"
  fi
  # ResNet-50 (batch 128, 224x224) under autocast-bf16 through mt::compile: its convolutions on
  # cuDNN (issue 15's GPU target: images/s against PyTorch AMP with channels_last, below).
  run_bench 120 "$file" "$training" --workloads resnet50 --precisions bf16 --step compiled \
    --warmup 3 --windows 2 --window-seconds 1 --budget-seconds 15 || status=1
  for precision in fp32 bf16; do
    run_bench 150 "$file" "$training" --workloads gpt2_small --precisions "$precision" \
      --step compiled --warmup 3 --windows 3 --window-seconds 1 --budget-seconds 15 || status=1
  done
  cat "$file"
fi
# PyTorch on the same workloads, where torch has CUDA: AMP eager and torch.compile for the MLPs;
# ResNet-50 eager bf16 (channels_last); for GPT-2 small eager fp32 and bf16, and torch.compile
# bf16 (compiling takes about a minute).
if python3 -c "import torch" > /dev/null 2>&1; then
  file="$out/peer_torch_gpu.jsonl"
  : > "$file"
  run_bench 150 "$file" python3 bench/peer_torch_gpu.py --workloads mlp_w64_b65536,mlp_w128_b65536 \
    --seconds 1.5
  run_bench 60 "$file" python3 bench/peer_torch_gpu.py --workloads resnet50 --modes eager \
    --precisions bf16 --seconds 3
  run_bench 90 "$file" python3 bench/peer_torch_gpu.py --workloads gpt2_small --modes eager \
    --seconds 3
  run_bench 150 "$file" python3 bench/peer_torch_gpu.py --workloads gpt2_small --modes compile \
    --precisions bf16 --seconds 3
  cat "$file"
fi
# One summary: each binary's exit code and time, and every failed test case by name.
python3 - "$out" "${summary[@]}" > "$out/summary.json" <<'PY'
import glob, json, os, sys
out, runs = sys.argv[1], [json.loads(s) for s in sys.argv[2:]]
for run in runs:
    path = os.path.join(out, "." + run["test"] + ".json")
    if os.path.exists(path):
        report = json.load(open(path))
        run["tests"], run["failures"] = report.get("tests"), report.get("failures")
        run["failed"] = [f"{s['name']}.{t['name']}" for s in report.get("testsuites", [])
                         for t in s.get("testsuite", []) if t.get("failures")]
        run["skipped"] = [f"{s['name']}.{t['name']}" for s in report.get("testsuites", [])
                          for t in s.get("testsuite", []) if t.get("result") == "SKIPPED"]
        os.remove(path)
print(json.dumps(runs, indent=1))
PY
cat "$out/summary.json"
exit $status

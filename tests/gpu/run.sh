#!/usr/bin/env bash
# tests/gpu/run.sh -- on a machine with an NVIDIA GPU: builds mixtape with its CUDA back end (or
# unpacks a bundle made by tools/gpu_bundle.sh), runs the gpu-labelled tests and the GPU
# benchmarks, and writes logs and JSON to OUTDIR: gpu_tests.log, summary.json, bench_*.json,
# nvidia-smi.txt. Exits non-zero when a test fails.
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

status=0
summary=()
for test in "$bin"/test_gpu_* "$bin"/test_nvrtc; do
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
for bench in "$bin"/bench_gpu_*; do
  [[ -x "$bench" ]] || continue
  name=$(basename "$bench")
  echo "=== $name" | tee -a "$log"
  timeout 300 "$bench" > "$out/$name.json" 2>> "$log" || { echo "$name failed" | tee -a "$log"; status=1; }
  cat "$out/$name.json"
done
# PyTorch's AMP eager and torch.compile steps on the same workload, where torch has CUDA.
if python3 -c "import torch" > /dev/null 2>&1; then
  echo "=== peer_torch_gpu" | tee -a "$log"
  timeout 300 python3 bench/peer_torch_gpu.py > "$out/peer_torch_gpu.json" 2>> "$log" ||
    echo "peer_torch_gpu failed" | tee -a "$log"
  cat "$out/peer_torch_gpu.json"
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

# bench/peer_deploy.py -- the deployment benchmark's peers: PyTorch eager, TorchScript and ONNX
# Runtime running the twins of bench_deploy's models with its weights.
"""Reads DIR/<model>_weights.safetensors and DIR/<model>_reference.safetensors, which bench_deploy
writes, into the PyTorch twins of peer_torch.py (the digits MLP as nn.Sequential, CharGpt), checks
the twin's output against mixtape's on the reference input, and prints one JSON line per system.

  --system torch   eager (torch.inference_mode) and TorchScript (torch.jit.trace, one trace per
                   batch size), at --threads (torch.set_num_threads)
  --system export  writes DIR/<model>.onnx from the twin with torch.onnx.export (dynamic batch)
  --system ort     ONNX Runtime on DIR/<model>.onnx (intra-op threads = --threads); does not
                   import torch, so its peak RSS is ONNX Runtime's own

Run under a python that has torch, safetensors and onnxruntime: bench/.venv-deploy, which
bench/setup_peers.sh makes on Debian's python3 with --system-site-packages (Debian's torch). The
timing rules are bench/deploy_driver.c's: batch 1 timed call by call for --latency-seconds (at least
50 calls; median, p10, p90), batch --max-batch as the median rows/s of --windows windows of about
--window-seconds. Peak RSS is the process's VmHWM.
"""

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np
from safetensors.numpy import load_file as load_numpy

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, BENCH_DIR)

VOCAB, CONTEXT = 110, 64  # bench_deploy's char_gpt: fortunes.txt's bytes, context 64


def emit(record):
    print(json.dumps(record), flush=True)


def peak_rss_kb():
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    return None


def make_input(model, batch, seed):
    """Pixels in [0, 1) (f32) or tokens in [0, VOCAB) (i64), as numpy."""
    rng = np.random.default_rng(seed)
    if model == "digits_mlp":
        return rng.random((batch, 64), dtype=np.float32)
    return rng.integers(0, VOCAB, size=(batch, CONTEXT), dtype=np.int64)


def time_calls(call, args):
    """deploy_driver.c's timing: batch 1 call by call, then batch max in windows."""
    for _ in range(20):
        call(1)
    times = []
    began = time.perf_counter()
    while len(times) < 50 or time.perf_counter() - began < args.latency_seconds:
        t0 = time.perf_counter()
        call(1)
        times.append(time.perf_counter() - t0)
    times.sort()
    n = len(times)
    warm = 0.0
    for _ in range(3):
        t0 = time.perf_counter()
        call(args.max_batch)
        warm = time.perf_counter() - t0
    per_window = max(1, round(args.window_seconds / max(warm, 1e-9)))
    rates = []
    for _ in range(args.windows):
        t0 = time.perf_counter()
        for _ in range(per_window):
            call(args.max_batch)
        rates.append(per_window * args.max_batch / (time.perf_counter() - t0))
    rows_per_s = statistics.median(rates)
    return {"batch1_calls": n, "batch1_latency_us": 1e6 * times[n // 2],
            "batch1_p10_us": 1e6 * times[n // 10], "batch1_p90_us": 1e6 * times[n * 9 // 10],
            "max_batch": args.max_batch, "calls_per_window": per_window, "windows": args.windows,
            "batch_max_rows_per_s": rows_per_s,
            "batch_max_ms_per_call": 1e3 * args.max_batch / rows_per_s}


def twin(model, directory):
    """The PyTorch twin with bench_deploy's weights (mixtape's names mapped onto the twin's)."""
    import torch
    import peer_torch
    weights = load_numpy(os.path.join(directory, f"{model}_weights.safetensors"))
    if model == "digits_mlp":
        net = peer_torch.mlp([64, 128, 128, 10])
        rename = {"fc1.": "0.", "fc2.": "2.", "fc3.": "4."}
    else:
        net = peer_torch.CharGpt(VOCAB, 4, 4, 128, CONTEXT)
        rename = {".attn.qkv.": ".qkv.", ".attn.proj.": ".proj.", ".mlp.fc1.": ".fc1.",
                  ".mlp.fc2.": ".fc2."}
    state = {}
    for name, value in weights.items():
        for old, new in rename.items():
            name = name.replace(old, new, 1)
        state[name] = torch.from_numpy(value.copy())
    missing, unexpected = net.load_state_dict(state, strict=False)
    if unexpected or [m for m in missing if m != "mask"]:
        sys.exit(f"peer_deploy: {model}: weights do not fit the twin: missing {missing}, "
                 f"unexpected {unexpected}")
    net.eval()
    return net


def reference(model, directory):
    tensors = load_numpy(os.path.join(directory, f"{model}_reference.safetensors"))
    return tensors["x"], tensors["logits"]


def max_diff(a, b):
    return float(np.max(np.abs(np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64))))


def run_torch(model, args):
    import torch
    torch.set_num_threads(args.threads)
    net = twin(model, args.dir)
    x_ref, logits_ref = reference(model, args.dir)
    inputs = {1: torch.from_numpy(make_input(model, 1, 1)),
              args.max_batch: torch.from_numpy(make_input(model, args.max_batch, 2))}
    with torch.inference_mode():
        diff = max_diff(net(torch.from_numpy(x_ref)).numpy(), logits_ref)
        record = {"system": "torch_eager", "model": model, "threads": args.threads,
                  "version": torch.__version__, "max_abs_diff_vs_mixtape": diff}
        record.update(time_calls(lambda batch: net(inputs[batch]), args))
        emit(record)
        traced = {batch: torch.jit.trace(net, (x,)) for batch, x in inputs.items()}
        traced_ref = torch.jit.trace(net, (torch.from_numpy(x_ref),))
        diff = max_diff(traced_ref(torch.from_numpy(x_ref)).numpy(), logits_ref)
        record = {"system": "torchscript", "model": model, "threads": args.threads,
                  "version": torch.__version__, "max_abs_diff_vs_mixtape": diff}
        record.update(time_calls(lambda batch: traced[batch](inputs[batch]), args))
        record["peak_rss_kb"] = peak_rss_kb()  # of the process that ran eager and TorchScript
        emit(record)


def export_onnx(model, args):
    import torch
    net = twin(model, args.dir)
    example = torch.from_numpy(make_input(model, 2, 3))
    path = os.path.join(args.dir, f"{model}.onnx")
    with torch.no_grad():
        torch.onnx.export(net, (example,), path, input_names=["x"], output_names=["logits"],
                          dynamic_axes={"x": {0: "batch"}, "logits": {0: "batch"}},
                          opset_version=args.opset)
    emit({"system": "onnx_export", "model": model, "torch_version": torch.__version__,
          "opset": args.opset, "bytes": os.path.getsize(path)})


def run_ort(model, args):
    import onnxruntime as ort
    path = os.path.join(args.dir, f"{model}.onnx")
    options = ort.SessionOptions()
    options.intra_op_num_threads = args.threads
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    inputs = {1: make_input(model, 1, 1), args.max_batch: make_input(model, args.max_batch, 2)}
    start = time.perf_counter()
    session = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
    opened = time.perf_counter()
    session.run(None, {"x": inputs[1]})
    first = time.perf_counter()
    x_ref, logits_ref = reference(model, args.dir)
    diff = max_diff(session.run(None, {"x": x_ref})[0], logits_ref)
    record = {"system": "onnxruntime", "model": model, "threads": args.threads,
              "version": ort.__version__, "max_abs_diff_vs_mixtape": diff,
              "open_ms": 1e3 * (opened - start), "open_to_first_result_ms": 1e3 * (first - start)}
    record.update(time_calls(lambda batch: session.run(None, {"x": inputs[batch]}), args))
    record["peak_rss_kb"] = peak_rss_kb()
    emit(record)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--system", required=True, choices=("torch", "export", "ort"))
    parser.add_argument("--dir", required=True, help="bench_deploy's --dir")
    parser.add_argument("--models", default="digits_mlp,char_gpt")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--max-batch", type=int, default=256)
    parser.add_argument("--latency-seconds", type=float, default=1.0)
    parser.add_argument("--window-seconds", type=float, default=0.5)
    parser.add_argument("--windows", type=int, default=5)
    parser.add_argument("--opset", type=int, default=17)
    args = parser.parse_args()
    run = {"torch": run_torch, "export": export_onnx, "ort": run_ort}[args.system]
    for model in [m for m in args.models.split(",") if m]:
        run(model, args)


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
# bench/peer_torch_gpu.py -- the peer of bench_gpu_training: the same MLP steps in PyTorch on the
# GPU, AMP eager (autocast bf16) and fp32, eager and under torch.compile; one JSON object.
"""Runs where PyTorch with CUDA is installed (tests/gpu/run.sh calls it when `python3 -c
"import torch"` works there). MLP 32 -> width x4 (ReLU) -> 16, MSE, Adam 1e-3, batch 65536, data
on the GPU; steps are queued and the clock stops after torch.cuda.synchronize()."""

import json
import sys
import time

SECONDS = 2.0
BATCH = 65536


def run(torch, width, precision, compiled):
    torch.manual_seed(0)
    layers = []
    sizes = [32, width, width, width, width, 16]
    for i in range(len(sizes) - 1):
        layers.append(torch.nn.Linear(sizes[i], sizes[i + 1]))
        if i + 2 < len(sizes):
            layers.append(torch.nn.ReLU())
    net = torch.nn.Sequential(*layers).cuda()
    optimizer = torch.optim.Adam(net.parameters(), lr=1e-3)
    x = torch.randn(BATCH, 32, device="cuda")
    y = torch.randn(BATCH, 16, device="cuda")

    def step():
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=precision == "bf16"):
            loss = torch.nn.functional.mse_loss(net(x).float(), y)
        loss.backward()
        optimizer.step()
        return loss

    if compiled:
        step = torch.compile(step)
    start = time.perf_counter()
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    warmup = time.perf_counter() - start
    steps, start = 0, time.perf_counter()
    while time.perf_counter() - start < SECONDS:
        for _ in range(20):
            step()
        steps += 20
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    return {"width": width, "batch": BATCH, "precision": precision,
            "mode": "torch.compile" if compiled else "eager", "steps_per_s": steps / seconds,
            "ms_per_step": 1e3 * seconds / steps, "warmup_seconds": warmup}


def main():
    try:
        import torch
    except ImportError as e:
        print(json.dumps({"skipped": f"no torch: {e}"}))
        return 0
    if not torch.cuda.is_available():
        print(json.dumps({"skipped": "torch has no CUDA device"}))
        return 0
    results = []
    for compiled in (False, True):
        for width in (64, 128):
            for precision in ("fp32", "bf16"):
                try:
                    results.append(run(torch, width, precision, compiled))
                except Exception as e:  # torch.compile needs a working Triton toolchain
                    results.append({"width": width, "precision": precision,
                                    "mode": "torch.compile" if compiled else "eager",
                                    "error": str(e).splitlines()[0][:300]})
                # Each result as it comes, so that a run cut short keeps what it measured.
                print(json.dumps(results[-1]), file=sys.stderr, flush=True)
    print(json.dumps({"benchmark": "peer_torch_gpu", "torch": torch.__version__,
                      "device": torch.cuda.get_device_name(), "results": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

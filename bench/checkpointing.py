# bench/checkpointing.py -- what activation checkpointing of every char-GPT block costs in step
# time, mixtape (bench_checkpointing) against PyTorch (torch.utils.checkpoint) in the same run.
"""Usage: /usr/bin/python3 bench/checkpointing.py [--build-dir build] [--policy fp32|bf16]
                                                 [--windows 7] [--threads 2]

Builds nothing: build bench_checkpointing first. Prints one JSON line: per system the CPU time
per training step (median of interleaved windows) with and without checkpointing, and their
ratio; for mixtape also the stored-values peak and the measured process peak of one step. The
PyTorch peer is peer_torch.py's CharGpt with each block called through
torch.utils.checkpoint.checkpoint (use_reentrant=False), the same model, data and AdamW step.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import peer_torch  # noqa: E402

import torch  # noqa: E402
import torch.utils.checkpoint  # noqa: E402


def checkpointed(model):
    """The model's forward with every block recomputed in backward."""
    def forward(tokens):
        time_steps = tokens.shape[1]
        x = model.token_embedding(tokens) + model.position_embedding(torch.arange(time_steps))
        mask = model.mask[:time_steps, :time_steps]
        for block in model.blocks:
            x = torch.utils.checkpoint.checkpoint(block, x, mask, use_reentrant=False)
        return model.head(model.ln_f(x))
    return forward


def torch_ratio(precision, windows, per_window):
    steps = {"plain": peer_torch.gpt_step(precision)[0],
             "checkpoint": peer_torch.gpt_step(precision, wrap=checkpointed)[0]}
    for step in steps.values():
        for _ in range(3):
            step()
    cpu = {name: [] for name in steps}
    for _ in range(windows):
        for name, step in steps.items():
            start = time.process_time()
            for _ in range(per_window):
                step()
            cpu[name].append((time.process_time() - start) / per_window)
    result = {name: {"cpu_ms_per_step": statistics.median(v) * 1e3} for name, v in cpu.items()}
    result["cpu_time_ratio"] = (statistics.median(cpu["checkpoint"]) /
                                statistics.median(cpu["plain"]))
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--build-dir", default="build")
    parser.add_argument("--policy", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument("--windows", type=int, default=7)
    parser.add_argument("--steps-per-window", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2, help="PyTorch's intra-op threads")
    args = parser.parse_args()
    load_before = os.getloadavg()[0]
    policy = "fp32" if args.policy == "fp32" else "autocast-bf16"
    ours = subprocess.run(
        [os.path.join(args.build_dir, "bench_checkpointing"), "--policy", policy,
         "--windows", str(args.windows), "--steps-per-window", str(args.steps_per_window)],
        check=True, capture_output=True, text=True)
    torch.set_num_threads(args.threads)
    peer = torch_ratio(args.policy, args.windows, args.steps_per_window)
    peer.update({"system": "torch", "version": torch.__version__, "threads": args.threads})
    print(json.dumps({"bench": "checkpointing", "policy": args.policy,
                      "mixtape": json.loads(ours.stdout.strip().splitlines()[-1]), "torch": peer,
                      "load_average": [load_before, os.getloadavg()[0]]}))


if __name__ == "__main__":
    main()

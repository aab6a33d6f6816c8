# bench/memory.py -- the memory table: measured peak bytes, tokens/s and the largest batch in a
# budget of one GPT-2-small-shaped training step, mixtape (bench_memory) against PyTorch eager.
"""Usage: /usr/bin/python3 bench/memory.py [--build-dir build] [--contexts 1024,2048]
                                          [--layers 2] [--vocab 8192] [--budget-gib 2]
                                          [--search] [--markdown] [--out memory.json]

Builds nothing: build bench_memory first. Where --rows is given, each configuration's row is
appended there as it completes; --table ROWS... prints the table of such files. The model is GPT-2 small's block (width 768, 12
heads, 4x GELU MLP, pre-norm) with fewer layers and a smaller vocabulary (both stated in the
output), trained one AdamW step at a time (gradient norm clipped at 1) on random tokens, no
dropout. Every configuration and batch runs in a fresh process: a warm-up step, then
--timed-steps timed ones (mixtape's steady peak needs the second step: AdamW's state exists
from the first step's update on):
- mixtape: peak_bytes is execution_stats().memory_peak_bytes over the batch's steps (the host
  allocator's high-water mark: parameters, gradients, AdamW state, activations, workspace);
- both: rss_growth_bytes is the growth of the process's resident high-water mark (ru_maxrss)
  from before the model is built, the only peak PyTorch offers on the CPU (no allocator
  high-water mark there); it also counts the allocator's caching, JIT code and libraries'
  buffers, so it is an upper bound of what the step needed.
The largest batch within the budget is extrapolated from the two largest measured batches:
floor((budget - a) / b) for peak = a + b * batch. It is a first guess to probe, not a measurement:
at small batches the AdamW update's floor (weights, gradients, moments and their new values)
can hide the activations' growth, and the guess then runs high (measure the guessed batch with
bench_memory --batches N). With --search the largest batch is also measured: from that guess,
one fresh process a batch, up while it fits and then by bisection (mixtape: peak_bytes; PyTorch:
rss_growth_bytes), each probed batch's bytes kept in the row. tokens/s are of the timed steps at
the smallest batch, CPU time and wall.
"""

import argparse
import contextlib
import json
import math
import os
import resource
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from peer_torch_gpu import gpt2_model  # noqa: E402
import run  # noqa: E402  (torch_env: OpenBLAS for Debian's torch, as the training bench)

GIB = 1 << 30
WIDTH, HEADS = 768, 12

# (name, mixtape flags) and (name, torch flags); the names are the table's rows.
MIXTAPE_CONFIGS = [
    ("fp32", ["--policy", "fp32", "--attention", "composite", "--checkpoint", "0"]),
    ("autocast-bf16", ["--policy", "autocast-bf16", "--attention", "composite", "--checkpoint", "0"]),
    ("bf16 + checkpointing", ["--policy", "autocast-bf16", "--attention", "composite",
                              "--checkpoint", "1"]),
    ("bf16 + checkpointing + fused attention", ["--policy", "autocast-bf16", "--attention",
                                                "fused", "--checkpoint", "1"]),
    ("bf16 + fused attention", ["--policy", "autocast-bf16", "--attention", "fused",
                                "--checkpoint", "0"]),
    ("fp32 + bf16 saved copies", ["--policy", "fp32", "--attention", "composite",
                                  "--checkpoint", "0", "--save-activations", "bf16"]),
]
TORCH_CONFIGS = [
    ("fp32", ["--precision", "fp32", "--checkpoint", "0"]),
    ("autocast-bf16", ["--precision", "bf16", "--checkpoint", "0"]),
    ("bf16 + checkpointing", ["--precision", "bf16", "--checkpoint", "1"]),
]


def max_rss_bytes():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def torch_peer(args):
    """One configuration of the PyTorch peer in this (fresh) process: JSON lines per batch."""
    rss_before = max_rss_bytes()
    import torch
    import torch.nn.functional as F
    import torch.utils.checkpoint
    torch.set_num_threads(args.threads)
    torch.manual_seed(1234)

    # GPT-2 small's block, as the GPU peer builds it (torch 1.13 has no
    # F.scaled_dot_product_attention: the [T, T] scores are materialized).
    model = gpt2_model(torch, args.layers, args.context, args.vocab, HEADS, WIDTH)

    def loss_of(tokens, targets):
        x = model.token_embedding(tokens) + model.position_embedding(torch.arange(tokens.shape[1]))
        for block in model.blocks:
            x = (torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
                 if args.checkpoint else block(x))
        logits = model.head(model.ln_f(x))
        return F.cross_entropy(logits.float().view(-1, args.vocab), targets.view(-1))

    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
    cast = (torch.autocast("cpu", dtype=torch.bfloat16) if args.precision == "bf16"
            else contextlib.nullcontext())

    def step(inputs, targets):
        optimizer.zero_grad(set_to_none=True)
        with cast:
            loss = loss_of(inputs, targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        return loss.item()

    for batch in args.batches:
        inputs = torch.randint(0, args.vocab, (batch, args.context))
        targets = torch.randint(0, args.vocab, (batch, args.context))
        loss = step(inputs, targets)
        record = {"bench": "memory", "system": "torch", "version": torch.__version__,
                  "threads": args.threads, "precision": args.precision,
                  "checkpoint": bool(args.checkpoint), "context": args.context,
                  "layers": args.layers, "vocab": args.vocab, "batch": batch}
        if args.timed_steps > 0 and batch == args.batches[0]:  # as bench_memory: the first only
            cpu, wall = [], []
            for _ in range(args.timed_steps):
                start_cpu, start_wall = time.process_time(), time.perf_counter()
                loss = step(inputs, targets)
                cpu.append(time.process_time() - start_cpu)
                wall.append(time.perf_counter() - start_wall)
            cpu_s, wall_s = sorted(cpu)[len(cpu) // 2], sorted(wall)[len(wall) // 2]
            record.update({"cpu_s_per_step": cpu_s, "wall_s_per_step": wall_s,
                           "tokens_per_cpu_s": batch * args.context / cpu_s,
                           "tokens_per_s": batch * args.context / wall_s})
        record.update({"loss": loss, "rss_growth_bytes": max_rss_bytes() - rss_before})
        print(json.dumps(record), flush=True)


def run_lines(command, env=None):
    result = subprocess.run(command, check=True, capture_output=True, text=True, env=env)
    return [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]


def largest_batch(records, key, budget):
    """floor((budget - a) / b) for the line through the two largest batches' `key` (None with
    fewer than two batches or no growth)."""
    if len(records) < 2:
        return None
    (b1, p1), (b2, p2) = [(r["batch"], r[key]) for r in records[-2:]]
    slope = (p2 - p1) / (b2 - b1)
    if slope <= 0:
        return None
    return max(0, math.floor(b2 + (budget - p2) / slope))


def measured_largest_batch(probe, guess, budget):
    """The largest batch whose bytes, probe(batch), stay within the budget (0 where batch 1 does
    not), and {batch: bytes} of the batches probed: from the guess up in steps of a quarter while
    it fits, then bisecting between the largest batch that fit and the smallest that did not."""
    probed = {}

    def fits(batch):
        if batch not in probed:
            probed[batch] = probe(batch)
        return probed[batch] <= budget

    fit, too_large = 0, None
    batch = max(1, guess or 1)
    while too_large is None or too_large - fit > 1:
        if fits(batch):
            fit = batch
        else:
            too_large = batch
        batch = fit + max(1, fit // 4) if too_large is None else (fit + too_large) // 2
    return fit, probed


def summarize(name, system, records, budget):
    first = records[0]
    row = {"config": name, "system": system, "context": first["context"],
           "peak_bytes": {r["batch"]: r.get("peak_bytes") for r in records},
           "rss_growth_bytes": {r["batch"]: r["rss_growth_bytes"] for r in records},
           "tokens_per_cpu_s": first.get("tokens_per_cpu_s"),
           "tokens_per_s": first.get("tokens_per_s"),
           "largest_batch_rss": largest_batch(records, "rss_growth_bytes", budget)}
    if system == "mixtape":
        row["largest_batch_peak"] = largest_batch(records, "peak_bytes", budget)
    row["records"] = records
    return row


def gib(value):
    return "-" if value is None else f"{value / GIB:.2f}"


def markdown(result):
    batches = result["batches"]
    head = (["context", "configuration", "system"] +
            [f"peak GiB (B={b})" for b in batches] + [f"RSS GiB (B={b})" for b in batches] +
            ["tokens/CPU-s (B=1)",
             f"batch in {result['budget_gib']:g} GiB, extrapolated (peak; RSS)",
             f"batch in {result['budget_gib']:g} GiB, measured (mixtape: peak; PyTorch: RSS)"])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in result["rows"]:
        peak = [gib(row["peak_bytes"].get(b)) for b in batches]
        rss = [gib(row["rss_growth_bytes"].get(b)) for b in batches]
        tokens = row["tokens_per_cpu_s"]
        largest = "; ".join("-" if row.get(key) is None else str(row[key])
                            for key in ("largest_batch_peak", "largest_batch_rss"))
        measured = row.get("largest_batch_measured")
        lines.append("| " + " | ".join(
            [str(row["context"]), row["config"], row["system"]] + peak + rss +
            ["-" if tokens is None else f"{tokens:.0f}", largest,
             "-" if measured is None else str(measured)]) + " |")
    return "\n".join(lines)


def targets(result):
    """The issue's targets from the measured rows, per context, where both sides were measured."""
    found = []
    for context in result["contexts"]:
        rows = {(r["system"], r["config"]): r for r in result["rows"] if r["context"] == context}
        ours_fp32, ours_bf16 = rows.get(("mixtape", "fp32")), rows.get(("mixtape", "autocast-bf16"))
        torch_amp, torch_fp32 = rows.get(("torch", "autocast-bf16")), rows.get(("torch", "fp32"))
        best = rows.get(("mixtape", "bf16 + checkpointing + fused attention"))
        target = {"context": context}
        if ours_fp32 and ours_bf16:
            target["bf16_over_fp32_peak"] = {
                b: ours_bf16["peak_bytes"][b] / ours_fp32["peak_bytes"][b]
                for b in ours_bf16["peak_bytes"] if b in ours_fp32["peak_bytes"]}
        if ours_bf16 and torch_amp:
            target["bf16_rss_over_torch_amp_rss"] = {
                b: ours_bf16["rss_growth_bytes"][b] / torch_amp["rss_growth_bytes"][b]
                for b in torch_amp["rss_growth_bytes"] if b in ours_bf16["rss_growth_bytes"]}
            target["bf16_peak_over_torch_amp_rss"] = {
                b: ours_bf16["peak_bytes"][b] / torch_amp["rss_growth_bytes"][b]
                for b in torch_amp["rss_growth_bytes"] if b in ours_bf16["peak_bytes"]}
        if best and torch_fp32:
            target["largest_batch"] = {
                "ckpt_fused_peak": best["largest_batch_peak"],
                "ckpt_fused_rss": best["largest_batch_rss"],
                "torch_fp32_rss": torch_fp32["largest_batch_rss"]}
            if "largest_batch_measured" in best and "largest_batch_measured" in torch_fp32:
                target["largest_batch_measured"] = {
                    "ckpt_fused_peak": best["largest_batch_measured"],
                    "torch_fp32_rss": torch_fp32["largest_batch_measured"]}
        found.append(target)
    return found


def run_configs(args, budget):
    """Runs the selected configurations, each in a fresh process; appends each summary row to
    --rows as it completes (a long run keeps what it measured) and returns them."""
    notes = []
    torch_env = run.torch_env(notes)
    for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        torch_env[name] = str(args.threads)
    common = ["--layers", str(args.layers), "--vocab", str(args.vocab),
              "--timed-steps", str(args.timed_steps)]
    selected = set(args.configs.split(",")) if args.configs else None
    rows = []
    for context in (int(c) for c in args.contexts.split(",")):
        runs = []
        if "mixtape" in args.systems:
            runs += [(name, "mixtape", [os.path.join(args.build_dir, "bench_memory"), *flags],
                      None) for name, flags in MIXTAPE_CONFIGS]
        if "torch" in args.systems:
            runs += [(name, "torch", [sys.executable, os.path.abspath(__file__), "--peer",
                                      *flags, "--threads", str(args.threads)], torch_env)
                     for name, flags in TORCH_CONFIGS]
        for name, system, command, env in runs:
            if selected and name not in selected:
                continue
            load = os.getloadavg()[0]
            # A process per batch: mixtape's allocator keeps freed blocks for reuse, so a larger
            # batch after a smaller one would add the smaller one's cache to the resident mark.
            records = [record for batch in args.batches for record in run_lines(
                command + ["--context", str(context), "--batches", str(batch), *common], env)]
            row = summarize(name, system, records, budget)
            if args.search:
                key = "peak_bytes" if system == "mixtape" else "rss_growth_bytes"
                guess = row.get("largest_batch_peak") if system == "mixtape" else \
                    row["largest_batch_rss"]

                def probe(batch):
                    [record] = run_lines(command + ["--context", str(context), "--batches",
                                                    str(batch), *common], env)
                    return record[key]

                row["largest_batch_measured"], probes = measured_largest_batch(probe, guess, budget)
                row["largest_batch_probes"] = {str(b): v for b, v in sorted(probes.items())}
            row["load_average"] = [load, os.getloadavg()[0]]
            row["notes"] = notes if system == "torch" else []
            rows.append(row)
            if args.rows:
                with open(args.rows, "a") as out:
                    out.write(json.dumps(row) + "\n")
            print(f"# {context} {system} {name}: done", file=sys.stderr, flush=True)
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--build-dir", default="build")
    parser.add_argument("--contexts", default="1024,2048")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--batches", default="1,2")
    parser.add_argument("--timed-steps", type=int, default=1)
    parser.add_argument("--budget-gib", type=float, default=2.0)
    parser.add_argument("--search", action="store_true",
                        help="also measure the largest batch within the budget (a process a batch)")
    parser.add_argument("--threads", type=int, default=2, help="PyTorch's intra-op threads")
    parser.add_argument("--systems", default="mixtape,torch")
    parser.add_argument("--configs", help="comma-separated configuration names (default: all)")
    parser.add_argument("--rows", help="append each configuration's row here (JSON lines)")
    parser.add_argument("--table", nargs="+", metavar="ROWS",
                        help="measure nothing: the table and targets of these --rows files")
    parser.add_argument("--markdown", action="store_true")
    # The peer's own process (the driver starts it once per configuration).
    parser.add_argument("--peer", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--context", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--precision", choices=["fp32", "bf16"], help=argparse.SUPPRESS)
    parser.add_argument("--checkpoint", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.batches = sorted(int(b) for b in args.batches.split(","))
    if args.peer:
        torch_peer(args)
        return
    budget = int(args.budget_gib * GIB)
    if args.table:
        rows = [json.loads(line) for path in args.table for line in open(path) if line.strip()]
    else:
        rows = run_configs(args, budget)
    for row in rows:  # JSON turned the batch keys into strings
        for key in ("peak_bytes", "rss_growth_bytes"):
            row[key] = {int(b): v for b, v in row[key].items()}
    result = {"bench": "memory", "width": WIDTH, "heads": HEADS, "layers": args.layers,
              "vocab": args.vocab, "budget_gib": args.budget_gib,
              "batches": sorted({b for row in rows for b in row["rss_growth_bytes"]}),
              "contexts": sorted({row["context"] for row in rows}),
              "cpu_model": next((line.split(":", 1)[1].strip()
                                 for line in open("/proc/cpuinfo") if
                                 line.startswith("model name")), ""), "rows": rows}
    result["targets"] = targets(result)
    if args.markdown:
        print(markdown(result))
        print()
        print(json.dumps(result["targets"], indent=1))
    else:
        print(json.dumps(result))


if __name__ == "__main__":
    main()

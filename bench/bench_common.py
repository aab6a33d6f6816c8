# bench/bench_common.py -- what the Python peers share: workload names, data, the timing loop.
"""Shared by peer_torch.py and peer_jax.py (and the driver, run.py).

Every system times a workload the same way (mixtape_bench.cpp has the same loop in C++):
warm-up steps (not timed into the result), then `windows` timed windows of K steps each, K
chosen from the fastest warm-up step after the first so that a window lasts about
`window_seconds`; the reported
rate is the median of the per-window rates.
"""

import argparse
import gzip
import json
import os
import re
import statistics
import sys
import time

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
DATA_DIR = os.environ.get("MIXTAPE_DATA_DIR") or os.path.join(BENCH_DIR, "..", "examples", "data")

# ---- the workloads (identical shapes, ops and optimizers in every system) ----
MLP_IN, MLP_OUT, MLP_HIDDEN_LAYERS, MLP_LR = 32, 16, 4, 1e-3
DIGITS = dict(hidden=128, batch=64, lr=0.05, momentum=0.9, label_smoothing=0.2, noise=0.2,
              train_rows=1437, optimizer="sgd")
# The README's demo, `digits_mlp --batch 256 --optimizer adamw`: AdamW 2e-3, weight decay 0.01.
DIGITS_DEMO = dict(DIGITS, batch=256, optimizer="adamw", lr=2e-3, weight_decay=0.01)
DIGITS_LOOPS = {"digits_mlp": DIGITS, "digits_demo": DIGITS_DEMO}
# nanoGPT's CPU settings, as examples/char_gpt.cpp: AdamW 1e-3 with beta2 0.99 and weight decay 0.1,
# gradient norm clipped at 1. One optimizer (decay on every parameter) in every system.
GPT = dict(layers=4, heads=4, width=128, context=64, batch=12, lr=1e-3, beta1=0.9, beta2=0.99,
           eps=1e-8, weight_decay=0.1, clip=1.0)
# Vision. resnet18: torchvision's ResNet-18 (examples/resnet_model.h) with 10 classes on one
# synthetic batch made once (inputs N(0, 1) [64, 3, 32, 32], labels uniform in 0..9), batch norm
# in training mode, cross-entropy, SGD momentum 0.9.
RESNET18 = dict(batch=64, channels=3, size=32, classes=10, lr=0.01, momentum=0.9)
# digits_cnn: examples/digits_cnn.cpp's model and defaults: batch 64 from a shuffled loader,
# shifts of up to `shift` pixels and N(0, noise) input noise outside the step, SGD 0.1 momentum 0.9
# on a cosine schedule over `steps` (repeating here), label smoothing 0.2.
DIGITS_CNN = dict(batch=64, lr=0.1, momentum=0.9, label_smoothing=0.2, noise=0.2, shift=1,
                  steps=2500, train_rows=1437)
BN_EPS, BN_MOMENTUM = 1e-5, 0.1  # PyTorch's BatchNorm2d defaults, as mixtape's
VISION_WORKLOADS = ("resnet18", "digits_cnn")


def resnet18_blocks():
    """(in, out, stride) of ResNet-18's eight BasicBlocks, in order."""
    blocks, width = [], 64
    for stage in range(4):
        out = 64 << stage
        blocks += [(width, out, 1 if stage == 0 else 2), (out, out, 1)]
        width = out
    return blocks


def resnet18_convs(batch=64, size=32):
    """ResNet-18's distinct convolutions at `size`x`size` inputs: a list of
    ((n, c, h, o, k, s), count) in network order, padding k // 2 (7x7 pad 3, 3x3 pad 1, 1x1 pad 0).
    `count` is how many of the step's convolutions have that shape."""
    shapes = {}
    add = lambda shape: shapes.__setitem__(shape, shapes.get(shape, 0) + 1)
    h = size
    add((batch, 3, h, 64, 7, 2))
    h = (h + 6 - 7) // 2 + 1  # stem
    h = (h + 2 - 3) // 2 + 1  # max pool
    for c, o, s in resnet18_blocks():
        add((batch, c, h, o, 3, s))
        if s != 1 or c != o:
            add((batch, c, h, o, 1, s))
        h = (h + 2 - 3) // s + 1
        add((batch, o, h, o, 3, 1))
    return list(shapes.items())


CONV_PASSES = ("fwd", "dgrad", "wgrad")


def conv_shape(name):
    """(dtype, pass, (n, c, h, o, k, s)) of a "conv_<f32|bf16>_<fwd|dgrad|wgrad>_n<N>_c<C>_h<H>_o<O>
    _k<K>_s<S>" workload: x [N, C, H, H] * w [O, C, K, K], stride S, padding K // 2; or None."""
    match = re.fullmatch(r"conv_(f32|bf16)_(fwd|dgrad|wgrad)_n(\d+)_c(\d+)_h(\d+)_o(\d+)_k(\d+)"
                         r"_s(\d+)", name)
    if not match:
        return None
    return match.group(1), match.group(2), tuple(int(match.group(i)) for i in range(3, 9))


def conv_name(dtype, conv_pass, shape):
    n, c, h, o, k, s = shape
    return f"conv_{dtype}_{conv_pass}_n{n}_c{c}_h{h}_o{o}_k{k}_s{s}"


def conv_out_size(shape):
    n, c, h, o, k, s = shape
    return (h + 2 * (k // 2) - k) // s + 1


def conv_flops(shape):
    """GEMM-equivalent flops of one pass (each pass has the same): 2 N O OH OW C K K, every tap
    of the window counted, padding included, as an im2col GEMM does."""
    n, c, h, o, k, s = shape
    return 2.0 * n * o * conv_out_size(shape) ** 2 * c * k * k


SEED = 0


def mlp_shape(name):
    """(width, batch) of an "mlp_w<W>_b<B>" workload, or None."""
    match = re.fullmatch(r"mlp_w(\d+)_b(\d+)", name)
    return (int(match.group(1)), int(match.group(2))) if match else None


def mlp_sizes(width):
    """Layer sizes: 32 -> width x4 hidden layers -> 16 (five Linear layers)."""
    return [MLP_IN] + [width] * MLP_HIDDEN_LAYERS + [MLP_OUT]


def gemm_shape(name):
    """(dtype, (m, n, k)) of a "gemm_<f32|bf16>_<N>" workload (an N^3 product) or of
    "gemm_<f32|bf16>_<M>x<N>x<K>" (M x K times K x N), or None."""
    match = re.fullmatch(r"gemm_(f32|bf16)_(\d+)(?:x(\d+)x(\d+))?", name)
    if not match:
        return None
    m = int(match.group(2))
    return match.group(1), ((m, m, m) if match.group(3) is None
                            else (m, int(match.group(3)), int(match.group(4))))


def known_workload(name):
    return (mlp_shape(name) is not None or gemm_shape(name) is not None
            or conv_shape(name) is not None
            or name in ("digits_mlp", "digits_demo", "char_gpt") + VISION_WORKLOADS)


# ---- data ----
def load_digits():
    """(pixels [1797][64] scaled to [0, 1], labels [1797]) as lists, like examples/digits_mlp."""
    pixels, labels = [], []
    with gzip.open(os.path.join(DATA_DIR, "digits.csv.gz"), "rt") as f:
        for line in f:
            fields = line.strip().split(",")
            if len(fields) != 65:
                continue
            pixels.append([float(v) / 16.0 for v in fields[:64]])
            labels.append(int(fields[64]))
    if len(labels) != 1797:
        sys.exit(f"digits: expected 1797 rows, found {len(labels)}")
    return pixels, labels


def load_fortunes():
    """(token ids as a list, vocabulary size): bytes of fortunes.txt, ids in sorted byte order
    (mt::CharVocab's rule)."""
    with open(os.path.join(DATA_DIR, "fortunes.txt"), "rb") as f:
        data = f.read()
    chars = sorted(set(data))
    index = {c: i for i, c in enumerate(chars)}
    return [index[b] for b in data], len(chars)


# ---- timing ----
def measure(step, sync, warmup, windows, window_seconds, budget_seconds, agree=lambda t: t):
    """Runs `step` warm-up then timed windows; returns the result fields of one workload.

    `sync` waits for all work issued so far (a no-op for synchronous systems). When the warm-up
    shows that the planned windows would exceed `budget_seconds`, fewer windows run (at least one
    step in one window) and the result says so; warm-up stops after two steps when the second
    alone takes half the budget. `agree` maps this process's timing to the one every process of
    a data-parallel run uses (rank 0's), so that all of them run the same number of steps."""
    warm_times = []
    for _ in range(max(1, warmup)):
        start = time.perf_counter()
        step()
        sync()
        warm_times.append(time.perf_counter() - start)
        # Slow steps: two warm-up steps (the first one compiles) are enough once the steps after
        # the first have taken half the budget.
        if len(warm_times) >= 2 and agree(sum(warm_times[1:])) > budget_seconds / 2:
            break
    # The fastest warm-up step after the first, as bench/timing.h takes it.
    estimate = agree(min(warm_times[1:]) if len(warm_times) > 1 else warm_times[0])
    per_window = max(1, round(window_seconds / max(estimate, 1e-9)))
    planned = windows
    if estimate * per_window * windows > budget_seconds:
        windows = max(1, int(budget_seconds // (estimate * per_window)))
    rates, cpu_per_step = [], []
    for _ in range(windows):
        start, cpu_start = time.perf_counter(), time.process_time()
        for _ in range(per_window):
            step()
        sync()
        rates.append(per_window / (time.perf_counter() - start))
        cpu_per_step.append((time.process_time() - cpu_start) / per_window)
    result = {
        "steps_per_s": statistics.median(rates),
        "window_steps_per_s": [round(r, 3) for r in rates],
        # CPU time of the whole process (every thread) per step, as timing.h's: at one thread
        # it moves far less with other processes' load than steps/s does.
        "cpu_us_per_step": round(statistics.median(cpu_per_step) * 1e6, 1),
        "steps_per_window": per_window,
        "windows": windows,
        "warmup_steps": len(warm_times),
        "first_step_s": warm_times[0],
    }
    if windows < planned:
        result["windows_cut_by_budget"] = planned
    return result


def peer_arguments(description):
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--workloads", required=True,
                        help="comma-separated: mlp_w64_b256, digits_mlp, char_gpt, "
                             "gemm_f32_1024...")
    parser.add_argument("--precisions", default="fp32,bf16", help="fp32,bf16 (not for gemm_*)")
    parser.add_argument("--warmup", type=int, default=5, help="warm-up steps per workload")
    parser.add_argument("--windows", type=int, default=5, help="timed windows per workload")
    parser.add_argument("--window-seconds", type=float, default=1.0, help="length of one window")
    parser.add_argument("--budget-seconds", type=float, default=60.0,
                        help="at most this long in timed windows per workload")
    return parser


def peer_cases(args, peer):
    """The (workload, precision) pairs a peer runs: GEMMs and convolutions have no precision."""
    for name in split_list(args.workloads):
        if not known_workload(name):
            sys.exit(f"{peer}: unknown workload {name}")
        shaped = gemm_shape(name) or conv_shape(name)
        for precision in [None] if shaped else split_list(args.precisions):
            yield name, precision


def make_workload(name, precision, makers):
    """What the peer's maker for workload `name` returns: `makers` maps gemm, conv, resnet18,
    digits_cnn, mlp, digits and gpt to the peer's functions."""
    gemm, conv = gemm_shape(name), conv_shape(name)
    if gemm:
        return makers["gemm"](*gemm)
    if conv:
        return makers["conv"](*conv)
    if name in ("resnet18", "digits_cnn"):
        return makers[name](precision)
    if mlp_shape(name):
        return makers["mlp"](*mlp_shape(name), precision)
    if name in DIGITS_LOOPS:
        return makers["digits"](name, precision)
    return makers["gpt"](precision)


def emit_workload(record, name, precision, parameters, result):
    """Completes a peer's record of one workload (GFLOP/s for GEMMs and convolutions) and
    prints it."""
    gemm, conv = gemm_shape(name), conv_shape(name)
    if gemm:
        record["dtype"] = gemm[0]
        record["gflops"] = result["steps_per_s"] * gemm_flops(gemm[1]) / 1e9
    elif conv:
        record["dtype"], record["pass"] = conv[0], conv[1]
        record["gflops"] = result["steps_per_s"] * conv_flops(conv[2]) / 1e9
    else:
        record["precision"] = precision
        record["parameters"] = parameters
    record.update(result)
    emit(record)


def split_list(text):
    return [item for item in text.split(",") if item]


def emit(record):
    print(json.dumps(record), flush=True)


def gemm_flops(shape):
    m, n, k = shape
    return 2.0 * m * n * k

# bench/peer_torch.py -- the PyTorch (eager) peer: the workloads as a PyTorch user writes them.
"""Run with /usr/bin/python3 (Debian's python3-torch) and OPENBLAS_CORETYPE=SkylakeX in the
environment (run.py sets it). Prints one JSON line per workload, precision and thread count.

bf16 is torch.autocast("cpu", dtype=torch.bfloat16) around forward and loss, f32 parameters and
optimizer, which is what mixtape's autocast-bf16 policy does.
"""

import contextlib
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_common as common  # noqa: E402

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402


def autocast(precision):
    if precision == "bf16":
        return torch.autocast("cpu", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def count(model):
    return sum(p.numel() for p in model.parameters())


def mlp(sizes):
    layers = []
    for i in range(len(sizes) - 1):
        layers.append(nn.Linear(sizes[i], sizes[i + 1]))
        if i + 2 < len(sizes):
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def mlp_step(width, batch, precision):
    torch.manual_seed(common.SEED)
    model = mlp(common.mlp_sizes(width))
    optimizer = torch.optim.Adam(model.parameters(), lr=common.MLP_LR)
    inputs = torch.randn(batch, common.MLP_IN)
    targets = torch.randn(batch, common.MLP_OUT)

    def step():
        optimizer.zero_grad()
        with autocast(precision):
            loss = F.mse_loss(model(inputs), targets)
        loss.backward()
        optimizer.step()

    return step, count(model)


def digits_step(name, precision):
    cfg = common.DIGITS_LOOPS[name]
    torch.manual_seed(common.SEED)
    pixels, labels = common.load_digits()
    rows = cfg["train_rows"]
    features = torch.tensor(pixels[:rows], dtype=torch.float32)
    classes = torch.tensor(labels[:rows], dtype=torch.int64)
    model = mlp([64, cfg["hidden"], cfg["hidden"], 10])
    if cfg["optimizer"] == "adamw":
        optimizer = torch.optim.AdamW(model.parameters(), lr=cfg["lr"],
                                      weight_decay=cfg["weight_decay"])
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=cfg["lr"], momentum=cfg["momentum"])
    generator = torch.Generator().manual_seed(common.SEED)
    batch, per_epoch = cfg["batch"], rows // cfg["batch"]  # shuffled, drop_last
    state = {"order": None, "next": per_epoch}

    def step():
        if state["next"] == per_epoch:
            state["order"], state["next"] = torch.randperm(rows, generator=generator), 0
        index = state["order"][state["next"] * batch:(state["next"] + 1) * batch]
        state["next"] += 1
        x = features[index]
        x = x + torch.randn(x.shape, generator=generator) * cfg["noise"]
        optimizer.zero_grad()
        with autocast(precision):
            loss = F.cross_entropy(model(x), classes[index], label_smoothing=cfg["label_smoothing"])
        loss.backward()
        optimizer.step()

    return step, count(model)


class Block(nn.Module):
    """Pre-norm GPT block, as mt::TransformerBlock: x + attn(ln1(x)), then x + mlp(ln2(x))."""

    def __init__(self, width, heads):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.ln2 = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, 4 * width)
        self.fc2 = nn.Linear(4 * width, width)

    def attention(self, x, mask):
        batch, time, width = x.shape
        q, k, v = self.qkv(x).split(width, dim=2)
        split = lambda t: t.view(batch, time, self.heads, width // self.heads).transpose(1, 2)
        q, k, v = split(q), split(k), split(v)
        scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(width // self.heads))
        scores = scores.masked_fill(~mask, float("-inf"))
        merged = (F.softmax(scores, dim=-1) @ v).transpose(1, 2).reshape(batch, time, width)
        return self.proj(merged)

    def forward(self, x, mask):
        x = x + self.attention(self.ln1(x), mask)
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x)), approximate="tanh"))


class CharGpt(nn.Module):
    """examples/char_gpt_model.h's CharGpt: token + position embeddings, blocks, final norm,
    linear head with bias (untied)."""

    def __init__(self, vocab, layers, heads, width, context):
        super().__init__()
        self.token_embedding = nn.Embedding(vocab, width)
        self.position_embedding = nn.Embedding(context, width)
        self.blocks = nn.ModuleList([Block(width, heads) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab)
        self.register_buffer("mask", torch.tril(torch.ones(context, context, dtype=torch.bool)))

    def forward(self, tokens):
        time = tokens.shape[1]
        x = self.token_embedding(tokens) + self.position_embedding(torch.arange(time))
        mask = self.mask[:time, :time]
        for block in self.blocks:
            x = block(x, mask)
        return self.head(self.ln_f(x))


def gpt_step(precision):
    cfg = common.GPT
    torch.manual_seed(common.SEED)
    tokens, vocab = common.load_fortunes()
    data = torch.tensor(tokens, dtype=torch.int64)
    model = CharGpt(vocab, cfg["layers"], cfg["heads"], cfg["width"], cfg["context"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg["lr"],
                                  betas=(cfg["beta1"], cfg["beta2"]), eps=cfg["eps"],
                                  weight_decay=cfg["weight_decay"])
    generator = torch.Generator().manual_seed(common.SEED)
    context, batch = cfg["context"], cfg["batch"]
    offsets = torch.arange(context)

    def step():
        starts = torch.randint(len(tokens) - context, (batch,), generator=generator)
        windows = starts[:, None] + offsets
        x, y = data[windows], data[windows + 1]
        optimizer.zero_grad()
        with autocast(precision):
            logits = model(x)
            loss = F.cross_entropy(logits.view(-1, vocab), y.view(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg["clip"])
        optimizer.step()

    return step, count(model)


def gemm_step(dtype, shape):
    m, n, k = shape
    torch.manual_seed(common.SEED)
    torch_dtype = torch.float32 if dtype == "f32" else torch.bfloat16
    a = torch.randn(m, k).to(torch_dtype)
    b = torch.randn(k, n).to(torch_dtype)
    out = torch.empty(m, n, dtype=torch_dtype)
    return lambda: torch.mm(a, b, out=out)


def blas_library():
    """Which BLAS torch's f32 matmuls went to (Debian's torch takes whatever libblas.so.3 is)."""
    torch.mm(torch.ones(64, 64), torch.ones(64, 64))
    with open("/proc/self/maps") as maps:
        text = maps.read()
    for marker, name in (("openblas", "openblas"), ("libmkl", "mkl"), ("blis", "blis"),
                         ("/blas/libblas", "netlib reference blas")):
        if marker in text:
            return name
    return "unknown"


def main():
    parser = common.peer_arguments(__doc__.splitlines()[0])
    parser.add_argument("--threads", default="1,2", help="thread counts to run, e.g. 1,2")
    args = parser.parse_args()
    blas = blas_library()
    for name in common.split_list(args.workloads):
        if not common.known_workload(name):
            sys.exit(f"peer_torch: unknown workload {name}")
        gemm = common.gemm_shape(name)
        for precision in [None] if gemm else common.split_list(args.precisions):
            for threads in [int(t) for t in common.split_list(args.threads)]:
                torch.set_num_threads(threads)
                parameters = None
                if gemm:
                    step = gemm_step(*gemm)
                elif common.mlp_shape(name):
                    step, parameters = mlp_step(*common.mlp_shape(name), precision)
                elif name in common.DIGITS_LOOPS:
                    step, parameters = digits_step(name, precision)
                else:
                    step, parameters = gpt_step(precision)
                result = common.measure(step, lambda: None, args.warmup, args.windows,
                                        args.window_seconds, args.budget_seconds)
                record = {"system": "torch", "workload": name, "threads": threads,
                          "version": torch.__version__, "blas": blas}
                if gemm:
                    record["dtype"] = gemm[0]
                    record["gflops"] = result["steps_per_s"] * common.gemm_flops(gemm[1]) / 1e9
                else:
                    record["precision"] = precision
                    record["parameters"] = parameters
                record.update(result)
                common.emit(record)


if __name__ == "__main__":
    main()

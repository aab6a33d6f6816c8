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

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "torch"))
from torch_resnet import BasicBlock, ResNet18  # noqa: E402  (shared with test_torch_parity)

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


def fixed_batch_step(model, optimizer, loss_fn, inputs, targets, precision):
    """One training step on the same batch each call: the synthetic-data workloads."""
    def step():
        optimizer.zero_grad()
        with autocast(precision):
            loss = loss_fn(model(inputs), targets)
        loss.backward()
        optimizer.step()

    return step


def mlp_step(width, batch, precision):
    torch.manual_seed(common.SEED)
    model = mlp(common.mlp_sizes(width))
    optimizer = torch.optim.Adam(model.parameters(), lr=common.MLP_LR)
    inputs = torch.randn(batch, common.MLP_IN)
    targets = torch.randn(batch, common.MLP_OUT)

    return fixed_batch_step(model, optimizer, F.mse_loss, inputs, targets, precision), count(model)


def digits_step(name, precision, wrap=None, rank=0):
    """`wrap` (optional) wraps the model for the forward pass (DistributedDataParallel); `rank`
    gives each process of a data-parallel run its own stream of batches."""
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
    forward = wrap(model) if wrap else model
    generator = torch.Generator().manual_seed(common.SEED + rank)
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
            loss = F.cross_entropy(forward(x), classes[index],
                                   label_smoothing=cfg["label_smoothing"])
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


def gpt_step(precision, wrap=None, rank=0):
    """`wrap` and `rank` as digits_step's."""
    cfg = common.GPT
    torch.manual_seed(common.SEED)
    tokens, vocab = common.load_fortunes()
    data = torch.tensor(tokens, dtype=torch.int64)
    model = CharGpt(vocab, cfg["layers"], cfg["heads"], cfg["width"], cfg["context"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg["lr"],
                                  betas=(cfg["beta1"], cfg["beta2"]), eps=cfg["eps"],
                                  weight_decay=cfg["weight_decay"])
    forward = wrap(model) if wrap else model
    generator = torch.Generator().manual_seed(common.SEED + rank)
    context, batch = cfg["context"], cfg["batch"]
    offsets = torch.arange(context)

    def step():
        starts = torch.randint(len(tokens) - context, (batch,), generator=generator)
        windows = starts[:, None] + offsets
        x, y = data[windows], data[windows + 1]
        optimizer.zero_grad()
        with autocast(precision):
            logits = forward(x)
            loss = F.cross_entropy(logits.view(-1, vocab), y.view(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg["clip"])
        optimizer.step()

    return step, count(model)


class DigitsCnn(nn.Module):
    """examples/digits_model.h's DigitsCnn: conv-bn-relu stem (16 channels) on the 8x8 digit, a
    BasicBlock, a strided one to 32 channels, global average pooling, linear to 10."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(16)
        self.layer1 = BasicBlock(16, 16, 1)
        self.layer2 = BasicBlock(16, 32, 2)
        self.fc = nn.Linear(32, 10)

    def forward(self, pixels):
        x = F.relu(self.bn1(self.conv1(pixels.reshape(-1, 1, 8, 8))))
        return self.fc(self.layer2(self.layer1(x)).mean((2, 3)))


def resnet18_step(precision):
    cfg = common.RESNET18
    torch.manual_seed(common.SEED)
    model = ResNet18(cfg["classes"])
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg["lr"], momentum=cfg["momentum"])
    inputs = torch.randn(cfg["batch"], cfg["channels"], cfg["size"], cfg["size"])
    targets = torch.randint(0, cfg["classes"], (cfg["batch"],))

    return fixed_batch_step(model, optimizer, F.cross_entropy, inputs, targets, precision), count(model)


def cosine_lr(peak, step, total):
    """mt::CosineWithWarmup without warm-up: peak * (1 + cos(pi * step / total)) / 2."""
    return 0.5 * peak * (1 + math.cos(math.pi * step / total))


def digits_cnn_step(precision):
    cfg = common.DIGITS_CNN
    torch.manual_seed(common.SEED)
    pixels, labels = common.load_digits()
    rows, batch, shift = cfg["train_rows"], cfg["batch"], cfg["shift"]
    features = torch.tensor(pixels[:rows], dtype=torch.float32).view(rows, 8, 8)
    classes = torch.tensor(labels[:rows], dtype=torch.int64)
    model = DigitsCnn()
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg["lr"], momentum=cfg["momentum"])
    generator = torch.Generator().manual_seed(common.SEED)
    per_epoch = rows // batch  # shuffled, drop_last
    state = {"order": None, "next": per_epoch, "step": 0}
    pixel = torch.arange(8)
    images = torch.arange(batch)[:, None, None]

    def step():
        if state["next"] == per_epoch:
            state["order"], state["next"] = torch.randperm(rows, generator=generator), 0
        index = state["order"][state["next"] * batch:(state["next"] + 1) * batch]
        state["next"] += 1
        # Each image moved by up to `shift` pixels along each axis, zeros coming in
        # (examples/digits_train.h's shifted): out[y][x] = in[y - dy][x - dx].
        padded = F.pad(features[index], (shift, shift, shift, shift))
        dy, dx = torch.randint(-shift, shift + 1, (2, batch), generator=generator)
        x = padded[images, (shift - dy)[:, None, None] + pixel[None, :, None],
                   (shift - dx)[:, None, None] + pixel[None, None, :]].reshape(batch, 64)
        x = x + torch.randn(x.shape, generator=generator) * cfg["noise"]
        for group in optimizer.param_groups:
            group["lr"] = cosine_lr(cfg["lr"], state["step"] % cfg["steps"], cfg["steps"])
        state["step"] += 1
        optimizer.zero_grad()
        with autocast(precision):
            loss = F.cross_entropy(model(x), classes[index], label_smoothing=cfg["label_smoothing"])
        loss.backward()
        optimizer.step()

    return step, count(model)


def conv_step(dtype, conv_pass, shape):
    """One convolution pass at `shape` as PyTorch runs it: F.conv2d, or its input or weight
    gradient through aten::convolution_backward (what autograd calls), NCHW tensors."""
    n, c, h, o, k, s = shape
    oh = common.conv_out_size(shape)
    torch.manual_seed(common.SEED)
    torch_dtype = torch.float32 if dtype == "f32" else torch.bfloat16
    x = torch.randn(n, c, h, h).to(torch_dtype)
    w = torch.randn(o, c, k, k).to(torch_dtype)
    dy = torch.randn(n, o, oh, oh).to(torch_dtype)
    stride, padding = [s, s], [k // 2, k // 2]
    if conv_pass == "fwd":
        return lambda: F.conv2d(x, w, None, stride, padding)
    mask = [conv_pass == "dgrad", conv_pass == "wgrad", False]
    return lambda: torch.ops.aten.convolution_backward(dy, x, w, None, stride, padding, [1, 1],
                                                       False, [0, 0], 1, mask)


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
    makers = {"gemm": gemm_step, "conv": conv_step, "resnet18": resnet18_step,
              "digits_cnn": digits_cnn_step, "mlp": mlp_step, "digits": digits_step,
              "gpt": gpt_step}
    for name, precision in common.peer_cases(args, "peer_torch"):
        for threads in [int(t) for t in common.split_list(args.threads)]:
            torch.set_num_threads(threads)
            made = common.make_workload(name, precision, makers)
            # A GEMM or convolution is a step alone; a model, (step, parameter count).
            step, parameters = made if isinstance(made, tuple) else (made, None)
            result = common.measure(step, lambda: None, args.warmup, args.windows,
                                    args.window_seconds, args.budget_seconds)
            record = {"system": "torch", "workload": name, "threads": threads,
                      "version": torch.__version__, "blas": blas}
            common.emit_workload(record, name, precision, parameters, result)


if __name__ == "__main__":
    main()

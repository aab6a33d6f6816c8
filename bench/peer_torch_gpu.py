#!/usr/bin/env python3
# bench/peer_torch_gpu.py -- the peer of bench_gpu_training: the same MLP, GPT-2 and ResNet-50
# steps in PyTorch on the GPU, AMP (autocast bf16) and fp32, eager and under torch.compile; JSON
# lines.
"""Runs where PyTorch with CUDA is installed (tests/gpu/run.sh calls it when `python3 -c
"import torch"` works there). One JSON line per workload, precision and mode, printed as each
finishes (a run cut short keeps what it measured); a failed configuration is a line with "error".

Workloads, as bench_gpu_training names them:
  mlp_w<W>_b<B>   MLP 32 -> W x4 (ReLU) -> 16, MSE, Adam 1e-3, one batch on the device reused;
                  torch.compile compiles the whole step.
  gpt2_small      GPT-2 small as bench_gpu_training builds it (12 layers, 12 heads, width 768,
                  context 1024, vocab 50257, untied head with bias, 4x GELU(tanh) MLP, batch 8),
                  four batches of uniformly random tokens on the device cycled, targets the
                  inputs shifted by one; AdamW lr 3e-4, betas 0.9/0.95, weight decay 0.1 on every
                  parameter (fused where this torch has it), gradient norm clipped at 1.
                  torch.compile compiles the model, as nanoGPT does. gpt2_l<L>_t<T>_b<B> overrides
                  layers, context and batch (each part optional).
  resnet50        torchvision's ResNet-50 (written out here: Bottleneck v1.5, 1000 classes) in
                  channels_last memory format, as NVIDIA's and PyTorch's AMP recipes train it,
                  batch 128 of 3x224x224 N(0, 1) images and uniform labels made once on the
                  device, cross-entropy, SGD lr 0.01 momentum 0.9, batch norm in training mode.
                  resnet50_b<B>_s<S> overrides batch and image size (each part optional).
Steps are queued and the clock stops after torch.cuda.synchronize(). --device cpu runs the same
code on the CPU (a smoke test of this script)."""

import argparse
import inspect
import json
import math
import re
import sys
import time

GPT2 = {"vocab": 50257, "heads": 12, "width": 768}
TOKEN_BATCHES = 4
FLOPS_FORMULA = ("flops_per_token = 6 * (parameters - embedding_parameters) + 12 * layers * "
                 "context * width; model_tflops = tokens_per_s * flops_per_token / 1e12")


def parse_workload(name):
    """("mlp", {width, batch}), ("gpt2", {layers, context, batch}) or ("resnet50", {batch,
    size}); ValueError otherwise."""
    match = re.fullmatch(r"mlp_w(\d+)_b(\d+)", name)
    if match and int(match[1]) > 0 and int(match[2]) > 0:
        return "mlp", {"width": int(match[1]), "batch": int(match[2])}
    match = re.fullmatch(r"resnet50(?:_b(\d+))?(?:_s(\d+))?", name)
    if match and int(match[1] or 1) > 0 and int(match[2] or 224) >= 32:
        return "resnet50", {"batch": int(match[1] or 128), "size": int(match[2] or 224)}
    shape = {"layers": 12, "context": 1024, "batch": 8}
    if name == "gpt2_small":
        return "gpt2", shape
    match = re.fullmatch(r"gpt2((?:_[ltb]\d+)*)", name)
    parts = re.findall(r"_([ltb])(\d+)", match[1]) if match else []
    keys = {"l": "layers", "t": "context", "b": "batch"}
    if match and len({p for p, _ in parts}) == len(parts) and all(int(v) > 0 for _, v in parts):
        shape.update({keys[p]: int(v) for p, v in parts})
        return "gpt2", shape
    raise ValueError(f"unknown workload {name!r} (mlp_w<W>_b<B>, gpt2_small, gpt2_l<L>_t<T>_b<B>, "
                     "resnet50, resnet50_b<B>_s<S>)")


def mlp_setup(torch, device, compiled, width, batch):
    layers = []
    sizes = [32, width, width, width, width, 16]
    for i in range(len(sizes) - 1):
        layers.append(torch.nn.Linear(sizes[i], sizes[i + 1]))
        if i + 2 < len(sizes):
            layers.append(torch.nn.ReLU())
    net = torch.nn.Sequential(*layers).to(device)
    optimizer = torch.optim.Adam(net.parameters(), lr=1e-3)
    x = torch.randn(batch, 32, device=device)
    y = torch.randn(batch, 16, device=device)

    def forward_loss():
        return torch.nn.functional.mse_loss(net(x).float(), y)

    facts = {"width": width, "batch": batch, "hidden_layers": 4,
             "parameters": sum(p.numel() for p in net.parameters())}
    return net, optimizer, forward_loss, None, facts


def gpt2_model(torch, layers, context, vocab, heads, width):
    nn, F = torch.nn, torch.nn.functional

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
            self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
            self.fc1, self.fc2 = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

        def forward(self, x):
            b, t, c = x.shape
            q, k, v = (z.view(b, t, heads, c // heads).transpose(1, 2)
                       for z in self.qkv(self.ln1(x)).split(width, dim=2))
            if hasattr(F, "scaled_dot_product_attention"):
                y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            else:  # torch < 2.0
                scores = (q @ k.transpose(-2, -1)) / math.sqrt(c // heads)
                causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
                y = scores.masked_fill(~causal, float("-inf")).softmax(-1) @ v
            x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
            return x + self.fc2(F.gelu(self.fc1(self.ln2(x)), approximate="tanh"))

    class Gpt(nn.Module):
        def __init__(self):
            super().__init__()
            self.token_embedding = nn.Embedding(vocab, width)
            self.position_embedding = nn.Embedding(context, width)
            self.blocks = nn.ModuleList(Block() for _ in range(layers))
            self.ln_f = nn.LayerNorm(width)
            self.head = nn.Linear(width, vocab)
            # nanoGPT's initialization, as examples/char_gpt_model.h's CharGpt.
            for name, p in self.named_parameters():
                if name.endswith("bias") and "ln" not in name:
                    nn.init.zeros_(p)
                elif p.dim() >= 2:
                    residual = name.endswith(("proj.weight", "fc2.weight"))
                    nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * layers) if residual else 0.02)

        def forward(self, tokens):
            positions = torch.arange(tokens.shape[1], device=tokens.device)
            x = self.token_embedding(tokens) + self.position_embedding(positions)
            for block in self.blocks:
                x = block(x)
            return self.head(self.ln_f(x))

    return Gpt()


def gpt2_setup(torch, device, compiled, layers, context, batch):
    model = gpt2_model(torch, layers, context, **GPT2).to(device)
    forward = torch.compile(model) if compiled else model
    fused = device == "cuda" and "fused" in inspect.signature(torch.optim.AdamW).parameters
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95),
                                  weight_decay=0.1, **({"fused": True} if fused else {}))
    streams = [torch.randint(0, GPT2["vocab"], (batch, context + 1), device=device)
               for _ in range(TOKEN_BATCHES)]
    batches = [(s[:, :-1].contiguous(), s[:, 1:].contiguous()) for s in streams]
    cursor = [0]

    def forward_loss():
        x, y = batches[cursor[0]]
        cursor[0] = (cursor[0] + 1) % len(batches)
        logits = forward(x).float()
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())

    parameters = sum(p.numel() for p in model.parameters())
    embedding = model.token_embedding.weight.numel() + model.position_embedding.weight.numel()
    facts = {"batch": batch, "context": context, "layers": layers, **GPT2,
             "parameters": parameters, "embedding_parameters": embedding,
             "tokens_per_step": batch * context,
             "flops_per_token": 6 * (parameters - embedding) + 12 * layers * context *
             GPT2["width"], "flops_formula": FLOPS_FORMULA, "adamw_fused": fused}
    return model, optimizer, forward_loss, 1.0, facts


def resnet50_model(torch, classes=1000):
    nn = torch.nn

    def conv_bn(cin, cout, kernel, stride=1):
        return [nn.Conv2d(cin, cout, kernel, stride, kernel // 2, bias=False), nn.BatchNorm2d(cout)]

    class Bottleneck(nn.Module):
        def __init__(self, cin, planes, stride):
            super().__init__()
            self.body = nn.Sequential(*conv_bn(cin, planes, 1), nn.ReLU(inplace=True),
                                      *conv_bn(planes, planes, 3, stride), nn.ReLU(inplace=True),
                                      *conv_bn(planes, 4 * planes, 1))
            self.downsample = (nn.Sequential(*conv_bn(cin, 4 * planes, 1, stride))
                               if stride != 1 or cin != 4 * planes else nn.Identity())

        def forward(self, x):
            return torch.relu(self.body(x) + self.downsample(x))

    layers, cin = [*conv_bn(3, 64, 7, 2), nn.ReLU(inplace=True), nn.MaxPool2d(3, 2, 1)], 64
    for stage, blocks in enumerate((3, 4, 6, 3)):
        for b in range(blocks):
            layers.append(Bottleneck(cin, 64 << stage, 2 if stage > 0 and b == 0 else 1))
            cin = 4 * (64 << stage)
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, classes)]
    return nn.Sequential(*layers)


def resnet50_setup(torch, device, compiled, batch, size):
    model = resnet50_model(torch).to(device).to(memory_format=torch.channels_last)
    forward = torch.compile(model) if compiled else model
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x = torch.randn(batch, 3, size, size, device=device).to(memory_format=torch.channels_last)
    y = torch.randint(0, 1000, (batch,), device=device)

    def forward_loss():
        return torch.nn.functional.cross_entropy(forward(x).float(), y)

    facts = {"batch": batch, "image": [3, size, size], "classes": 1000, "optimizer": "sgd",
             "memory_format": "channels_last", "images_per_step": batch,
             "parameters": sum(p.numel() for p in model.parameters())}
    return model, optimizer, forward_loss, None, facts


def run(torch, device, name, precision, compiled, args):
    kind, shape = parse_workload(name)
    torch.manual_seed(0)
    setup = {"mlp": mlp_setup, "gpt2": gpt2_setup, "resnet50": resnet50_setup}[kind]
    model, optimizer, forward_loss, clip, facts = setup(torch, device, compiled, **shape)

    def step():
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device, dtype=torch.bfloat16, enabled=precision == "bf16"):
            loss = forward_loss()
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        return loss

    if compiled and kind == "mlp":
        step = torch.compile(step)

    def synchronize():
        if device == "cuda":
            torch.cuda.synchronize()

    start = time.perf_counter()
    step()
    synchronize()
    first_step = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(max(1, args.warmup - 1)):
        step()
    synchronize()
    per_step = (time.perf_counter() - start) / max(1, args.warmup - 1)
    # Steps queued between synchronizations: about 0.2 s of them, at most 20.
    chunk = max(1, min(20, round(0.2 / max(per_step, 1e-9))))
    steps, start = 0, time.perf_counter()
    while steps == 0 or time.perf_counter() - start < args.seconds:
        for _ in range(chunk):
            loss = step()
        steps += chunk
        synchronize()
    seconds = time.perf_counter() - start
    result = {"workload": name, **facts, "precision": precision,
              "mode": "torch.compile" if compiled else "eager", "steps": steps,
              "steps_per_s": steps / seconds, "ms_per_step": 1e3 * seconds / steps,
              "first_step_s": first_step, "final_loss": loss.item()}
    if "images_per_step" in facts:
        result["images_per_s"] = result["steps_per_s"] * facts["images_per_step"]
    if "tokens_per_step" in facts:
        result["tokens_per_s"] = result["steps_per_s"] * facts["tokens_per_step"]
        result["model_tflops"] = result["tokens_per_s"] * facts["flops_per_token"] / 1e12
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default="mlp_w64_b65536,mlp_w128_b65536")
    parser.add_argument("--precisions", default="fp32,bf16")
    parser.add_argument("--modes", default="eager,compile", help="eager and/or compile")
    parser.add_argument("--seconds", type=float, default=2.0, help="timed per configuration")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    args = parser.parse_args()
    workloads = [w for w in args.workloads.split(",") if w]
    modes = [m for m in args.modes.split(",") if m]
    precisions = [p for p in args.precisions.split(",") if p]
    for name in workloads:
        try:
            parse_workload(name)
        except ValueError as e:
            parser.error(str(e))
    if not set(modes) <= {"eager", "compile"} or not set(precisions) <= {"fp32", "bf16"}:
        parser.error("modes are eager and compile, precisions fp32 and bf16")
    head = {"benchmark": "peer_torch_gpu"}
    try:
        import torch
    except ImportError as e:
        print(json.dumps({**head, "skipped": f"no torch: {e}"}))
        return 0
    if args.device == "cuda" and not torch.cuda.is_available():
        print(json.dumps({**head, "skipped": "torch has no CUDA device"}))
        return 0
    head.update(torch=torch.__version__, device=torch.cuda.get_device_name()
                if args.device == "cuda" else "cpu")
    for compiled in [m == "compile" for m in modes]:
        for name in workloads:
            for precision in precisions:
                try:
                    result = run(torch, args.device, name, precision, compiled, args)
                except Exception as e:  # torch.compile needs torch >= 2 and a working Triton
                    result = {"workload": name, "precision": precision,
                              "mode": "torch.compile" if compiled else "eager",
                              "error": (str(e).splitlines() or [type(e).__name__])[0][:300]}
                print(json.dumps({**head, **result}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

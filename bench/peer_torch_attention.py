# bench/peer_torch_attention.py -- bench_attention's PyTorch peer: causal attention forward and
# backward over [B, H, T, D], f32 and autocast-bf16, one JSON line each.
"""Run by bench_attention with: B H T D WINDOW_SECONDS [DROPOUT]. Uses F.scaled_dot_product_attention where
this torch has it (2.0 and later), else the same math written out (Debian's torch 1.13 has no
fused attention: it materializes the [T, T] scores, as its math back end does). peak_rss_bytes is
the growth of the process's resident high-water mark over the step (ru_maxrss), which includes
the allocator's caching: an upper bound of what the step needed, not mixtape's stored-value count.
"""

import contextlib
import json
import math
import os
import resource
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_common as common  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402


def attention(q, k, v, dropout_p):
    if hasattr(F, "scaled_dot_product_attention"):
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)
    t = q.shape[-2]
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    s = s.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), float("-inf"))
    return F.dropout(torch.softmax(s, -1), dropout_p) @ v


def main():
    b, h, t, d = (int(x) for x in sys.argv[1:5])
    window_seconds = float(sys.argv[5])
    dropout_p = float(sys.argv[6]) if len(sys.argv) > 6 else 0.0
    torch.manual_seed(1)
    for precision in ("f32", "bf16"):
        q, k, v = (torch.randn(b, h, t, d, requires_grad=True) for _ in range(3))
        w = torch.randn(b, h, t, d)
        cast = (torch.autocast("cpu", dtype=torch.bfloat16) if precision == "bf16"
                else contextlib.nullcontext())

        def step():
            for x in (q, k, v):
                x.grad = None
            with cast:
                out = attention(q, k, v, dropout_p)
            (out.float() * w).sum().backward()

        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        result = common.measure(step, lambda: None, 2, 3, window_seconds, 20.0)
        after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        record = {"bench": "attention", "system": "torch", "precision": precision, "batch": b,
                  "heads": h, "t": t, "d": d, "dropout": dropout_p, "torch": torch.__version__,
                  "fused_sdpa": hasattr(F, "scaled_dot_product_attention"),
                  "threads": torch.get_num_threads()}
        record.update(result)
        record["peak_rss_growth_bytes"] = after - before
        print(json.dumps(record), flush=True)


main()

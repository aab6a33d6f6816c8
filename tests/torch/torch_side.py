# tests/torch/torch_side.py -- what the PyTorch sides of the parity tests share: safetensors
# files read and written with numpy (the tests know mixtape only through these files) and the
# reference modules, with torch's own layers and state_dict names.
import json, math, os, struct, sys
try:
    import numpy as np
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
except ImportError as e:
    print('cannot import torch and numpy (%s)' % e)
    sys.exit(77)  # the C++ side reads 77 as "skip": probing first would start a second python
torch.set_num_threads(1)

DTYPES = {'F32': np.float32, 'F64': np.float64, 'I64': np.int64, 'I32': np.int32, 'BOOL': np.bool_}
TAGS = {np.dtype(v): k for k, v in DTYPES.items()}
TORCH_DTYPES = {'F64': torch.float64, 'F32': torch.float32, 'F16': torch.float16,
                'BF16': torch.bfloat16, 'I64': torch.int64, 'I32': torch.int32, 'BOOL': torch.bool}

def load(path):
    """The tensors of a safetensors file (16-bit floats included), and its __metadata__."""
    with open(path, 'rb') as f:
        raw = f.read()
    n = struct.unpack('<Q', raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    meta = header.pop('__metadata__', {})
    out = {}
    for name, info in header.items():
        b, e = info['data_offsets']
        dtype = TORCH_DTYPES[info['dtype']]
        data = bytearray(raw[8 + n + b:8 + n + e])  # a copy the tensor may own and write
        flat = torch.frombuffer(data, dtype=dtype) if data else torch.zeros(0, dtype=dtype)
        out[name] = flat.reshape(info['shape'])
    return out, meta

def save(path, tensors, meta=None):
    """Writes tensors (16-bit floats widened to f32, which numpy lacks) atomically."""
    header, blobs, offset = ({'__metadata__': meta} if meta else {}), [], 0
    for name, t in tensors.items():
        t = t.detach()
        if t.dtype in (torch.bfloat16, torch.float16):
            t = t.float()
        a = t.contiguous().numpy()
        b = a.tobytes()
        header[name] = {'dtype': TAGS[a.dtype], 'shape': list(a.shape),
                        'data_offsets': [offset, offset + len(b)]}
        blobs.append(b)
        offset += len(b)
    text = json.dumps(header).encode()
    with open(path + '.tmp', 'wb') as f:
        f.write(struct.pack('<Q', len(text)) + text + b''.join(blobs))
    os.replace(path + '.tmp', path)

# False: nn.Linear, one addmm whose bias joins the f32 accumulator. True: what mixtape computes,
# the matmul's output rounded to its type, then the bias added (differs only in 16-bit types).
MATMUL_THEN_BIAS = [False]

def linear(module, x):
    if not MATMUL_THEN_BIAS[0]:
        return module(x)
    y = x @ module.weight.t()
    return y + module.bias.to(y.dtype)

ACT = {'relu': F.relu, 'gelu': F.gelu, 'gelu_tanh': lambda x: F.gelu(x, approximate='tanh'),
       'silu': F.silu, 'tanh': torch.tanh}

class MLP(nn.Module):
    def __init__(self, sizes, act):
        super().__init__()
        self.n = len(sizes) - 1
        for i in range(self.n):
            setattr(self, 'fc%d' % (i + 1), nn.Linear(sizes[i], sizes[i + 1]))
        self.act = ACT[act]
    def forward(self, x):
        for i in range(self.n):
            x = linear(getattr(self, 'fc%d' % (i + 1)), x)
            if i + 1 < self.n:
                x = self.act(x)
        return x

class Attention(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.qkv, self.proj, self.heads = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim), heads
    def forward(self, x):
        B, T, C = x.shape
        H, D = self.heads, C // self.heads
        q, k, v = linear(self.qkv, x).split(C, dim=-1)
        q, k, v = [t.reshape(B, T, H, D).transpose(1, 2) for t in (q, k, v)]
        # Multiplying by 1/sqrt(D), as mixtape writes it; dividing rounds differently in bf16.
        scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(D))
        mask = torch.tril(torch.ones(T, T, dtype=torch.bool))
        att = scores.masked_fill(~mask, float('-inf')).softmax(-1)
        return linear(self.proj, (att @ v).transpose(1, 2).reshape(B, T, C))

class Block(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.ln1, self.attn = nn.LayerNorm(dim, eps=1e-5), Attention(dim, heads)
        self.ln2, self.mlp = nn.LayerNorm(dim, eps=1e-5), MLP([dim, 4 * dim, dim], 'gelu_tanh')
    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))

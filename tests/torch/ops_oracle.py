# tests/torch/ops_oracle.py -- the PyTorch side of test_ops' oracle: recomputes every case the
# test saved (inputs, metadata naming the op and its arguments) and prints PASS or FAIL a case.
import math, sys
from torch_side import *  # exits 77 when torch does not import

def f16(t):
    # numpy rounds float64 to float16 directly; torch would round through float32 first.
    return torch.from_numpy(np.asarray(t.double().numpy()).astype(np.float16))

def unslice(a, starts, steps, shape):
    z = torch.zeros(shape, dtype=a.dtype)
    z[tuple(slice(s, s + st * n, st) for s, st, n in zip(starts, steps, a.shape))] = a
    return z

def sdpa(q, k, v, causal):
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        t = s.shape[-1]
        s = s.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), float('-inf'))
    return torch.softmax(s, -1) @ v

def rms_norm(x, w, eps):
    return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + eps) * w

def conv_module(cls, x, w, b, **kw):
    # A torch.nn convolution module holding w and b: the padding rules and modes are the module's.
    m = cls(w.shape[1] * kw.get('groups', 1), w.shape[0], tuple(w.shape[2:]), bias=b is not None,
            dtype=x.dtype, **kw)
    with torch.no_grad():
        m.weight.copy_(w)
        if b is not None:
            m.bias.copy_(b)
        return m(x)

def same_shape(*ts):
    return [t.contiguous() for t in torch.broadcast_tensors(*ts)]

def compare(out, want, rtol, atol):
    if not isinstance(want, torch.Tensor):
        return 'torch gave a %s' % type(want).__name__
    if tuple(out.shape) != tuple(want.shape):
        return 'shape %s vs torch %s' % (list(out.shape), list(want.shape))
    if out.dtype != want.dtype:
        return 'dtype %s vs torch %s' % (out.dtype, want.dtype)
    if not out.is_floating_point():
        bad = (out != want).reshape(-1).nonzero()
        if len(bad):
            i = bad[0].item()
            return 'element %d: mixtape %s vs torch %s' % (
                i, out.reshape(-1)[i].item(), want.reshape(-1)[i].item())
        return None
    o, w = out.double().reshape(-1), want.double().reshape(-1)
    ok = (o.isnan() & w.isnan()) | (o == w) | ((o - w).abs() <= atol + rtol * w.abs())
    bad = (~ok).nonzero()
    if len(bad):
        i = bad[0].item()
        return 'element %d of %d bad (%d in all): mixtape %r vs torch %r' % (
            i, len(o), len(bad), o[i].item(), w[i].item())
    return None

def main():
    tensors, meta = load(sys.argv[1])
    for name in sorted(k[5:] for k in meta if k.startswith('expr/')):
        env = dict(torch=torch, F=F, np=np, math=math, f16=f16, unslice=unslice, sdpa=sdpa,
                   rms_norm=rms_norm, same_shape=same_shape,
                   conv_module=conv_module)
        i = 0
        while '%s/in%d' % (name, i) in tensors:
            env['abcdefgh'[i]] = tensors['%s/in%d' % (name, i)]
            i += 1
        rtol, atol = (float(t) for t in meta['tol/' + name].split())
        try:
            problem = compare(tensors[name + '/out'], eval(meta['expr/' + name], env), rtol, atol)
        except Exception as e:
            problem = 'torch raised %s: %s' % (type(e).__name__, e)
        print('FAIL %s: %s' % (name, problem) if problem else 'PASS ' + name, flush=True)

main()

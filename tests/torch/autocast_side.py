# tests/torch/autocast_side.py -- the PyTorch side of test_precision's autocast parity: an MLP
# and a transformer block under torch.autocast('cpu', bfloat16), and in f32, on the test's files.
from torch_side import *  # exits 77 when torch does not import

def step(model, d, kind, autocast):
    model.zero_grad()
    with torch.autocast('cpu', dtype=torch.bfloat16, enabled=autocast):
        out = model(d['x'])
        loss = F.cross_entropy(out, d['y']) if kind == 'mlp' else F.mse_loss(out, d['target'])
    loss.backward()
    return out, loss

folder = sys.argv[1]
for kind in ('mlp', 'block'):
    d = load(os.path.join(folder, kind + '.in.safetensors'))[0]
    params = load(os.path.join(folder, kind + '.params.safetensors'))[0]
    model = MLP([16, 32, 32, 5], 'relu') if kind == 'mlp' else Block(32, 4)
    model.load_state_dict(params, strict=True)
    result, meta = {}, {}
    for mode, autocast, addmm in (('bf16', True, False), ('bf16_addmm', True, True),
                                  ('fp32', False, True)):
        MATMUL_THEN_BIAS[0] = not addmm
        out, loss = step(model, d, kind, autocast)
        result[mode + '.loss'] = loss.reshape([])
        result[mode + '.output'] = out
        for name, p in model.named_parameters():
            result[mode + '.grad.' + name] = p.grad.clone()
        meta[mode + '.output_dtype'] = str(out.dtype)
        meta[mode + '.loss_dtype'] = str(loss.dtype)
        grad_dtypes = {str(p.grad.dtype) for p in model.parameters()}
        meta[mode + '.grad_dtypes'] = ','.join(sorted(grad_dtypes))
    save(os.path.join(folder, kind + '.out.safetensors'), result, meta)
# What CPU autocast does to ops whose lists differ from CUDA's (printed for the test log).
x32, w = torch.randn(4, 8), torch.randn(8, 8)
with torch.autocast('cpu', dtype=torch.bfloat16):
    xb = x32 @ w
    probes = {'mm': xb, 'layer_norm(f32 in)': F.layer_norm(x32, (8,)),
              'softmax(bf16 in)': xb.softmax(-1), 'gelu(bf16 in)': F.gelu(xb),
              'sum(bf16 in)': xb.sum(),
              'cross_entropy(bf16 in)': F.cross_entropy(xb, torch.zeros(4, dtype=torch.long))}
print('torch %s CPU autocast bf16: %s' % (torch.__version__,
      ', '.join('%s -> %s' % (k, str(v.dtype).replace('torch.', '')) for k, v in probes.items())))

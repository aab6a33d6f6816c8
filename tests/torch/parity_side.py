# tests/torch/parity_side.py -- the PyTorch side of test_torch_parity: runs every case the test
# wrote into the folder given (models, optimizers, schedules, ops) and writes torch's results.
import time
t0 = time.time()
from torch_side import *  # exits 77 when torch does not import
t_import = time.time() - t0

from torch_resnet import BasicBlock, ResNet18  # torchvision's layout and state_dict names

def run_resnet(d, m, _):
    torch.manual_seed(int(m['seed']))
    net = ResNet18(int(m['classes']))
    # Batch norm's affine parameters and statistics away from their 1/0 start, so that a wrong
    # name or a missed buffer shows.
    with torch.no_grad():
        for name, t in net.state_dict().items():
            if 'bn' in name or 'downsample.1' in name:
                if name.endswith('weight') or name.endswith('running_var'):
                    t.uniform_(0.5, 1.5)
                elif name.endswith('bias') or name.endswith('running_mean'):
                    t.uniform_(-0.2, 0.2)
    init = {k: v.clone() for k, v in net.state_dict().items()}
    def train_step(bf16):
        net.load_state_dict(init)
        net.zero_grad()
        opt = torch.optim.SGD(net.parameters(), lr=float(m['lr']), momentum=0.9)
        with torch.autocast('cpu', dtype=torch.bfloat16, enabled=bf16):
            logits = net(d['x'])
        loss = F.cross_entropy(logits.float(), d['y'])
        loss.backward()
        opt.step()
        return loss.detach().reshape(1), {k: v.clone() for k, v in net.state_dict().items()}
    out = {'init.' + k: v for k, v in init.items()}
    # The f32 step, and under autocast also the bf16 one: the bf16 error PyTorch itself makes.
    loss, after = train_step(False)
    out.update({'f32.' + k: v for k, v in after.items()})
    out['f32.loss'] = loss
    if m['policy'] == 'autocast-bf16':
        loss, after = train_step(True)
    out.update({'after.' + k: v for k, v in after.items()})
    out['loss'] = loss
    return out

def run_seq(d, m, params):
    flag = lambda k: m.get(k) == '1'
    layer = m['layer']
    if layer == 'mha':
        mod = nn.MultiheadAttention(int(m['embed']), int(m['heads']), batch_first=flag('batch_first'))
    elif layer == 'encoder':
        def encoder_layer():
            return nn.TransformerEncoderLayer(
                int(m['embed']), int(m['heads']), dim_feedforward=int(m['feedforward']),
                dropout=0.0, activation='gelu' if flag('gelu') else 'relu',
                batch_first=flag('batch_first'), norm_first=flag('norm_first'))
        layers = int(m['layers'])
        mod = encoder_layer() if layers == 1 else nn.TransformerEncoder(
            encoder_layer(), layers, norm=nn.LayerNorm(int(m['embed'])))
    else:
        mod = (nn.LSTM if layer == 'lstm' else nn.GRU)(
            int(m['input']), int(m['hidden']), int(m['layers']), batch_first=flag('batch_first'),
            bidirectional=flag('bidirectional'))
    mod.load_state_dict(params, strict=True)
    with torch.autocast('cpu', dtype=torch.bfloat16, enabled=flag('autocast')):
        return seq_forward_backward(mod, layer, d, flag)

def seq_forward_backward(mod, layer, d, flag):
    out = {}
    if layer == 'mha':
        names = ['query'] if flag('self') else ['query', 'key', 'value']
        ins = {n: d[n].clone().requires_grad_(True) for n in names}
        q = ins['query']
        k, v = (q, q) if flag('self') else (ins['key'], ins['value'])
        y, w = mod(q, k, v, key_padding_mask=d.get('key_padding_mask'),
                   attn_mask=d.get('attn_mask'), need_weights=True)
        y, w = y.float(), w.float()
        ((y * d['w']).sum() + (w * d['ww']).sum()).backward()
        out.update({'output': y, 'weights': w})
    elif layer == 'encoder':
        ins = {'src': d['src'].clone().requires_grad_(True)}
        y = mod(ins['src'], d['src_mask'], d.get('src_key_padding_mask')).float()
        (y * d['w']).sum().backward()
        out['output'] = y
    else:
        ins = {'x': d['x'].clone().requires_grad_(True)}
        if layer == 'lstm':
            y, (h, c) = mod(ins['x'], (d['h0'], d['c0'])) if 'h0' in d else mod(ins['x'])
            y, h, c = y.float(), h.float(), c.float()
            ((y * d['w']).sum() + (h * d['wh']).sum() + (c * d['wc']).sum()).backward()
            out.update({'output': y, 'h_n': h, 'c_n': c})
        else:
            y, h = mod(ins['x'], d['h0']) if 'h0' in d else mod(ins['x'])
            y, h = y.float(), h.float()
            ((y * d['w']).sum() + (h * d['wh']).sum()).backward()
            out.update({'output': y, 'h_n': h})
    out.update({'dinput.' + n: t.grad for n, t in ins.items()})
    out.update(grads(mod))
    return out

def sizes(m):
    return [int(s) for s in m['sizes'].split(',')]

def grads(model):
    return {'grad.' + n: p.grad for n, p in model.named_parameters()}

def run_mlp(d, m, params):
    model = MLP(sizes(m), m['activation'])
    model.load_state_dict(params, strict=True)
    out = model(d['x'])
    loss = F.cross_entropy(out, d['y'])
    loss.backward()
    return {'loss': loss, 'output': out, **grads(model)}

def run_block(d, m, params):
    model = Block(int(m['dim']), int(m['heads']))
    model.load_state_dict(params, strict=True)
    x = d['x'].clone().requires_grad_(True)
    out = model(x)
    loss = F.mse_loss(out, d['target'])
    loss.backward()
    return {'loss': loss, 'output': out, 'grad.input': x.grad, **grads(model)}

# Neither is in torch 1.13: lucidrains' lion-pytorch and transformers' Adafactor, as written
# there (Adafactor without the half-precision copies: every case is f32), their per-parameter
# update under one step loop.
class PerParameterOptimizer(torch.optim.Optimizer):
    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            for p in group['params']:
                if p.grad is not None:
                    self.update(group, p)

class Lion(PerParameterOptimizer):
    def __init__(self, params, lr, betas, weight_decay):
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay))
    def update(self, group, p):
        grad, lr, wd, state = p.grad, group['lr'], group['weight_decay'], self.state[p]
        beta1, beta2 = group['betas']
        if len(state) == 0:
            state['exp_avg'] = torch.zeros_like(p)
        exp_avg = state['exp_avg']
        p.data.mul_(1 - lr * wd)
        update = exp_avg.clone().mul_(beta1).add(grad, alpha=1 - beta1).sign_()
        p.add_(update, alpha=-lr)
        exp_avg.mul_(beta2).add_(grad, alpha=1 - beta2)

class Adafactor(PerParameterOptimizer):
    def __init__(self, params, lr=None, eps=(1e-30, 1e-3), clip_threshold=1.0, decay_rate=-0.8,
                 beta1=None, weight_decay=0.0, scale_parameter=True, relative_step=True,
                 warmup_init=False):
        super().__init__(params, dict(lr=lr, eps=eps, clip_threshold=clip_threshold,
                                      decay_rate=decay_rate, beta1=beta1,
                                      weight_decay=weight_decay, scale_parameter=scale_parameter,
                                      relative_step=relative_step, warmup_init=warmup_init))
    @staticmethod
    def _get_lr(param_group, param_state):
        rel_step_sz = param_group['lr']
        if param_group['relative_step']:
            min_step = 1e-6 * param_state['step'] if param_group['warmup_init'] else 1e-2
            rel_step_sz = min(min_step, 1.0 / math.sqrt(param_state['step']))
        param_scale = 1.0
        if param_group['scale_parameter']:
            param_scale = max(param_group['eps'][1], param_state['RMS'])
        return param_scale * rel_step_sz
    @staticmethod
    def _rms(tensor):
        return tensor.norm(2) / (tensor.numel() ** 0.5)
    @staticmethod
    def _approx_sq_grad(exp_avg_sq_row, exp_avg_sq_col):
        r_factor = (exp_avg_sq_row / exp_avg_sq_row.mean(dim=-1, keepdim=True)).rsqrt_().unsqueeze(-1)
        c_factor = exp_avg_sq_col.unsqueeze(-2).rsqrt()
        return torch.mul(r_factor, c_factor)
    def update(self, group, p):
        grad = p.grad
        state = self.state[p]
        grad_shape = grad.shape
        factored = len(grad_shape) >= 2
        use_first_moment = group['beta1'] is not None
        if len(state) == 0:
            state['step'] = 0
            if use_first_moment:
                state['exp_avg'] = torch.zeros_like(grad)
            if factored:
                state['exp_avg_sq_row'] = torch.zeros(grad_shape[:-1]).to(grad)
                state['exp_avg_sq_col'] = torch.zeros(grad_shape[:-2] + grad_shape[-1:]).to(grad)
            else:
                state['exp_avg_sq'] = torch.zeros_like(grad)
            state['RMS'] = 0
        p_data_fp32 = p
        state['step'] += 1
        state['RMS'] = self._rms(p_data_fp32)
        lr = self._get_lr(group, state)
        beta2t = 1.0 - math.pow(state['step'], group['decay_rate'])
        update = (grad**2) + group['eps'][0]
        if factored:
            exp_avg_sq_row = state['exp_avg_sq_row']
            exp_avg_sq_col = state['exp_avg_sq_col']
            exp_avg_sq_row.mul_(beta2t).add_(update.mean(dim=-1), alpha=(1.0 - beta2t))
            exp_avg_sq_col.mul_(beta2t).add_(update.mean(dim=-2), alpha=(1.0 - beta2t))
            update = self._approx_sq_grad(exp_avg_sq_row, exp_avg_sq_col)
            update.mul_(grad)
        else:
            exp_avg_sq = state['exp_avg_sq']
            exp_avg_sq.mul_(beta2t).add_(update, alpha=(1.0 - beta2t))
            update = exp_avg_sq.rsqrt().mul_(grad)
        update.div_((self._rms(update) / group['clip_threshold']).clamp_(min=1.0))
        update.mul_(lr)
        if use_first_moment:
            exp_avg = state['exp_avg']
            exp_avg.mul_(group['beta1']).add_(update, alpha=(1 - group['beta1']))
            update = exp_avg
        if group['weight_decay'] != 0:
            p_data_fp32.add_(p_data_fp32, alpha=(-group['weight_decay'] * lr))
        p_data_fp32.add_(-update)

def make_optimizer(m, params):
    f = lambda k: float(m[k])
    if m['optimizer'] == 'lion':
        return Lion(params, lr=f('lr'), betas=(f('beta1'), f('beta2')),
                    weight_decay=f('weight_decay'))
    if m['optimizer'] == 'adafactor':
        opt = lambda k: None if m[k] == 'none' else float(m[k])
        return Adafactor(params, lr=None if m['relative_step'] == '1' else f('lr'),
                         clip_threshold=f('clip_threshold'),
                         decay_rate=f('decay_rate'), beta1=opt('af_beta1'),
                         weight_decay=f('weight_decay'),
                         scale_parameter=m['scale_parameter'] == '1',
                         relative_step=m['relative_step'] == '1',
                         warmup_init=m['warmup_init'] == '1')
    maximize = m.get('maximize', '0') == '1'
    if m['optimizer'] == 'sgd':
        return torch.optim.SGD(params, lr=f('lr'), momentum=f('momentum'),
                               dampening=f('dampening'), weight_decay=f('weight_decay'),
                               nesterov=m['nesterov'] == '1', maximize=maximize)
    if m['optimizer'] == 'rmsprop':
        return torch.optim.RMSprop(params, lr=f('lr'), alpha=f('alpha'), eps=f('eps'),
                                   weight_decay=f('weight_decay'), momentum=f('momentum'),
                                   centered=m['centered'] == '1', maximize=maximize)
    if m['optimizer'] == 'adagrad':
        return torch.optim.Adagrad(params, lr=f('lr'), lr_decay=f('lr_decay'),
                                   weight_decay=f('weight_decay'),
                                   initial_accumulator_value=f('initial_accumulator_value'),
                                   eps=f('eps'), maximize=maximize)
    betas = (f('beta1'), f('beta2'))
    if m['optimizer'] == 'adamax':
        return torch.optim.Adamax(params, lr=f('lr'), betas=betas, eps=f('eps'),
                                  weight_decay=f('weight_decay'), maximize=maximize)
    if m['optimizer'] == 'nadam':
        # The multi-tensor update: 1.13's single-tensor one squares mu in mu_product_next, which
        # later releases fixed (both forms there agree with this one).
        assert not maximize
        return torch.optim.NAdam(params, lr=f('lr'), betas=betas, eps=f('eps'),
                                 weight_decay=f('weight_decay'),
                                 momentum_decay=f('momentum_decay'), foreach=True)
    if m['optimizer'] == 'radam':
        assert not maximize
        return torch.optim.RAdam(params, lr=f('lr'), betas=betas, eps=f('eps'),
                                 weight_decay=f('weight_decay'))
    if m['optimizer'] == 'adadelta':
        return torch.optim.Adadelta(params, lr=f('lr'), rho=f('rho'), eps=f('eps'),
                                    weight_decay=f('weight_decay'), maximize=maximize)
    kind = {'adam': torch.optim.Adam, 'adamw': torch.optim.AdamW}[m['optimizer']]
    return kind(params, lr=f('lr'), betas=betas, eps=f('eps'),
                weight_decay=f('weight_decay'), amsgrad=m.get('amsgrad', '0') == '1',
                maximize=maximize)

def run_optim(d, m, params):
    model = MLP(sizes(m), m['activation'])
    model.load_state_dict(params, strict=True)
    params = list(model.parameters())
    grouped = m.get('grouped', '0') == '1'
    if grouped:
        # Two param_groups: the weight matrices with the options, the biases at half the rate
        # and without weight decay.
        params = [{'params': [p for p in params if p.dim() > 1]},
                  {'params': [p for p in params if p.dim() <= 1],
                   'lr': float(m['lr']) * 0.5, 'weight_decay': 0.0}]
    opt = make_optimizer(m, params)
    # OneCycleLR with PyTorch's defaults (cycle_momentum: the momentum or beta1 cycles too).
    peak = [float(m['lr']), float(m['lr']) * 0.5] if grouped else float(m['lr'])
    sched = (torch.optim.lr_scheduler.OneCycleLR(opt, peak, int(m['onecycle']))
             if int(m.get('onecycle', '0')) else None)
    dropped = [e.rsplit('@', 1) for e in m.get('dropped', '').split(';') if e]
    named = dict(model.named_parameters())
    out = {}
    for step in range(int(m['steps'])):
        opt.zero_grad()
        loss = F.cross_entropy(model(d['x']), d['y'])
        loss.backward()
        for name, at in dropped:
            if int(at) == step:
                named[name].grad = None  # not updated this step: its own "step" stays
        opt.step()
        if sched:
            sched.step()
        out['loss%d' % step] = loss.detach().clone()
        for n, p in model.named_parameters():
            out['step%d.%s' % (step, n)] = p.detach().clone()
    return out

def make_schedule(opt, spec):
    S = torch.optim.lr_scheduler
    kind = spec['type']
    if kind == 'step':
        return S.StepLR(opt, spec['step_size'], spec['gamma'])
    if kind == 'multistep':
        return S.MultiStepLR(opt, spec['milestones'], spec['gamma'])
    if kind == 'exponential':
        return S.ExponentialLR(opt, spec['gamma'])
    if kind == 'linear':
        return S.LinearLR(opt, **spec.get('args', {}))
    if kind == 'onecycle':
        return S.OneCycleLR(opt, **spec['args'])
    if kind == 'cosine':
        return S.CosineAnnealingLR(opt, **spec['args'])
    if kind == 'constant':
        return S.ConstantLR(opt, **spec['args'])
    if kind == 'warm_restarts':
        return S.CosineAnnealingWarmRestarts(opt, **spec['args'])
    if kind == 'polynomial':
        return S.PolynomialLR(opt, **spec['args'])
    if kind == 'sequential':
        return S.SequentialLR(opt, [make_schedule(opt, s) for s in spec['schedules']],
                              spec['milestones'])
    if kind == 'lambda':  # the factors the C++ side writes as graph code
        if spec['fn'] == 'warmup_decay':  # transformers' get_linear_schedule_with_warmup
            w, n = spec['warmup'], spec['total']
            return S.LambdaLR(opt, lambda t: t / w if t < w else max(0.0, (n - t) / (n - w)))
        if spec['fn'] == 'power':
            return S.LambdaLR(opt, lambda t: spec['gamma'] ** t)
        if spec['fn'] == 'whole':  # a lambda returning an int
            return S.LambdaLR(opt, lambda t: 1 + t // 3)
    raise ValueError('unknown schedule ' + kind)

# The rate each optimizer step uses: the one the scheduler set after as many scheduler.step()s.
def run_schedule(d, m, _):
    p = torch.zeros(1, requires_grad=True)
    opt = torch.optim.SGD([p], lr=float(m['base_lr']))
    sched = make_schedule(opt, json.loads(m['spec']))
    lrs, momenta = [], []
    for step in range(int(m['steps'])):
        lrs.append(opt.param_groups[0]['lr'])
        momenta.append(opt.param_groups[0]['momentum'])
        opt.step()
        if step + 1 < int(m['steps']):  # OneCycleLR refuses steps past total_steps
            sched.step()
    return {'lr': torch.tensor(lrs, dtype=torch.float64),
            'momentum': torch.tensor(momenta, dtype=torch.float64)}

# ReduceLROnPlateau fed the case's metrics, one per epoch, over two parameter groups: each
# group's rate after each step(metric).
def run_plateau(d, m, _):
    a, b = torch.zeros(1, requires_grad=True), torch.zeros(1, requires_grad=True)
    opt = torch.optim.SGD([{'params': [a]}, {'params': [b], 'lr': 0.05}], lr=0.1)
    sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, **json.loads(m['args']))
    rates = []
    for metric in d['metrics'].tolist():
        sched.step(metric)
        rates.append([group['lr'] for group in opt.param_groups])
    return {'lr': torch.tensor(rates, dtype=torch.float64)}

# AveragedModel (EMA with an avg_fn, or SWA's mean) over a Linear-BatchNorm-Linear whose weights
# the case gives for each update.
def run_averaged(d, m, _):
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4),
                                torch.nn.Linear(4, 2))
    avg_fn = None
    if m['decay'] != 'none':
        decay = float(m['decay'])
        avg_fn = lambda average, weight, n: decay * average + (1 - decay) * weight
    averaged = torch.optim.swa_utils.AveragedModel(model, avg_fn=avg_fn,
                                                   use_buffers=m['buffers'] == '1')
    for k in range(int(m['updates'])):
        model.load_state_dict({name: d['w%d.%s' % (k, name)] for name in model.state_dict()})
        averaged.update_parameters(model)
    return dict(averaged.state_dict())

def run_clip(d, m, params):
    model = MLP(sizes(m), m['activation'])
    model.load_state_dict(params, strict=True)
    F.cross_entropy(model(d['x']), d['y']).backward()
    if float(m.get('clip_value', '0')) > 0:
        torch.nn.utils.clip_grad_value_(model.parameters(), float(m['clip_value']))
        return grads(model)
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), float(m['max_norm']),
                                          float(m.get('norm_type', '2')))
    return {'norm': norm, **grads(model)}

def run_cross_entropy(d, m, _):
    logits = d['logits'].clone().requires_grad_(True)
    targets = d['targets']
    C = logits.shape[-1]
    loss = F.cross_entropy(logits.reshape(-1, C), targets.reshape(-1), reduction=m['reduction'],
                           ignore_index=int(m['ignore_index']),
                           label_smoothing=float(m['label_smoothing']))
    if m['reduction'] == 'none':
        loss = loss.reshape(targets.shape)
        (loss * d['w']).sum().backward()
    else:
        loss.backward()
    return {'loss': loss, 'grad.logits': logits.grad}

def run_op(d, m, _):
    x = d['x'].clone().requires_grad_(True)
    extra = {k: d[k].clone().requires_grad_(True) for k in ('weight', 'bias') if k in d}
    op = m['op']
    if op == 'softmax':
        y = torch.softmax(x, int(m['axis']))
    elif op == 'log_softmax':
        y = torch.log_softmax(x, int(m['axis']))
    elif op == 'logsumexp':
        y = torch.logsumexp(x, dim=[int(a) for a in m['axes'].split(',')])
    elif op == 'layer_norm':
        n = int(m['normalized_dims'])
        y = F.layer_norm(x, x.shape[-n:], extra.get('weight'), extra.get('bias'), float(m['eps']))
    elif op == 'rms_norm':
        # torch 1.13 has no rms_norm: the textbook formula.
        y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + float(m['eps']))
        if 'weight' in extra:
            y = y * extra['weight']
    elif op == 'gelu':
        y = F.gelu(x)
    elif op == 'gelu_tanh':
        y = F.gelu(x, approximate='tanh')
    else:
        raise ValueError('unknown op ' + op)
    (y * d['w']).sum().backward()
    return {'y': y, 'grad.x': x.grad, **{'grad.' + k: t.grad for k, t in extra.items()}}

def run_vision(d, m, _):
    x = d['x'].clone().requires_grad_(True)
    extra = {k: d[k].clone().requires_grad_(True) for k in ('weight', 'bias') if k in d}
    stats = {k: d[k].clone() for k in ('running_mean', 'running_var') if k in d}
    ints = lambda k: [int(v) for v in m[k].split(',')]
    flag = lambda k: m.get(k) == '1'
    op, ac = m['op'], flag('autocast')
    # Under autocast the op reads a bf16 matmul output in both libraries.
    with torch.autocast('cpu', dtype=torch.bfloat16, enabled=ac):
        h = x @ d['p'] if ac else x
        if op == 'max_pool2d_relu':
            y = F.max_pool2d(F.relu(h), int(m['k']), int(m['s']), int(m['pad']),
                             ceil_mode=flag('ceil'))
        elif op == 'avg_pool2d':
            y = F.avg_pool2d(h, int(m['k']), int(m['s']), int(m['pad']), ceil_mode=flag('ceil'),
                             count_include_pad=flag('include_pad'))
        elif op == 'adaptive_avg_pool2d':
            y = F.adaptive_avg_pool2d(h, ints('size'))
        # Batch and instance norm as torch's autocast runs them: f32 inside, the result in the
        # input's type (bf16). Group norm is on torch's CUDA autocast f32 list, which mixtape
        # follows on every back end (torch's CPU autocast fails on it: a bf16 input with f32
        # weights), so this side computes it in f32 from the same bf16 input.
        elif op == 'batch_norm':
            y = F.batch_norm(h, stats.get('running_mean'), stats.get('running_var'),
                             extra.get('weight'), extra.get('bias'), training=flag('training'),
                             momentum=float(m['momentum']), eps=float(m['eps']))
        elif op == 'instance_norm':
            y = F.instance_norm(h, weight=extra.get('weight'), bias=extra.get('bias'),
                                eps=float(m['eps']))
        elif op == 'group_norm':
            y = F.group_norm(h.float(), int(m['groups']), extra.get('weight'), extra.get('bias'),
                             float(m['eps']))
        elif op == 'interpolate':
            # torch 1.13's CPU bicubic kernel weighs and sums a bf16 input in bf16 (6% off an f64
            # computation from the same values); mixtape's sums in f32 and rounds once, as its
            # f32 kernel on those values does, which is the reference here.
            source = h.float() if m['mode'] == 'bicubic' else h
            y = F.interpolate(source, size=ints('size'), mode=m['mode'],
                              align_corners=flag('align_corners') if m['mode'] != 'nearest' else None)
            y = y.to(h.dtype)
        elif op == 'adaptive_max_pool2d_relu':
            y = F.adaptive_max_pool2d(F.relu(h), ints('size'))
        elif op == 'pad':
            y = F.pad(h, ints('pads'), mode=m['mode'])
        else:
            raise ValueError('unknown vision op ' + op)
        (y.float() * d['w']).sum().backward()
    return {'y': y.float(), 'grad.x': x.grad, **{'grad.' + k: t.grad for k, t in extra.items()},
            **stats}

def run_scan(d, m, _):
    x = d['x'].clone().requires_grad_(True)
    op, dim, ac = m['op'], int(m['dim']), m.get('autocast') == '1'
    # Under autocast the op reads a bf16 matmul output in both libraries: torch's CPU autocast
    # runs prod in f32 and the rest in bf16 (accumulating in f32); mixtape stores the scans in f32.
    with torch.autocast('cpu', dtype=torch.bfloat16, enabled=ac):
        h = x @ d['p'] if ac else x
        if op == 'cumsum':
            y = torch.cumsum(h, dim)
        elif op == 'cumprod':
            y = torch.cumprod(h, dim)
        elif op == 'logcumsumexp':
            y = torch.logcumsumexp(h.float() if ac else h, dim)
        elif op == 'prod':
            y = torch.prod(h, dim)
        elif op == 'sort':
            y = torch.sort(h, dim, descending=True)[0]
        elif op == 'topk':
            y = torch.topk(h, 3, dim)[0]
        else:
            raise ValueError('unknown scan op ' + op)
        (y.float() * d['w']).sum().backward()
    return {'y': y.float(), 'grad.x': x.grad}

# A functional expression over the inputs a, b, c, ... (those named in 'grads' require a
# gradient); under autocast the first input enters as a @ p, a bf16 matmul output, in both.
def run_expr(d, m, _):
    names = m['names'].split(',')
    wants = set(m['grads'].split(',')) if m['grads'] else set()
    leaves = {n: d[n].clone().requires_grad_(n in wants) for n in names}
    ac = m.get('autocast') == '1'
    with torch.autocast('cpu', dtype=torch.bfloat16, enabled=ac):
        env = dict(leaves)
        if ac:
            env['a'] = env['a'] @ d['p']
        y = eval(m['expr'], dict(torch=torch, F=F, math=math, **env))
        (y.float() * d['w']).sum().backward()
    return {'y': y.float(), **{'grad.' + n: leaves[n].grad for n in wants}}

HANDLERS = {'mlp': run_mlp, 'block': run_block, 'optim': run_optim, 'clip': run_clip,
            'schedule': run_schedule, 'plateau': run_plateau, 'averaged': run_averaged,
            'cross_entropy': run_cross_entropy, 'op': run_op,
            'vision': run_vision, 'resnet': run_resnet, 'seq': run_seq, 'scan': run_scan,
            'expr': run_expr}

folder = sys.argv[1]
cases = sorted(f[:-len('.in.safetensors')] for f in os.listdir(folder)
               if f.endswith('.in.safetensors'))
t1 = time.time()
for case in cases:
    data, meta = load(os.path.join(folder, case + '.in.safetensors'))
    params_path = os.path.join(folder, case + '.params.safetensors')
    params = load(params_path)[0] if os.path.exists(params_path) else None
    result = HANDLERS[meta['kind']](data, meta, params)
    save(os.path.join(folder, case + '.out.safetensors'),
         {k: v.detach() for k, v in result.items() if v is not None})
print('torch %s: %d cases, import %.2f s, cases %.2f s' % (torch.__version__, len(cases),
      t_import, time.time() - t1))

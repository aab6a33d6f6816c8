# bench/peer_jax.py -- the JAX peer: each workload's whole training step under jax.jit (XLA fuses).
"""Run with bench/.venv/bin/python (bench/setup_peers.sh installs JAX there). Prints one JSON line
per workload and precision. The step (forward, gradient, optimizer update) is one jitted function
with the parameters and optimizer state donated, so XLA may update them in place; its compile
time is measured apart (`jit_compile_s`, lower + compile) and never enters the step rate.

bf16 mirrors mixtape's autocast-bf16 policy and torch.autocast: f32 master parameters and
optimizer; matmul inputs (activations, weights, biases) cast to bf16 inside the step, matmul
outputs bf16; norms, softmax, GELU and losses computed in f32.
"""

import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_common as common  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

BF16 = jnp.bfloat16


def dense(x, layer, precision):
    """x @ W + b with W [in, out]; in bf16 the inputs are rounded and the output stays bf16."""
    w, b = layer
    if precision == "bf16":
        return jnp.dot(x.astype(BF16), w.astype(BF16)) + b.astype(BF16)
    return jnp.dot(x, w) + b


def init_dense(key, fan_in, fan_out):
    """PyTorch's nn.Linear initialization: U(-1/sqrt(in), 1/sqrt(in))."""
    bound = 1.0 / math.sqrt(fan_in)
    kw, kb = jax.random.split(key)
    w = jax.random.uniform(kw, (fan_in, fan_out), jnp.float32, -bound, bound)
    b = jax.random.uniform(kb, (fan_out,), jnp.float32, -bound, bound)
    return (w, b)


def init_mlp(key, sizes):
    keys = jax.random.split(key, len(sizes) - 1)
    return [init_dense(k, sizes[i], sizes[i + 1]) for i, k in enumerate(keys)]


def mlp_forward(params, x, precision):
    for i, layer in enumerate(params):
        x = dense(x, layer, precision)
        if i + 1 < len(params):
            x = jax.nn.relu(x)
    return x.astype(jnp.float32)


def adam_update(params, grads, state, lr, beta1, beta2, eps, weight_decay, decoupled):
    """torch.optim.Adam (decoupled=False, L2 decay) / AdamW (decoupled=True) on a pytree."""
    m, v, count = state
    count = count + 1
    bias1 = 1 - beta1 ** count
    bias2 = 1 - beta2 ** count

    def one(p, g, m, v):
        if weight_decay and not decoupled:
            g = g + weight_decay * p
        if weight_decay and decoupled:
            p = p * (1 - lr * weight_decay)
        m = beta1 * m + (1 - beta1) * g
        v = beta2 * v + (1 - beta2) * g * g
        p = p - (lr / bias1) * m / (jnp.sqrt(v) / jnp.sqrt(bias2) + eps)
        return p, m, v

    flat = jax.tree_util.tree_map(one, params, grads, m, v)
    treedef = jax.tree_util.tree_structure(params)
    leaves = treedef.flatten_up_to(flat)
    new_p = treedef.unflatten([leaf[0] for leaf in leaves])
    new_m = treedef.unflatten([leaf[1] for leaf in leaves])
    new_v = treedef.unflatten([leaf[2] for leaf in leaves])
    return new_p, (new_m, new_v, count)


def adam_init(params):
    zeros = jax.tree_util.tree_map(jnp.zeros_like, params)
    return (zeros, jax.tree_util.tree_map(jnp.zeros_like, params), jnp.zeros((), jnp.float32))


def compiled_step(step_fn, args):
    """(compiled executable, seconds to lower and compile it) for the donated-state step."""
    start = time.perf_counter()
    compiled = jax.jit(step_fn, donate_argnums=(0,)).lower(*args).compile()
    return compiled, time.perf_counter() - start


class Runner:
    """Holds the training state between steps: `state` is donated to and returned by each call."""

    def __init__(self, compiled, state, inputs):
        self.compiled, self.state, self.inputs = compiled, state, inputs
        # Trainable parameters: the first member of every state tuple.
        self.parameters = sum(leaf.size for leaf in jax.tree_util.tree_leaves(state[0]))

    def step(self):
        self.state = self.compiled(self.state, *self.inputs())

    def sync(self):
        jax.block_until_ready(self.state)


def mlp_runner(width, batch, precision):
    key = jax.random.PRNGKey(common.SEED)
    kp, kx, ky = jax.random.split(key, 3)
    params = init_mlp(kp, common.mlp_sizes(width))
    x = jax.random.normal(kx, (batch, common.MLP_IN), jnp.float32)
    y = jax.random.normal(ky, (batch, common.MLP_OUT), jnp.float32)

    def step(state, x, y):
        params, opt = state
        loss_fn = lambda p: jnp.mean((mlp_forward(p, x, precision) - y) ** 2)
        grads = jax.grad(loss_fn)(params)
        return adam_update(params, grads, opt, common.MLP_LR, 0.9, 0.999, 1e-8, 0.0, False)

    state = (params, adam_init(params))
    compiled, seconds = compiled_step(step, (state, x, y))
    return Runner(compiled, state, lambda: (x, y)), seconds


def cross_entropy(logits, labels, label_smoothing=0.0):
    """PyTorch's F.cross_entropy (mean) with label smoothing, in f32."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    nll = -jnp.take_along_axis(logp, labels[:, None], axis=-1)[:, 0]
    if label_smoothing:
        nll = (1 - label_smoothing) * nll - label_smoothing * jnp.mean(logp, axis=-1)
    return jnp.mean(nll)


def digits_runner(name, precision):
    cfg = common.DIGITS_LOOPS[name]
    pixels, labels = common.load_digits()
    rows, batch = cfg["train_rows"], cfg["batch"]
    features = jnp.asarray(np.array(pixels[:rows], np.float32))
    classes = jnp.asarray(np.array(labels[:rows], np.int32))
    params = init_mlp(jax.random.PRNGKey(common.SEED), [64, cfg["hidden"], cfg["hidden"], 10])
    adamw = cfg["optimizer"] == "adamw"
    opt = adam_init(params) if adamw else jax.tree_util.tree_map(jnp.zeros_like, params)

    def step(state, index):
        params, opt, key = state
        key, noise_key = jax.random.split(key)
        x = features[index] + cfg["noise"] * jax.random.normal(noise_key, (batch, 64))
        loss_fn = lambda p: cross_entropy(mlp_forward(p, x, precision), classes[index],
                                          cfg["label_smoothing"])
        grads = jax.grad(loss_fn)(params)
        if adamw:
            params, opt = adam_update(params, grads, opt, cfg["lr"], 0.9, 0.999, 1e-8,
                                      cfg["weight_decay"], True)
            return params, opt, key
        # torch.optim.SGD with momentum: buf = momentum * buf + g (buf starts as g), p -= lr * buf.
        momentum = jax.tree_util.tree_map(lambda b, g: cfg["momentum"] * b + g, opt, grads)
        params = jax.tree_util.tree_map(lambda p, b: p - cfg["lr"] * b, params, momentum)
        return params, momentum, key

    rng = np.random.default_rng(common.SEED)
    per_epoch = rows // batch  # shuffled, drop_last
    loader = {"order": None, "next": per_epoch}

    def next_index():
        if loader["next"] == per_epoch:
            loader["order"], loader["next"] = rng.permutation(rows).astype(np.int32), 0
        index = loader["order"][loader["next"] * batch:(loader["next"] + 1) * batch]
        loader["next"] += 1
        return (index,)

    state = (params, opt, jax.random.PRNGKey(common.SEED + 1))
    compiled, seconds = compiled_step(step, (state, np.zeros(batch, np.int32)))
    return Runner(compiled, state, next_index), seconds


def layer_norm(x, scale, shift, eps=1e-5):
    x = x.astype(jnp.float32)
    mean = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean((x - mean) ** 2, axis=-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + eps) * scale + shift


def init_gpt(key, vocab, layers, width, context):
    keys = iter(jax.random.split(key, 4 + 4 * layers))
    # A fresh pair per norm: donated state may not hold one buffer twice.
    norm = lambda: (jnp.ones((width,), jnp.float32), jnp.zeros((width,), jnp.float32))
    blocks = []
    for _ in range(layers):
        blocks.append({
            "ln1": norm(), "qkv": init_dense(next(keys), width, 3 * width),
            "proj": init_dense(next(keys), width, width), "ln2": norm(),
            "fc1": init_dense(next(keys), width, 4 * width),
            "fc2": init_dense(next(keys), 4 * width, width)})
    head = init_dense(next(keys), width, vocab)
    return {"wte": jax.random.normal(next(keys), (vocab, width), jnp.float32),
            "wpe": jax.random.normal(next(keys), (context, width), jnp.float32),
            "blocks": blocks, "ln_f": norm(), "head": head}


def gpt_forward(params, tokens, heads, precision):
    """CharGpt (examples/char_gpt_model.h): embeddings, pre-norm blocks, final norm, linear head
    with bias."""
    low = BF16 if precision == "bf16" else jnp.float32
    batch, time = tokens.shape
    x = params["wte"][tokens] + params["wpe"][:time]
    width = x.shape[-1]
    head_dim = width // heads
    mask = jnp.tril(jnp.ones((time, time), bool))
    for block in params["blocks"]:
        qkv = dense(layer_norm(x, *block["ln1"]), block["qkv"], precision)
        q, k, v = [t.reshape(batch, time, heads, head_dim).transpose(0, 2, 1, 3)
                   for t in jnp.split(qkv, 3, axis=-1)]
        scores = jnp.einsum("bhtd,bhsd->bhts", q, k) * jnp.asarray(1 / math.sqrt(head_dim), low)
        scores = jnp.where(mask, scores.astype(jnp.float32), -jnp.inf)
        attention = jax.nn.softmax(scores, axis=-1).astype(low)
        merged = jnp.einsum("bhts,bhsd->bhtd", attention, v).transpose(0, 2, 1, 3)
        x = x + dense(merged.reshape(batch, time, width), block["proj"], precision)
        hidden = dense(layer_norm(x, *block["ln2"]), block["fc1"], precision)
        hidden = jax.nn.gelu(hidden.astype(jnp.float32), approximate=True).astype(low)
        x = x + dense(hidden, block["fc2"], precision)
    return dense(layer_norm(x, *params["ln_f"]), params["head"], precision)


def gpt_runner(precision):
    cfg = common.GPT
    tokens, vocab = common.load_fortunes()
    data = jnp.asarray(np.array(tokens, np.int32))
    context, batch = cfg["context"], cfg["batch"]
    params = init_gpt(jax.random.PRNGKey(common.SEED), vocab, cfg["layers"], cfg["width"], context)
    offsets = jnp.arange(context)

    def step(state, starts):
        params, opt = state
        windows = starts[:, None] + offsets
        x, y = data[windows], data[windows + 1]

        def loss_fn(p):
            logits = gpt_forward(p, x, cfg["heads"], precision)
            return cross_entropy(logits.reshape(-1, vocab), y.reshape(-1))

        grads = jax.grad(loss_fn)(params)
        # torch.nn.utils.clip_grad_norm_: scale by clip / (norm + 1e-6) when that is below 1.
        norm = jnp.sqrt(sum(jnp.sum(g * g) for g in jax.tree_util.tree_leaves(grads)))
        scale = jnp.minimum(1.0, cfg["clip"] / (norm + 1e-6))
        grads = jax.tree_util.tree_map(lambda g: g * scale, grads)
        return adam_update(params, grads, opt, cfg["lr"], cfg["beta1"], cfg["beta2"], cfg["eps"],
                           cfg["weight_decay"], True)

    rng = np.random.default_rng(common.SEED)
    state = (params, adam_init(params))
    compiled, seconds = compiled_step(step, (state, np.zeros(batch, np.int32)))
    starts = lambda: (rng.integers(0, len(tokens) - context, batch).astype(np.int32),)
    return Runner(compiled, state, starts), seconds


def conv2d(x, w, stride, precision):
    """F.conv2d without bias, NCHW / OIHW, padding K // 2; bf16 operands and result in bf16
    (XLA accumulates in f32), as autocast's conv2d."""
    k = w.shape[-1]
    if precision == "bf16":
        x, w = x.astype(BF16), w.astype(BF16)
    return jax.lax.conv_general_dilated(x, w, (stride, stride), [(k // 2, k // 2)] * 2,
                                        dimension_numbers=("NCHW", "OIHW", "NCHW"))


def batch_norm(x, bn, stats):
    """BatchNorm2d in training mode: batch statistics in f32 (biased variance normalizes, the
    unbiased one goes into the running variance, as PyTorch), the result in x's dtype. Returns
    (y, new running statistics)."""
    scale, shift = bn
    mean_run, var_run = stats
    xf = x.astype(jnp.float32)
    mean = jnp.mean(xf, axis=(0, 2, 3))
    var = jnp.mean(jnp.square(xf - mean[None, :, None, None]), axis=(0, 2, 3))
    inv = jax.lax.rsqrt(var + common.BN_EPS) * scale
    y = (xf - mean[None, :, None, None]) * inv[None, :, None, None] + shift[None, :, None, None]
    count = x.size // x.shape[1]
    m = common.BN_MOMENTUM
    new_stats = ((1 - m) * mean_run + m * jax.lax.stop_gradient(mean),
                 (1 - m) * var_run + m * jax.lax.stop_gradient(var) * count / (count - 1))
    return y.astype(x.dtype), new_stats


def init_conv(key, inp, out, k):
    """Kaiming normal (fan_out, ReLU), torchvision's ResNet initialization."""
    return jax.random.normal(key, (out, inp, k, k), jnp.float32) * math.sqrt(2.0 / (out * k * k))


def init_bn(channels):
    # A fresh array per member: donated state may not hold one buffer twice.
    return ((jnp.ones((channels,), jnp.float32), jnp.zeros((channels,), jnp.float32)),
            (jnp.zeros((channels,), jnp.float32), jnp.ones((channels,), jnp.float32)))


def init_block(key, inp, out, stride):
    """(params, running statistics) of a BasicBlock."""
    k1, k2, k3 = jax.random.split(key, 3)
    (bn1, s1), (bn2, s2) = init_bn(out), init_bn(out)
    params = {"conv1": init_conv(k1, inp, out, 3), "bn1": bn1,
              "conv2": init_conv(k2, out, out, 3), "bn2": bn2}
    stats = {"bn1": s1, "bn2": s2}
    if stride != 1 or inp != out:
        bn, s = init_bn(out)
        params["downsample"] = {"conv": init_conv(k3, inp, out, 1), "bn": bn}
        stats["downsample"] = s
    return params, stats


def block_forward(p, stats, x, stride, precision):
    new = {}
    if "downsample" in p:
        identity, new["downsample"] = batch_norm(
            conv2d(x, p["downsample"]["conv"], stride, precision), p["downsample"]["bn"],
            stats["downsample"])
    else:
        identity = x
    y, new["bn1"] = batch_norm(conv2d(x, p["conv1"], stride, precision), p["bn1"], stats["bn1"])
    y = jax.nn.relu(y)
    y, new["bn2"] = batch_norm(conv2d(y, p["conv2"], 1, precision), p["bn2"], stats["bn2"])
    return jax.nn.relu(y + identity.astype(y.dtype)), new


def init_resnet18(key, classes):
    keys = jax.random.split(key, 10)
    bn, s = init_bn(64)
    params = {"conv1": init_conv(keys[0], 3, 64, 7), "bn1": bn, "blocks": []}
    stats = {"bn1": s, "blocks": []}
    for i, (inp, out, stride) in enumerate(common.resnet18_blocks()):
        p, s = init_block(keys[1 + i], inp, out, stride)
        params["blocks"].append(p)
        stats["blocks"].append(s)
    params["fc"] = init_dense(keys[9], 512, classes)
    return params, stats


def resnet18_forward(params, stats, x, precision):
    """(logits, new running statistics) of torchvision's ResNet-18."""
    new = {"blocks": []}
    y, new["bn1"] = batch_norm(conv2d(x, params["conv1"], 2, precision), params["bn1"],
                               stats["bn1"])
    y = jax.nn.relu(y)
    y = jax.lax.reduce_window(y, -jnp.inf, jax.lax.max, (1, 1, 3, 3),
                              (1, 1, 2, 2), ((0, 0), (0, 0), (1, 1), (1, 1)))
    for p, s, (_, _, stride) in zip(params["blocks"], stats["blocks"], common.resnet18_blocks()):
        y, block_stats = block_forward(p, s, y, stride, precision)
        new["blocks"].append(block_stats)
    pooled = jnp.mean(y.astype(jnp.float32), axis=(2, 3)).astype(y.dtype)
    return dense(pooled, params["fc"], precision).astype(jnp.float32), new


def sgd_momentum(params, grads, buffers, lr, momentum):
    """torch.optim.SGD with momentum: buf = momentum * buf + g (buf starts as g), p -= lr * buf."""
    buffers = jax.tree_util.tree_map(lambda b, g: momentum * b + g, buffers, grads)
    params = jax.tree_util.tree_map(lambda p, b: p - lr * b, params, buffers)
    return params, buffers


def resnet18_runner(precision):
    cfg = common.RESNET18
    kp, kx, ky = jax.random.split(jax.random.PRNGKey(common.SEED), 3)
    params, stats = init_resnet18(kp, cfg["classes"])
    x = jax.random.normal(kx, (cfg["batch"], cfg["channels"], cfg["size"], cfg["size"]),
                          jnp.float32)
    y = jax.random.randint(ky, (cfg["batch"],), 0, cfg["classes"])

    def step(state, x, y):
        params, buffers, stats = state

        def loss_fn(p):
            logits, new_stats = resnet18_forward(p, stats, x, precision)
            return cross_entropy(logits, y), new_stats

        grads, new_stats = jax.grad(loss_fn, has_aux=True)(params)
        params, buffers = sgd_momentum(params, grads, buffers, cfg["lr"], cfg["momentum"])
        return params, buffers, new_stats

    state = (params, jax.tree_util.tree_map(jnp.zeros_like, params), stats)
    compiled, seconds = compiled_step(step, (state, x, y))
    return Runner(compiled, state, lambda: (x, y)), seconds


def init_digits_cnn(key):
    k1, k2, k3, k4 = jax.random.split(key, 4)
    bn, s = init_bn(16)
    b1, s1 = init_block(k2, 16, 16, 1)
    b2, s2 = init_block(k3, 16, 32, 2)
    params = {"conv1": init_conv(k1, 1, 16, 3), "bn1": bn, "layer1": b1, "layer2": b2,
              "fc": init_dense(k4, 32, 10)}
    return params, {"bn1": s, "layer1": s1, "layer2": s2}


def digits_cnn_forward(params, stats, pixels, precision):
    new = {}
    x = pixels.reshape(-1, 1, 8, 8)
    y, new["bn1"] = batch_norm(conv2d(x, params["conv1"], 1, precision), params["bn1"],
                               stats["bn1"])
    y, new["layer1"] = block_forward(params["layer1"], stats["layer1"], jax.nn.relu(y), 1,
                                     precision)
    y, new["layer2"] = block_forward(params["layer2"], stats["layer2"], y, 2, precision)
    pooled = jnp.mean(y.astype(jnp.float32), axis=(2, 3)).astype(y.dtype)
    return dense(pooled, params["fc"], precision).astype(jnp.float32), new


def digits_cnn_runner(precision):
    cfg = common.DIGITS_CNN
    pixels, labels = common.load_digits()
    rows, batch, shift = cfg["train_rows"], cfg["batch"], cfg["shift"]
    features = jnp.asarray(np.array(pixels[:rows], np.float32).reshape(rows, 8, 8))
    classes = jnp.asarray(np.array(labels[:rows], np.int32))
    params, stats = init_digits_cnn(jax.random.PRNGKey(common.SEED))
    pixel = jnp.arange(8)
    images = jnp.arange(batch)[:, None, None]

    def step(state, index, lr):
        params, buffers, stats, key = state
        key, shift_key, noise_key = jax.random.split(key, 3)
        # examples/digits_train.h's shifted: out[y][x] = in[y - dy][x - dx], zeros coming in.
        padded = jnp.pad(features[index], ((0, 0), (shift, shift), (shift, shift)))
        dy, dx = jax.random.randint(shift_key, (2, batch), -shift, shift + 1)
        x = padded[images, (shift - dy)[:, None, None] + pixel[None, :, None],
                   (shift - dx)[:, None, None] + pixel[None, None, :]].reshape(batch, 64)
        x = x + cfg["noise"] * jax.random.normal(noise_key, (batch, 64))

        def loss_fn(p):
            logits, new_stats = digits_cnn_forward(p, stats, x, precision)
            return cross_entropy(logits, classes[index], cfg["label_smoothing"]), new_stats

        grads, new_stats = jax.grad(loss_fn, has_aux=True)(params)
        params, buffers = sgd_momentum(params, grads, buffers, lr, cfg["momentum"])
        return params, buffers, new_stats, key

    rng = np.random.default_rng(common.SEED)
    per_epoch = rows // batch  # shuffled, drop_last
    loader = {"order": None, "next": per_epoch, "step": 0}

    def next_inputs():
        if loader["next"] == per_epoch:
            loader["order"], loader["next"] = rng.permutation(rows).astype(np.int32), 0
        index = loader["order"][loader["next"] * batch:(loader["next"] + 1) * batch]
        loader["next"] += 1
        # mt::CosineWithWarmup without warm-up, set outside the step as the example does.
        t = loader["step"] % cfg["steps"]
        loader["step"] += 1
        return index, np.float32(0.5 * cfg["lr"] * (1 + math.cos(math.pi * t / cfg["steps"])))

    state = (params, jax.tree_util.tree_map(jnp.zeros_like, params), stats,
             jax.random.PRNGKey(common.SEED + 1))
    compiled, seconds = compiled_step(step, (state, np.zeros(batch, np.int32), np.float32(0)))
    return Runner(compiled, state, next_inputs), seconds


def conv_runner(dtype, conv_pass, shape):
    """One convolution pass under jax.jit: lax.conv_general_dilated, or its input or weight
    gradient through jax.vjp (the transposed convolutions XLA emits for the backward pass)."""
    n, c, h, o, k, s = shape
    oh = common.conv_out_size(shape)
    kx, kw, ky = jax.random.split(jax.random.PRNGKey(common.SEED), 3)
    jdtype = jnp.float32 if dtype == "f32" else BF16
    x = jax.random.normal(kx, (n, c, h, h), jnp.float32).astype(jdtype)
    w = jax.random.normal(kw, (o, c, k, k), jnp.float32).astype(jdtype)
    dy = jax.random.normal(ky, (n, o, oh, oh), jnp.float32).astype(jdtype)
    conv = lambda x, w: conv2d(x, w, s, "f32")
    if conv_pass == "fwd":
        fn, args = conv, (x, w)
    elif conv_pass == "dgrad":
        fn, args = lambda w, dy: jax.vjp(lambda x: conv(x, w), x)[1](dy)[0], (w, dy)
    else:
        fn, args = lambda x, dy: jax.vjp(lambda w: conv(x, w), w)[1](dy)[0], (x, dy)
    start = time.perf_counter()
    compiled = jax.jit(fn).lower(*args).compile()
    seconds = time.perf_counter() - start
    holder = {"out": None}

    def step():
        holder["out"] = compiled(*args)

    return step, lambda: jax.block_until_ready(holder["out"]), seconds


def gemm_runner(dtype, shape):
    m, n, k = shape
    ka, kb = jax.random.split(jax.random.PRNGKey(common.SEED))
    jdtype = jnp.float32 if dtype == "f32" else BF16
    a = jax.random.normal(ka, (m, k), jnp.float32).astype(jdtype)
    b = jax.random.normal(kb, (k, n), jnp.float32).astype(jdtype)
    start = time.perf_counter()
    # f32 output for bf16 operands (f32 accumulation), as mixtape's GEMM sweep.
    compiled = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32)).lower(
        a, b).compile()
    seconds = time.perf_counter() - start
    holder = {"out": None}

    def step():
        holder["out"] = compiled(a, b)

    return step, lambda: jax.block_until_ready(holder["out"]), seconds


def main():
    args = common.peer_arguments(__doc__.splitlines()[0]).parse_args()
    makers = {"gemm": gemm_runner, "conv": conv_runner, "resnet18": resnet18_runner,
              "digits_cnn": digits_cnn_runner, "mlp": mlp_runner, "digits": digits_runner,
              "gpt": gpt_runner}
    for name, precision in common.peer_cases(args, "peer_jax"):
        made = common.make_workload(name, precision, makers)
        if len(made) == 3:  # a GEMM or convolution: (step, sync, compile seconds)
            (step, sync, compile_seconds), parameters = made, None
        else:  # a model: (runner, compile seconds)
            runner, compile_seconds = made
            step, sync, parameters = runner.step, runner.sync, runner.parameters
        result = common.measure(step, sync, args.warmup, args.windows, args.window_seconds,
                                args.budget_seconds)
        record = {"system": "jax", "workload": name, "version": jax.__version__,
                  "jit_compile_s": compile_seconds}
        common.emit_workload(record, name, precision, parameters, result)


if __name__ == "__main__":
    main()

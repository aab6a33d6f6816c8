# bench/peer_torch_vision.py -- bench_vision_ops's PyTorch peer: the same ops on the same shapes,
# forward and backward in eager mode, one JSON line each.
"""Run by bench_vision_ops with: WINDOW_SECONDS."""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_common as common  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402


def main():
    window_seconds = float(sys.argv[1])
    torch.set_num_threads(os.cpu_count())  # mixtape's CPU back end uses every core
    torch.manual_seed(3)
    x = torch.randn(8, 64, 32, 32)
    theta = torch.randn(8, 2, 3) * 0.1 + torch.tensor([[1.0, 0, 0], [0, 1, 0]])
    weight = torch.randn(64, 64, 3, 3) * 0.05
    positions = torch.randint(0, 1024, (8, 64, 1024))
    weight3 = torch.randn(16, 16, 3, 3, 3) * 0.05
    weight_up = torch.randn(16, 16, 2, 2, 2) * 0.1

    def volume(t):
        return t.reshape(8, 16, 16, 16, 16)

    ops = {
        "unfold_fold": lambda t: F.fold(F.unfold(t, 3, 1, 1), (32, 32), 3, 1, 1),
        "affine_grid_sample": lambda t: F.grid_sample(
            t, F.affine_grid(theta, (8, 64, 32, 32), align_corners=False), align_corners=False),
        "interpolate_bilinear": lambda t: F.interpolate(t, size=(64, 64), mode="bilinear",
                                                        align_corners=False),
        "take_along_dim": lambda t: torch.take_along_dim(t.reshape(8, 64, 1024), positions, 2),
        "sort": lambda t: torch.sort(t.reshape(8, 64, 1024), 2).values,
        "interpolate_bicubic": lambda t: F.interpolate(t, size=(64, 64), mode="bicubic",
                                                       align_corners=False),
        "conv2d_same_reflect": lambda t: F.conv2d(F.pad(t, (1, 1, 1, 1), mode="reflect"), weight),
        "conv3d": lambda t: F.conv3d(volume(t), weight3, padding=1),
        "conv_transpose3d": lambda t: F.conv_transpose3d(volume(t), weight_up, stride=2),
        "max_pool3d": lambda t: F.max_pool3d(volume(t), 3, 2, 1),
        "avg_pool3d": lambda t: F.avg_pool3d(volume(t), 2),
    }
    for name, op in ops.items():
        def step():
            w = x.detach().requires_grad_()
            (op(w) ** 2).sum().backward()

        result = common.measure(step, lambda: None, 3, 3, window_seconds, 20.0)
        record = {"bench": "vision_ops", "system": "torch", "op": name,
                  "torch": torch.__version__, "threads": torch.get_num_threads()}
        record.update(result)
        print(json.dumps(record), flush=True)


main()

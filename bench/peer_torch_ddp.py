# bench/peer_torch_ddp.py -- the PyTorch DistributedDataParallel peer of the scaling benchmark.
"""Times peer_torch.py's digits_mlp and char_gpt steps on N processes, one thread each: N = 1 is
the plain single-process loop, N > 1 wraps the model in DistributedDataParallel (gloo back end,
processes on localhost started by torch.multiprocessing). Each process draws its own batches at
the per-process batch size, as with a DistributedSampler. Rank 0 prints one JSON line per
workload and precision; every rank runs the same steps (rank 0's warm-up sets the windows).

Run with /usr/bin/python3 (Debian's python3-torch); bench/scaling.py sets OPENBLAS_* and
OMP_NUM_THREADS=1 in the environment.
"""

import argparse
import os
import socket
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_common as common  # noqa: E402
import peer_torch  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402


def rank0_value(value):
    """Rank 0's number on every process (a broadcast over the gloo group)."""
    t = torch.tensor([value], dtype=torch.float64)
    dist.broadcast(t, 0)
    return float(t.item())


def ddp(model):
    """DistributedDataParallel with its defaults (25 MB buckets, buffers broadcast every forward),
    except for boolean buffers (char_gpt's causal mask, a constant), which gloo cannot broadcast."""
    constant = [name for name, b in model.named_buffers() if b.dtype == torch.bool]
    DDP = torch.nn.parallel.DistributedDataParallel
    DDP._set_params_and_buffers_to_ignore_for_model(model, constant)
    return DDP(model)


def run(rank, world, port, args, queue):
    torch.set_num_threads(1)
    wrap, agree = None, lambda t: t
    if world > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world)
        wrap, agree = ddp, rank0_value
    for name in common.split_list(args.workloads):
        for precision in common.split_list(args.precisions):
            if name == "char_gpt":
                step, parameters = peer_torch.gpt_step(precision, wrap, rank)
                batch = common.GPT["batch"]
            else:
                step, parameters = peer_torch.digits_step(name, precision, wrap, rank)
                batch = common.DIGITS_LOOPS[name]["batch"]
            result = common.measure(step, lambda: None, args.warmup, args.windows,
                                    args.window_seconds, args.budget_seconds, agree)
            if rank == 0:
                record = {"system": "torch", "workload": name, "precision": precision,
                          "world_size": world, "threads": 1, "version": torch.__version__,
                          "blas": peer_torch.blas_library(), "parameters": parameters,
                          "batch_per_process": batch,
                          "data_parallel": "DistributedDataParallel(gloo)" if world > 1
                          else "none (one process)"}
                record.update(result)
                queue.put(record)
    if world > 1:
        dist.destroy_process_group()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    parser = common.peer_arguments(__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2, help="processes (1: no DDP)")
    args = parser.parse_args()
    for name in common.split_list(args.workloads):
        if name not in ("digits_mlp", "char_gpt"):
            sys.exit(f"peer_torch_ddp: unknown workload {name} (digits_mlp, char_gpt)")
    context = mp.get_context("spawn")
    queue = context.SimpleQueue()
    mp.spawn(run, args=(args.world_size, free_port(), args, queue), nprocs=args.world_size)
    while not queue.empty():
        common.emit(queue.get())


if __name__ == "__main__":
    main()

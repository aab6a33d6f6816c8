#!/usr/bin/env python3
# bench/scaling.py -- the data-parallel scaling benchmark: mixtape (MPI) against PyTorch DDP (gloo).
"""Times the digits MLP and the char GPT at 1 and 2 processes, one thread each, in mixtape
(`bench_training`, plain at 1 process, under `mpirun -np 2` with dist::DataParallel at 2) and in
PyTorch (`peer_torch_ddp.py`: plain at 1 process, DistributedDataParallel over gloo at 2), all in
one run on this machine, alternating the systems in each round. Prints one JSON document
(stdout and --out) with steps/s, samples/s, the scaling efficiency (2-process samples/s over
twice the 1-process samples/s), what data parallelism adds to a step, and mixtape's time in
all_reduce against the rest of the step; progress and a table go to stderr.

  cmake --build build --target bench_training
  chrt -f 50 python3 bench/scaling.py --out scaling.json    # about 2 minutes on 2 cores

Each process has the per-process batch of the workload (digits 64, char GPT 12), so 2 processes
train on twice the samples per step (weak scaling, as DDP is used). Each configuration's rate is
the best of --repeats rounds (load from other work only slows a run down).
"""

import argparse
import os
import shutil
import sys

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, BENCH_DIR)
import run as driver  # noqa: E402

WORKLOADS = ("digits_mlp", "char_gpt")
TIMING = {"quick": dict(warmup=3, windows=3, window_seconds=0.2, budget_seconds=3.0),
          "full": dict(warmup=5, windows=5, window_seconds=0.5, budget_seconds=8.0)}


def scheduling():
    """The scheduling class this run has (chrt -f 50 gives SCHED_FIFO, which the children
    inherit): on a shared machine only a real-time class keeps other work off the cores."""
    policy = os.sched_getscheduler(0)
    names = {os.SCHED_OTHER: "SCHED_OTHER", os.SCHED_FIFO: "SCHED_FIFO", os.SCHED_RR: "SCHED_RR"}
    return {"policy": names.get(policy, str(policy)),
            "priority": os.sched_getparam(0).sched_priority}


def mixtape_command(binary, mpirun, world, name, precision, step, timing):
    command = [binary, "--workloads", name, "--precisions", precision, "--step", step]
    command += driver.timing_flags(timing)
    if world == 1:
        return command
    return [mpirun, "--allow-run-as-root", "--oversubscribe", "-np", str(world), "-x",
            "OMP_NUM_THREADS=1", "-x", "MIXTAPE_DEVICE=cpu"] + command


def torch_command(world, name, precision, timing):
    return (["/usr/bin/python3", os.path.join(BENCH_DIR, "peer_torch_ddp.py"), "--workloads", name,
             "--precisions", precision, "--world-size", str(world)] + driver.timing_flags(timing))


def samples_per_s(record):
    batch = record.get("batch_per_process", record.get("batch"))
    return record["steps_per_s"] * record.get("world_size", 1) * batch


def summarize(name, precision, runs):
    """The figures of one workload and precision from every run's records."""
    out = {"workload": name, "precision": precision, "runs": runs}
    for system in ("mixtape", "torch"):
        best = {}
        for world in (1, 2):
            records = runs.get(f"{system}_{world}", [])
            if records:
                best[world] = max(records, key=lambda r: r["steps_per_s"])
        for world, record in best.items():
            out[f"{system}_{world}p_steps_per_s"] = record["steps_per_s"]
            out[f"{system}_{world}p_samples_per_s"] = samples_per_s(record)
        if 1 in best and 2 in best:
            one, two = best[1], best[2]
            out[f"{system}_scaling_efficiency"] = samples_per_s(two) / (2 * samples_per_s(one))
            # What running data parallel adds to a step's wall time: the reduction, waiting for
            # the slower process, and the hooks.
            out[f"{system}_data_parallel_ms_per_step"] = 1e3 * (
                1 / two["steps_per_s"] - 1 / one["steps_per_s"])
        if system == "mixtape" and 2 in best:
            stats = best[2].get("per_step_stats", {})
            step_ms = 1e3 / best[2]["steps_per_s"]
            reduce_ms = 1e3 * stats.get("collective_seconds", 0)
            out["mixtape_all_reduce_ms_per_step"] = reduce_ms
            out["mixtape_all_reduce_share_of_step"] = reduce_ms / step_ms
            # The rank that waits least shows the transfer itself; the others add their wait.
            out["mixtape_all_reduce_ms_per_step_by_rank"] = [
                1e3 * r["collective_seconds_per_step"] for r in best[2].get("by_rank", [])]
            out["mixtape_all_reduces_per_step"] = stats.get("collectives")
            out["mixtape_all_reduce_bytes_per_step"] = stats.get("collective_bytes")
    if "mixtape_2p_samples_per_s" in out and "torch_2p_samples_per_s" in out:
        out["ratio_2p_vs_torch"] = out["mixtape_2p_samples_per_s"] / out["torch_2p_samples_per_s"]
    if "mixtape_scaling_efficiency" in out and "torch_scaling_efficiency" in out:
        out["targets"] = {
            "efficiency_at_or_above_ddp":
                out["mixtape_scaling_efficiency"] >= out["torch_scaling_efficiency"],
            "throughput_2p_at_least_2x_ddp": out.get("ratio_2p_vs_torch", 0) >= 2}
    return out


def fmt(value, digits=2):
    return "-" if value is None else f"{value:.{digits}f}"


def print_table(document):
    lines = [f"{'workload':<18} {'system':<8} {'1p steps/s':>11} {'2p steps/s':>11} "
             f"{'efficiency':>10} {'DP ms/step':>10}  all_reduce ms/step by rank"]
    for key, w in document["workloads"].items():
        for system in ("mixtape", "torch"):
            reduce_ms = (" ".join(fmt(ms, 3) for ms in w.get(
                "mixtape_all_reduce_ms_per_step_by_rank", [])) if system == "mixtape" else "-")
            lines.append(f"{key:<18} {system:<8} {fmt(w.get(f'{system}_1p_steps_per_s'), 1):>11} "
                         f"{fmt(w.get(f'{system}_2p_steps_per_s'), 1):>11} "
                         f"{fmt(w.get(f'{system}_scaling_efficiency')):>10} "
                         f"{fmt(w.get(f'{system}_data_parallel_ms_per_step'), 3):>10}  {reduce_ms}")
        lines.append(f"{'':<18} mixtape/torch at 2 processes: {fmt(w.get('ratio_2p_vs_torch'))}x")
    print("\n".join(lines), file=sys.stderr)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="shorter windows")
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--precisions", default="fp32")
    parser.add_argument("--repeats", type=int, default=3, help="rounds; the best of them counts")
    parser.add_argument("--step", default="traced", choices=("traced", "compiled"),
                        help="mixtape's loop: traced every step, or through mt::compile")
    parser.add_argument("--build-dir", default=os.path.join(driver.REPO_DIR, "build"))
    parser.add_argument("--out", help="also write the JSON document here")
    args = parser.parse_args()
    timing = TIMING["quick" if args.quick else "full"]
    notes = []
    binary = os.path.join(args.build_dir, "bench_training")
    mpirun = shutil.which("mpirun")
    if not os.path.exists(binary):
        sys.exit(f"scaling: {binary} is missing: cmake --build build --target bench_training")
    if not mpirun:
        sys.exit("scaling: mpirun is missing (apt-get install openmpi-bin libopenmpi-dev)")
    mixtape_env = driver.base_env()
    mixtape_env.update(MIXTAPE_DEVICE="cpu", OMP_NUM_THREADS="1")
    torch_env = driver.torch_env(notes)
    torch_env.update(OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    machine = driver.machine_info()
    machine["scheduling"] = scheduling()
    if machine["scheduling"]["policy"] == "SCHED_OTHER":
        notes.append("not run under a real-time class: on a shared machine the figures move "
                     "with other work (chrt -f 50 python3 bench/scaling.py)")
    workloads = [w for w in args.workloads.split(",") if w]
    precisions = [p for p in args.precisions.split(",") if p]
    runs, errors = {}, []
    timeout = 600
    for round_index in range(args.repeats):
        for name in workloads:
            for precision in precisions:
                key = f"{name}/{precision}"
                for world in (1, 2):
                    for system in ("mixtape", "torch"):
                        label = f"{system}_{world}"
                        if system == "mixtape":
                            command = mixtape_command(binary, mpirun, world, name, precision,
                                                      args.step, timing)
                            env = mixtape_env
                        else:
                            command, env = torch_command(world, name, precision, timing), torch_env
                        records, error = driver.run_child(f"{key} {label} round {round_index + 1}",
                                                          command, env, timeout)
                        for r in records:
                            r.setdefault("world_size", world)
                        runs.setdefault(key, {}).setdefault(label, []).extend(records)
                        if error:
                            errors.append(f"{key} {label}: {error}")
    document = {"mixtape_scaling_bench": 1, "machine": machine, "timing": timing,
                "mixtape_step": args.step, "repeats": args.repeats,
                "efficiency": "2-process samples/s / (2 x 1-process samples/s); per-process "
                              "batch fixed, one thread per process",
                "notes": notes, "errors": errors,
                "workloads": {key: summarize(*key.split("/"), per) for key, per in runs.items()}}
    document["machine"]["load_average_1min_at_end"] = round(os.getloadavg()[0], 2)
    driver.emit_document(document, args.out)
    print_table(document)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())

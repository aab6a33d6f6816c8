#!/usr/bin/env python3
# bench/run.py -- the benchmark driver: mixtape and its peers in one run, one JSON document out.
"""Runs the benchmark programs (built beforehand: bench_training, bench_gemm) under each mixtape
back end, then the PyTorch and JAX peers on the same workloads, and prints one JSON document
with steps/s, GFLOP/s and ratios (mixtape / peer: above 1 means mixtape is faster). Progress and
a summary table go to stderr; the JSON goes to stdout (and to --out).

  python3 bench/run.py --quick                 # about six minutes on 2 cores (vision: four)
  python3 bench/run.py                         # every size, longer windows
  python3 bench/run.py --only mlp,gemm --build-dir /tmp/build

It builds nothing: build the programs first (cmake --build build --target bench_training
bench_gemm). Peers: bench/setup_peers.sh installs JAX into bench/.venv and unpacks OpenBLAS for
Debian's torch; what is missing is skipped with a note in the output.
"""

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
REPO_DIR = os.path.dirname(BENCH_DIR)
sys.path.insert(0, BENCH_DIR)
import bench_common as common  # noqa: E402

OPENBLAS_DIR = os.path.join(BENCH_DIR, ".openblas", "usr", "lib", "x86_64-linux-gnu",
                            "openblas-pthread")

# Each mode is one child environment for the mixtape programs (runtime/device.h reads these).
MIXTAPE_MODES = {
    "compiled": {"MIXTAPE_DEVICE": "cpu"},
    "eager": {"MIXTAPE_DEVICE": "cpu", "MIXTAPE_EAGER": "1"},
    "reference": {"MIXTAPE_DEVICE": "reference"},
    "step": {"MIXTAPE_DEVICE": "cpu"},
}
# Modes that differ in how bench_training writes the step rather than in the environment:
# "step" runs it through mt::compile (traced once, then replayed), the others trace every step.
MODE_ARGS = {"step": ["--step", "compiled"]}

# What each size of run covers and how long it times each workload. The reference executor (an
# oracle, not a speed target) runs only where it is cheap, with few warm-up steps.
# GEMM sizes: N for an N^3 cube, "MxNxK" for the MLPs' small products (K = 64-256).
SMALL_GEMMS = ["256x64x64", "256x256x64", "4096x64x64", "4096x256x256"]
PLANS = {
    "quick": dict(mlp=["mlp_w64_b256", "mlp_w64_b4096"], gemm_sizes=SMALL_GEMMS + [256, 512, 1024],
                  timing=dict(warmup=3, windows=3, window_seconds=0.2, budget_seconds=2.0),
                  reference=["mlp_w64_b256", "digits_mlp"],
                  reference_timing=dict(warmup=2, windows=3, window_seconds=0.25,
                                        budget_seconds=2.0),
                  child_timeout=300),
    "full": dict(mlp=["mlp_w64_b256", "mlp_w64_b4096", "mlp_w128_b4096", "mlp_w256_b4096"],
                 gemm_sizes=SMALL_GEMMS + [256, 512, 1024, 2048],
                 timing=dict(warmup=5, windows=5, window_seconds=1.0, budget_seconds=20.0),
                 reference=["mlp_w64_b256", "mlp_w64_b4096", "digits_mlp", "char_gpt"],
                 reference_timing=dict(warmup=2, windows=3, window_seconds=1.0,
                                       budget_seconds=10.0),
                 child_timeout=1800),
}

GROUPS = ("mlp", "digits", "gpt", "gemm", "jit", "vision", "conv")
# "vision": resnet18 and digits_cnn training steps plus "conv", the three convolution passes at
# every distinct shape of ResNet-18's step (3x32x32 inputs, batch 64), f32 and bf16.
VISION_TRAINING = ["resnet18", "digits_cnn"]


def resnet18_conv_workloads():
    return [common.conv_name(dtype, conv_pass, shape) for dtype in ("f32", "bf16")
            for shape, _ in common.resnet18_convs() for conv_pass in common.CONV_PASSES]
START = time.perf_counter()


def log(message):
    print(f"[{time.perf_counter() - START:6.1f}s] {message}", file=sys.stderr, flush=True)


def timing_flags(timing):
    return ["--warmup", str(timing["warmup"]), "--windows", str(timing["windows"]),
            "--window-seconds", str(timing["window_seconds"]),
            "--budget-seconds", str(timing["budget_seconds"])]


def run_child(label, command, env, timeout):
    """(JSON records the child printed, error text or None). A crash or timeout keeps the records
    printed before it."""
    log(f"{label}: {' '.join(os.path.relpath(c) if os.path.isabs(c) else c for c in command)}")
    load_before = os.getloadavg()[0]
    start = time.perf_counter()
    try:
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
        stdout, stderr, code = done.stdout, done.stderr, done.returncode
    except subprocess.TimeoutExpired as expired:
        stdout = expired.stdout.decode() if isinstance(expired.stdout, bytes) else expired.stdout
        stderr, code = f"timed out after {timeout} s", None
    records = []
    for line in (stdout or "").splitlines():
        if line.startswith("{"):
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            record["load_average_1min"] = [round(load_before, 2), round(os.getloadavg()[0], 2)]
            records.append(record)
    error = None
    if code != 0:
        tail = [line for line in (stderr or "").strip().splitlines() if line.strip()]
        error = f"exit status {code}: {tail[-1] if tail else 'no message'}"
        if code is None:
            error = stderr
        log(f"{label}: FAILED ({error})")
    log(f"{label}: {len(records)} results in {time.perf_counter() - start:.1f} s")
    return records, error


def select_workloads(plan, only):
    """Training, gemm and convolution workload names for the --only selection."""
    training, gemm, conv = [], [], []
    for item in only:
        if item == "mlp":
            training += plan["mlp"]
        elif item == "digits":
            training += ["digits_mlp", "digits_demo"]
        elif item == "gpt":
            training.append("char_gpt")
        elif item == "gemm":
            gemm += [f"gemm_{dtype}_{n}" for dtype in ("f32", "bf16") for n in plan["gemm_sizes"]]
        elif item == "jit":
            pass  # measured apart: measure_jit
        elif item in ("vision", "conv"):
            training += VISION_TRAINING if item == "vision" else []
            conv += resnet18_conv_workloads()
        elif common.gemm_shape(item):
            gemm.append(item)
        elif common.conv_shape(item):
            conv.append(item)
        elif common.known_workload(item):
            training.append(item)
        else:
            sys.exit(f"run.py: --only takes {', '.join(GROUPS)} or workload names "
                     f"(mlp_w64_b256, digits_mlp, char_gpt, resnet18, gemm_f32_1024, "
                     f"conv_f32_fwd_n64_c64_h8_o64_k3_s1), not '{item}'")
    unique = lambda names: list(dict.fromkeys(names))
    return unique(training), unique(gemm), unique(conv)


def base_env():
    env = dict(os.environ)
    for name in ("MIXTAPE_DEVICE", "MIXTAPE_EAGER"):
        env.pop(name, None)
    return env


def jax_python(requested, notes):
    candidates = [requested] if requested else [os.path.join(BENCH_DIR, ".venv", "bin", "python"),
                                                sys.executable]
    for python in candidates:
        if python and os.path.exists(python):
            check = subprocess.run([python, "-c", "import jax"], capture_output=True)
            if check.returncode == 0:
                return python
    notes.append("JAX skipped: not importable by " + " or ".join(c for c in candidates if c) +
                 "; install it with bench/setup_peers.sh (a venv in bench/.venv)")
    return None


def openblas_coretype():
    """SkylakeX's kernels where the CPU has AVX-512; they die of SIGILL on one without it (an AMD
    EPYC of the Zen 2 or 3 kind), which gets Haswell's (AVX2 and FMA)."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            flags = next((line for line in cpuinfo if line.startswith("flags")), "").split()
    except OSError:
        flags = []
    return "SkylakeX" if "avx512f" in flags else "Haswell"


def torch_env(notes):
    env = base_env()
    env["OPENBLAS_CORETYPE"] = openblas_coretype()
    if os.path.exists(os.path.join(OPENBLAS_DIR, "libblas.so.3")):
        env["LD_LIBRARY_PATH"] = OPENBLAS_DIR + (
            ":" + env["LD_LIBRARY_PATH"] if env.get("LD_LIBRARY_PATH") else "")
    else:
        notes.append("torch runs with the system's libblas.so.3; bench/setup_peers.sh unpacks "
                     "OpenBLAS for it (Debian's default reference BLAS is ~50x slower)")
    return env


def ratio(numerator, denominator):
    if numerator is None or not denominator:
        return None
    return numerator / denominator


def best(runs, label):
    """The fastest of a system's records (one per thread setting), or None."""
    records = runs.get(label, [])
    return max(records, key=lambda r: r["steps_per_s"]) if records else None


def by_threads(runs, label, scale=1.0):
    """Rate by thread setting when a system ran more than one, else None."""
    records = runs.get(label, [])
    if len(records) < 2:
        return None
    return {str(r.get("threads", "default")): r["steps_per_s"] * scale for r in records}


def summarize_training(name, precision, runs, errors):
    def rate(label):
        record = best(runs, label)
        return record["steps_per_s"] if record else None

    torch_best, jax_best = best(runs, "torch"), best(runs, "jax")
    mixtape_best = best(runs, "mixtape")
    torch_rate = rate("torch")
    entry = {
        "workload": name,
        "precision": precision,
        "mixtape_steps_per_s": rate("mixtape"),
        "mixtape_backend": mixtape_best["backend"] if mixtape_best else None,
        "mixtape_threads": mixtape_best.get("threads", "default") if mixtape_best else None,
        "mixtape_eager_steps_per_s": rate("mixtape_eager"),
        "mixtape_reference_steps_per_s": rate("mixtape_reference"),
        "mixtape_step_steps_per_s": rate("mixtape_step"),
        "torch_steps_per_s": torch_rate,
        "torch_threads": torch_best["threads"] if torch_best else None,
        "torch_steps_per_s_by_threads": by_threads(runs, "torch"),
        "jax_steps_per_s": rate("jax"),
        "jax_jit_compile_s": jax_best["jit_compile_s"] if jax_best else None,
    }
    # CPU time per step of each system's fastest run: on a loaded machine at one thread, a
    # steadier comparison than steps/s (a ratio above 1: mixtape uses less CPU per step).
    cpu = lambda label: (best(runs, label) or {}).get("cpu_us_per_step")
    for label in ("mixtape", "mixtape_step", "mixtape_eager", "torch", "jax"):
        entry[f"{label}_cpu_us_per_step"] = cpu(label)
    for mode, key in (("", "mixtape"), ("step_", "mixtape_step")):
        for peer in ("torch", "jax"):
            entry[f"{mode}cpu_ratio_vs_{peer}"] = ratio(cpu(peer), cpu(key))
    for mode, key in (("", "mixtape"), ("eager_", "mixtape_eager"),
                      ("reference_", "mixtape_reference"), ("step_", "mixtape_step")):
        entry[f"{mode}ratio_vs_torch"] = ratio(rate(key), torch_rate)
        entry[f"{mode}ratio_vs_jax"] = ratio(rate(key), rate("jax"))
    entry["compiled_vs_eager"] = ratio(rate("mixtape"), rate("mixtape_eager"))
    # Every system reports its trainable parameter count: one model, or the comparison is void.
    counts = {label: records[0]["parameters"] for label, records in runs.items()
              if records and records[0].get("parameters") is not None}
    if len(set(counts.values())) == 1:
        entry["parameters"] = next(iter(counts.values()))
    elif counts:
        entry["parameters"] = counts
        entry["parameter_counts_differ"] = True
    if errors:
        entry["errors"] = errors
    entry["runs"] = runs
    return entry


def with_gflops_ratios(entry, errors, runs):
    """A GEMM or convolution entry finished: mixtape's GFLOP/s over each peer's, the errors and
    the runs."""
    entry["ratio_vs_torch"] = ratio(entry["mixtape_gflops"], entry["torch_gflops"])
    entry["ratio_vs_jax"] = ratio(entry["mixtape_gflops"], entry["jax_gflops"])
    if errors:
        entry["errors"] = errors
    entry["runs"] = runs
    return entry


def summarize_gemm(name, runs, errors, peak):
    dtype, shape = common.gemm_shape(name)
    torch_best = best(runs, "torch")
    mixtape_best = best(runs, "mixtape")
    gflops = lambda record: record["gflops"] if record else None
    peak_value = None
    if peak:
        # One core's peak times the cores (bench_gemm's machine_*); bf16 may be widened to f32
        # and run on the FMA units, so its ceiling is the better of the two peaks (bench_gemm's
        # bf16 peak is AMX's where the machine has it).
        f32 = peak["machine_f32_gflops"]
        peak_value = max(f32, peak["machine_bf16_gflops"]) if dtype == "bf16" else f32
    entry = {
        "workload": name, "dtype": dtype,
        "size": shape[0] if len(set(shape)) == 1 else "x".join(map(str, shape)),
        "mixtape_kernel": mixtape_best.get("kernel") if mixtape_best else None,
        "peak_gflops": peak_value,
        "mixtape_gflops": gflops(mixtape_best),
        "mixtape_threads": mixtape_best.get("threads", "default") if mixtape_best else None,
        "mixtape_gflops_by_threads": by_threads(runs, "mixtape", common.gemm_flops(shape) / 1e9),
        "torch_gflops": gflops(torch_best),
        "torch_threads": torch_best["threads"] if torch_best else None,
        "torch_gflops_by_threads": by_threads(runs, "torch", common.gemm_flops(shape) / 1e9),
        "jax_gflops": gflops(best(runs, "jax")),
    }
    for system in ("mixtape", "torch", "jax"):
        entry[f"{system}_fraction_of_peak"] = ratio(entry[f"{system}_gflops"], peak_value)
    return with_gflops_ratios(entry, errors, runs)


def peak_at(peak, dtype, threads):
    """The FMA peak (bench/peak.h's record) a run at `threads` threads is held to: the machine's
    on all cores, else one core's times the threads; bf16 the best of f32, AVX512-BF16 and AMX."""
    if not peak:
        return None
    cores = peak["threads"][-1]
    if not threads or threads >= cores:
        f32 = peak["machine_f32_gflops"]
        return max(f32, peak["machine_bf16_gflops"]) if dtype == "bf16" else f32
    one_core = [peak["f32_gflops"][0]]
    if dtype == "bf16":
        one_core += [peak["bf16_gflops"][0]] + peak.get("amx_bf16_gflops", [])[:1]
    return threads * max(one_core)


def summarize_conv(name, runs, errors, peak, jax_threads):
    dtype, conv_pass, shape = common.conv_shape(name)
    mixtape_best, torch_best, jax_best = best(runs, "mixtape"), best(runs, "torch"), best(runs, "jax")
    gflops = lambda record: record["gflops"] if record else None
    entry = {
        "workload": name, "dtype": dtype, "pass": conv_pass,
        "shape": dict(zip(("n", "c", "h", "o", "k", "stride"), shape),
                      padding=shape[4] // 2, out=common.conv_out_size(shape)),
        "gemm_equivalent_flops": common.conv_flops(shape),
        "mixtape_kernel": mixtape_best.get("kernel") if mixtape_best else None,
        "mixtape_gflops": gflops(mixtape_best),
        "mixtape_threads": mixtape_best.get("threads", "default") if mixtape_best else None,
        "torch_gflops": gflops(torch_best),
        "torch_threads": torch_best["threads"] if torch_best else None,
        "jax_gflops": gflops(jax_best),
    }
    # Each system against the peak at the threads it ran on (mixtape's record has its own).
    peaks = {"mixtape": mixtape_best.get("peak_gflops") if mixtape_best else None,
             "torch": peak_at(peak, dtype, entry["torch_threads"]),
             "jax": peak_at(peak, dtype, jax_threads)}
    for system in ("mixtape", "torch", "jax"):
        entry[f"{system}_peak_gflops"] = peaks[system]
        entry[f"{system}_fraction_of_peak"] = ratio(entry[f"{system}_gflops"], peaks[system])
    if mixtape_best:
        entry["mixtape_fraction_of_f32_fma_peak"] = mixtape_best.get("fraction_of_f32_fma_peak")
    return with_gflops_ratios(entry, errors, runs)


def resnet18_conv_totals(workloads):
    """ResNet-18's training step's convolutions as a whole, per dtype and system: every
    convolution of the step (each shape times its count) forward, input gradient (not the stem's:
    the images need none) and weight gradient, GEMM-equivalent flops over the summed time."""
    totals = {}
    convs = common.resnet18_convs()
    for dtype in ("f32", "bf16"):
        for system in ("mixtape", "torch", "jax"):
            flops = seconds = 0.0
            peak_gflops = None
            complete = True
            for index, (shape, count) in enumerate(convs):
                for conv_pass in common.CONV_PASSES:
                    if index == 0 and conv_pass == "dgrad":
                        continue
                    entry = workloads.get(common.conv_name(dtype, conv_pass, shape))
                    rate = entry and entry.get(f"{system}_gflops")
                    if not rate:
                        complete = False
                        continue
                    peak_gflops = peak_gflops or entry.get(f"{system}_peak_gflops")
                    work = count * common.conv_flops(shape)
                    flops += work
                    seconds += work / (rate * 1e9)
            if complete and seconds:
                rate = flops / seconds / 1e9
                totals.setdefault(dtype, {})[system] = {
                    "gflop": round(flops / 1e9, 3), "ms": round(seconds * 1e3, 2),
                    "gflops": rate, "peak_gflops": peak_gflops,
                    "fraction_of_peak": ratio(rate, peak_gflops)}
    return totals


def fmt(value, digits=1):
    if value is None:
        return "-"
    if isinstance(value, float) and abs(value) < 10 and digits == 1:
        return f"{value:.2f}"
    return f"{value:.{digits}f}"


def print_table(document):
    rows = [("workload", "mixtape", "compile", "eager", "ref", "torch(thr)", "jax", "x torch",
             "x jax", "compile x jax")]
    for key, e in document["workloads"].items():
        if "precision" in e:
            torch_cell = (f"{fmt(e['torch_steps_per_s'])}({e['torch_threads']})"
                          if e["torch_steps_per_s"] else "-")
            rows.append((key, fmt(e["mixtape_steps_per_s"]), fmt(e["mixtape_step_steps_per_s"]),
                         fmt(e["mixtape_eager_steps_per_s"]),
                         fmt(e["mixtape_reference_steps_per_s"]), torch_cell,
                         fmt(e["jax_steps_per_s"]), fmt(e["ratio_vs_torch"], 2),
                         fmt(e["ratio_vs_jax"], 2), fmt(e["step_ratio_vs_jax"], 2)))
        elif "pass" in e:
            torch_cell = (f"{fmt(e['torch_gflops'])}({e['torch_threads']})"
                          if e["torch_gflops"] else "-")
            rows.append((key[5:] + " GFLOP/s", fmt(e["mixtape_gflops"]),
                         fmt(e["mixtape_fraction_of_peak"], 2), "", "", torch_cell,
                         fmt(e["jax_gflops"]), fmt(e["ratio_vs_torch"], 2),
                         fmt(e["ratio_vs_jax"], 2), ""))
        else:
            torch_cell = (f"{fmt(e['torch_gflops'])}({e['torch_threads']})"
                          if e["torch_gflops"] else "-")
            rows.append((key + " GFLOP/s", fmt(e["mixtape_gflops"]), "", "", "", torch_cell,
                         fmt(e["jax_gflops"]), fmt(e["ratio_vs_torch"], 2),
                         fmt(e["ratio_vs_jax"], 2), ""))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    print("", file=sys.stderr)
    for row in rows:
        print("  ".join(cell.rjust(w) if i else cell.ljust(w) for i, (cell, w) in
                        enumerate(zip(row, widths))), file=sys.stderr)
    print("(steps/s unless marked; mixtape: the step traced every call, compile: mt::compile "
          "(for convolutions: the fraction of the FMA peak); x = mixtape / peer, above 1 is "
          "faster)", file=sys.stderr)
    for dtype, systems in document.get("resnet18_convs", {}).items():
        cells = ", ".join(f"{system} {t['gflops']:.1f} GFLOP/s ({t['ms']:.1f} ms)"
                          for system, t in systems.items())
        print(f"ResNet-18 step's convolutions, {dtype}: {cells}", file=sys.stderr)


def emit_document(document, out):
    """The result document to stdout and, when given, to the file `out`."""
    text = json.dumps(document, indent=1)
    print(text)
    if out:
        with open(out, "w") as f:
            f.write(text + "\n")


def machine_info():
    model = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return {"cpu": model, "cores": os.cpu_count(), "platform": platform.platform(),
            "load_average_1min_at_start": round(os.getloadavg()[0], 2),
            "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def measure_jit(binary, timing, timeout, mixtape_env, notes):
    """Compile and disk-load times of the demo's kernels (digits_demo, fp32, through mt::compile as
    `digits_mlp --batch 256 --optimizer adamw` runs) from an empty cache and from a filled one, its
    first step's time (wall, and CPU time of every thread), what the cold JIT costs against a
    1000-step run (issue 20's targets; in wall time, and in CPU time, which a loaded machine does
    not inflate), and each process's wall time, start to exit (a cold one's includes whatever its
    exit waits for)."""
    import tempfile
    with tempfile.TemporaryDirectory(prefix="mixtape-jit-") as cache:
        env = mixtape_env("compiled", None)
        env["MIXTAPE_CACHE_DIR"] = cache
        result = {}
        for phase in ("cold", "warm"):
            started = time.perf_counter()
            found, error = run_child(f"mixtape jit {phase}",
                                     [binary, "--workloads", "digits_demo", "--precisions", "fp32",
                                      "--step", "compiled"] + timing_flags(timing), env, timeout)
            process_seconds = time.perf_counter() - started
            if error or not found:
                notes.append(f"jit {phase} run failed: {error}")
                return None
            stats = [r["setup_and_warmup_stats"] for r in found]
            jit = [r.get("jit") or {} for r in found]
            compiled = sum(s["kernels_compiled"] for s in stats)
            loaded = sum(s["kernels_from_disk"] for s in stats)
            compile_s = sum(s["compile_seconds"] for s in stats)
            load_s = sum(s["load_seconds"] for s in stats)
            steps_per_s = min(r["steps_per_s"] for r in found)
            result[phase] = {
                "kernels_compiled": compiled, "kernels_from_disk": loaded,
                "compile_seconds": round(compile_s, 4), "load_seconds": round(load_s, 4),
                "ms_per_compiled_kernel": round(1e3 * compile_s / compiled, 2) if compiled else None,
                "ms_per_loaded_kernel": round(1e3 * load_s / loaded, 3) if loaded else None,
                "compile_cpu_seconds": round(sum(j.get("compile_cpu_seconds", 0) for j in jit), 4),
                "tier_up_cpu_seconds": round(sum(j.get("tier_up_cpu_seconds", 0) for j in jit), 4),
                "steps_per_s": round(steps_per_s, 1),
                "cpu_us_per_step": max(r["cpu_us_per_step"] for r in found),
                "setup_s": round(max(r.get("setup_s", 0) for r in found), 4),
                "first_step_s": round(max(r["first_step_s"] for r in found), 4),
                "first_step_cpu_s": round(max(r.get("first_step_cpu_s", 0) for r in found), 4),
                "process_seconds": round(process_seconds, 3)}
        cold, warm = result["cold"], result["warm"]
        run_seconds = 1000 / cold["steps_per_s"]
        result["cold_jit_share_of_1000_steps"] = round(
            cold["compile_seconds"] / (cold["compile_seconds"] + run_seconds), 4)
        # The same in CPU time, which a loaded machine does not inflate: the foreground compiles
        # against 1000 steps' CPU time, and with the background tier-ups counted too.
        run_cpu = 1000 * cold["cpu_us_per_step"] * 1e-6
        if run_cpu > 0:
            jit_cpu = cold["compile_cpu_seconds"]
            result["cold_jit_cpu_share_of_1000_steps"] = round(jit_cpu / (jit_cpu + run_cpu), 4)
            jit_cpu += cold["tier_up_cpu_seconds"]
            result["cold_jit_and_tier_up_cpu_share_of_1000_steps"] = round(
                jit_cpu / (jit_cpu + run_cpu), 4)
        result["warm_start_added_seconds"] = round(warm["compile_seconds"] + warm["load_seconds"], 4)
        result["targets"] = {"warm_start_added_seconds": "< 0.05",
                             "cold_jit_share_of_1000_steps": "< 0.10",
                             "cold_jit_cpu_share_of_1000_steps": "< 0.10",
                             "cold first_step_s": "< 0.06"}
        return result


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n".join(__doc__.splitlines()[1:]))
    parser.add_argument("--quick", action="store_true", help="fewer sizes, short windows (~6 min)")
    parser.add_argument("--only", default=",".join(g for g in GROUPS if g != "conv"),
                        help="groups (mlp,digits,gpt,gemm,jit,vision,conv; vision includes "
                             "conv) or workload names; default all")
    parser.add_argument("--precisions", default="fp32,bf16")
    parser.add_argument("--build-dir", default=os.path.join(REPO_DIR, "build"),
                        help="where bench_training and bench_gemm are (default: build/)")
    parser.add_argument("--modes", default="compiled,step,eager,reference",
                        help="mixtape back ends to run: compiled, step (mt::compile), eager, "
                             "reference")
    parser.add_argument("--peers", default="torch,jax", help="peers to run: torch, jax")
    parser.add_argument("--torch-python", default="/usr/bin/python3")
    parser.add_argument("--jax-python", default=None,
                        help="python with JAX (default: bench/.venv/bin/python, else this one)")
    parser.add_argument("--torch-threads", default="1,2", help="torch runs each; the best counts")
    parser.add_argument("--jax-threads", default="",
                        help="1: JAX with XLA's multi-threaded Eigen kernels off "
                             "(--xla_cpu_multi_thread_eigen=false); default: all cores")
    parser.add_argument("--mixtape-threads", default="",
                        help="OMP_NUM_THREADS values to run mixtape at, the best counts (e.g. "
                             "1,2); default: the library's own (all cores)")
    parser.add_argument("--out", help="also write the JSON document to this file")
    args = parser.parse_args()

    plan = PLANS["quick" if args.quick else "full"]
    training, gemm, conv = select_workloads(plan, common.split_list(args.only))
    precisions = common.split_list(args.precisions)
    modes = common.split_list(args.modes)
    peers = common.split_list(args.peers)
    for mode in modes:
        if mode not in MIXTAPE_MODES:
            sys.exit(f"run.py: unknown mode '{mode}' (compiled, step, eager, reference)")
    for peer in peers:
        if peer not in ("torch", "jax"):
            sys.exit(f"run.py: unknown peer '{peer}' (torch, jax)")
    notes, errors = [], {}
    machine = machine_info()
    records = []  # (system label, record)

    def add(label, found, error, workloads):
        records.extend((label, r) for r in found)
        if error:
            for name in workloads:
                errors.setdefault(name, {})[label] = error

    # ---- mixtape ----
    training_binary = os.path.join(args.build_dir, "bench_training")
    gemm_binary = os.path.join(args.build_dir, "bench_gemm")
    conv_binary = os.path.join(args.build_dir, "bench_conv")
    timing = plan["timing"]
    for binary, needed in ((training_binary, training), (gemm_binary, gemm),
                           (conv_binary, conv)):
        if needed and not os.access(binary, os.X_OK):
            notes.append(f"mixtape skipped for {', '.join(needed)}: {binary} is not built "
                         f"(cmake --build {args.build_dir} --target "
                         f"{os.path.basename(binary)}, or pass --build-dir)")
    thread_settings = common.split_list(args.mixtape_threads) or [None]

    def mixtape_env(mode, threads):
        env = base_env()
        env.update(MIXTAPE_MODES[mode])
        if threads:
            env["OMP_NUM_THREADS"] = threads
        return env

    def tag(found, threads):
        for r in found:
            if threads:
                r["threads"] = int(threads)
        return found

    if training and os.access(training_binary, os.X_OK):
        for mode in modes:
            names = [n for n in training if mode != "reference" or n in plan["reference"]]
            mode_timing = plan["reference_timing"] if mode == "reference" else timing
            label = "mixtape" if mode == "compiled" else f"mixtape_{mode}"
            # One child per workload, so a crash loses only that workload.
            for name in names:
                for threads in thread_settings:
                    found, error = run_child(
                        f"{label} {name}" + (f" OMP_NUM_THREADS={threads}" if threads else ""),
                        [training_binary, "--workloads", name, "--precisions",
                         ",".join(precisions)] + timing_flags(mode_timing)
                        + MODE_ARGS.get(mode, []),
                        mixtape_env(mode, threads), plan["child_timeout"])
                    add(label, tag(found, threads), error, [f"{name}/{p}" for p in precisions])
    # GEMM and convolution binaries: each measures the machine's FMA peak beside its products.
    # The peak does not depend on OMP_NUM_THREADS (it starts its own threads): keep one.
    peak = None
    for what, binary, workloads in (("gemm", gemm_binary, gemm), ("conv", conv_binary, conv)):
        if not workloads or not os.access(binary, os.X_OK):
            continue
        for threads in thread_settings:
            found, error = run_child(
                f"mixtape {what}" + (f" OMP_NUM_THREADS={threads}" if threads else ""),
                [binary, "--workloads", ",".join(["fma_peak"] + workloads)] + timing_flags(timing),
                mixtape_env("compiled", threads), plan["child_timeout"])
            peak = peak or next((r for r in found if r["workload"] == "fma_peak"), None)
            add("mixtape", tag([r for r in found if r["workload"] != "fma_peak"], threads), error,
                workloads)

    # ---- (d) JIT cost: digits_mlp with an empty kernel cache (cold), then the filled one (warm)
    jit = None
    if "jit" in common.split_list(args.only) and os.access(training_binary, os.X_OK):
        jit = measure_jit(training_binary, timing, plan["child_timeout"], mixtape_env, notes)

    # ---- peers ----
    peer_workloads = training + gemm + conv
    peer_flags = ["--workloads", ",".join(peer_workloads), "--precisions", ",".join(precisions)]
    peer_flags += timing_flags(timing)
    if "torch" in peers and peer_workloads:
        if shutil.which(args.torch_python) or os.path.exists(args.torch_python):
            env = torch_env(notes)
            for threads in common.split_list(args.torch_threads):
                # OpenBLAS (torch's f32 GEMMs) keeps its own thread pool, which
                # torch.set_num_threads does not size: one child per count, both pools set.
                env.update(OPENBLAS_NUM_THREADS=threads, OMP_NUM_THREADS=threads)
                found, error = run_child(
                    f"torch threads={threads}",
                    [args.torch_python, os.path.join(BENCH_DIR, "peer_torch.py")] + peer_flags
                    + ["--threads", threads], dict(env), plan["child_timeout"])
                add("torch", found, error, peer_workloads)
                note = f"torch used {found[0].get('blas')} for f32 matmuls" if found else None
                if note and found[0].get("blas") != "openblas" and note not in notes:
                    notes.append(note)
        else:
            notes.append(f"torch skipped: {args.torch_python} not found")
    jax_threads = int(args.jax_threads) if args.jax_threads else None
    if "jax" in peers and peer_workloads:
        python = jax_python(args.jax_python, notes)
        if python:
            env = base_env()
            if jax_threads == 1:
                env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") +
                                    " --xla_cpu_multi_thread_eigen=false").strip()
                env["OMP_NUM_THREADS"] = "1"
            elif jax_threads:
                sys.exit("run.py: --jax-threads takes 1 (or nothing: all cores)")
            found, error = run_child("jax", [python, os.path.join(BENCH_DIR, "peer_jax.py")]
                                     + peer_flags, env, plan["child_timeout"])
            add("jax", found, error, peer_workloads)

    # ---- one document ----
    workloads = {}
    for name in training:
        for precision in precisions:
            key = f"{name}/{precision}"
            runs = {}
            for label, r in records:
                if r["workload"] == name and r.get("precision") == precision:
                    runs.setdefault(label, []).append(r)
            workloads[key] = summarize_training(name, precision, runs, errors.get(key, {}))
    for name in gemm:
        runs = {}
        for label, r in records:
            if r["workload"] == name:
                runs.setdefault(label, []).append(r)
        workloads[name] = summarize_gemm(name, runs, errors.get(name, {}), peak)
    for name in conv:
        runs = {}
        for label, r in records:
            if r["workload"] == name:
                runs.setdefault(label, []).append(r)
        workloads[name] = summarize_conv(name, runs, errors.get(name, {}), peak, jax_threads)
    machine["load_average_1min_at_end"] = round(os.getloadavg()[0], 2)
    for key, entry in workloads.items():
        if entry.get("parameter_counts_differ"):
            notes.append(f"{key}: the systems' parameter counts differ: {entry['parameters']}")
    document = {
        "mixtape_bench": 1,
        "quick": args.quick,
        "machine": machine,
        "timing": {"training_and_gemm": timing, "reference": plan["reference_timing"],
                   "rule": "warm-up steps untimed, then windows of K steps (K from the warm-up "
                           "step time); rate = median window; JAX compile time apart"},
        "ratio": "mixtape steps/s (or GFLOP/s) divided by the peer's; above 1: mixtape is faster",
        "notes": notes,
        "peak": peak,
        "jit": jit,
        "workloads": workloads,
        "resnet18_convs": resnet18_conv_totals(workloads) if conv else {},
        "seconds": round(time.perf_counter() - START, 1),
    }
    emit_document(document, args.out)
    print_table(document)
    for note in notes:
        print("note: " + note, file=sys.stderr)
    failed = sorted({label for per in errors.values() for label in per})
    if failed:
        print(f"failed runs: {', '.join(failed)} (see 'errors' in the JSON)", file=sys.stderr)
    print(f"done in {document['seconds']} s", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

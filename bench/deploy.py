#!/usr/bin/env python3
# bench/deploy.py -- the deployment benchmark's driver: bench_deploy and its peers in one run, one
# JSON document out, a Markdown summary on stderr.
"""Runs bench_deploy (exports the digits MLP and the char GPT, times the C driver built against
each artifact and the JIT'd forward; exports their training steps and times the C step driver
against mt::compile), then bench/peer_deploy.py for PyTorch eager, TorchScript and ONNX Runtime on
the same weights, each at every thread count of --threads; the best thread count counts. Prints
one JSON document (stdout and --out) and the tables of bench/README.md's "Deployment" section
(stderr).

  cmake --build build --target bench_deploy && bench/setup_peers.sh
  python3 bench/deploy.py --out deploy.json         # about 5 minutes on 2 idle cores
  python3 bench/deploy.py --quick                   # short windows, about 3 minutes
"""

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, BENCH_DIR)
import run as driver  # noqa: E402  (run.py's child runner, environments and machine facts)

SYSTEMS = [  # (label in the tables, record system, record mode)
    ("mixtape artifact (C)", "mixtape_artifact", "driver"),
    ("mixtape JIT, mt::compile", "mixtape_jit", "compiled"),
    ("mixtape JIT, traced", "mixtape_jit", "traced"),
    ("PyTorch eager", "torch_eager", None),
    ("TorchScript (trace)", "torchscript", None),
    ("ONNX Runtime", "onnxruntime", None),
]


def pick(records, model, system, mode, key, lowest):
    """The record of `system` for `model` with the best `key` over thread counts."""
    found = [r for r in records if r.get("model") == model and r["system"] == system
             and (mode is None or r.get("mode") == mode) and r.get(key) is not None]
    if not found:
        return None
    return (min if lowest else max)(found, key=lambda r: r[key])


def summarize(records, models):
    summary = {}
    for model in models:
        rows = {}
        for label, system, mode in SYSTEMS:
            latency = pick(records, model, system, mode, "batch1_latency_us", True)
            throughput = pick(records, model, system, mode, "batch_max_rows_per_s", False)
            if not latency:
                continue
            rss = [r.get("peak_rss_kb") for r in records if r.get("model") == model
                   and r["system"] == (system if system != "torch_eager" else "torchscript")
                   and (mode is None or r.get("mode") == mode) and r.get("peak_rss_kb")]
            cold = pick(records, model, system, mode, "open_to_first_result_ms", True)
            first = pick(records, model, system, mode, "first_result_ms_cold_kernel_cache", True)
            rows[label] = {
                "batch1_latency_us": latency["batch1_latency_us"],
                "batch1_p90_us": latency["batch1_p90_us"],
                "batch1_threads": latency.get("threads"),
                "batch_max_rows_per_s": throughput["batch_max_rows_per_s"],
                "batch_max_threads": throughput.get("threads"),
                "open_to_first_result_ms": cold["open_to_first_result_ms"] if cold else None,
                "jit_first_result_ms_cold_cache":
                    first["first_result_ms_cold_kernel_cache"] if first else None,
                "process_wall_ms": cold.get("process_wall_ms") if cold else None,
                "peak_rss_kb": max(rss) if rss else None,
                "max_abs_diff_vs_mixtape": latency.get("max_abs_diff_vs_mixtape"),
            }
        artifact = rows.get("mixtape artifact (C)")
        check = next((r for r in records if r.get("model") == model and
                      r["system"] == "mixtape_artifact" and r.get("mode") == "check"), None)
        if artifact and check:  # the C driver's batch-256 output against the JIT's, in-process
            artifact["max_abs_diff_vs_mixtape"] = check["max_abs_diff_vs_jit"]
            artifact["bit_identical_to_jit"] = check["bit_identical_to_jit"]
        ratios = {}
        if artifact:
            for peer in ("ONNX Runtime", "PyTorch eager", "TorchScript (trace)",
                         "mixtape JIT, mt::compile"):
                if peer in rows:
                    ratios[f"batch1_speedup_vs_{peer}"] = (rows[peer]["batch1_latency_us"]
                                                           / artifact["batch1_latency_us"])
                    ratios[f"throughput_vs_{peer}"] = (artifact["batch_max_rows_per_s"]
                                                       / rows[peer]["batch_max_rows_per_s"])
        export = next((r for r in records if r.get("model") == model and
                       r["system"] == "mixtape_artifact" and r.get("mode") == "export"), None)
        targets = {}
        if artifact and "batch1_speedup_vs_ONNX Runtime" in ratios:
            targets["batch1_at_or_below_onnxruntime"] = (
                ratios["batch1_speedup_vs_ONNX Runtime"] >= 1.0)
        if artifact and "batch1_speedup_vs_PyTorch eager" in ratios:
            targets["batch1_3x_faster_than_torch_eager"] = (
                ratios["batch1_speedup_vs_PyTorch eager"] >= 3.0)
        if artifact and artifact["open_to_first_result_ms"] is not None:
            targets["open_to_first_result_under_20ms"] = artifact["open_to_first_result_ms"] < 20
        summary[model] = {"systems": rows, "ratios": ratios, "targets_met": targets,
                          "artifact": export, "artifact_check": check}
    return summary


def summarize_steps(records):
    """One row per exported training step and thread count: the C step driver against the same
    step under mt::compile (bench_deploy's step_* records)."""
    rows = []
    for cmp in (r for r in records if r.get("mode") == "step_vs_compile"):
        def find(mode):
            return next((r for r in records if r.get("mode") == mode
                         and r.get("model") == cmp["model"] and r.get("policy") == cmp["policy"]
                         and r.get("threads", cmp["threads"]) == cmp["threads"]), None)
        driver, compiled, export = find("step_driver"), find("step_compiled"), find("step_export")
        rows.append({
            "model": cmp["model"], "policy": cmp["policy"], "batch": cmp["batch"],
            "threads": cmp["threads"],
            "artifact_steps_per_s": cmp["steps_per_s_artifact"],
            "compile_steps_per_s": cmp["steps_per_s_compile"],
            "ratio_artifact_to_compile": cmp["ratio_artifact_to_compile"],
            "within_5_percent": cmp["within_5_percent"],
            "losses_bit_identical": cmp["losses_bit_identical"],
            "open_to_first_step_ms": driver["open_to_first_step_ms"] if driver else None,
            "artifact_peak_rss_kb": driver.get("peak_rss_kb") if driver else None,
            "compile_peak_rss_kb": compiled.get("peak_rss_kb") if compiled else None,
            "export_s": export["export_s"] if export else None,
            "artifact_bytes": export["total_bytes"] if export else None,
        })
    return rows


def fmt(value, digits=1):
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    return f"{value:,}"


def diff_cell(row):
    diff = row["max_abs_diff_vs_mixtape"]
    if diff is None:
        return "–"
    if row.get("bit_identical_to_jit"):
        return "0 (bit-identical to the JIT)"
    return f"{diff:.1e}"


def markdown(document):
    lines = []
    m = document["machine"]
    lines.append(f"Measured {m['date_utc']} on {m['cpu']}, {m['cores']} cores; 1-minute load "
                 f"average {m['load_average_1min_at_start']} at the start, "
                 f"{m['load_average_1min_at_end']} at the end; {document['seconds']} s.")
    lines.append("")
    lines.append("| model | system | batch-1 latency µs (p90; threads) "
                 "| batch-256 rows/s (threads) "
                 "| open → first result ms | peak RSS MB | max abs diff vs mixtape |")
    lines.append("|---|---|---:|---:|---:|---:|---:|")
    for model, s in document["summary"].items():
        for label, r in s["systems"].items():
            cold = r["open_to_first_result_ms"]
            if cold is None and r["jit_first_result_ms_cold_cache"] is not None:
                cold_cell = f"({fmt(r['jit_first_result_ms_cold_cache'])} JIT, empty cache)"
            else:
                cold_cell = fmt(cold, 2)
            rss = r["peak_rss_kb"] / 1024 if r["peak_rss_kb"] else None
            lines.append(
                f"| {model} | {label} | {fmt(r['batch1_latency_us'], 1)} "
                f"({fmt(r['batch1_p90_us'], 1)}; {r['batch1_threads']}) "
                f"| {fmt(r['batch_max_rows_per_s'], 0)} ({r['batch_max_threads']}) | {cold_cell} "
                f"| {fmt(rss, 1)} | {diff_cell(r)} |")
    lines.append("")
    lines.append("| model | artifact batch-1 speed-up vs ONNX Runtime (target ≥ 1) | vs PyTorch "
                 "eager (target ≥ 3) | vs TorchScript | batch-256 throughput vs ONNX Runtime | "
                 "vs PyTorch eager | open → first result < 20 ms |")
    lines.append("|---|---:|---:|---:|---:|---:|---|")
    for model, s in document["summary"].items():
        r, t = s["ratios"], s["targets_met"]
        def cell(key):
            return f"{r[key]:.2f}" if key in r else "–"
        yes = lambda key: ("met" if t.get(key) else "not met") if key in t else "–"
        lines.append(f"| {model} | {cell('batch1_speedup_vs_ONNX Runtime')} "
                     f"({yes('batch1_at_or_below_onnxruntime')}) "
                     f"| {cell('batch1_speedup_vs_PyTorch eager')} "
                     f"({yes('batch1_3x_faster_than_torch_eager')}) "
                     f"| {cell('batch1_speedup_vs_TorchScript (trace)')} "
                     f"| {cell('throughput_vs_ONNX Runtime')} "
                     f"| {cell('throughput_vs_PyTorch eager')} "
                     f"| {yes('open_to_first_result_under_20ms')} |")
    lines.append("")
    lines.append("| model | artifact files (bytes) | total | export s |")
    lines.append("|---|---|---:|---:|")
    for model, s in document["summary"].items():
        a = s["artifact"]
        if a:
            files = ", ".join(f"{name} {size:,}" for name, size in a["files_bytes"].items())
            lines.append(f"| {model} | {files} | {a['total_bytes']:,} | {a['export_s']:.1f} |")
    steps = document.get("summary_steps")
    if steps:
        lines.append("")
        lines.append("| training step | batch | threads | artifact (C) steps/s "
                     "| mt::compile steps/s | artifact / compile (target ≥ 0.95) "
                     "| open → first step ms | first losses | peak RSS MB C / C++ | artifact MB |")
        lines.append("|---|---:|---:|---:|---:|---:|---:|---|---:|---:|")
        for r in steps:
            mb = lambda kb: fmt(kb / 1024, 1) if kb else "–"
            lines.append(
                f"| {r['model']} {r['policy']} | {r['batch']} | {r['threads']} "
                f"| {fmt(r['artifact_steps_per_s'], 1)} | {fmt(r['compile_steps_per_s'], 1)} "
                f"| {r['ratio_artifact_to_compile']:.3f} "
                f"({'met' if r['within_5_percent'] else 'not met'}) "
                f"| {fmt(r['open_to_first_step_ms'], 1)} "
                f"| {'bit-identical' if r['losses_bit_identical'] else 'DIFFER'} "
                f"| {mb(r['artifact_peak_rss_kb'])} / {mb(r['compile_peak_rss_kb'])} "
                f"| {fmt((r['artifact_bytes'] or 0) / 1e6, 1)} |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n".join(__doc__.splitlines()[1:]))
    parser.add_argument("--quick", action="store_true", help="short windows (~2 minutes)")
    parser.add_argument("--models", default="digits_mlp,char_gpt")
    parser.add_argument("--threads", default="1,2", help="every system runs at each; best counts")
    parser.add_argument("--steps", default="digits_mlp:fp32,digits_mlp:bf16,char_gpt:bf16",
                        help="training steps (MODEL:fp32|bf16) timed against mt::compile, or none")
    parser.add_argument("--build-dir", default=os.path.join(driver.REPO_DIR, "build"))
    parser.add_argument("--python",
                        default=os.path.join(BENCH_DIR, ".venv-deploy", "bin", "python"),
                        help="python with torch, safetensors and onnxruntime (setup_peers.sh)")
    parser.add_argument("--dir", help="keep the artifacts, weights and ONNX files here")
    parser.add_argument("--out", help="also write the JSON document to this file")
    args = parser.parse_args()

    timing = (dict(latency_seconds=0.3, window_seconds=0.2, windows=3, step_window_seconds=0.3)
              if args.quick else
              dict(latency_seconds=1.0, window_seconds=0.5, windows=5, step_window_seconds=1.0))
    flags = ["--latency-seconds", str(timing["latency_seconds"]),
             "--window-seconds", str(timing["window_seconds"]), "--windows", str(timing["windows"])]
    machine = driver.machine_info()
    notes, errors, records = [], {}, []
    work = args.dir or tempfile.mkdtemp(prefix="mixtape-deploy-")
    os.makedirs(work, exist_ok=True)
    timeout = 1800

    binary = os.path.join(args.build_dir, "bench_deploy")
    if not os.access(binary, os.X_OK):
        sys.exit(f"deploy.py: {binary} is not built (cmake --build {args.build_dir} --target "
                 "bench_deploy)")
    found, error = driver.run_child(
        "bench_deploy", [binary, "--models", args.models, "--threads", args.threads,
                         "--dir", work, "--steps", args.steps,
                         "--step-window-seconds", str(timing["step_window_seconds"])] + flags,
        driver.base_env(), timeout)
    records += found
    if error:
        errors["mixtape"] = error

    if os.path.exists(args.python):
        peer = [args.python, os.path.join(BENCH_DIR, "peer_deploy.py"), "--dir", work,
                "--models", args.models] + flags
        env = driver.torch_env(notes)
        found, error = driver.run_child("onnx export", peer + ["--system", "export"], env, timeout)
        records += found
        if error:
            errors["onnx_export"] = error
        for threads in driver.common.split_list(args.threads):
            env.update(OPENBLAS_NUM_THREADS=threads, OMP_NUM_THREADS=threads)
            for system in ("torch", "ort"):
                if system == "ort" and "onnx_export" in errors:
                    continue
                found, error = driver.run_child(f"{system} threads={threads}",
                                                peer + ["--system", system, "--threads", threads],
                                                dict(env), timeout)
                records += found
                if error:
                    errors[f"{system}_threads_{threads}"] = error
    else:
        notes.append(f"peers skipped: {args.python} not found (run bench/setup_peers.sh)")

    machine["load_average_1min_at_end"] = round(os.getloadavg()[0], 2)
    models = driver.common.split_list(args.models)
    document = {
        "mixtape_bench_deploy": 1,
        "quick": args.quick,
        "machine": machine,
        "timing": dict(timing, rule="batch 1: each call timed, median (p10, p90) after 20 warm-up "
                       "calls; batch 256: rows/s, median of windows after 3 warm-up calls; best "
                       "of --threads per system; peak RSS = VmHWM; training steps: steps/s, "
                       "median of windows after 5 warm-up steps, artifact and mt::compile at "
                       "the same thread count"),
        "notes": notes,
        "summary": summarize(records, models),
        "summary_steps": summarize_steps(records),
        "records": records,
        "seconds": round(time.perf_counter() - driver.START, 1),
    }
    if errors:
        document["errors"] = errors
    text = json.dumps(document, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    print(markdown(document), file=sys.stderr)
    for note in notes:
        print("note: " + note, file=sys.stderr)
    if not args.dir:
        shutil.rmtree(work, ignore_errors=True)
    if errors:
        print(f"failed runs: {', '.join(sorted(errors))} (see 'errors' in the JSON)",
              file=sys.stderr)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
# bench/to_markdown.py -- renders a run.py JSON document as the Markdown tables of bench/README.md.
"""usage: python3 bench/to_markdown.py RESULT.json  (from python3 bench/run.py --out RESULT.json)"""

import json
import sys


def cell(value, digits=None):
    if value is None:
        return "–"
    if digits is None:
        digits = 2 if abs(value) < 10 else 1 if abs(value) < 1000 else 0
    return f"{value:,.{digits}f}"


def with_note(value, note):
    """A figure and, in brackets, what it ran with (threads, compile time); "–" where none."""
    return f"{cell(value)} ({note})" if value else "–"


def device(entry):
    backend = entry.get("mixtape_backend")
    if not backend:
        return ""
    return f" ({backend['device']}{', eager' if backend.get('eager') else ''})"


def print_convs(doc, convs):
    """One row per shape and dtype: GFLOP/s of each pass (forward, input gradient, weight
    gradient) per system, mixtape's with its fraction of the peak at its threads."""
    rows = {}
    for e in convs:
        sh = e["shape"]
        key = (f"{sh['c']}→{sh['o']}, {sh['h']}²→{sh['out']}², {sh['k']}×{sh['k']} s{sh['stride']}",
               e["dtype"])
        rows.setdefault(key, {})[e["pass"]] = e
    passes = ("fwd", "dgrad", "wgrad")
    print("\nConvolutions, GFLOP/s counted as an im2col GEMM's (2·N·O·OH·OW·C·K², padded taps "
          "included); in brackets mixtape's fraction of the peak at the threads it ran on (bf16: "
          "the best of f32 FMA, AVX512-BF16 and AMX). fwd: the convolution, dgrad: its input "
          "gradient, wgrad: its weight gradient, each with the result in the operands' dtype.")
    print("\n| conv (batch 64) | dtype | "
          + " | ".join(f"mixtape {p}" for p in passes) + " | "
          + " | ".join(f"torch {p}" for p in passes) + " | "
          + " | ".join(f"jax {p}" for p in passes) + " | mixtape kernel (fwd) |")
    print("|---|---|" + "---:|" * 9 + "---|")
    for (shape, dtype), by_pass in rows.items():
        mixtape = []
        for p in passes:
            e = by_pass.get(p)
            mixtape.append(f"{cell(e['mixtape_gflops'])} ({cell(e['mixtape_fraction_of_peak'])})"
                           if e and e["mixtape_gflops"] else "–")
        peer = lambda system: [cell(by_pass[p][f"{system}_gflops"]) if p in by_pass else "–"
                               for p in passes]
        kernel = by_pass.get("fwd", {}).get("mixtape_kernel") or "–"
        print(f"| {shape} | {dtype} | " + " | ".join(mixtape + peer("torch") + peer("jax"))
              + f" | {kernel} |")
    for dtype, systems in doc.get("resnet18_convs", {}).items():
        cells = "; ".join(f"{system} {cell(t['gflops'])} GFLOP/s in {cell(t['ms'])} ms "
                          f"({cell(t.get('fraction_of_peak'))} of the peak)"
                          for system, t in systems.items())
        print(f"\nResNet-18 step's {systems[next(iter(systems))]['gflop']} GFLOP of convolutions "
              f"(GEMM-equivalent), {dtype}: {cells}.")


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    with open(sys.argv[1]) as f:
        doc = json.load(f)
    machine = doc["machine"]
    print(f"Measured {machine['date_utc']} on {machine['cpu']}, {machine['cores']} cores; "
          f"1-minute load average {machine['load_average_1min_at_start']} at the start, "
          f"{machine['load_average_1min_at_end']} at the end; "
          f"{'--quick' if doc['quick'] else 'full'} run, {doc['seconds']} s.\n")
    print("| workload | mixtape compiled | mt::compile step | mixtape eager | mixtape reference "
          "| torch (threads) | jax (jit compile s) | compiled / torch | compiled / jax "
          "| mt::compile / torch | mt::compile / jax |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for key, e in doc["workloads"].items():
        if "precision" not in e:
            continue
        torch = with_note(e["torch_steps_per_s"], e["torch_threads"])
        jax = with_note(e["jax_steps_per_s"], cell(e.get("jax_jit_compile_s"), 1))
        print(f"| {key} | {cell(e['mixtape_steps_per_s'])}{device(e)} | "
              f"{cell(e.get('mixtape_step_steps_per_s'))} | "
              f"{cell(e['mixtape_eager_steps_per_s'])} | "
              f"{cell(e['mixtape_reference_steps_per_s'])} | {torch} | {jax} | "
              f"{cell(e['ratio_vs_torch'])} | {cell(e['ratio_vs_jax'])} | "
              f"{cell(e.get('step_ratio_vs_torch'))} | {cell(e.get('step_ratio_vs_jax'))} |")
    timed = [(k, e) for k, e in doc["workloads"].items()
             if "precision" in e and e.get("mixtape_cpu_us_per_step")]
    if timed:
        print("\nCPU time per step, ms (every thread of the process; at one thread the figure "
              "that moves least with other processes' load), and the peers' CPU time over "
              "mixtape's:\n")
        print("| workload | mixtape compiled | mt::compile step | mixtape eager | torch | jax "
              "| torch / compiled | jax / compiled | torch / mt::compile | jax / mt::compile |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        ms = lambda us: cell(us / 1e3) if us else "–"
        for key, e in timed:
            print(f"| {key} | {ms(e['mixtape_cpu_us_per_step'])} | "
                  f"{ms(e['mixtape_step_cpu_us_per_step'])} | {ms(e['mixtape_eager_cpu_us_per_step'])} | "
                  f"{ms(e['torch_cpu_us_per_step'])} | {ms(e['jax_cpu_us_per_step'])} | "
                  f"{cell(e['cpu_ratio_vs_torch'])} | {cell(e['cpu_ratio_vs_jax'])} | "
                  f"{cell(e['step_cpu_ratio_vs_torch'])} | {cell(e['step_cpu_ratio_vs_jax'])} |")
    gemms = [e for e in doc["workloads"].values() if "size" in e]
    convs = [e for e in doc["workloads"].values() if "pass" in e]
    if gemms or convs:
        peak = doc.get("peak")
        if peak:
            print(f"\nFMA peak, GFLOP/s at threads {peak['threads']}: f32 ({peak['f32_isa']}) "
                  f"{[round(v, 1) for v in peak['f32_gflops']]}, bf16 dot products "
                  f"({peak['bf16_isa']}) {[round(v, 1) for v in peak['bf16_gflops']]}"
                  + (f", AMX bf16 tiles {[round(v, 1) for v in peak['amx_bf16_gflops']]}"
                     if peak.get("amx_bf16_gflops") else "")
                  + f"; machine peak (one core's times the cores) f32 "
                  f"{peak['machine_f32_gflops']:.0f}, bf16 {peak['machine_bf16_gflops']:.0f}. "
                  f"CPU: {peak.get('cpu_model', 'not recorded')}. Fractions below are of the "
                  f"machine peak (bf16: the best of f32, AVX512-BF16 and AMX, as bf16 may be "
                  f"widened to f32).\n")
    if gemms:
        print("| GEMM (N³ or MxNxK) | mixtape GFLOP/s (threads) | fraction of peak | torch.mm (threads) "
              "| fraction | jax | fraction | mixtape / torch |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|")
        for e in gemms:
            mixtape = with_note(e["mixtape_gflops"], e["mixtape_threads"])
            torch = with_note(e["torch_gflops"], e["torch_threads"])
            print(f"| {e['dtype']} {e['size']} | {mixtape} | {cell(e['mixtape_fraction_of_peak'])} "
                  f"| {torch} | {cell(e['torch_fraction_of_peak'])} | {cell(e['jax_gflops'])} "
                  f"| {cell(e['jax_fraction_of_peak'])} | {cell(e['ratio_vs_torch'])} |")
    if convs:
        print_convs(doc, convs)
    jit = doc.get("jit")
    if jit:
        cold, warm = jit["cold"], jit["warm"]
        print(f"\nJIT (digits_demo, fp32, mt::compile): cold, {cold['kernels_compiled']} kernels "
              f"compiled in {cold['compile_seconds']} s ({cold['ms_per_compiled_kernel']} ms "
              f"each), {cell(100 * jit['cold_jit_share_of_1000_steps'], 1)}% of a 1000-step run "
              f"(target < 10%), first step {cell(1e3 * cold['first_step_s'], 1)} ms "
              f"(target < 60 ms); warm, {warm['kernels_from_disk']} kernels loaded from the disk "
              f"cache in {warm['load_seconds']} s ({warm['ms_per_loaded_kernel']} ms each), "
              f"{warm['kernels_compiled']} compiled: a warm start adds "
              f"{cell(1e3 * jit['warm_start_added_seconds'], 1)} ms (target < 50 ms).")
    for note in doc.get("notes", []):
        print(f"\nNote: {note}")


if __name__ == "__main__":
    main()

"""python -m pageserve.lab.kernel_bench: the kernel checks and benchmarks, one JSON record.

On the H200 ``--out <dir>`` runs the checks in bf16, fp16 and fp32 at the 3B shapes, measures the
ceilings (device-to-device copy, a pure read, a bf16 matmul; eager ``triton.testing.do_bench``)
and times every kernel as GPU time: calls back to back in one CUDA graph, replays timed with CUDA
events (``timing.graph_ms``), since the engine runs the decode kernels in graphs and an eager
launch from Python costs more than a small kernel (inputs larger than L2, or weights rotated
through copies). Bytes are counted as the fewest the kernel must move: each input read once,
each output written once. A failing kernel is recorded and the run goes on. Writes
``<dir>/kernels_bench.json`` and prints a table. ``--parts sweep_m1`` runs the GEMV config sweep
at M = 1 (``sweeps.sweep_gemv_m1``). Without CUDA only the checks run, on Triton's CPU interpreter.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch

if not torch.cuda.is_available():  # before triton is first imported: the kernels run on the CPU interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402

from .checks import run_checks  # noqa: E402
from .run import BENCH_PARTS, DEFAULT_PARTS, gbps_table, run_benchmarks  # noqa: E402
from ..results import provenance  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pageserve.lab.kernel_bench", description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="folder for the JSON (--json)")
    ap.add_argument("--no-tune", action="store_true", help="GEMV: heuristic config only, no sweep")
    ap.add_argument("--skip-checks", action="store_true")
    ap.add_argument("--skip-bench", action="store_true")
    ap.add_argument("--parts", default=",".join(DEFAULT_PARTS),
                    help=f"comma-separated subset of {','.join(BENCH_PARTS)} (default: all but sweep_m1; "
                         "e.g. --parts switches, --parts sweep_m1)")
    ap.add_argument("--json", default="kernels_bench.json", help="file name under --out (default: %(default)s)")
    ap.add_argument("--gemv-batches", default="1,4,8",
                    help="batch sizes M of the gemv part (default %(default)s; e.g. 16,64: the skinny GEMM against cuBLAS)")
    args = ap.parse_args(argv)
    parts = tuple(p for p in args.parts.split(",") if p)
    unknown = set(parts) - set(BENCH_PARTS)
    if unknown:
        ap.error(f"unknown --parts {sorted(unknown)}; choose from {BENCH_PARTS}")
    os.makedirs(args.out, exist_ok=True)
    cuda = torch.cuda.is_available()
    record: dict = {**provenance(), "device": torch.cuda.get_device_name(0) if cuda else "cpu (interpreter)",
                    "torch": torch.__version__, "triton": triton.__version__}  # provenance: the commit it ran at
    t0 = time.time()
    path = os.path.join(args.out, args.json)

    def save():
        record["elapsed_s"] = time.time() - t0
        with open(path, "w") as f:
            json.dump(record, f, indent=2, default=str)

    if not args.skip_checks:
        dtypes = (torch.bfloat16, torch.float16, torch.float32) if cuda else (torch.float32, torch.bfloat16)
        record["checks"] = run_checks(dtypes, full=cuda)
        save()
    if cuda and not args.skip_bench:
        tuned: dict = {}
        gemv_batches = tuple(int(m) for m in args.gemv_batches.split(","))
        record["bench"] = run_benchmarks(tune_gemv=not args.no_tune, parts=parts, tuned=tuned, gemv_batches=gemv_batches)
        record["gemv_tuned_configs"] = {str(k): repr(v) for k, v in tuned.items()}
    save()

    checks_ = record.get("checks", {})
    failed = sorted(k.removesuffix("_pass") for k, v in checks_.items() if k.endswith("_pass") and not v)
    print(f"\n== checks: {sum(1 for k in checks_ if k.endswith('_pass'))} run, {len(failed)} failed: {failed}")
    for k, v in checks_.items():
        if k.endswith("_rel_err"):
            print(f"  {k:45s} {v:.3g}")
    bench = record.get("bench", {})
    if bench:
        print(f"\n== ceilings: copy {bench.get('copy_gbps', float('nan')):.0f} GB/s, read {bench.get('read_gbps', float('nan')):.0f} GB/s, "
              f"bf16 matmul {bench.get('matmul_bf16_tflops', float('nan')):.0f} TFLOP/s")
        for row in gbps_table(bench):
            frac = row["frac_of_read"]
            print(f"  {row['kernel']:32s} {row['gbps']:8.0f} GB/s  {'' if frac is None else f'{frac:6.1%}'}")
        for k, v in bench.items():
            if k.endswith(("_vs_cublas", "_stack_m1_ms", "_bw_frac", "_tflops", "_mma_frac", "_error", "_config")):
                print(f"  {k:40s} {v}")
        switches = {k: v for k, v in bench.items() if k.startswith("sw_") and k.endswith("_us")}
        if switches:
            print("\n== decode switches (µs per call in a CUDA graph; saved_us: per layer, x36 per step)")
            for k, v in switches.items():
                print(f"  {k:45s} {v:8.2f}")
        sweep = [k.removesuffix("_best_us") for k in bench if k.startswith("sweep_m1_") and k.endswith("_best_us")]
        if sweep:
            print("\n== GEMV M=1 sweep (µs per call in a CUDA graph, weights rotated out of L2)")
            for p in sweep:
                print(f"  {p.removeprefix('sweep_m1_'):10s} best {bench[p + '_best_us']:7.2f}  "
                      f"heuristic {bench.get(p + '_heuristic_us', math.nan):7.2f}  "
                      f"torch {bench.get(p + '_cublas_us', math.nan):7.2f}  {bench[p + '_best_config']}")
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

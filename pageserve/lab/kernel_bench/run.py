"""The bench's parts in one call (``run_benchmarks``) and the record's figures."""
from __future__ import annotations

import traceback

import torch

from ...kernels._util import use_pdl
from .ceilings import measure_ceilings
from .shapes import DTYPE_NAMES
from .sweeps import bench_decode_attention, bench_gemv, sweep_gemv_m1
from .switches import bench_switches
from .throughput import bench_elementwise, bench_prefill_attention


BENCH_PARTS = ("ceilings", "elementwise", "decode_attn", "prefill_attn", "gemv", "switches", "sweep_m1", "gemv_int8")
DEFAULT_PARTS = BENCH_PARTS[:-2]  # sweep_m1 (~2 min of compiles) and the int8 GEMV only when asked for


def run_benchmarks(dtype=torch.bfloat16, tune_gemv: bool = True, gemv_batches=(1, 4, 8),
                   decode_batch: int = 64, decode_context: int = 2048, parts: tuple = DEFAULT_PARTS,
                   tuned: dict | None = None) -> dict:
    """The named ``parts`` of ``BENCH_PARTS`` in that order (default: all but sweep_m1; the parts
    themselves need CUDA). A part that raises is recorded as ``<part>_error`` and the rest run. Kernel timings are GPU time, calls back to
    back in a CUDA graph (``graph_ms``); only the ceilings are timed eagerly. The GEMV parts put
    their best configs into ``tuned`` (``config_key -> GemvConfig``), which the later parts use."""
    tuned = {} if tuned is None else tuned
    # 1: kernels over at most PDL_MAX_TOKENS rows launch with PDL (the M <= 8 GEMVs; not batch 64)
    cuda = torch.cuda.is_available()
    figures: dict = {"pdl_launch": int(cuda and use_pdl(torch.empty(0, device="cuda"), 1))}
    table = [("ceilings", measure_ceilings), ("elementwise", lambda: bench_elementwise(dtype)),
             ("decode_attn", lambda: bench_decode_attention(decode_batch, decode_context, dtype)),
             ("prefill_attn", lambda: bench_prefill_attention(dtype))]
    table += [(f"gemv_m{m}", lambda m=m: bench_gemv(m, dtype, tune_gemv, tuned=tuned)) for m in gemv_batches]
    table += [(f"gemv_int8_m{m}", lambda m=m: bench_gemv(m, dtype, tune_gemv, tuned=tuned, quant=True))
              for m in gemv_batches]
    table += [("switches", lambda: bench_switches(dtype, configs=tuned)),
              ("sweep_m1", lambda: sweep_gemv_m1(dtype, tuned=tuned))]
    for part, fn in table:
        name = "gemv_int8" if part.startswith("gemv_int8_m") else "gemv" if part.startswith("gemv_m") else part
        if name not in parts:
            continue
        try:
            figures.update(fn())
        except Exception as e:
            figures[f"{part}_error"] = f"{type(e).__name__}: {e}"[:2000]
            traceback.print_exc()
        if cuda:
            torch.cuda.synchronize()
    read = figures.get("read_gbps")
    if read:
        if "paged_decode_attn_gbps" in figures:  # the default configuration (the engine's), not the sweep's best
            figures["paged_decode_attn_bw_frac"] = figures["paged_decode_attn_gbps"] / read
        for k in list(figures):
            if k.endswith("_gbps") and not k.startswith(("read", "copy")):
                figures[k.removesuffix("_gbps") + "_read_frac"] = figures[k] / read
    if "matmul_bf16_tflops" in figures and "paged_prefill_attn_tflops" in figures:
        figures["paged_prefill_attn_mma_frac"] = figures["paged_prefill_attn_tflops"] / figures["matmul_bf16_tflops"]
    return figures


def summary_figures(check_results: dict, bench_results: dict, dtype=torch.bfloat16) -> dict:
    """The record's figures: ``<kernel>_rel_err`` in ``dtype`` (and ``<kernel>_<dtype>_rel_err`` for
    every dtype checked), ``checks_failed``, then every timing figure."""
    dn = DTYPE_NAMES[dtype]
    figures = {}
    for k, v in check_results.items():
        if k.endswith("_rel_err"):
            figures[k] = v
            if k.endswith(f"_{dn}_rel_err"):
                figures[k.removesuffix(f"_{dn}_rel_err") + "_rel_err"] = v
    figures["checks_failed"] = sum(1 for k, v in check_results.items() if k.endswith("_pass") and not v)
    figures.update({k: v for k, v in bench_results.items() if isinstance(v, (int, float))})
    return figures


def gbps_table(figures: dict) -> list[dict]:
    """Rows (kernel, GB/s, fraction of the read ceiling) for printing and plotting."""
    rows = []
    read = figures.get("read_gbps")
    for k, v in figures.items():
        if k.endswith("_gbps") and not k.startswith(("read", "copy")) and isinstance(v, (int, float)):
            name = k.removesuffix("_gbps")
            rows.append({"kernel": name, "gbps": v, "frac_of_read": v / read if read else None})
    return rows

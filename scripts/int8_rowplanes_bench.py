"""Issue 12: the int8 linears at decode batches of 8-512 rows, GPU time per call from CUDA-graph replays
(weights rotated out of L2), for the 3B shapes: bf16 as the engine runs it (cuBLAS), int8 as the engine
runs it today (``gemv_int8``'s tl.dot tiles to 64 rows, dequantize + cuBLAS above), and
``int8_rowplanes`` (x's digit planes made once per launch, scaled per row, then the integer MMAs), its
heuristic and a small sweep of tiles, its two-digit form at the heuristic; the planes' prepass
(``row_planes``) alone too.

    python scripts/int8_rowplanes_bench.py --out DIR [--ms 8,16,32,64,128,256,512] [--sweep-ms 16,64,256]

Writes DIR/int8_rowplanes_bench.json (with the commit) after every shape: microseconds per call, each
candidate's, the best config per (M, shape), and per M the four linears' sum ("stack", SiLU·mul + down in
down's place). On the H200: stage ``rowplanes`` of scripts/h200_run.sh.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from pageserve.kernels.int8_rowplanes import (RowPlanesConfig, linear_int8_rowplanes, row_planes, rowplanes_config,
                                              silu_mul_linear_int8_rowplanes)
from pageserve.kernels.reference import quantize_int8
from pageserve.lab.kernel_bench.shapes import GEMV_SHAPES
from pageserve.lab.kernel_bench.timing import graph_ms
from pageserve.lab.results import provenance
from pageserve.model.quant import QuantizedWeight
from pageserve.model.triton_ops import TritonOps

SHAPES = {name: GEMV_SHAPES[name] for name in ("qkv", "o", "gate_up", "down")}


def candidates(M: int, N: int, K: int, sms: int, wide: bool) -> list[RowPlanesConfig]:
    """The heuristic, then (``wide``) 64 or 128 weight rows x 16-128 x rows, 128 or 256 columns a step, the
    split that gives ~2 programs per SM and its double, 4 warps (8 at 128 weight rows), 3 or 4 stages."""
    out = [rowplanes_config(M, N, K, sms)]
    if not wide:
        return out
    bms = sorted({min(max(16, 1 << (M - 1).bit_length()), 128), min(max(16, 1 << (M - 1).bit_length()) // 2, 64),
                  32} - {8})
    for bn in (64, 128):
        for bm in bms:
            if bm < 16:
                continue
            for bk in (128, 256):
                tiles = -(-N // bn) * -(-M // bm)
                split = max(1, min(-(-2 * sms // tiles), K // (2 * bk)))
                for sp in sorted({split, min(2 * split, max(1, K // bk))}):
                    for stages in (3, 4):
                        cand = RowPlanesConfig(bn, bm, bk, sp, 8 if bn == 128 else 4, stages)
                        if cand not in out:
                            out.append(cand)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--ms", default="8,16,32,64,128,256,512")
    ap.add_argument("--sweep-ms", default="16,64,256", help="row counts that get the sweep")
    ap.add_argument("--budget-s", type=float, default=200.0, help="stop sweeping (heuristics only) after this long")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("int8_rowplanes_bench times CUDA graphs: it needs a GPU")
    out = Path(args.out) / "int8_rowplanes_bench.json"
    t0 = time.time()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rec = {**provenance(), "us": {}, "best": {}, "stack_us": {}}
    gen = torch.Generator(device="cuda").manual_seed(0)
    ops = TritonOps()  # the engine's paths today
    sweep_ms = {int(m) for m in args.sweep_ms.split(",")}
    weights = {}
    for name, (N, K) in SHAPES.items():
        n = max(2, min(16, -(-200_000_000 // (N * K * 2))))
        ws = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16, generator=gen) * K ** -0.5 for _ in range(n)]
        weights[name] = (ws, [QuantizedWeight(*quantize_int8(w)) for w in ws])
    for M in (int(m) for m in args.ms.split(",")):
        stack = {"bf16": 0.0, "int8": 0.0, "rowplanes_heuristic": 0.0, "rowplanes_best": 0.0, "prepass": 0.0,
                 "rowplanes2_heuristic": 0.0}
        for name, (N, K) in SHAPES.items():
            ws, qs = weights[name]
            silu = name == "down"  # the MLP's down runs fused with SiLU·mul in the engine
            x = torch.randn(M, 2 * K if silu else K, device="cuda", dtype=torch.bfloat16, generator=gen)
            if silu:
                impls = {"bf16": lambda i: ops.silu_mul_linear(x, ws[i % len(ws)]),
                         "int8": lambda i: ops.silu_mul_linear(x, qs[i % len(qs)])}
            else:
                impls = {"bf16": lambda i: ops.linear(x, ws[i % len(ws)], None),
                         "int8": lambda i: ops.linear(x, qs[i % len(qs)], None)}
            row = {k: graph_ms(fn, calls=len(ws)) * 1e3 for k, fn in impls.items()}
            row["prepass"] = graph_ms(lambda i: row_planes(x, silu), calls=len(ws)) * 1e3
            fn = silu_mul_linear_int8_rowplanes if silu else linear_int8_rowplanes
            row["rowplanes2_heuristic"] = graph_ms(  # two digits: two products
                lambda i: fn(x, qs[i % len(qs)].qweight, qs[i % len(qs)].scale, planes=2), calls=len(qs)) * 1e3
            cands = candidates(M, N, K, sms, M in sweep_ms and time.time() - t0 < args.budget_s)
            timed = {}
            for cfg in cands:
                if time.time() - t0 > args.budget_s and timed:
                    break
                try:
                    timed[cfg] = graph_ms(lambda i: fn(x, qs[i % len(qs)].qweight, qs[i % len(qs)].scale, config=cfg),
                                          calls=len(qs)) * 1e3
                except Exception as e:  # noqa: BLE001 - a config that does not compile or fit is skipped, named
                    rec["us"][f"{name}/M={M}/rowplanes {cfg}"] = f"failed: {type(e).__name__}: {str(e)[:200]}"
            if not timed:
                print(name, M, "no rowplanes config ran", flush=True)
                continue
            row["rowplanes_heuristic"] = timed.get(cands[0], float("nan"))
            best = min(timed, key=timed.get)
            row["rowplanes_best"] = timed[best]
            for cfg, us in timed.items():
                rec["us"][f"{name}/M={M}/rowplanes {cfg}"] = us
            for k, v in row.items():
                rec["us"][f"{name}/M={M}/{k}"] = v
                stack[k] += v
            rec["best"][f"{name}/M={M}"] = repr(best)
            print(name, M, {k: round(v, 2) for k, v in row.items()}, "best", best, flush=True)
            out.write_text(json.dumps(rec, indent=1))
        rec["stack_us"][str(M)] = stack
        print("stack", M, {k: round(v, 1) for k, v in stack.items()}, flush=True)
        out.write_text(json.dumps(rec, indent=1))
    rec["elapsed_s"] = time.time() - t0
    out.write_text(json.dumps(rec, indent=1))


if __name__ == "__main__":
    main()

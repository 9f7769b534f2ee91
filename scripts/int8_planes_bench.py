"""Issue 12: the int8 linears at decode row counts, GPU time per call from CUDA-graph replays (weights
rotated out of L2), for the 3B shapes: bf16 as the engine runs it (its GEMV at one row, cuBLAS above),
int8 as the engine runs it today (``gemv_int8``: each weight converted on the CUDA cores), and
``int8_planes`` (x as int8 digit planes on the integer MMAs) with its heuristic and a small sweep of tiles.

    python scripts/int8_planes_bench.py --out DIR [--ms 1,2,4,8] [--sweep-ms 1,8]

Writes DIR/int8_planes_bench.json (with the commit) after every shape: microseconds per call, each
planes candidate's, the best config per (M, shape) under ``planes_config_key`` (the form of the device
JSON's ``int8_tuned_configs``), and per M the four linears' sum ("stack", the fused SiLU·down in down's
place). On the H200: stage ``planes`` of scripts/h200_run.sh.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from pageserve.kernels.gemv import GemvConfig
from pageserve.kernels.int8_planes import (gemv_int8_planes, planes_config, planes_config_key, planes_rows,
                                           silu_mul_gemv_int8_planes)
from pageserve.kernels.reference import quantize_int8
from pageserve.lab.kernel_bench.shapes import GEMV_SHAPES
from pageserve.lab.kernel_bench.timing import graph_ms
from pageserve.lab.results import provenance
from pageserve.model.quant import QuantizedWeight
from pageserve.model.triton_ops import TritonOps

SHAPES = {name: GEMV_SHAPES[name] for name in ("qkv", "o", "gate_up", "down")}


def candidates(M: int, N: int, K: int, sms: int, silu: bool, wide: bool) -> list[GemvConfig]:
    """The heuristic, then tiles around it: 64-128 weight rows, 128-512 int8 columns, the split that
    gives ~4 programs per SM and its double, 4 warps x 3 stages or 8 x 4, the product plain or
    transposed (``wide``: all of them; else two tiles at one launch shape, transposed). (At f307388
    the bench also ran 16-64 rows, with the digits made by a prepass kernel: slower than gemv_int8.)"""
    out = [planes_config(M, N, K, sms, silu)]
    tiles = [(64, 256), (128, 256), (64, 512), (128, 128)] if wide else [(64, 256), (128, 256)]
    rows = -(-M // planes_rows(M))
    for bn, bk in tiles:
        split = max(1, min(-(-4 * sms // (-(-N // bn) * rows)), K // (2 * bk)))
        for sp in sorted({split, min(2 * split, max(1, K // bk))} if wide else {split}):
            for warps, stages in ([(4, 3), (8, 4)] if wide else [(4, 4)]):
                for swap in ((False, True) if wide else (True,)):  # swap: the weights as wgmma's M side
                    cand = GemvConfig(bn, bk, sp, warps, stages, swap_ab=swap)
                    if cand not in out:
                        out.append(cand)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--ms", default="1,2,4,8")
    ap.add_argument("--sweep-ms", default="1,8", help="row counts that get the wide sweep")
    ap.add_argument("--budget-s", type=float, default=170.0, help="stop sweeping (heuristics only) after this long")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("int8_planes_bench times CUDA graphs: it needs a GPU")
    out = Path(args.out) / "int8_planes_bench.json"
    t0 = time.time()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rec = {**provenance(), "us": {}, "best": {}, "tuned_configs": {}, "stack_us": {}}
    gen = torch.Generator(device="cuda").manual_seed(0)
    ops = TritonOps()  # the engine's paths: tuned bf16 GEMV / cuBLAS, tuned int8 GEMV
    sweep_ms = {int(m) for m in args.sweep_ms.split(",")}
    weights = {}
    for name, (N, K) in SHAPES.items():
        n = max(2, min(16, -(-200_000_000 // (N * K * 2))))
        ws = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16, generator=gen) * K ** -0.5 for _ in range(n)]
        weights[name] = (ws, [QuantizedWeight(*quantize_int8(w)) for w in ws])
    for M in (int(m) for m in args.ms.split(",")):
        stack = {"bf16": 0.0, "int8": 0.0, "planes_heuristic": 0.0, "planes_best": 0.0}
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
            fn = silu_mul_gemv_int8_planes if silu else gemv_int8_planes
            cands = candidates(M, N, K, sms, silu, M in sweep_ms and time.time() - t0 < args.budget_s)
            timed = {}
            for cfg in cands:
                if time.time() - t0 > args.budget_s and timed:
                    break
                try:
                    timed[cfg] = graph_ms(lambda i: fn(x, qs[i % len(qs)].qweight, qs[i % len(qs)].scale, config=cfg),
                                          calls=len(qs)) * 1e3
                except Exception as e:  # noqa: BLE001 - a config that does not compile or fit is skipped, named
                    rec["us"][f"{name}/M={M}/planes {cfg}"] = f"failed: {type(e).__name__}: {str(e)[:200]}"
            if not timed:
                print(name, M, "no planes config ran", flush=True)
                continue
            row["planes_heuristic"] = timed.get(cands[0], float("nan"))
            best = min(timed, key=timed.get)
            row["planes_best"] = timed[best]
            for cfg, us in timed.items():
                rec["us"][f"{name}/M={M}/planes {cfg}"] = us
            for k, v in row.items():
                rec["us"][f"{name}/M={M}/{k}"] = v
                stack[k] += v
            rec["best"][f"{name}/M={M}"] = repr(best)
            rec["tuned_configs"][str(planes_config_key(M, N, K, silu))] = repr(best)
            print(name, M, {k: round(v, 2) for k, v in row.items()}, "best", best, flush=True)
            out.write_text(json.dumps(rec, indent=1))
        rec["stack_us"][str(M)] = stack
        print("stack", M, {k: round(v, 1) for k, v in stack.items()}, flush=True)
        out.write_text(json.dumps(rec, indent=1))
    rec["elapsed_s"] = time.time() - t0
    out.write_text(json.dumps(rec, indent=1))


if __name__ == "__main__":
    main()

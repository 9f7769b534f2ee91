"""The split-K GEMM (``kernels.gemm_splitk``) against cuBLAS in the decode band where cuBLAS runs
below the tensor-core ceiling (issue 14: 129-256 rows, results/h200/diagnostics/kernels_cublas_band_*):
for each row count M and each Qwen2.5-3B linear, GPU time per call of cuBLAS and of a list of
tile x K-slice configs (both operand orders), each call on the next of several weight copies so
that the weights come from HBM, as in a decode step. Every config's output is checked against
cuBLAS's. The reduce launch of a split config is inside its time; ``reduce_us`` is that launch
alone (what fusing the partials' sum into the next kernel would save).

    python scripts/splitk_probe.py --out DIR [--ms 128,160,200,256] [--shapes qkv,o,gate_up,down]

Writes DIR/splitk_probe.json (with ``provenance``) after every M, so a time limit keeps what ran.
On the H200: stage ``splitk`` of scripts/h200_run.sh.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import torch

from pageserve.kernels.gemm_splitk import SplitKConfig, splitk_matmul
from pageserve.kernels.gemv import reduce_splits
from pageserve.lab.kernel_bench.shapes import GEMV_SHAPES, LAYERS
from pageserve.lab.kernel_bench.timing import graph_ms, weight_copies
from pageserve.lab.results import provenance

# (block_m, block_n, block_k, num_warps, num_stages): block_m the batch rows, block_n the weight rows
TILES = [(64, 64, 128, 4, 4), (64, 128, 64, 4, 4), (128, 64, 64, 4, 4), (128, 128, 64, 8, 4),
         (64, 32, 128, 4, 6), (128, 256, 64, 8, 3), (256, 64, 64, 8, 4)]
SWAPPED = [(256, 64, 64, 4, 4), (256, 64, 128, 4, 3), (128, 64, 128, 4, 4), (256, 128, 64, 8, 3),
           (128, 128, 64, 8, 4), (256, 64, 64, 4, 3)]
SPLITS = (1, 2, 3, 4, 6, 8)


def candidates(M: int, N: int, K: int, sms: int) -> list[SplitKConfig]:
    """Every tile (both orders) with the K slice counts that keep slices >= 4 K steps long and the
    grid between a third of the SMs and four waves."""
    out = []
    for tiles, swap in ((TILES, False), (SWAPPED, True)):
        for bm, bn, bk, w, st in tiles:
            if bm > 2 * M:  # a row tile more than half padding
                continue
            tiles_n = -(-M // bm) * -(-N // bn)
            for s in SPLITS:
                if s > 1 and K // s < 4 * bk:
                    continue
                if s > 1 and not sms // 3 <= tiles_n * s <= 4 * sms:
                    continue
                out.append(SplitKConfig(bm, bn, bk, splits=s, num_warps=w, num_stages=st, swap_ab=swap))
    return out


def cublas(x, w, bias, y):
    return torch.matmul(x, w.T, out=y) if bias is None else torch.addmm(bias, x, w.T, out=y)


def probe_shape(name: str, N: int, K: int, M: int, sms: int, gen: torch.Generator) -> dict:
    dtype, dev = torch.bfloat16, gen.device
    ws = weight_copies(N, K, dtype, gen, min_bytes=200e6)
    bias = torch.randn(N, device=dev, dtype=dtype, generator=gen) if name == "qkv" else None
    x = torch.randn(M, K, device=dev, dtype=dtype, generator=gen)
    y = torch.empty(M, N, device=dev, dtype=dtype)
    ref = cublas(x, ws[0], bias, torch.empty_like(y)).float()
    rec = {"cublas_us": 1e3 * graph_ms(lambda i: cublas(x, ws[i % len(ws)], bias, y), calls=len(ws)),
           "rows": [], "reduce_us": {}}
    for cfg in candidates(M, N, K, sms):
        row = dataclasses.asdict(cfg)
        try:
            out = splitk_matmul(x, ws[0], bias, cfg)
            row["rel_err"] = float((out.float() - ref).norm() / ref.norm())
            row["us"] = 1e3 * graph_ms(lambda i, c=cfg: splitk_matmul(x, ws[i % len(ws)], bias, c, out=y),
                                       calls=len(ws))
        except Exception as e:  # out of shared memory, a descriptor the GPU refuses: recorded, skipped
            row["error"] = f"{type(e).__name__}: {e}"[:240]
        rec["rows"].append(row)
    for s in sorted({r["splits"] for r in rec["rows"] if r["splits"] > 1}):
        part = torch.randn(s, M, N, device=dev, dtype=torch.float32, generator=gen)
        rec["reduce_us"][str(s)] = 1e3 * graph_ms(lambda i, p=part: reduce_splits(p, None, bias, y, {"USE_PDL": False}),
                                                  calls=8)
    ok = [r for r in rec["rows"] if "us" in r and r["rel_err"] < 1e-2]
    rec["rows"].sort(key=lambda r: r.get("us", float("inf")))
    rec["best"] = min(ok, key=lambda r: r["us"]) if ok else None
    rec["bad"] = [r for r in rec["rows"] if "us" in r and r["rel_err"] >= 1e-2]
    return rec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--ms", default="128,160,200,256")
    ap.add_argument("--shapes", default="qkv,o,gate_up,down")
    ap.add_argument("--name", default="splitk_probe", help="the JSON's file name (without .json)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("splitk_probe times CUDA graphs: it needs a GPU")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    path = Path(args.out) / f"{args.name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    rec = {**provenance(), "device": torch.cuda.get_device_name(), "by_m": {}}
    gen = torch.Generator(device="cuda").manual_seed(0)
    for M in (int(m) for m in args.ms.split(",")):
        t0 = time.time()
        per = {name: probe_shape(name, *GEMV_SHAPES[name], M, sms, gen) for name in args.shapes.split(",")}
        torch.cuda.empty_cache()
        cub = LAYERS * sum(r["cublas_us"] for r in per.values())
        best = LAYERS * sum(min(r["cublas_us"], r["best"]["us"] if r["best"] else float("inf")) for r in per.values())
        rec["by_m"][str(M)] = {"shapes": per, "stack_cublas_us": cub, "stack_best_us": best, "elapsed_s": time.time() - t0}
        path.write_text(json.dumps(rec, indent=1))
        print(f"M={M}: {LAYERS} layers x {list(per)}: cuBLAS {cub:.0f} us, best of both {best:.0f} us "
              f"({time.time() - t0:.0f} s)", flush=True)
        for n, r in per.items():
            b = r["best"] or {}
            print(f"  {n}: cublas {r['cublas_us']:.1f} splitk best {b.get('us', float('nan')):.1f} "
                  f"{ {k: b.get(k) for k in ('block_m', 'block_n', 'block_k', 'splits', 'num_warps', 'num_stages', 'swap_ab')} } "
                  f"reduce {r['reduce_us']} bad {len(r['bad'])}", flush=True)


if __name__ == "__main__":
    main()

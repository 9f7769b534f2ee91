"""A decoder layer's o or down product followed by the add + RMSNorm that reads it, two ways (issue 14's
batch-64 step): as the engine runs it today (cuBLAS, which splits down's K itself and sums the slices in a
reduce launch of its own, then the norm kernel), and as ``TritonOps(split_to_norm=)`` runs it (one batched
cuBLAS call over S equal K slices with fp32 outputs, ``triton_ops.split_products``; the norm kernel sums the
slices before its residual add). GPU time per pair of launches in a CUDA graph, the weights rotated out of
L2, at each row count and S; and per case whether the split path's output is within bf16 rounding of
today's and bitwise what the norm gives the slices summed first (``reference.split_sum``).

    python scripts/split_norm_probe.py --out DIR [--rows 4,16,64] [--slices 2,4,8] [--dtype bf16]

Writes DIR/split_norm_probe.json (``results.provenance`` commit). On the H200: stage ``splitnorm`` of
scripts/h200_run.sh.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from pageserve.kernels import add_rms_norm, reference
from pageserve.lab.kernel_bench.shapes import GEMV_SHAPES
from pageserve.lab.kernel_bench.timing import graph_us, weight_copies
from pageserve.lab.results import provenance
from pageserve.model.triton_ops import split_products

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def case(proj: str, rows: int, slices_list: list[int], dtype: torch.dtype, gen: torch.Generator) -> dict:
    N, K = GEMV_SHAPES[proj]
    x = torch.randn(rows, K, device="cuda", dtype=dtype, generator=gen)
    residual = torch.randn(rows, N, device="cuda", dtype=dtype, generator=gen)
    norm_w = (1 + 0.1 * torch.randn(N, device="cuda", generator=gen)).to(dtype)
    ws = weight_copies(N, K, dtype, gen, min_bytes=200e6)
    res_out = torch.empty_like(residual)

    def today(i):
        return add_rms_norm(torch.nn.functional.linear(x, ws[i % len(ws)]), residual, norm_w, 1e-6,
                            residual_out=res_out)

    r = {"N": N, "K": K, "rows": rows, "today_us": graph_us(today, 20)}
    want = today(0)[0].float()
    for s in slices_list:
        if K % s:
            continue

        def split(i, s=s):
            return add_rms_norm(split_products(x, ws[i % len(ws)], s), residual, norm_w, 1e-6, residual_out=res_out)

        r[f"split{s}_us"] = graph_us(split, 20)
        parts = split_products(x, ws[0], s)
        got = add_rms_norm(parts, residual, norm_w, 1e-6)[0]
        summed_first = add_rms_norm(reference.split_sum(parts.parts, dtype), residual, norm_w, 1e-6)[0]
        r[f"split{s}_same_bits_as_summed_first"] = bool(torch.equal(got, summed_first))
        r[f"split{s}_rel_err_vs_today"] = float((got.float() - want).norm() / want.norm())
    splits = {k: v for k, v in r.items() if k.startswith("split") and k.endswith("_us")}
    if splits:
        best = min(splits, key=splits.get)
        r["best"], r["best_speedup"] = best.removesuffix("_us"), r["today_us"] / splits[best]
    return r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--rows", default="4,16,64")
    ap.add_argument("--slices", default="2,4,8")
    ap.add_argument("--projs", default="o,down")
    ap.add_argument("--dtype", default="bf16", choices=tuple(DTYPES))
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("split_norm_probe times CUDA graphs: it needs a GPU")
    dtype = DTYPES[args.dtype]
    rec = {**provenance(), "device": torch.cuda.get_device_name(), "dtype": args.dtype, "cases": {}}
    out = Path(args.out) / "split_norm_probe.json"
    gen = torch.Generator(device="cuda").manual_seed(0)
    slices = [int(s) for s in args.slices.split(",")]
    for proj in args.projs.split(","):
        for rows in (int(m) for m in args.rows.split(",")):
            r = case(proj, rows, slices, dtype, gen)
            rec["cases"][f"{proj}/m{rows}"] = r
            print(proj, rows, {k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()}, flush=True)
            out.write_text(json.dumps(rec, indent=1))


if __name__ == "__main__":
    main()

"""The MLP's gate_up product followed by SiLU·mul at prefill row counts, each way the engine could
run it, GPU time per call from CUDA-graph replays (weights rotated out of L2), Qwen2.5-3B shape:

- ``cublas``: the product alone (what the default mode's step runs, before the SiLU·mul kernel);
- ``cublas_then_silu``: cuBLAS then ``silu_and_mul`` (the default mode today above 64 rows);
- ``dual_<tile>``: ``matmul_invariant(silu_mul=True)``, a gate tile and an up tile a program (two
  accumulators, two MMA chains);
- ``paired_<tile>``: ``kernels.gate_up_silu``, gate and up rows interleaved in one tile (one chain),
  pointer or TMA loads.

Each fused variant's output is compared with ``cublas_then_silu``'s (bitwise, and the largest
difference). Issue 14: W1's prefill step spends ~4.6 ms of ~80 in the SiLU·mul kernel.

    python scripts/gate_up_silu_probe.py --out DIR [--ms 512,2048,8192] [--dtype bf16] [--variants round2]

Writes DIR/gate_up_silu_probe.json (with the commit) after every row count. Stage ``gusprobe`` of
scripts/h200_run.sh.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from pageserve.kernels import matmul_invariant, silu_and_mul
from pageserve.kernels.gate_up_silu import gate_up_silu
from pageserve.kernels.matmul_invariant import InvariantMatmulConfig as C
from pageserve.lab.kernel_bench.shapes import GEMV_SHAPES
from pageserve.lab.kernel_bench.timing import graph_ms, weight_copies
from pageserve.lab.results import provenance

DUAL = {  # block_n = both halves: matmul_invariant halves it per accumulator
    "dual_256x128x64_w8s4_tma": C(256, 128, 64, 8, 4, tma=True),  # measured_config above 1,024 rows (00ce090)
    "dual_128x256x64_w8s3_tma": C(128, 256, 64, 8, 3, tma=True),
    "dual_128x256x64_w8s4_tma": C(128, 256, 64, 8, 4, tma=True),
}
PAIRED_ROUND1 = {  # block_n = the tile's weight rows: half gate, half up
    "paired_128x256x64_w8s3_tma": C(128, 256, 64, 8, 3, tma=True),
    "paired_128x256x64_w8s4_tma": C(128, 256, 64, 8, 4, tma=True),
    "paired_256x128x64_w8s4_tma": C(256, 128, 64, 8, 4, tma=True),
    "paired_128x128x64_w8s4_tma": C(128, 128, 64, 8, 4, tma=True),
    "paired_128x256x64_w8s3_ptr": C(128, 256, 64, 8, 3),
    "paired_128x256x64_w8s4_ptr": C(128, 256, 64, 8, 4),
    "paired_256x128x64_w8s4_ptr": C(256, 128, 64, 8, 4),
}
PAIRED_ROUND2 = {  # after round 1 (83d553f): TMA 128 x 256 x 64, 3 stages best; the persistent walk, K tiles, groups
    "paired_128x256x64_w8s3_tma": C(128, 256, 64, 8, 3, tma=True),
    "paired_128x256x64_w8s3_tma_g16": C(128, 256, 64, 8, 3, group_m=16, tma=True),
    "paired_128x256x128_w8s2_tma": C(128, 256, 128, 8, 2, tma=True),
    "paired_256x256x64_w16s3_tma": C(256, 256, 64, 16, 3, tma=True),
    "persist_128x256x64_w8s3": C(128, 256, 64, 8, 3, tma=True, persistent=True),
    "persist_128x256x64_w8s4": C(128, 256, 64, 8, 4, tma=True, persistent=True),
    "persist_128x256x64_w8s3_g16": C(128, 256, 64, 8, 3, group_m=16, tma=True, persistent=True),
    "persist_128x256x128_w8s2": C(128, 256, 128, 8, 2, tma=True, persistent=True),
}
PAIRED_ROUND3 = {  # session 33, below 2,048 rows (cuBLAS + SiLU·mul there): the persistent walk with smaller tiles
    "persist_128x256x64_w8s3": C(128, 256, 64, 8, 3, tma=True, persistent=True),
    "persist_128x256x64_w8s4": C(128, 256, 64, 8, 4, tma=True, persistent=True),
    "persist_64x256x64_w4s4": C(64, 256, 64, 4, 4, tma=True, persistent=True),
    "persist_128x128x64_w8s4": C(128, 128, 64, 8, 4, tma=True, persistent=True),
    "persist_128x128x64_w4s4": C(128, 128, 64, 4, 4, tma=True, persistent=True),
    "persist_64x128x64_w4s5": C(64, 128, 64, 4, 5, tma=True, persistent=True),
}
ROUNDS = {"round1": (DUAL, PAIRED_ROUND1), "round2": ({}, PAIRED_ROUND2), "round3": ({}, PAIRED_ROUND3),
          "default": ({}, {"default_config": None})}  # gate_up_silu's own default (a check of the shipped code)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--ms", default="512,2048,8192")
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp16"))
    ap.add_argument("--variants", default="round2", choices=tuple(ROUNDS))
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gate_up_silu_probe times CUDA graphs: it needs a GPU")
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    out = Path(args.out) / "gate_up_silu_probe.json"
    dual, paired = ROUNDS[args.variants]
    rec = {**provenance(), "dtype": args.dtype, "variants": args.variants, "us": {}, "bit_equal": {}, "max_abs_diff": {}, "errors": {}}
    gen = torch.Generator(device="cuda").manual_seed(0)
    N, K = GEMV_SHAPES["gate_up"]
    ws = weight_copies(N, K, dtype, gen, min_bytes=200e6)
    for M in (int(m) for m in args.ms.split(",")):
        x = torch.randn(M, K, device="cuda", dtype=dtype, generator=gen)
        impls = {"cublas": lambda i: torch.nn.functional.linear(x, ws[i % len(ws)]),
                 "cublas_then_silu": lambda i: silu_and_mul(torch.nn.functional.linear(x, ws[i % len(ws)]))}
        for name, cfg in dual.items():
            impls[name] = lambda i, cfg=cfg: matmul_invariant(x, ws[i % len(ws)], silu_mul=True, config=cfg,
                                                               specialize=False)
        for name, cfg in paired.items():
            impls[name] = lambda i, cfg=cfg: gate_up_silu(x, ws[i % len(ws)], config=cfg)
        ref = impls["cublas_then_silu"](0)
        for impl, fn in impls.items():
            key = f"M={M}/{impl}"
            try:
                if impl != "cublas":
                    y = fn(0)
                    rec["bit_equal"][key] = bool(torch.equal(y, ref))
                    rec["max_abs_diff"][key] = float((y.float() - ref.float()).abs().max())
                rec["us"][key] = graph_ms(fn, calls=len(ws)) * 1e3
            except Exception as e:  # noqa: BLE001 - a variant that fails to compile or launch is a finding
                rec["errors"][key] = f"{type(e).__name__}: {str(e)[:300]}"
            print(key, {k: v[key] for k, v in rec.items() if isinstance(v, dict) and key in v}, flush=True)
            out.write_text(json.dumps(rec, indent=1))


if __name__ == "__main__":
    main()

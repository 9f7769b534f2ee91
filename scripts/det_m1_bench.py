"""The deterministic mode's linears at decode row counts, GPU time per call from CUDA-graph replays
(weights rotated out of L2): each 3B shape through ``matmul_invariant`` with the M-specialized and
the generic compile, and gate_up with SiLU·mul in its epilogue against the product followed by the
separate ``silu_and_mul`` kernel (issue 15: which of the two is faster at which M).

    python scripts/det_m1_bench.py --out DIR [--ms 1,64,512]

Writes DIR/det_m1_bench.json (with the commit) after every shape. On the H200: stage ``detm1`` of
scripts/h200_run.sh.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from pageserve.kernels import matmul_invariant, silu_and_mul
from pageserve.lab.kernel_bench.shapes import GEMV_SHAPES
from pageserve.lab.kernel_bench.timing import graph_ms, weight_copies
from pageserve.lab.results import provenance


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--ms", default="1,64,512")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("det_m1_bench times CUDA graphs: it needs a GPU")
    out = Path(args.out) / "det_m1_bench.json"
    rec = {**provenance(), "us": {}}
    gen = torch.Generator(device="cuda").manual_seed(0)
    for name, (N, K) in GEMV_SHAPES.items():
        ws = weight_copies(N, K, torch.bfloat16, gen, min_bytes=200e6)
        for M in (int(m) for m in args.ms.split(",")):
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, generator=gen)
            impls = {"specialized": lambda i: matmul_invariant(x, ws[i % len(ws)], specialize=True),
                     "generic": lambda i: matmul_invariant(x, ws[i % len(ws)], specialize=False)}
            if name == "gate_up":
                impls["silu_epilogue"] = lambda i: matmul_invariant(x, ws[i % len(ws)], silu_mul=True, specialize=True)
                impls["then_silu_kernel"] = lambda i: silu_and_mul(matmul_invariant(x, ws[i % len(ws)],
                                                                                    specialize=True))
            for impl, fn in impls.items():
                rec["us"][f"{name}/M={M}/{impl}"] = graph_ms(fn, calls=len(ws)) * 1e3
            print({k: round(v, 1) for k, v in rec["us"].items() if k.startswith(f"{name}/M={M}/")}, flush=True)
            out.write_text(json.dumps(rec, indent=1))


if __name__ == "__main__":
    main()

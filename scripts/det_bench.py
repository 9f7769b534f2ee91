"""Where the deterministic mode's time goes, kernel by kernel (issue 15): the invariant matmul
against the default path (cuBLAS, and at M = 1 the split-K GEMVs) on the Qwen2.5-3B linear
shapes, and the invariant attention against the decode and prefill kernels. GPU time per call
from CUDA-graph replays (``kernel_bench.timing.graph_ms``), weights rotated out of L2.

    python scripts/det_bench.py --out DIR [--ms 1,64,4096]

Writes DIR/det_bench.json (with the commit, ``results.provenance``) after every shape, so a
time limit keeps what ran. On the H200: stage ``detbench`` of scripts/h200_run.sh.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from pageserve.lab.attention_invariance import attention_timings
from pageserve.lab.determinism_checks import matmul_timings
from pageserve.lab.kernel_bench.shapes import GEMV_SHAPES
from pageserve.lab.results import provenance


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--ms", default="1,64,4096", help="row counts M to time the linears at")
    ap.add_argument("--contexts", default="512,2048", help="decode contexts for the attention timings")
    ap.add_argument("--skip-matmul", action="store_true", help="the attention timings only")
    ap.add_argument("--batches", default="1,64", help="decode batch sizes for the attention timings")
    ap.add_argument("--prefill-block-m", type=int, default=128,
                    help="also time the attention with this prefill_block_m (0: not)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("det_bench times CUDA graphs: it needs a GPU")
    out = Path(args.out) / "det_bench.json"
    rec = {**provenance(), "matmul_ms": {}, "attention_us": {}}
    ms = [int(m) for m in args.ms.split(",")]
    for name, (N, K) in ({} if args.skip_matmul else GEMV_SHAPES).items():
        rec["matmul_ms"].update(matmul_timings(name, N, K, torch.bfloat16, ms, seed=0))
        out.write_text(json.dumps(rec, indent=1))
        for key in sorted(k for k in rec["matmul_ms"] if f"/{name}/" in k and k.rsplit("/", 1)[1]
                          in ("matmul_invariant", "cublas", "gemv")):
            print(f"{key}: {rec['matmul_ms'][key] * 1e3:.1f} us", flush=True)
    for ctx in (int(c) for c in args.contexts.split(",")):
        batches = tuple(int(b) for b in args.batches.split(","))
        times = attention_timings(context=ctx, batches=batches, prefill_len=512)
        if args.prefill_block_m:  # taller prefill tiles with MMA row sums: the decode rows keep 16-row tiles
            tall = attention_timings(context=ctx, batches=batches, prefill_len=512, prefill_block_m=args.prefill_block_m)
            times.update({f"{k}_prefill_block_m{args.prefill_block_m}": v for k, v in tall.items() if "invariant" in k})
        rec["attention_us"].update({f"ctx{ctx}/{k}": v for k, v in times.items()})
        out.write_text(json.dumps(rec, indent=1))
        print({k: round(v, 1) for k, v in times.items()}, flush=True)


if __name__ == "__main__":
    main()

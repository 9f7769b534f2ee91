"""Paged prefill attention: graph-timed configs at W1's prefill shapes (a GPU-session tool to
choose the kernel's defaults; issue 14's table has prefill attention at ~0.2 of the tensor-core
ceiling: 4.3 ms of a 77.8 ms step of 16 x 512 tokens).

    python scripts/prefill_attn_sweep.py --out DIR [--cases 16x512,2x4096]

Each case is ``prompts x length``, fresh prompts (no cached prefix), Qwen2.5-3B heads, bf16.
Writes DIR/prefill_attn_sweep.json (with the commit): per case the us of each config (block_m,
block_n, num_warps, num_stages), fastest first, its TFLOP/s (causal FLOPs) and whether its output
matches the default config's within bf16 tolerance.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os

import torch

from pageserve.lab import kernel_checks as checks
from pageserve.lab.kernel_bench.shapes import HEAD_DIM, HKV, HQ
from pageserve.lab.kernel_bench.timing import graph_ms
from pageserve.lab.results import provenance
from pageserve.kernels.paged_prefill import paged_prefill_attention


def causal_flops(num_prompts: int, length: int, heads: int = HQ, head_dim: int = HEAD_DIM) -> float:
    """QK^T and PV over the causal triangle (diagonal included): 4 * d FLOPs per visible pair."""
    pairs = length * (length + 1) / 2
    return 4.0 * head_dim * heads * pairs * num_prompts


def configs() -> list[dict]:
    rows = [{}]  # the default first
    for bm, bn, nw, ns in itertools.product((64, 128, 256), (32, 64, 128), (4, 8), (2, 3)):
        if bm * bn <= 256 * 64:
            rows.append({"block_m": bm, "block_n": bn, "num_warps": nw, "num_stages": ns})
    return rows


def sweep(num_prompts: int, length: int) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    q, _, _, kc, vc, meta = checks.random_paged_batch([length] * num_prompts, [length] * num_prompts, HQ, HKV,
                                                      HEAD_DIM, 16, torch.bfloat16, "cuda", gen)
    meta.query_start_loc_cpu = None  # graph-safe: no host-side padding zeroing
    scale = HEAD_DIM**-0.5
    reference = paged_prefill_attention(q, kc, vc, meta, scale)
    flops = causal_flops(num_prompts, length)
    rows = []
    for cfg in configs():
        out = torch.empty_like(q)
        try:
            ms = graph_ms(lambda i, cfg=cfg: paged_prefill_attention(q, kc, vc, meta, scale, out=out, **cfg),
                          calls=8, replays=10)
        except Exception as e:  # out of shared memory / registers: skip
            rows.append({**cfg, "error": f"{type(e).__name__}: {e}"[:200]})
            continue
        ok = torch.allclose(out.float(), reference.float(), rtol=2e-2, atol=2e-2)
        rows.append({**cfg, "us": ms * 1e3, "tflops": flops / ms / 1e9, "matches_default": ok})
    return sorted(rows, key=lambda r: r.get("us", float("inf")))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/out"))
    ap.add_argument("--cases", default="16x512,2x4096", help="prompts x length pairs")
    args = ap.parse_args()
    record = dict(provenance())
    for case in args.cases.split(","):
        n, length = (int(v) for v in case.split("x"))
        rows = sweep(n, length)
        record[f"p{n}_len{length}"] = rows
        default = next(r for r in rows if "block_m" not in r)
        print(f"== {n} prompts x {length}: default {default.get('us', float('nan')):.1f} us "
              f"({default.get('tflops', float('nan')):.0f} TFLOP/s)", flush=True)
        for r in rows[:6]:
            print("  ", r, flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "prefill_attn_sweep.json"), "w") as f:
        json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()

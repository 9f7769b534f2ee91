"""The batch-invariant matmul's tile configs against cuBLAS (issue 15's W1 and batch-1 cost): for
each row count M and each Qwen2.5-3B linear shape, GPU time per call of a list of configs
(row/column/K tiles, warps, stages, pointer or TMA loads) and whether each config's output has
the default config's bits (``same_bits``) and gives row 0 the bits it gets alone
(``row0_alone``). A config may enter the engine's policy only if both hold at every M.

    python scripts/invariant_sweep.py --out DIR [--ms 1,16,64,128,256,512,1024,4096,8192] [--shapes down,o]

Writes DIR/invariant_sweep.json (``results.provenance`` commit) after every M, so a time limit
keeps what ran. On the H200: stage ``invsweep`` of scripts/h200_run.sh.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import torch

from pageserve.kernels.matmul_invariant import InvariantMatmulConfig, invariant_config, matmul_invariant
from pageserve.lab.kernel_bench.shapes import GEMV_SHAPES, LAYERS
from pageserve.lab.kernel_bench.timing import graph_ms, weight_copies
from pageserve.lab.results import provenance

# (block_m, block_n, block_k, num_warps, num_stages) by row count; each also with TMA loads
CANDIDATES = {
    "decode": [(16, 16, 128, 4, 8), (16, 32, 128, 4, 6), (16, 32, 64, 4, 8), (16, 64, 64, 4, 6),
               (16, 16, 64, 4, 8), (16, 64, 128, 4, 4), (16, 128, 64, 4, 4), (16, 32, 256, 4, 4),
               (16, 16, 256, 4, 6), (16, 64, 128, 4, 3)],
    "mid": [(64, 16, 128, 4, 6), (64, 32, 128, 4, 4), (64, 64, 64, 4, 4), (64, 64, 128, 4, 3),
            (64, 128, 64, 4, 4), (32, 32, 128, 4, 6), (16, 32, 128, 4, 6)],
    "large": [(64, 128, 64, 4, 4), (64, 256, 64, 8, 3), (128, 128, 64, 8, 4), (128, 128, 128, 8, 3),
              (128, 256, 64, 8, 3), (64, 128, 128, 4, 3), (128, 64, 64, 4, 4), (64, 64, 128, 4, 4),
              (64, 32, 128, 4, 6), (32, 64, 128, 4, 6), (32, 128, 128, 4, 4), (128, 64, 128, 4, 3),
              (64, 64, 64, 4, 6), (128, 128, 64, 8, 5)],
    "prefill": [(128, 128, 64, 8, 4), (128, 256, 64, 8, 3), (128, 256, 64, 8, 4), (256, 128, 64, 8, 3),
                (128, 128, 128, 8, 3), (64, 256, 64, 8, 4), (256, 128, 64, 8, 4), (256, 64, 64, 8, 4),
                (256, 128, 128, 8, 2), (128, 128, 64, 4, 4)],
}


# (session 27) decode tiles no earlier sweep tried: 512-wide K slices and 1, 2 or 8 warps on 16-row tiles,
# for the one-row down projection that holds the det batch-1 step (17.2 us against the split-K GEMV's 13.2)
DECODE_EXTRA = [(16, 16, 512, 4, 4), (16, 16, 512, 4, 3), (16, 16, 512, 2, 4), (16, 16, 512, 8, 4),
                (16, 16, 256, 1, 6), (16, 16, 256, 2, 6), (16, 16, 256, 8, 6), (16, 16, 256, 4, 8),
                (16, 32, 512, 4, 3), (16, 16, 128, 2, 8)]


# (session 44) the product transposed (``swap_ab``: the weight tile as the MMA's M side, wgmma's 64-row A operand
# from 64 columns on; pointer loads), at up to 16 rows: fewer instructions a weight than 16-row x tiles with 15 rows
# of padding, but N / BLOCK_N programs (32 for down and o at 64 columns): the sweep says which wins, and its
# same_bits whether the MMA rounds the swapped k-steps alike
DECODE_SWAP = [(16, 64, 128, 4, 4), (16, 64, 256, 4, 3), (16, 64, 64, 4, 6), (16, 128, 128, 4, 3),
               (16, 128, 64, 4, 4), (16, 128, 128, 8, 3), (16, 256, 64, 8, 3), (16, 16, 256, 4, 6),
               (16, 32, 256, 4, 4)]


def swap_candidates() -> list[InvariantMatmulConfig]:
    return [InvariantMatmulConfig(*c, swap_ab=True) for c in DECODE_SWAP]


def candidates(M: int) -> list[InvariantMatmulConfig]:
    kind = "decode" if M <= 16 else "mid" if M <= 64 else "large" if M <= 1024 else "prefill"
    cfgs = [InvariantMatmulConfig(bm, bn, bk, w, s) for bm, bn, bk, w, s in CANDIDATES[kind]]
    if kind in ("large", "prefill"):  # the pointer loads lost every large-M case at 8df43651
        tma = [dataclasses.replace(c, tma=True) for c in cfgs]
        return tma + [dataclasses.replace(c, persistent=True) for c in tma]  # and one program per SM
    return cfgs + [dataclasses.replace(c, tma=True) for c in cfgs] + (swap_candidates() if kind == "decode" else [])


def cublas(x, w, bias, y):
    return torch.matmul(x, w.T, out=y) if bias is None else torch.addmm(bias, x, w.T, out=y)


def sweep_shape(name: str, N: int, K: int, M: int, sms: int, gen: torch.Generator,
                configs: list[InvariantMatmulConfig] | None = None) -> dict:
    dtype, dev = torch.bfloat16, gen.device
    ws = weight_copies(N, K, dtype, gen, min_bytes=200e6)
    bias = torch.randn(N, device=dev, dtype=dtype, generator=gen) if name == "qkv" else None
    x = torch.randn(M, K, device=dev, dtype=dtype, generator=gen)
    y = torch.empty(M, N, device=dev, dtype=dtype)
    default = invariant_config(M, N, dtype, sms, K=K)
    ref = matmul_invariant(x, ws[0], bias, config=default)
    alone = matmul_invariant(x[:1], ws[0], bias)  # row 0 through the default policy at M = 1
    rec = {"default": dataclasses.asdict(default),
           "cublas_us": 1e3 * graph_ms(lambda i: cublas(x, ws[i % len(ws)], bias, y), calls=len(ws)),
           "default_us": 1e3 * graph_ms(lambda i: matmul_invariant(x, ws[i % len(ws)], bias, out=y, config=default),
                                        calls=len(ws)),
           "rows": []}
    for cfg in configs or candidates(M):
        row = dataclasses.asdict(cfg)
        try:
            out = matmul_invariant(x, ws[0], bias, config=cfg)
            row["same_bits"] = bool(torch.equal(out, ref))
            row["row0_alone"] = bool(torch.equal(out[:1], alone))
            row["us"] = 1e3 * graph_ms(lambda i, c=cfg: matmul_invariant(x, ws[i % len(ws)], bias, out=y, config=c),
                                       calls=len(ws))
        except Exception as e:  # out of shared memory, a descriptor the GPU refuses: recorded, skipped
            row["error"] = f"{type(e).__name__}: {e}"[:240]
        rec["rows"].append(row)
    rec["rows"].sort(key=lambda r: r.get("us", float("inf")))
    best = next((r for r in rec["rows"] if r.get("same_bits") and r.get("row0_alone")), None)
    rec["best_invariant"] = best
    return rec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--ms", default="1,16,64,128,256,512,1024,4096,8192")
    ap.add_argument("--shapes", default=",".join(GEMV_SHAPES), help="which of the 3B linears (default: all)")
    ap.add_argument("--decode-extra", action="store_true",
                    help="time only DECODE_EXTRA (pointer loads) instead of the row count's candidates")
    ap.add_argument("--swap-only", action="store_true",
                    help="time only DECODE_SWAP (the transposed product) and the default config")
    ap.add_argument("--name", default="invariant_sweep", help="the JSON's file name (without .json)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("invariant_sweep times CUDA graphs: it needs a GPU")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    path = Path(args.out) / f"{args.name}.json"
    extra = [InvariantMatmulConfig(*c) for c in DECODE_EXTRA] if args.decode_extra else None
    if args.swap_only:
        extra = swap_candidates()
    path.parent.mkdir(parents=True, exist_ok=True)
    rec = {**provenance(), "device": torch.cuda.get_device_name(), "by_m": {}}
    gen = torch.Generator(device="cuda").manual_seed(0)
    for M in (int(m) for m in args.ms.split(",")):
        t0 = time.time()
        per = {}
        for name, (N, K) in GEMV_SHAPES.items():
            if name not in args.shapes.split(","):
                continue
            if name == "lm_head" and M > 1024:  # prefill samples only the last rows: no M = 4096 LM head
                continue
            per[name] = sweep_shape(name, N, K, M, sms, gen, configs=extra)
            torch.cuda.empty_cache()
        # the decoder's four linears x 36 layers (+ the LM head where timed), per policy
        layer = [n for n in per if n != "lm_head"]
        tot = {k: LAYERS * sum(per[n][k] for n in layer) + (per["lm_head"][k] if "lm_head" in per else 0.0)
               for k in ("cublas_us", "default_us")}
        tot["best_invariant_us"] = LAYERS * sum(per[n]["best_invariant"]["us"] for n in layer if per[n]["best_invariant"]) \
            + (per["lm_head"]["best_invariant"]["us"] if "lm_head" in per and per["lm_head"]["best_invariant"] else 0.0)
        rec["by_m"][str(M)] = {"shapes": per, "stack": tot, "elapsed_s": time.time() - t0}
        path.write_text(json.dumps(rec, indent=1))
        print(f"M={M}: stack cuBLAS {tot['cublas_us']:.0f} us, default {tot['default_us']:.0f}, best invariant "
              f"{tot['best_invariant_us']:.0f} ({time.time() - t0:.0f} s)", flush=True)
        for n, r in per.items():
            b = r["best_invariant"] or {}
            bad = [f"{c['block_m']}x{c['block_n']}x{c['block_k']}{'t' if c['tma'] else ''}{'s' if c.get('swap_ab') else ''}"
                   for c in r["rows"]
                   if "us" in c and not (c["same_bits"] and c["row0_alone"])]
            print(f"  {n}: cublas {r['cublas_us']:.1f} default {r['default_us']:.1f} best {b.get('us', 0):.1f} "
                  f"{ {k: b.get(k) for k in ('block_m', 'block_n', 'block_k', 'num_warps', 'num_stages', 'tma', 'swap_ab')} } "
                  f"not invariant: {bad}", flush=True)


if __name__ == "__main__":
    main()

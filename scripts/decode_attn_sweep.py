"""Paged decode attention: graph-timed configs at the engine's shapes (a GPU-session tool to
choose the kernel's defaults). K/V caches are rotated so back-to-back calls read HBM, as the
36 layers of a real step do.

    python scripts/decode_attn_sweep.py --out /tmp/out     # Qwen2.5-3B heads, bf16
    python scripts/decode_attn_sweep.py --cases 256x640,512x640 --warps 2,4,8   # W1's decode batches
    python scripts/decode_attn_sweep.py --splits auto,8 --stages 2,3 --prefetch 0,1   # the loads' schedule
    python scripts/decode_attn_sweep.py --cases 200x880 --pages 16,64 --pool-gib 0,1.5 --reference   # the KV layout
    python scripts/decode_attn_sweep.py --cases 200x880 --under-load --reference   # kernel time beside a layer's GEMMs
    python scripts/decode_attn_sweep.py --cases 64x640 --layouts token_major,head_major   # the cache's storage

Writes <out>/decode_attn_sweep.json: per (batch, context) the µs of each config, fastest first.
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
from pageserve.kernels.paged_decode import decode_num_splits, paged_decode_attention


def spread_caches(bt: torch.Tensor, used: int, page: int, pool_gib: float, copies: int, gen: torch.Generator):
    """K/V caches of ``pool_gib`` GiB each (K and V), the table's blocks moved to random places among
    all of them, as an engine's pool (sized from the GPU's memory) holds a step's blocks. Values are
    random normals made on the device (their size would take the host minutes)."""
    block_bytes = page * HKV * HEAD_DIM * 2
    num_blocks = max(used, int(pool_gib * 2**30) // block_bytes)
    where = torch.randperm(num_blocks, generator=gen)[:used].to(torch.int32).to(bt.device)
    table = where[bt.long()]  # every id in the table is one of the case's ``used`` blocks
    shape = (num_blocks, page, HKV, HEAD_DIM)
    caches = [tuple(torch.empty(shape, dtype=torch.bfloat16, device=bt.device).normal_() for _ in range(2))
              for _ in range(copies)]
    return table, caches


def head_major(cache: torch.Tensor) -> torch.Tensor:
    """The same [num_blocks, page, Hkv, D] cache stored head-major inside each block ([num_blocks, Hkv, page, D]
    underneath, returned as a permuted view): each KV head's rows of a block one contiguous run (page * D
    elements) instead of D-element runs interleaved with the other heads'. The kernels take the cache's
    strides, so they read it as it is."""
    return cache.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3)


def kernel_us(fn, calls: int, name: str) -> float:
    """Device µs of the kernels whose names hold ``name`` per call of ``fn(i)``, the calls captured back to back in
    one CUDA graph and its replays profiled (the kernel's own time, no launch gaps)."""
    from pageserve.lab.profiling import profile_kernels

    fn(0)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(i)
    graph.replay()
    rows = profile_kernels(graph.replay, repeats=3)
    return sum(r.us for r in rows if name in r.name) / calls


def layer_load(batch: int, copies: int, gen: torch.Generator):
    """A decode layer's big products at ``batch`` rows (gate_up then down, cuBLAS, bf16, weights rotated
    over ``copies`` so they come from HBM): what runs on the GPU between two attention launches of a step."""
    from pageserve.lab.kernel_bench.shapes import GEMV_SHAPES

    (n_gu, k_gu), (n_dn, k_dn) = GEMV_SHAPES["gate_up"], GEMV_SHAPES["down"]
    def mk(*shape):
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02

    ws = [(mk(n_gu, k_gu), mk(n_dn, k_dn)) for _ in range(copies)]
    x, h = mk(batch, k_gu), mk(batch, k_dn)

    def run(i):
        w_gu, w_dn = ws[i % copies]
        torch.nn.functional.linear(x, w_gu)
        torch.nn.functional.linear(h, w_dn)
    return run


def sweep(batch: int, ctx: int, max_blocks: int, copies: int, configs: list[dict], page: int = 16,
          pool_gib: float = 0.0, under_load: bool = False, layout: str = "token_major") -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    q, _, _, kc, vc, meta = checks.random_paged_batch([1] * batch, [ctx] * batch, HQ, HKV, HEAD_DIM, page,
                                                      torch.bfloat16, "cuda", gen)
    bt = torch.zeros(batch, max_blocks, dtype=torch.int32, device="cuda")
    bt[:, : meta.block_tables.shape[1]] = meta.block_tables[:, :max_blocks]
    if pool_gib > 0:
        bt, caches = spread_caches(bt, kc.shape[0], page, pool_gib, copies, gen)
    else:
        caches = [(kc, vc)] + [(kc.clone(), vc.clone()) for _ in range(copies - 1)]
    if layout == "head_major":
        caches = [(head_major(k), head_major(v)) for k, v in caches]
    out = torch.empty_like(q)
    nbytes = 2 * batch * ctx * HKV * HEAD_DIM * 2
    load = layer_load(batch, 2, torch.Generator(device="cuda").manual_seed(1)) if under_load else None
    rows = []
    for cfg in configs:
        kw = {k: v for k, v in cfg.items() if k != "reference"}

        def call(i, kw=kw):
            k, v = caches[i % copies]
            paged_decode_attention(q, k, v, meta.seq_lens, bt, HEAD_DIM**-0.5, out=out, **kw)
        try:
            ms = graph_ms(call, calls=4 * copies, replays=10)
        except Exception as e:  # out of resources: skip
            rows.append({**cfg, "error": f"{type(e).__name__}: {e}"[:200]})
            continue
        row = {**cfg, "us": ms * 1e3, "gbps": nbytes / ms / 1e6}
        if under_load:  # the kernel's device time alone, and with a layer's GEMMs between its launches

            def loaded(i, call=call):
                load(i)
                call(i)
            row["kernel_us"] = kernel_us(call, 4 * copies, "_decode_")
            row["kernel_us_loaded"] = kernel_us(loaded, 4 * copies, "_decode_")
        rows.append(row)
    return sorted(rows, key=lambda r: r.get("us", float("inf")))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/out"))
    ap.add_argument("--max-model-len", type=int, default=2048, help="the block table's width in tokens")
    ap.add_argument("--pages", default="16", help="KV block sizes (tokens a page) to time every case at")
    ap.add_argument("--pool-gib", default="0", help="K (and V) cache sizes in GiB to spread each case's blocks "
                    "over (0: just the blocks the case uses, a random order); the engine's pool is tens of GiB")
    ap.add_argument("--cases", default="1x512,64x512,64x2048",
                    help="batch x context pairs, e.g. 256x640,512x640 for W1's decode steps")
    ap.add_argument("--warps", default="2,4", help="num_warps values to sweep (e.g. 2,4,8)")
    ap.add_argument("--splits", default="", help="num_splits values ('auto' = the kernel's own); default: a set per case")
    ap.add_argument("--block-n", default="32,64", help="key-tile sizes to sweep")
    ap.add_argument("--stages", default="2", help="num_stages values to sweep (the kernel's default is 2)")
    ap.add_argument("--prefetch", default="0", help="prefetch values to sweep (1: q with seq_len, blocks a tile ahead)")
    ap.add_argument("--under-load", action="store_true",
                    help="also profile each config's kernel time alone and with a layer's gate_up and down GEMMs "
                         "(cuBLAS, the case's rows) between launches, as in an engine step (power and clock)")
    ap.add_argument("--layouts", default="token_major",
                    help="the caches' storage: token_major (the engine's [blocks, page, Hkv, D]) and/or head_major "
                         "([blocks, Hkv, page, D] underneath: each head's rows of a block contiguous)")
    ap.add_argument("--reference", action="store_true",
                    help="also time the kernel's own launch (no keywords) in every case, as row 'reference'")
    args = ap.parse_args()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    record = dict(provenance())
    cases = [tuple(int(v) for v in c.split("x")) for c in args.cases.split(",")]
    warps = tuple(int(w) for w in args.warps.split(","))
    block_ns = tuple(int(v) for v in args.block_n.split(","))
    stages = tuple(int(v) for v in args.stages.split(","))
    prefetch = tuple(bool(int(v)) for v in args.prefetch.split(","))
    for (batch, ctx), page, pool, layout in itertools.product(cases, [int(p) for p in args.pages.split(",")],
                                                               [float(g) for g in args.pool_gib.split(",")],
                                                               args.layouts.split(",")):
        max_blocks = -(-args.max_model_len // page)
        auto = decode_num_splits(batch, HKV, max_blocks, page, sms)
        if args.splits:
            splits = sorted({auto if v == "auto" else int(v) for v in args.splits.split(",")})
        else:  # from batch 32 up the grid holds 64+ (sequence, KV head) pairs: 1-2 splits are candidates too
            splits = sorted({auto, 8, 16} | ({3, 4} if batch > 1 else {4}) | ({1, 2} if batch >= 32 else set()))
        configs = []
        for sp, bn, nw, st, pf in itertools.product(splits, block_ns, warps, stages, prefetch):
            configs.append({"num_splits": sp, "block_n": bn, "num_warps": nw, "num_stages": st, "prefetch": pf})
        if args.reference:
            configs.append({"reference": True})
        if 1 in splits and not args.splits:  # the A/B of the one-split direct write: the same config through the merge kernel
            configs.append({"num_splits": 1, "block_n": 64, "num_warps": 4, "num_stages": 2, "prefetch": False,
                            "direct": False})
        copies = max(1, -(-200_000_000 // (2 * batch * ctx * HKV * HEAD_DIM * 2 + 1)))  # >= 200 MB rotated
        rows = sweep(batch, ctx, max_blocks, min(copies, 64), configs, page, pool, args.under_load, layout)
        key = (f"b{batch}_ctx{ctx}" + (f"_page{page}" if page != 16 else "") + (f"_pool{pool:g}gib" if pool else "")
               + (f"_{layout}" if layout != "token_major" else ""))
        record[key] = {"auto_splits": auto, "page": page, "pool_gib": pool, "layout": layout, "rows": rows}
        default = next((r for r in rows if r.get("num_splits") == auto and r.get("block_n") == 64
                        and r.get("num_warps") == 4 and r.get("num_stages") == 2
                        and not r.get("prefetch") and "direct" not in r), None)
        print(f"== batch {batch} x ctx {ctx}, page {page}, pool {pool:g} GiB, {layout} (auto splits {auto}); default "
              f"{default and round(default['us'], 2)} µs", flush=True)
        for r in rows[:10]:
            print("  ", r, flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "decode_attn_sweep.json"), "w") as f:
        json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()

"""The deterministic mode's attention, walk by walk (issue 15): at 2df709a a W1-sized decode step (512
sequences at context 640) spent 5.03 ms in the invariant split kernel against 4.06 for the default
mode's decode kernel (results/h200/diagnostics/profile_steps_6bad32f.*), with the same grid (one
program per sequence and KV head) and tiles. The invariant kernel restarts its loop at every split
(256 keys: 4 tiles), so its loads are pipelined within a split only. This script times, per case,
the loop per split (``flat=False``), the one flat loop over key tiles (``flat=True``, the default
where a program takes all of a tile's small-tile splits), each at pipeline depths 2 and 3 (2 and 8
warps were timed at 0960f7a and left), and, for the decode
cases, more programs per tile (``split_programs``) and the default mode's decode kernel; and checks
that every variant's output equals the loop per split's, bit for bit (none may change a bit).

    python scripts/det_attn_sweep.py --out DIR [--cases b512c640,b64c640,...] [--max-model-len 32768]
        [--walks per_split,flat,...] [--kv-splits 128]

Cases: ``b<batch>c<context>`` is a decode batch (block tables as wide as ``--max-model-len``, as in an
engine), ``mixed<decodes>`` a step of that many decodes at context 640 plus 16 fresh 512-token prompts,
``prefill<prompts>`` that many fresh 512-token prompts (tall tiles only).
Qwen2.5-3B attention shape (16 query heads, 2 KV heads, head_dim 128, 16-token pages), bf16, the
engine's Hopper launch (``prefill_block_m`` 128). GPU time per call from CUDA-graph replays. Writes
DIR/det_attn_sweep.json (with the commit) after every case. On the H200: stage ``detattn``.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from pageserve.kernels import paged_attention_invariant, paged_decode_attention
from pageserve.lab.attention_invariance import PagedPool, _time_us
from pageserve.lab.results import provenance

PREFILL_BLOCK_M = 128
WALKS = {
    "per_split": {"flat": False, "split_stages": 2},
    "per_split_stages3": {"flat": False, "split_stages": 3},
    "flat": {"flat": True, "split_stages": 2},
    "flat_stages3": {"flat": True, "split_stages": 3},
    "as_shipped": {},  # the launch's own choice (paged_attention_invariant's defaults)
    # session 23 also timed "unroll*" and "fold*" walks (each split's key tiles unrolled with the next tile's
    # loads ahead; the merge folding 2-8 splits a trip) at 3416e93-943114a, the only commits with those
    # keywords (diagnostics/det_attn_sweep_{unroll_fold_3416e93,ksplit_silu_in_943114a}.*): no gain at one row
    "per_split_warps4": {"flat": False, "split_warps": 4},  # the launch before the small-batch policy
    "per_split_warps8": {"flat": False, "split_warps": 8},
    # 0b4076b also timed *_no_prefetch walks against a prefetch of the block-table entries a tile ahead (then
    # the default; slower: diagnostics/det_attn_sweep_prefetch_0b4076b.*, removed with its keyword)
}
DECODE_PROGRAMS = (2, 3)  # split_programs tried on decode cases (loop per split)


def _case(name: str, max_model_len: int, page: int):
    """(pool, q, meta, is_decode) for a case name."""
    if name.startswith("prefill"):
        prompts, plen = int(name[7:]), 512
        pool = PagedPool([plen] * prompts, 16, 2, 128, page, torch.bfloat16, "cuda")
        q, meta = pool.batch([(j, 0, plen) for j in range(prompts)])
        return pool, q, meta, False
    if name.startswith("mixed"):
        decodes, ctx, prompts, plen = int(name[5:]), 640, 16, 512
        pool = PagedPool([ctx] * decodes + [plen] * prompts, 16, 2, 128, page, torch.bfloat16, "cuda")
        entries = [(i, ctx - 1, ctx) for i in range(decodes)] + [(decodes + j, 0, plen) for j in range(prompts)]
        q, meta = pool.batch(entries)
        return pool, q, meta, False
    batch, ctx = (int(x) for x in name[1:].split("c"))
    pool = PagedPool([ctx] * batch, 16, 2, 128, page, torch.bfloat16, "cuda")
    width = -(-ctx // page)
    q, meta = pool.batch([(i, ctx - 1, ctx) for i in range(batch)], extra_cols=max(0, max_model_len // page - width))
    return pool, q, meta, True


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--cases", default="b512c640,b256c640,b64c640,b64c2048,b1c640,b1c4096,mixed256,prefill16")
    ap.add_argument("--max-model-len", type=int, default=32768)
    ap.add_argument("--page", type=int, default=16)
    ap.add_argument("--kv-splits", default="",
                    help="other split sizes to time too (e.g. 128): other bits, so each is compared with its own "
                         "loop per split, not with the default's")
    ap.add_argument("--walks", default=",".join(WALKS), help="which of the walks to time")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("det_attn_sweep times CUDA graphs: it needs a GPU")
    out_path = Path(args.out) / "det_attn_sweep.json"
    out_path.parent.mkdir(parents=True, exist_ok=True)
    rec = {**provenance(), "max_model_len": args.max_model_len, "prefill_block_m": PREFILL_BLOCK_M, "cases": {}}
    for name in args.cases.split(","):
        pool, q, meta, is_decode = _case(name, args.max_model_len, args.page)
        kc, vc, sc = pool.k_cache, pool.v_cache, pool.scale
        walks = {w: WALKS[w] for w in args.walks.split(",")}
        if is_decode:
            walks.update({f"programs{p}": {"split_programs": p, "flat": False} for p in DECODE_PROGRAMS})
        for ks in (int(k) for k in args.kv_splits.split(",") if k):
            walks.update({f"kv{ks}_{w}": {**kw, "kv_split": ks} for w, kw in list(walks.items())
                          if "kv_split" not in kw})
        row, bases = {"us": {}, "bits_equal": {}}, {}
        for walk, kw in walks.items():
            kw = dict(kw)
            if kw.get("flat"):
                kw["split_programs"] = 1
            try:
                got = paged_attention_invariant(q, kc, vc, meta, sc, prefill_block_m=PREFILL_BLOCK_M, **kw)
            except ValueError as e:  # e.g. a walk this case's launch cannot take
                row["us"][walk] = None
                row["bits_equal"][walk] = str(e)
                continue
            base = bases.setdefault(kw.get("kv_split"), got.clone())  # the first walk of each split size
            row["bits_equal"][walk] = bool(torch.equal(got, base))
            row["us"][walk] = _time_us(
                lambda kw=kw: paged_attention_invariant(q, kc, vc, meta, sc, prefill_block_m=PREFILL_BLOCK_M, **kw))
        if is_decode:
            row["us"]["default_decode_kernel"] = _time_us(
                lambda: paged_decode_attention(q, kc, vc, meta.seq_lens, meta.block_tables, sc))
        rec["cases"][name] = row
        print(name, {k: (round(v, 1) if v is not None else None) for k, v in row["us"].items()},
              "bits equal:", all(v is True for v in row["bits_equal"].values()), flush=True)
        out_path.write_text(json.dumps(rec, indent=1))
        pool = q = meta = None  # the next case builds its own (GPU memory)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()

"""What holds the paged prefill attention at ~0.2 of the tensor-core ceiling: a GPU-session probe.

The shipped kernel (``kernels/paged_prefill.py``) against variants of it built here, the same
tiles and arithmetic, one change each:

- ``prefetch``: each key tile's block-table entries loaded a tile ahead (as the decode kernel's
  PREFETCH), so a tile's K/V addresses never wait on a load issued in the same iteration;
- ``contig``: K/V read from the step's contiguous k, v [T, Hkv, D] (no block table at all): the
  upper bound of what the gather costs, for prompts without a cached prefix;
- ``diag``: the causal mask applied only to the key tiles that cross a row's position (the
  others are visible to every row of the tile), with ``prefetch``;
and torch's SDPA (flash, causal, the KV heads repeated) on the same prompts as a reference point;
since session 31 also the shipped chunk launch (``chunk_prefill_attention``), with whether its
output equals the shipped paged kernel's bit for bit.

    python scripts/prefill_attn_probe.py --out DIR [--cases 16x512,4x2048]

Writes DIR/prefill_attn_probe.json (with the commit): per case and variant the µs of a call
(graph-timed), its TFLOP/s (causal FLOPs) and its largest difference from the shipped kernel.
"""
from __future__ import annotations

import argparse
import copy
import json
import os

import torch
import triton
import triton.language as tl

from pageserve.kernels._util import dot_precision, dot_upcast, kv_pages, load_kv_at, mma, online_softmax_step
from pageserve.kernels.paged_prefill import LOG2E, chunk_prefill_attention, paged_prefill_attention
from pageserve.lab import kernel_checks as checks
from pageserve.lab.kernel_bench.shapes import HEAD_DIM, HKV, HQ
from pageserve.lab.kernel_bench.timing import graph_ms
from pageserve.lab.results import provenance


@triton.jit
def _probe_kernel(
    q_ptr, kc_ptr, vc_ptr, k2_ptr, v2_ptr, out_ptr, bt_ptr, seq_lens_ptr, qsl_ptr,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_k2t, stride_k2h, stride_bt, qk_scale,
    GROUP: tl.constexpr, PAGE: tl.constexpr, Q_TOK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr,
    PREFETCH: tl.constexpr, CONTIG: tl.constexpr, DIAG: tl.constexpr,
):
    mb = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    h = tl.program_id(2)
    q_start = tl.load(qsl_ptr + b).to(tl.int64)
    q_len = (tl.load(qsl_ptr + b + 1) - q_start).to(tl.int32)
    first_tok = mb * Q_TOK
    if first_tok >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + b)
    prefix = seq_len - q_len
    r = tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    tok = first_tok + r // GROUP
    head = h * GROUP + r % GROUP
    rmask = (r < Q_TOK * GROUP) & (tok < q_len)
    dmask = d < BLOCK_D
    q_rows = q_start + tok
    q = tl.load(q_ptr + q_rows[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=rmask[:, None], other=0.0)
    q_pos = prefix + tok
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    kv_end = tl.minimum(seq_len, prefix + tl.minimum(first_tok + Q_TOK, q_len))
    bt_row = bt_ptr + b * stride_bt
    if DIAG:  # tiles wholly at or before the tile's first position: visible to every row
        full_end = ((prefix + first_tok + 1) // BLOCK_N) * BLOCK_N
    else:
        full_end = 0
    n_first = tl.arange(0, BLOCK_N)
    page = kv_pages(bt_row, n_first, n_first < kv_end, PAGE)
    for n0 in range(0, full_end, BLOCK_N):
        kpos = n0 + tl.arange(0, BLOCK_N)
        if CONTIG:
            rows = (q_start + kpos - prefix)[:, None] * stride_k2t + h * stride_k2h + d[None, :]
            k = tl.load(k2_ptr + rows)
            v = tl.load(v2_ptr + rows)
        else:
            if PREFETCH:
                nxt = kpos + BLOCK_N
                page_next = kv_pages(bt_row, nxt, nxt < kv_end, PAGE)
            else:
                page = kv_pages(bt_row, kpos, kpos < kv_end, PAGE)
            k, v = load_kv_at(kc_ptr, vc_ptr, page, kpos, kpos < kv_end, h, d, dmask,
                              stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, PAGE)
            if PREFETCH:
                page = page_next
        scores = mma(q, tl.trans(k), PREC, UPCAST) * qk_scale
        m_i, l_i, acc = online_softmax_step(scores, v, m_i, l_i, acc, PREC, UPCAST)
    for n0 in range(full_end, kv_end, BLOCK_N):
        kpos = n0 + tl.arange(0, BLOCK_N)
        kmask = kpos < kv_end
        if CONTIG:
            rows = (q_start + kpos - prefix)[:, None] * stride_k2t + h * stride_k2h + d[None, :]
            k = tl.load(k2_ptr + rows, mask=kmask[:, None], other=0.0)
            v = tl.load(v2_ptr + rows, mask=kmask[:, None], other=0.0)
        else:
            if PREFETCH:
                nxt = kpos + BLOCK_N
                page_next = kv_pages(bt_row, nxt, nxt < kv_end, PAGE)
            else:
                page = kv_pages(bt_row, kpos, kmask, PAGE)
            k, v = load_kv_at(kc_ptr, vc_ptr, page, kpos, kmask, h, d, dmask,
                              stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, PAGE)
            if PREFETCH:
                page = page_next
        scores = mma(q, tl.trans(k), PREC, UPCAST) * qk_scale
        visible = kmask[None, :] & (kpos[None, :] <= q_pos[:, None])
        scores = tl.where(visible, scores, float("-inf"))
        m_i, l_i, acc = online_softmax_step(scores, v, m_i, l_i, acc, PREC, UPCAST)
    out = acc / tl.maximum(l_i, 1e-30)[:, None]
    tl.store(out_ptr + q_rows[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=rmask[:, None])


@triton.jit
def _fa_kernel(
    q_ptr, k2_ptr, v2_ptr, out_ptr, seq_lens_ptr, qsl_ptr,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_k2t, stride_k2h, qk_scale, n_mb,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    PREC: tl.constexpr, UPCAST: tl.constexpr, HEAVY_FIRST: tl.constexpr,
):
    """FlashAttention-2's tiling: BLOCK_M query tokens of one query head (no GQA packing), K/V of
    its KV head from contiguous [T, Hkv, D] tensors, the mask only on the tiles that cross the
    diagonal. Fresh prompts only (no cached prefix): the probe's question is the tiling's speed."""
    if HEAVY_FIRST:
        mb = n_mb - 1 - tl.program_id(0)
    else:
        mb = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    hq = tl.program_id(2)
    h = hq // GROUP
    q_start = tl.load(qsl_ptr + b).to(tl.int64)
    q_len = (tl.load(qsl_ptr + b + 1) - q_start).to(tl.int32)
    first = mb * BLOCK_M
    if first >= q_len:
        return
    r = first + tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    rmask = r < q_len
    q = tl.load(q_ptr + (q_start + r)[:, None] * stride_qt + hq * stride_qh + d[None, :], mask=rmask[:, None],
                other=0.0)
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    kv_end = tl.minimum(first + BLOCK_M, q_len)
    full_end = ((first + 1) // BLOCK_N) * BLOCK_N  # keys every row of the tile sees
    kv_base = k2_ptr + q_start * stride_k2t + h * stride_k2h
    vv_base = v2_ptr + q_start * stride_k2t + h * stride_k2h
    for n0 in range(0, full_end, BLOCK_N):
        kpos = n0 + tl.arange(0, BLOCK_N)
        k = tl.load(kv_base + kpos[:, None] * stride_k2t + d[None, :])
        v = tl.load(vv_base + kpos[:, None] * stride_k2t + d[None, :])
        scores = mma(q, tl.trans(k), PREC, UPCAST) * qk_scale
        m_i, l_i, acc = online_softmax_step(scores, v, m_i, l_i, acc, PREC, UPCAST)
    for n0 in range(full_end, kv_end, BLOCK_N):
        kpos = n0 + tl.arange(0, BLOCK_N)
        kmask = kpos < kv_end
        k = tl.load(kv_base + kpos[:, None] * stride_k2t + d[None, :], mask=kmask[:, None], other=0.0)
        v = tl.load(vv_base + kpos[:, None] * stride_k2t + d[None, :], mask=kmask[:, None], other=0.0)
        scores = mma(q, tl.trans(k), PREC, UPCAST) * qk_scale
        scores = tl.where(kmask[None, :] & (kpos[None, :] <= r[:, None]), scores, float("-inf"))
        m_i, l_i, acc = online_softmax_step(scores, v, m_i, l_i, acc, PREC, UPCAST)
    out = acc / tl.maximum(l_i, 1e-30)[:, None]
    tl.store(out_ptr + (q_start + r)[:, None] * stride_ot + hq * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=rmask[:, None])


def fa(q, k2, v2, meta, out, block_m=128, block_n=64, warps=8, stages=3, heavy_first=True):
    T, Hq, D = q.shape
    B = meta.seq_lens.shape[0]
    n_mb = triton.cdiv(meta.max_query_len, block_m)
    _fa_kernel[(n_mb, B, Hq)](
        q, k2, v2, out, meta.seq_lens, meta.query_start_loc, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k2.stride(0), k2.stride(1), D**-0.5 * LOG2E, n_mb, GROUP=Hq // k2.shape[1], BLOCK_M=block_m, BLOCK_D=D,
        BLOCK_N=block_n, PREC=dot_precision(q.dtype), UPCAST=dot_upcast(q.dtype), HEAVY_FIRST=heavy_first,
        num_warps=warps, num_stages=stages,
    )
    return out


def probe(q, kc, vc, k2, v2, meta, out, block_m=64, block_n=64, warps=4, stages=2, prefetch=False, contig=False,
          diag=False):
    T, Hq, D = q.shape
    B = meta.seq_lens.shape[0]
    group = Hq // HKV
    q_tok = block_m // group
    grid = (triton.cdiv(meta.max_query_len, q_tok), B, HKV)
    _probe_kernel[grid](
        q, kc, vc, k2, v2, out, meta.block_tables, meta.seq_lens, meta.query_start_loc,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), kc.stride(0), kc.stride(1), kc.stride(2),
        vc.stride(0), vc.stride(1), vc.stride(2), k2.stride(0), k2.stride(1), meta.block_tables.stride(0),
        D**-0.5 * LOG2E, GROUP=group, PAGE=kc.shape[1], Q_TOK=q_tok, BLOCK_M=block_m, BLOCK_D=D, BLOCK_N=block_n,
        PREC=dot_precision(q.dtype), UPCAST=dot_upcast(q.dtype), PREFETCH=prefetch, CONTIG=contig, DIAG=diag,
        num_warps=warps, num_stages=stages,
    )
    return out


def gather_kv(kc, vc, meta, T):
    """The prompts' K/V as contiguous [T, Hkv, D] (what the step's projections held)."""
    k2 = torch.empty(T, kc.shape[2], kc.shape[3], dtype=kc.dtype, device=kc.device)
    v2 = torch.empty_like(k2)
    qsl = meta.query_start_loc.tolist()
    for b in range(len(qsl) - 1):
        n = qsl[b + 1] - qsl[b]
        pos = torch.arange(n, device=kc.device)
        page = meta.block_tables[b].long()[pos // kc.shape[1]]
        k2[qsl[b]:qsl[b + 1]] = kc[page, pos % kc.shape[1]]
        v2[qsl[b]:qsl[b + 1]] = vc[page, pos % vc.shape[1]]
    return k2, v2


VARIANTS = {
    "shipped": None,
    "shipped_like": {},
    "prefetch": {"prefetch": True},
    "contig": {"contig": True},
    "diag_prefetch": {"prefetch": True, "diag": True},
    "diag_contig": {"contig": True, "diag": True},
    "diag_prefetch_bn32": {"prefetch": True, "diag": True, "block_n": 32},
    "diag_prefetch_bm128_w8": {"prefetch": True, "diag": True, "block_m": 128, "warps": 8},
    "diag_prefetch_bm128_w8_s3": {"prefetch": True, "diag": True, "block_m": 128, "warps": 8, "stages": 3},
    "diag_prefetch_bm128_bn128_w8": {"prefetch": True, "diag": True, "block_m": 128, "block_n": 128, "warps": 8},
    "diag_contig_bm128_w8": {"contig": True, "diag": True, "block_m": 128, "warps": 8},
    "diag": {"diag": True},
}
# FlashAttention-2 tiling (``_fa_kernel``): (block_m, block_n, warps, stages)
FA_VARIANTS = [(128, 64, 8, 3), (128, 64, 4, 3), (128, 128, 8, 3), (128, 64, 8, 2), (64, 64, 4, 3), (128, 32, 4, 3),
               (64, 128, 4, 3), (128, 128, 8, 2)]


def run_case(num_prompts: int, length: int) -> dict:
    gen = torch.Generator().manual_seed(0)
    q, _, _, kc, vc, meta = checks.random_paged_batch([length] * num_prompts, [length] * num_prompts, HQ, HKV,
                                                      HEAD_DIM, 16, torch.bfloat16, "cuda", gen)
    meta.query_start_loc_cpu = None
    scale = HEAD_DIM**-0.5
    T = q.shape[0]
    k2, v2 = gather_kv(kc, vc, meta, T)
    ref = paged_prefill_attention(q, kc, vc, meta, scale, tile_map=False)
    flops = 4.0 * HEAD_DIM * HQ * length * (length + 1) / 2 * num_prompts
    rows = {}
    for name, kw in VARIANTS.items():
        out = torch.empty_like(q)
        if kw is None:
            fn = lambda i: paged_prefill_attention(q, kc, vc, meta, scale, out=out, tile_map=False)  # noqa: E731
        else:
            fn = lambda i, kw=kw: probe(q, kc, vc, k2, v2, meta, out, **kw)  # noqa: E731
        try:
            ms = graph_ms(fn, calls=8, replays=10)
        except Exception as e:  # noqa: BLE001 - out of resources: a data point
            rows[name] = {"error": f"{type(e).__name__}: {e}"[:200]}
            continue
        rows[name] = {**(kw or {}), "us": ms * 1e3, "tflops": flops / ms / 1e9,
                      "max_abs_diff": (out.float() - ref.float()).abs().max().item()}
        print(f"{num_prompts}x{length} {name:32s} {ms * 1e3:8.1f} us {flops / ms / 1e9:6.0f} TFLOP/s "
              f"diff {rows[name]['max_abs_diff']:.2e}", flush=True)
    for bm, bn, nw, ns in FA_VARIANTS:
        name = f"fa_bm{bm}_bn{bn}_w{nw}_s{ns}"
        out = torch.empty_like(q)
        try:
            ms = graph_ms(lambda i, c=(bm, bn, nw, ns): fa(q, k2, v2, meta, out, *c), calls=8, replays=10)
        except Exception as e:  # noqa: BLE001
            rows[name] = {"error": f"{type(e).__name__}: {e}"[:200]}
            continue
        rows[name] = {"block_m": bm, "block_n": bn, "warps": nw, "stages": ns, "us": ms * 1e3,
                      "tflops": flops / ms / 1e9, "max_abs_diff": (out.float() - ref.float()).abs().max().item()}
        print(f"{num_prompts}x{length} {name:32s} {ms * 1e3:8.1f} us {flops / ms / 1e9:6.0f} TFLOP/s "
              f"diff {rows[name]['max_abs_diff']:.2e}", flush=True)
    # the shipped chunk launch (``chunk_prefill_attention``, session 31): FA-2 tiling with a prefix path
    cmeta = copy.copy(meta)
    cmeta.query_start_loc_cpu = meta.query_start_loc.tolist()
    cmeta.scratch = {}
    for name, kw in (("chunk_shipped", {}), ("chunk_tiles_inner", {"heads_inner": False}),
                     ("chunk_bm64", {"block_m": 64, "num_warps": 4}),
                     ("chunk_bm128_w8", {"block_m": 128, "num_warps": 8}),
                     ("chunk_tiles_inner_bm128_w8", {"heads_inner": False, "block_m": 128, "num_warps": 8})):
        out = torch.empty_like(q)
        try:
            ms = graph_ms(lambda i, kw=kw: chunk_prefill_attention(q, k2, v2, kc, vc, cmeta, scale, out=out, **kw),
                          calls=8, replays=10)
            rows[name] = {**kw, "us": ms * 1e3, "tflops": flops / ms / 1e9,
                          "max_abs_diff": (out.float() - ref.float()).abs().max().item(),
                          "bits_equal_shipped": bool(torch.equal(out, ref))}
            print(f"{num_prompts}x{length} {name:32s} {ms * 1e3:8.1f} us {flops / ms / 1e9:6.0f} TFLOP/s "
                  f"bits equal {rows[name]['bits_equal_shipped']}", flush=True)
        except Exception as e:  # noqa: BLE001
            rows[name] = {"error": f"{type(e).__name__}: {e}"[:200]}
    # torch SDPA (flash where it applies) on [B, H, L, D], the KV heads repeated for the group
    qb = q.view(num_prompts, length, HQ, HEAD_DIM).transpose(1, 2)
    kb = k2.view(num_prompts, length, HKV, HEAD_DIM).transpose(1, 2).repeat_interleave(HQ // HKV, dim=1)
    vb = v2.view(num_prompts, length, HKV, HEAD_DIM).transpose(1, 2).repeat_interleave(HQ // HKV, dim=1)
    try:
        ms = graph_ms(lambda i: torch.nn.functional.scaled_dot_product_attention(qb, kb, vb, is_causal=True),
                      calls=8, replays=10)
        o = torch.nn.functional.scaled_dot_product_attention(qb, kb, vb, is_causal=True).transpose(1, 2).reshape_as(q)
        rows["torch_sdpa"] = {"us": ms * 1e3, "tflops": flops / ms / 1e9,
                              "max_abs_diff": (o.float() - ref.float()).abs().max().item()}
        print(f"{num_prompts}x{length} torch_sdpa {ms * 1e3:8.1f} us {flops / ms / 1e9:6.0f} TFLOP/s", flush=True)
    except Exception as e:  # noqa: BLE001
        rows["torch_sdpa"] = {"error": f"{type(e).__name__}: {e}"[:200]}
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/out"))
    ap.add_argument("--cases", default="16x512,4x2048")
    args = ap.parse_args()
    record = dict(provenance())
    for case in args.cases.split(","):
        p, n = (int(v) for v in case.split("x"))
        record[f"p{p}_len{n}"] = run_case(p, n)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "prefill_attn_probe.json")
    with open(path, "w") as f:
        json.dump(record, f, indent=2)
    print(path)


if __name__ == "__main__":
    main()

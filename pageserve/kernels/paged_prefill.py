"""Paged attention for prefill chunks (and mixed batches) over a cached prefix.

Reference: ``pageserve.kernels.reference.paged_attention``.

The batch is flattened: sequence i owns query rows ``query_start_loc[i]:query_start_loc[i+1]``,
its last ``q_len`` positions, so query j of the chunk sits at position ``seq_len - q_len + j``
and sees keys ``0..that position`` (causal in the chunk, full over the prefix). K/V are read
straight from the paged cache through the block table; nothing is gathered.

A program takes BLOCK_M rows of one sequence b: ``Q_TOK = BLOCK_M // group`` query tokens
times the ``group`` query heads that share KV head h, flattened as row = token * group + head.
One K/V tile thus serves the whole group. Key tiles stop at the last position the block
needs, and only those that cross a row's position take the causal mask. The grid is one
program per (query tile, KV head) from the step's tile map (``_util.query_tile_map``, built
once a step on the host); without the host copy of ``query_start_loc``, (tile mb, sequence b,
KV head h) over ``max_query_len``'s tiles, the programs past a chunk's end exiting at once.
It runs eagerly, or inside a mixed step's CUDA graph from a static tile map. A decode is a
chunk of length 1, so mixed batches need no special case.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .reference import paged_attention as paged_attention_reference
from ._util import (cdiv, check, check_paged_meta, dot_precision, dot_upcast, load_kv_tile, mma, next_pow2,
                    online_softmax_step, query_tile_map)

__all__ = ["paged_prefill_attention", "paged_attention_reference"]

LOG2E = 1.4426950408889634


# stride_bt (the step's block-table width) and n_tiles follow the step: unspecialised, so a new
# width or tile count never compiles a variant
@triton.jit(do_not_specialize=["stride_bt", "n_tiles"])
def _prefill_kernel(
    q_ptr, kc_ptr, vc_ptr, out_ptr, bt_ptr, seq_lens_ptr, qsl_ptr, tiles_ptr,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_bt, qk_scale, n_tiles,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, Q_TOK: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    PREC: tl.constexpr, UPCAST: tl.constexpr, TILE_MAP: tl.constexpr, DIAG_MASK: tl.constexpr,
):
    if TILE_MAP:  # program (t, h): the step's t-th query tile, (sequence, tile of its chunk) from the map
        t = tl.program_id(0)
        b = tl.load(tiles_ptr + t).to(tl.int64)
        mb = tl.load(tiles_ptr + n_tiles + t)
        h = tl.program_id(1)
    else:  # program (mb, b, h) over every sequence's max_query_len: tiles past a chunk exit at once
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
    tok = first_tok + r // GROUP  # token within the chunk
    head = h * GROUP + r % GROUP
    rmask = (r < Q_TOK * GROUP) & (tok < q_len)
    dmask = d < HEAD_DIM
    qmask = rmask[:, None] & dmask[None, :]
    q_rows = q_start + tok
    q = tl.load(q_ptr + q_rows[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :], mask=qmask, other=0.0)
    q_pos = prefix + tok  # [BLOCK_M]

    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    # keys up to the last position any row of this block can see
    kv_end = tl.minimum(seq_len, prefix + tl.minimum(first_tok + Q_TOK, q_len))
    bt_row = bt_ptr + b * stride_bt
    if DIAG_MASK:  # key tiles at or before the block's first position are visible to every row: no mask
        full_end = ((prefix + first_tok + 1) // BLOCK_N) * BLOCK_N
    else:
        full_end = 0
    for n0 in range(0, full_end, BLOCK_N):
        kpos = n0 + tl.arange(0, BLOCK_N)
        k, v = load_kv_tile(kc_ptr, vc_ptr, bt_row, kpos, kpos < full_end, h, d, dmask,
                            stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, PAGE)
        scores = mma(q, tl.trans(k), PREC, UPCAST) * qk_scale
        m_i, l_i, acc = online_softmax_step(scores, v, m_i, l_i, acc, PREC, UPCAST)
    for n0 in range(full_end, kv_end, BLOCK_N):
        kpos = n0 + tl.arange(0, BLOCK_N)
        kmask = kpos < kv_end
        k, v = load_kv_tile(kc_ptr, vc_ptr, bt_row, kpos, kmask, h, d, dmask,
                            stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, PAGE)
        scores = mma(q, tl.trans(k), PREC, UPCAST) * qk_scale  # [BLOCK_M, BLOCK_N], log2 units
        visible = kmask[None, :] & (kpos[None, :] <= q_pos[:, None])
        scores = tl.where(visible, scores, float("-inf"))
        m_i, l_i, acc = online_softmax_step(scores, v, m_i, l_i, acc, PREC, UPCAST)

    out = acc / tl.maximum(l_i, 1e-30)[:, None]  # l_i == 0 only if seq_len == 0: zeros
    tl.store(out_ptr + q_rows[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=qmask)


def prefill_block_m(group: int) -> int:
    return max(64, next_pow2(group))


def paged_prefill_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta, scale: float,
    out: torch.Tensor | None = None, block_m: int | None = None, block_n: int | None = None,
    num_warps: int | None = None, num_stages: int = 2, tile_map: bool | None = None,
    heavy_first: bool = True, diag_mask: bool = True,
) -> torch.Tensor:
    """q: [T, Hq, D] flattened by ``meta.query_start_loc``; caches [num_blocks, block_size, Hkv, D].
    Returns [T, Hq, D]. Rows past ``query_start_loc[-1]`` (padding) are zeroed when the host copy
    ``meta.query_start_loc_cpu`` is present, as in the reference. ``block_m`` / ``block_n`` /
    ``num_warps`` / ``num_stages`` are tuning knobs (scripts/prefill_attn_sweep.py); the defaults
    are what the engine runs. ``tile_map`` launches one program per real query tile from
    ``query_tile_map`` instead of ``max_query_len``'s tiles for every sequence: the same tiles
    with the same arithmetic, so the same bits, without the programs that only exit (a step of
    512 decodes beside a 1,000-token chunk launched 125 x 513 x Hkv programs for ~615 x Hkv
    tiles). Default: on the engine's path (``meta.query_start_loc_cpu`` there), whatever the step.
    ``heavy_first``: the map's tiles launch longest first (``query_tile_map``); False keeps them in
    sequence order. Either way the same bits. ``diag_mask``: the causal mask only on the key tiles
    that cross a row's position (the tiles before them, visible to every row of the block, skip the
    compare and select); False masks every tile, as before session 30 (the A/B; probe on the H200,
    NOTES.md session 30: 16 x 512 -7%, 4 x 2,048 -19%, 1 x 8,192 -23% a call)."""
    page, Hkv, B = check_paged_meta(q, k_cache, v_cache, meta)
    T, Hq, D = q.shape
    out = torch.empty_like(q) if out is None else out
    check("out", out, shape=(T, Hq, D), dtype=q.dtype)
    if meta.query_start_loc_cpu is not None and meta.query_start_loc_cpu[-1] < T:
        out[meta.query_start_loc_cpu[-1]:].zero_()
    elif "static_tiles" in getattr(meta, "scratch", {}):
        out.zero_()  # a graphed mixed step: where its padding rows start is known on the device only
    if B == 0 or T == 0 or meta.max_query_len == 0:
        return out
    group = Hq // Hkv
    BLOCK_M = block_m or prefill_block_m(group)
    if BLOCK_M < group:
        raise ValueError(f"block_m {BLOCK_M} smaller than the GQA group {group}")
    q_tok = BLOCK_M // group
    BLOCK_N = block_n or 64
    if tile_map is None:
        # always on the engine's path, even where the full grid would be exact (one sequence, or
        # one tile each): a launch whose variant followed the step's shape would compile the other
        # variant mid-run the first time a step crossed over (a server's first batch after lone prompts)
        # (or a step replayed from a mixed-step CUDA graph: its map is a static buffer in ``scratch``)
        tile_map = meta.query_start_loc_cpu is not None or "static_tiles" in getattr(meta, "scratch", {})
    if tile_map:  # one program per real query tile (and KV head)
        tiles = query_tile_map(meta, q_tok, B, q.device, heavy_first=heavy_first)
        n_tiles = tiles.shape[1]
        grid = (n_tiles, Hkv)
    else:
        tiles, n_tiles = meta.query_start_loc, 0  # unread
        grid = (cdiv(meta.max_query_len, q_tok), B, Hkv)
    if grid[0] == 0:
        return out
    _prefill_kernel[grid](
        q, k_cache, v_cache, out, meta.block_tables, meta.seq_lens, meta.query_start_loc, tiles,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        meta.block_tables.stride(0), float(scale) * LOG2E, n_tiles,
        GROUP=group, HEAD_DIM=D, PAGE=page, Q_TOK=q_tok,
        BLOCK_M=BLOCK_M, BLOCK_D=max(16, next_pow2(D)), BLOCK_N=BLOCK_N,
        PREC=dot_precision(q.dtype), UPCAST=dot_upcast(q.dtype), TILE_MAP=bool(tile_map), DIAG_MASK=bool(diag_mask),
        num_warps=num_warps or (4 if BLOCK_M * BLOCK_N <= 64 * 64 else 8), num_stages=num_stages,
    )
    return out

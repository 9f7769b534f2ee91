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

``chunk_prefill_attention`` is the second launch an eager step may split its chunks off to:
FlashAttention-2's tiling, BLOCK_M query tokens of one query head a program (no GQA packing),
the chunk's own keys read from the step's contiguous rotated k and v (no block table: the
gather's address math and scattered rows are what held the paged kernel at ~0.2 of the tensor
cores on W1's 512-token prompts, NOTES.md session 30), a cached prefix through the block table.
Key tiles sit at the same absolute positions as the paged kernel's and are folded in the same
order; on the H200 a row's bits still differ from the paged kernel's at some shapes (the compiler
schedules other tile heights differently: bit-equal at 16 x 512 and 4 x 2,048, not at 1 x 8,192,
NOTES.md session 31), so the two agree to rounding, not bit for bit.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .reference import paged_attention as paged_attention_reference
from ._util import (cdiv, check, check_paged_meta, dot_precision, dot_upcast, load_kv_tile, mma, mma_dot_for,
                    next_pow2, online_softmax_step, query_tile_map)

__all__ = ["paged_prefill_attention", "chunk_prefill_attention", "paged_attention_reference"]

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


def prefill_config(group: int, block_m: int | None = None, block_n: int | None = None, num_warps: int | None = None,
                   num_stages: int = 2, mma: bool = True) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, warps, stages) of ``paged_prefill_attention``'s launch, the knobs left None
    taking the defaults the engine runs: its own function so that the offline audit
    (scripts/t4_compile_audit.py) compiles the tiles a launch gets. ``mma`` False (``_util.mma_dot_for``:
    a GPU below sm_80, where a dot runs on FMAs): 16-key tiles over 8 warps, the widest that compile
    for sm_75 without spilling at head_dim 64 and 128 (64 keys spill 6.5 KB a thread at 64, 73 KB at
    128); BLOCK_M stays ``prefill_block_m``, which the mixed-step graphs' tile maps are built with."""
    bm = block_m or prefill_block_m(group)
    if not mma:
        return bm, block_n or 16, num_warps or 8, num_stages
    bn = block_n or 64
    return bm, bn, num_warps or (4 if bm * bn <= 64 * 64 else 8), num_stages


def paged_prefill_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta, scale: float,
    out: torch.Tensor | None = None, block_m: int | None = None, block_n: int | None = None,
    num_warps: int | None = None, num_stages: int = 2, tile_map: bool | None = None,
    heavy_first: bool = True, diag_mask: bool = True, part: str = "all", short_len: int = 0,
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
    NOTES.md session 30: 16 x 512 -7%, 4 x 2,048 -19%, 1 x 8,192 -23% a call).
    ``part`` / ``short_len`` (tile map only): "short" computes only the sequences of at most
    ``short_len`` new tokens, leaving the other rows of ``out`` as they are (``chunk_prefill_attention``
    writes those); "all" every sequence."""
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
    BLOCK_M, BLOCK_N, num_warps, num_stages = prefill_config(group, block_m, block_n, num_warps, num_stages,
                                                             mma_dot_for(q))
    if BLOCK_M < group:
        raise ValueError(f"block_m {BLOCK_M} smaller than the GQA group {group}")
    q_tok = BLOCK_M // group
    if tile_map is None:
        # always on the engine's path, even where the full grid would be exact (one sequence, or
        # one tile each): a launch whose variant followed the step's shape would compile the other
        # variant mid-run the first time a step crossed over (a server's first batch after lone prompts)
        # (or a step replayed from a mixed-step CUDA graph: its map is a static buffer in ``scratch``)
        tile_map = meta.query_start_loc_cpu is not None or "static_tiles" in getattr(meta, "scratch", {})
    if part != "all" and not tile_map:
        raise ValueError(f"part={part!r} needs the tile map")
    if tile_map:  # one program per real query tile (and KV head)
        tiles = query_tile_map(meta, q_tok, B, q.device, part=part, short_len=short_len, heavy_first=heavy_first)
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
        num_warps=num_warps, num_stages=num_stages,
    )
    return out


# stride_bt and n_tiles follow the step: unspecialised, as the paged kernel's
@triton.jit(do_not_specialize=["stride_bt", "n_tiles"])
def _chunk_kernel(
    q_ptr, k_ptr, v_ptr, kc_ptr, vc_ptr, out_ptr, bt_ptr, seq_lens_ptr, qsl_ptr, tiles_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kch, stride_vb, stride_vs, stride_vch,
    stride_bt, qk_scale, n_tiles,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    PREC: tl.constexpr, UPCAST: tl.constexpr, HEADS_INNER: tl.constexpr,
):
    # the map's t-th tile (sequence b, BLOCK_M tokens of its chunk), query head hq; HEADS_INNER: the
    # heads of one tile launch next to each other (a KV head's group reads its K/V tiles together)
    if HEADS_INNER:
        hq = tl.program_id(0)
        t = tl.program_id(1)
    else:
        t = tl.program_id(0)
        hq = tl.program_id(1)
    h = hq // GROUP
    b = tl.load(tiles_ptr + t).to(tl.int64)
    mb = tl.load(tiles_ptr + n_tiles + t)
    q_start = tl.load(qsl_ptr + b).to(tl.int64)
    q_len = (tl.load(qsl_ptr + b + 1) - q_start).to(tl.int32)
    prefix = tl.load(seq_lens_ptr + b) - q_len
    first = mb * BLOCK_M  # the tile's first token within the chunk

    r = first + tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    dmask = d < HEAD_DIM
    rmask = r < q_len
    q = tl.load(q_ptr + (q_start + r)[:, None] * stride_qt + hq * stride_qh + d[None, :],
                mask=rmask[:, None] & dmask[None, :], other=0.0)
    q_pos = prefix + r
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    # key tiles at absolute positions n0 .. n0 + BLOCK_N, ascending, as the paged kernel walks them
    kv_end = prefix + tl.minimum(first + BLOCK_M, q_len)  # past the last key any row of the tile sees
    cached_end = (prefix // BLOCK_N) * BLOCK_N  # tiles wholly in the cached prefix
    full_end = ((prefix + first + 1) // BLOCK_N) * BLOCK_N  # tiles every row of the tile sees whole
    bt_row = bt_ptr + b * stride_bt
    k_rows = k_ptr + (q_start - prefix) * stride_kt + h * stride_kh  # row of absolute position 0
    v_rows = v_ptr + (q_start - prefix) * stride_vt + h * stride_vh
    for n0 in range(0, cached_end, BLOCK_N):  # the cached prefix, through the block table
        kpos = n0 + tl.arange(0, BLOCK_N)
        k, v = load_kv_tile(kc_ptr, vc_ptr, bt_row, kpos, kpos < cached_end, h, d, dmask,
                            stride_kb, stride_ks, stride_kch, stride_vb, stride_vs, stride_vch, PAGE)
        scores = mma(q, tl.trans(k), PREC, UPCAST) * qk_scale
        m_i, l_i, acc = online_softmax_step(scores, v, m_i, l_i, acc, PREC, UPCAST)
    n0 = cached_end
    if n0 < prefix:  # the tile where the prefix ends and the chunk begins: both sources, masked
        kpos = n0 + tl.arange(0, BLOCK_N)
        cached = kpos < prefix
        fresh = (kpos >= prefix) & (kpos < kv_end)
        kc, vc = load_kv_tile(kc_ptr, vc_ptr, bt_row, kpos, cached, h, d, dmask,
                              stride_kb, stride_ks, stride_kch, stride_vb, stride_vs, stride_vch, PAGE)
        fmask = fresh[:, None] & dmask[None, :]
        kf = tl.load(k_rows + kpos[:, None] * stride_kt + d[None, :], mask=fmask, other=0.0)
        vf = tl.load(v_rows + kpos[:, None] * stride_vt + d[None, :], mask=fmask, other=0.0)
        k = tl.where(cached[:, None], kc, kf)
        v = tl.where(cached[:, None], vc, vf)
        scores = mma(q, tl.trans(k), PREC, UPCAST) * qk_scale
        visible = (cached | fresh)[None, :] & (kpos[None, :] <= q_pos[:, None])
        scores = tl.where(visible, scores, float("-inf"))
        m_i, l_i, acc = online_softmax_step(scores, v, m_i, l_i, acc, PREC, UPCAST)
        n0 += BLOCK_N
    for n1 in range(n0, full_end, BLOCK_N):  # the chunk's keys every row sees: no mask
        kpos = n1 + tl.arange(0, BLOCK_N)
        k = tl.load(k_rows + kpos[:, None] * stride_kt + d[None, :], mask=dmask[None, :], other=0.0)
        v = tl.load(v_rows + kpos[:, None] * stride_vt + d[None, :], mask=dmask[None, :], other=0.0)
        scores = mma(q, tl.trans(k), PREC, UPCAST) * qk_scale
        m_i, l_i, acc = online_softmax_step(scores, v, m_i, l_i, acc, PREC, UPCAST)
    for n1 in range(tl.maximum(n0, full_end), kv_end, BLOCK_N):  # the diagonal: causal mask
        kpos = n1 + tl.arange(0, BLOCK_N)
        kmask = kpos < kv_end
        lmask = kmask[:, None] & dmask[None, :]
        k = tl.load(k_rows + kpos[:, None] * stride_kt + d[None, :], mask=lmask, other=0.0)
        v = tl.load(v_rows + kpos[:, None] * stride_vt + d[None, :], mask=lmask, other=0.0)
        scores = mma(q, tl.trans(k), PREC, UPCAST) * qk_scale
        visible = kmask[None, :] & (kpos[None, :] <= q_pos[:, None])
        scores = tl.where(visible, scores, float("-inf"))
        m_i, l_i, acc = online_softmax_step(scores, v, m_i, l_i, acc, PREC, UPCAST)

    out = acc / tl.maximum(l_i, 1e-30)[:, None]
    tl.store(out_ptr + (q_start + r)[:, None] * stride_ot + hq * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=rmask[:, None] & dmask[None, :])


# chunks of at least this many new tokens take ``chunk_prefill_attention`` (TritonOps); decodes and
# shorter chunks the paged kernel, whose GQA packing fills its tiles with 8 tokens x 8 heads
CHUNK_MIN_TOKENS = 64


# (block_m, block_n, num_warps, num_stages) of the chunk launch's two tile configs (``chunk_config``)
CHUNK_CONFIGS = ((64, 64, 4, 3), (128, 64, 8, 3))


def chunk_config(max_query_len: int) -> tuple[int, int, int, int]:
    """(block_m, block_n, num_warps, num_stages) of the chunk launch: the H200 probe's best
    (diagnostics/prefill_attn_probe_f6cd55b.*): 64-token tiles, 4 warps up to 2,048-token chunks
    (16 x 512 77.8 us, 4 x 2,048 195.5), 128-token tiles, 8 warps for longer ones (1 x 8,192 637.8);
    64-key tiles, 3 stages either way (the paged kernel's key tiles: the mask splits stay at the same
    positions)."""
    return CHUNK_CONFIGS[1] if max_query_len > 2048 else CHUNK_CONFIGS[0]


def chunk_prefill_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta,
    scale: float, out: torch.Tensor | None = None, min_len: int = CHUNK_MIN_TOKENS, block_m: int | None = None,
    block_n: int | None = None, num_warps: int | None = None, num_stages: int | None = None,
    heavy_first: bool = True, heads_inner: bool = True,
) -> torch.Tensor:
    """The rows of the step's chunks of at least ``min_len`` new tokens, FlashAttention-2's tiling
    (module docstring); every other row of ``out`` is left as it is (``paged_prefill_attention(...,
    part="short", short_len=min_len - 1)`` writes those). q: [T, Hq, D]; k, v: [T, Hkv, D], the step's
    rotated k and v in q's row order (strided views are fine: last dim contiguous), whose rows a
    chunk reads for its own keys (they must equal what the step wrote to the cache); a cached
    prefix is read from the caches [num_blocks, block_size, Hkv, D] through ``meta.block_tables``.
    Needs the host copy ``meta.query_start_loc_cpu`` (the tile map is built on the host: eager
    steps). ``block_m`` / ``block_n`` / ``num_warps`` / ``num_stages``: tuning knobs (default
    ``chunk_config``); ``heavy_first`` as in ``paged_prefill_attention``; ``heads_inner``: the grid's
    fastest axis is the query head (a tile's heads launch together), else the tile; launch order
    only, the same bits. H200 probe at 4807f40: 1 x 8,192 660.7 -> 597.5 us, 16 x 512 84.6 -> 84.2."""
    page, Hkv, B = check_paged_meta(q, k_cache, v_cache, meta)
    T, Hq, D = q.shape
    check("k", k, shape=(T, Hkv, D), dtype=q.dtype)
    check("v", v, shape=(T, Hkv, D), dtype=q.dtype)
    out = torch.empty_like(q) if out is None else out
    check("out", out, shape=(T, Hq, D), dtype=q.dtype)
    if meta.query_start_loc_cpu is None:
        raise ValueError("chunk_prefill_attention needs meta.query_start_loc_cpu (its tile map is built on the host)")
    if B == 0 or T == 0 or meta.max_query_len < min_len:
        return out
    cfg = chunk_config(meta.max_query_len)
    BLOCK_M, BLOCK_N = block_m or cfg[0], block_n or cfg[1]
    tiles = query_tile_map(meta, BLOCK_M, B, q.device, part="long", short_len=min_len - 1, heavy_first=heavy_first)
    n_tiles = tiles.shape[1]
    if n_tiles == 0:
        return out
    _chunk_kernel[(Hq, n_tiles) if heads_inner else (n_tiles, Hq)](
        q, k, v, k_cache, v_cache, out, meta.block_tables, meta.seq_lens, meta.query_start_loc, tiles,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        meta.block_tables.stride(0), float(scale) * LOG2E, n_tiles,
        GROUP=Hq // Hkv, HEAD_DIM=D, PAGE=page, BLOCK_M=BLOCK_M, BLOCK_D=max(16, next_pow2(D)), BLOCK_N=BLOCK_N,
        PREC=dot_precision(q.dtype), UPCAST=dot_upcast(q.dtype), HEADS_INNER=bool(heads_inner),
        num_warps=num_warps or cfg[2], num_stages=num_stages or cfg[3],
    )
    return out

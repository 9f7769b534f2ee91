"""Batch-invariant paged attention: one kernel family for prefill chunks, decodes and mixed batches.

Reference: ``pageserve.kernels.reference.paged_attention``.

The contract (deterministic mode, issue 15): the output bits of a query row (token at position
p, query head j) are a function of its q row, p, and the K/V of positions 0..p of its sequence
only — not of the batch size, the other sequences, the chunk it was prefilled in, its place in
that chunk, nor whether it is a decode or a prefill row. ``paged_decode`` and ``paged_prefill``
break this: the decode split count follows the batch size, and the two kernels reduce in
different orders. One set of launch constants (``block_m``, ``block_n``, ``kv_split``, dtype,
head_dim, group, page) must be used for every step of a run; the bits are a function of those.

Work layout. The batch is flattened as in ``paged_prefill``: sequence b owns query rows
``query_start_loc[b]:query_start_loc[b+1]``, its last q_len positions. Its chunk is cut into
tiles of ``Q_TOK = BLOCK_M // group`` query tokens; the step's tiles are listed in a tile map
(``query_tile_map``: (b, mb) per tile) and program (t, p*Hkv+h) takes tile t times the group of
query heads sharing KV head h (row = token * group + head), and the keys of splits p, p + P,
... (P programs per tile and head, from the grid's size): split s covers absolute positions
``[s * kv_split, (s + 1) * kv_split)``, each split computed from scratch (a program that takes all of
a small tile's splits walks them as one loop over key tiles, resetting its state at each split's
first tile: ``FLAT``, the same arithmetic). A decode is a chunk of one token; its tile is
the same [BLOCK_M, BLOCK_N] shape with the rows past its group masked. A decode batch
(max_query_len 1) has one tile per sequence and a constant map, and its split count comes from
the block-table width, so its launch is fixed by shapes: CUDA-graph safe. Splits past a tile's
last position are skipped. On Hopper, ``prefill_block_m`` gives the chunks of a step taller
tiles (128 rows) in a launch of their own, with the row sums of point 1 taken by an MMA.
Rows of seq_len 0 (graph padding) come out zero.

Why each row's bits are invariant:

1. One compiled kernel, one tile shape. Every case runs the same two kernels with the same
   constexprs (batch-dependent ints are not specialised on), so Triton's dot and reduction
   layouts are identical everywhere. In ``q @ k^T`` and ``p @ v`` an output element is the dot
   of one row with one column, in an order fixed by the tile shape; ``tl.max`` is
   order-free; ``tl.sum(p, axis=1)`` reduces each row with the same fixed tree. So a row's
   values never depend on the other rows of its tile or on which tile row it sits in. With
   ``prefill_block_m`` the row sums are an MMA against ones instead (``_softmax_step``): an
   MMA element is the same chain whatever the tile's height (measured on the H200), so decode
   rows in 16-row tiles and chunk rows in 128-row tiles get the same bits.
2. Fixed key tiles. Keys are walked in BLOCK_N tiles aligned to position 0, in increasing
   order, inside splits of fixed SIZE aligned to 0: a row at position p has exactly
   ``p // kv_split + 1`` splits, whatever the batch, and in split s sees the same tiles with
   the same causal mask (keys > p at -inf) whether it was alone or in a chunk.
3. Extra tiles are exact no-ops. A chunk's tile walks keys up to its last row's position, so
   an earlier row meets tiles it cannot see: its scores are all -inf, so m is unchanged,
   alpha = exp2(0) = 1, p = 0, l + 0 = l and acc * 1 + 0 @ v = acc exactly. Key slots past the
   tile's last needed position (maybe never written: NaN/garbage) load as 0, so a 0 weight
   only ever meets finite V. (Only the sign of an exactly-zero accumulator could flip.)
4. Fixed merge. A row with one split (p < kv_split) writes acc / l straight from the split
   kernel; a row with several writes unnormalised (m, l, acc) per split and the merge kernel
   folds them in split order 0, 1, ... with elementwise fp32 arithmetic; which path a row
   takes depends only on p. Tile rows with fewer splits are held by ``tl.where``, exactly.

The cost of invariance: a decode tile carries BLOCK_M rows for ``group`` real ones, and the
partial buffers are [num_splits, T, Hq, D] fp32 (only rows past the first split write them).
Defaults, from graph-replayed timings on the H200 (Qwen2.5-3B shape, bf16, µs per call; the
split-K decode / prefill kernels in brackets): BLOCK_M 16, BLOCK_N 64, kv_split 256 give decode
batch 1 @ 512 8.9 [7.2], batch 64 @ 512 13.0 [12.1], batch 1 @ 4k 13.8 [8.8], batch 64 @ 4k
84.9 [70.5]; prefill 512 22.8 [14.8], prefill 4k 854 [309]. BLOCK_M 64 / kv_split 512 would
halve the 4k prefill (455) but slow every decode (batch 1 @ 512 17.3); decode is the hot path.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._util import (cdiv, check, check_paged_meta, dot_precision, dot_upcast, kv_pages, load_kv_tile, mma, mma_dot_for,
                    next_pow2, online_softmax_step, pdl_args, pdl_enter_after_inputs, pdl_enter_before_inputs,
                    query_tile_map, sm_count_for)
from .paged_decode import _newest_kv, _rope_row, _rotate

__all__ = ["paged_attention_invariant", "invariant_block_m", "KV_SPLIT", "BLOCK_N"]

LOG2E = 1.4426950408889634
KV_SPLIT = 256  # keys per split (a multiple of BLOCK_N): a row at position p has p // KV_SPLIT + 1 splits
#                (512: faster at batch 64 @ 4k and in prefill, slower at batch 1; module docstring)
BLOCK_N = 64  # keys per tile
FMA_BLOCK_N = 32  # keys per tile where a dot runs on FMAs (_util.mma_dot_for): 64 spill on sm_75, 32 do not
# decode launches of at most this many (sequence, KV head) tiles run the split kernel at 8 warps where the row
# sums are MMAs (ROWSUM_DOT, Hopper): H200, graphed 3B step (diagnostics/det_b1_switches_ksplit_silu_in_943114a.*),
# batch 1 2.603 -> 2.558 ms, batch 4 2.747 -> 2.702; two more pairs with this policy at 004f872 (..._attn_warps_
# 004f872.*): 2.609 -> 2.561, 2.744 -> 2.713; at 64 sequences 8 warps cost +0.40 ms (19 -> 31 us a call). Warps change which thread holds which element, not a bit, where every sum is an MMA chain (bits
# equal in every walk of the sweeps); a tl.sum tree (ROWSUM_DOT off) follows the layout, so there 4 always
WIDE_WARPS_MAX_TILES = 8
# paged_attention_invariant(phased=None) walks a split's key tiles in phases on decode launches of at most this
# many small tiles with MMA row sums (Hopper): the 8-warp launches, batches 1-4 at 2 KV heads. Built in session 40
# for batch 1, where the split kernel's chain of four tiles was the det step's largest excess (9.96 us a layer
# against the default's 5.27 for RoPE + split, diagnostics/profile_steps_chain_ce246be.*). H200 A/B at ac249bd
# (diagnostics/det_b1_switches_ac249bd.*, graphed 3B det step, two pairs): batch 1 2.517 -> 2.484 and 2.523 ->
# 2.471 ms, batch 4 2.681 -> 2.618 and 2.672 -> 2.623, batch 64 level (its launches have more tiles). On every
# launch (det_attn_phased_all) batch 64 took 4.15 ms against 3.33: hence the bound. lab.profiling's
# attn_unphased patch sets 0 (the loop everywhere) for A/Bs
PHASED_MAX_TILES = WIDE_WARPS_MAX_TILES
# paged_attention_invariant's keywords that choose a launch, never a bit (DeterministicOps' attention_launch)
LAUNCH_OPTIONS = ("split_programs", "flat", "split_stages", "split_warps", "phased")


def invariant_block_m(group: int) -> int:
    """Rows per tile for a GQA group: the fewest that tl.dot takes (16) and hold one group.
    It must stay the same for every step of a run (decode pads up to it)."""
    return max(16, next_pow2(group))


@triton.jit
def _rows(qsl_ptr, seq_lens_ptr, mb, b, h, GROUP: tl.constexpr, Q_TOK: tl.constexpr, BLOCK_M: tl.constexpr):
    """The tile's rows: chunk token, query head, global token index, position, validity."""
    q_start = tl.load(qsl_ptr + b).to(tl.int64)
    q_len = tl.load(qsl_ptr + b + 1).to(tl.int64) - q_start
    prefix = tl.load(seq_lens_ptr + b).to(tl.int64) - q_len
    r = tl.arange(0, BLOCK_M)
    tok = mb * Q_TOK + r // GROUP
    head = h * GROUP + r % GROUP
    rmask = (r < Q_TOK * GROUP) & (tok < q_len)
    return q_start + tok, head, prefix + tok, rmask


@triton.jit
def _num_splits(q_pos, rmask, KV_SPLIT: tl.constexpr):
    # position p -> p // KV_SPLIT + 1 splits; a row at p < 0 (seq_len 0: padding) has none
    return tl.where(rmask & (q_pos >= 0), tl.maximum(q_pos, 0) // KV_SPLIT + 1, 0)


@triton.jit
def _softmax_step(scores, v, m_i, l_i, acc, PREC: tl.constexpr, UPCAST: tl.constexpr, ROWSUM_DOT: tl.constexpr):
    """``online_softmax_step``; with ROWSUM_DOT the row sums of p come from an MMA against a
    ones matrix (of the p that also meets V, in V's dtype) instead of ``tl.sum``: an MMA output
    element is the same chain of k16-steps whatever the tile's height (measured for the
    invariant matmul), while ``tl.sum``'s tree follows the tile's layout, which changes with
    BLOCK_M. So with it a row's bits do not depend on BLOCK_M (``prefill_block_m``)."""
    if ROWSUM_DOT:
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None]).to(v.dtype)
        ones = tl.full([v.shape[0], 16], 1.0, v.dtype)
        # every column of the product is the row sum; max picks one exactly, in any order
        l_i = l_i * alpha + tl.max(mma(p, ones, PREC, UPCAST), axis=1)
        acc = acc * alpha[:, None] + mma(p, v, PREC, UPCAST)
        return m_new, l_i, acc
    else:
        return online_softmax_step(scores, v, m_i, l_i, acc, PREC, UPCAST)


@triton.jit(do_not_specialize=["stride_bt", "num_splits", "n_tiles", "split_programs", "split_rows"])
def _split_kernel(
    q_ptr, kc_ptr, vc_ptr, out_ptr, part_acc_ptr, part_ml_ptr, bt_ptr, seq_lens_ptr, qsl_ptr, tiles_ptr,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_bt, qk_scale, num_splits, n_tiles, split_programs, split_rows,
    kn_ptr, vn_ptr, pos_ptr, cs_ptr, slot_ptr, stride_knt, stride_knh, stride_vnt, stride_vnh, stride_cs,
    GROUP: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
    Q_TOK: tl.constexpr, KV_SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr, ROWSUM_DOT: tl.constexpr, USE_PDL: tl.constexpr,
    FLAT: tl.constexpr, ROPE: tl.constexpr = False, PHASED: tl.constexpr = 0,
):
    # PHASED (0 or the split's key tiles, 2 or 4; a loop per split): each split's tiles in phases
    # (``_phased_split``) instead of one after the other: the same operations on the same values, only
    # issued in another order.
    # ROPE (decode launches only, ``paged_attention_invariant(rope=...)``): q is the step's query before
    # RoPE, rotated here with rope_kv's own expression and rounded once, as rope_kv stores it; the cache
    # lacks each row's newest position, whose k (before RoPE) and v are at kn / vn. The program that walks
    # the row's last split first writes that token (rotated k, v) at the row's slot, exactly as rope_kv
    # would, then waits on a barrier and walks its key tiles as without ROPE: the same loads, the same
    # arithmetic, so the same bits as rope_kv's launch followed by this kernel. kn_ptr..stride_cs are
    # unused without ROPE.
    pdl_enter_before_inputs(USE_PDL)
    # step inputs (the tile map, query_start_loc, seq_lens): before the wait (_util)
    t = tl.program_id(0)  # the step's t-th query tile: (sequence, tile of its chunk) from the tile map
    b = tl.load(tiles_ptr + t).to(tl.int64)
    mb = tl.load(tiles_ptr + n_tiles + t)
    first = tl.program_id(1) // NUM_KV_HEADS  # this program's splits: first, first + split_programs, ...
    h = tl.program_id(1) % NUM_KV_HEADS
    q_len = tl.load(qsl_ptr + b + 1) - tl.load(qsl_ptr + b)
    rows, head, q_pos, rmask = _rows(qsl_ptr, seq_lens_ptr, mb, b, h, GROUP, Q_TOK, BLOCK_M)
    last_pos = tl.max(tl.where(rmask, q_pos, -1), axis=0)  # the tile's last row's position
    # the splits the tile's rows have; split 0 always runs: it writes the zeros of seq_len-0 rows
    n_tile = tl.minimum(tl.maximum(last_pos, 0) // KV_SPLIT + 1, num_splits)
    d = tl.arange(0, BLOCK_D)
    dmask = d < HEAD_DIM
    if ROPE:  # step inputs too: the token's cos|sin and slot
        tok0 = tl.load(qsl_ptr + b).to(tl.int64)  # a decode tile: the sequence's one token
        cos, sin, partner = _rope_row(cs_ptr, pos_ptr, tok0, stride_cs, d, dmask, HEAD_DIM)
        slot = tl.load(slot_ptr + tok0).to(tl.int64)
    pdl_enter_after_inputs(USE_PDL)
    if mb * Q_TOK >= q_len:
        return

    qmask = rmask[:, None] & dmask[None, :]
    if ROPE:
        q = _rotate(q_ptr + rows[:, None] * stride_qt + head[:, None] * stride_qh, d[None, :], partner[None, :],
                    qmask, cos[None, :], sin[None, :], HEAD_DIM // 2).to(q_ptr.dtype.element_ty)
        # the newest position is in the last split: written by the program that walks that split
        newest_split = n_tile - 1
        mine = (last_pos >= 0) & (newest_split >= first) & ((newest_split - first) % split_programs == 0)
        _newest_kv(kn_ptr + tok0 * stride_knt + h * stride_knh, vn_ptr + tok0 * stride_vnt + h * stride_vnh,
                   kc_ptr, vc_ptr, slot, mine, h, d, dmask, cos, sin, partner,
                   stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, PAGE, HEAD_DIM)
        tl.debug_barrier()  # every thread's stores done before any thread loads that key tile
    else:
        q = tl.load(q_ptr + rows[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :], mask=qmask,
                    other=0.0)
    bt_row = bt_ptr + b * stride_bt
    n_row = _num_splits(q_pos, rmask, KV_SPLIT)
    prow0 = rows * (NUM_KV_HEADS * GROUP) + head  # [BLOCK_M], split 0's partial row
    if FLAT:
        # one program walks all its tile's splits (split_programs 1) as one loop over key tiles, so
        # the loads are pipelined across split boundaries; at a split's first tile (m, l, acc) are
        # reset to the values a fresh split starts from, exactly, and at its last the split's
        # results are stored: the same arithmetic, tile for tile, as the loop per split below
        end = tl.minimum(last_pos + 1, n_tile * KV_SPLIT)
        m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        # at least one (fully masked) tile: a tile of seq_len-0 rows still writes their zeros
        for n0 in range(0, tl.maximum(end, 1), BLOCK_N):
            fresh = (n0 % KV_SPLIT) == 0
            m_i = tl.where(fresh, -1.0e30, m_i)
            l_i = tl.where(fresh, 0.0, l_i)
            acc = tl.where(fresh, 0.0, acc)
            kpos = n0 + tl.arange(0, BLOCK_N)
            kmask = kpos < end  # past it: zeros, never unwritten slots
            k, v = load_kv_tile(kc_ptr, vc_ptr, bt_row, kpos, kmask, h, d, dmask,
                                stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, PAGE)
            scores = mma(q, tl.trans(k), PREC, UPCAST) * qk_scale
            scores = tl.where(kmask[None, :] & (kpos[None, :] <= q_pos[:, None]), scores, float("-inf"))
            m_i, l_i, acc = _softmax_step(scores, v, m_i, l_i, acc, PREC, UPCAST, ROWSUM_DOT)
            if ((n0 + BLOCK_N) % KV_SPLIT == 0) | (n0 + BLOCK_N >= end):
                _store_split(out_ptr, part_acc_ptr, part_ml_ptr, acc, m_i, l_i, n0 // KV_SPLIT, rows, head, d, dmask,
                             rmask, n_row, prow0, split_rows, stride_ot, stride_oh, HEAD_DIM)
    else:
        # each split from scratch, as if it had a program of its own (the grid does not change a bit)
        for s in range(first, n_tile, split_programs):
            split_start = s * KV_SPLIT
            kv_end = tl.minimum(split_start + KV_SPLIT, last_pos + 1)
            m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
            l_i = tl.zeros([BLOCK_M], tl.float32)
            acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
            if PHASED:
                m_i, l_i, acc = _phased_split(q, kc_ptr, vc_ptr, bt_row, split_start, kv_end, q_pos, qk_scale, h, d,
                                              dmask, m_i, l_i, acc, stride_kb, stride_ks, stride_kh, stride_vb,
                                              stride_vs, stride_vh, PAGE, BLOCK_N, PHASED, PREC, UPCAST, ROWSUM_DOT)
            else:
                for n0 in range(split_start, kv_end, BLOCK_N):
                    kpos = n0 + tl.arange(0, BLOCK_N)
                    kmask = kpos < kv_end  # past it: zeros, never unwritten slots
                    k, v = load_kv_tile(kc_ptr, vc_ptr, bt_row, kpos, kmask, h, d, dmask,  # [BLOCK_N, BLOCK_D] each
                                        stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, PAGE)
                    scores = mma(q, tl.trans(k), PREC, UPCAST) * qk_scale  # [BLOCK_M, BLOCK_N], log2 units
                    scores = tl.where(kmask[None, :] & (kpos[None, :] <= q_pos[:, None]), scores, float("-inf"))
                    m_i, l_i, acc = _softmax_step(scores, v, m_i, l_i, acc, PREC, UPCAST, ROWSUM_DOT)
            _store_split(out_ptr, part_acc_ptr, part_ml_ptr, acc, m_i, l_i, s, rows, head, d, dmask,
                         rmask, n_row, prow0, split_rows, stride_ot, stride_oh, HEAD_DIM)


@triton.jit
def _cache_tile(c_ptr, bt_row, pos, pmask, h, d, dmask, stride_b, stride_s, stride_h, PAGE: tl.constexpr):
    """One cache's rows (K or V) of KV head ``h`` at positions ``pos`` [N], through the block-table row, as
    ``load_kv_tile`` loads them (masked positions: zeros). [N, BLOCK_D]."""
    page = kv_pages(bt_row, pos, pmask, PAGE)
    return tl.load(c_ptr + (page * stride_b + (pos % PAGE) * stride_s + h * stride_h)[:, None] + d[None, :],
                   mask=pmask[:, None] & dmask[None, :], other=0.0)


@triton.jit
def _tile_scores(q, k, kpos, kv_end, q_pos, qk_scale, PREC: tl.constexpr, UPCAST: tl.constexpr):
    """A key tile's masked scores, [BLOCK_M, BLOCK_N] in log2 units, as the loop per split computes them."""
    scores = mma(q, tl.trans(k), PREC, UPCAST) * qk_scale
    return tl.where((kpos < kv_end)[None, :] & (kpos[None, :] <= q_pos[:, None]), scores, float("-inf"))


@triton.jit
def _tile_weights(scores, m_new, v, PREC: tl.constexpr, UPCAST: tl.constexpr, ROWSUM_DOT: tl.constexpr):
    """A tile's p (in V's dtype) and its row sums, as ``_softmax_step`` computes them for a running max m_new."""
    p = tl.exp2(scores - m_new[:, None])
    pv = p.to(v.dtype)
    if ROWSUM_DOT:  # every column of the product is the row sum (of the p that meets V); max picks one exactly
        rowsum = tl.max(mma(pv, tl.full([v.shape[0], 16], 1.0, v.dtype), PREC, UPCAST), axis=1)
    else:
        rowsum = tl.sum(p, axis=1)
    return pv, rowsum


@triton.jit
def _phased_split(q, kc_ptr, vc_ptr, bt_row, split_start, kv_end, q_pos, qk_scale, h, d, dmask, m_i, l_i, acc,
                  stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, PAGE: tl.constexpr,
                  BLOCK_N: tl.constexpr, TILES: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr,
                  ROWSUM_DOT: tl.constexpr):
    """One split of TILES (2 or 4) key tiles folded into (m_i, l_i, acc) exactly as TILES ``_softmax_step``
    calls in key order fold them, but in phases: every tile's K loads, the score products and the running
    maxes, the V loads, the p, row sums and p @ V products, and last the elementwise folds in key order. The
    loop per split runs each tile's chain (load, scores, max, exp, p @ V, fold) before the next tile's can
    start; here the tiles' loads and products are independent of each other until the fold, which is a few
    elementwise operations. Each value is computed by the same operation from the same operands:
    - a tile's scores and p @ V are the same [BLOCK_M, BLOCK_N] / [BLOCK_N, BLOCK_D] MMAs;
    - the running max after tile j, max(m_{j-1}, rowmax_j), is exact whatever the order it is taken in;
    - alpha_j = exp2(m_{j-1} - m_j), p_j = exp2(s_j - m_j) and the folds l * alpha_j + rowsum_j,
      acc * alpha_j + pv_j are the loop's expressions, applied in the loop's order.
    A tile wholly past kv_end, which the loop never visits, is an exact no-op: its scores are all -inf, so
    m_j = m_{j-1}, alpha_j = exp2(0) = 1, p_j = 0 and its V loads zeros, so l * 1 + 0 = l and acc * 1 + 0 =
    acc (the module docstring's point 3)."""
    kpos0 = split_start + tl.arange(0, BLOCK_N)
    kpos1 = kpos0 + BLOCK_N
    # K first; V once the scores are taken, when the K tiles are dead: fewer tiles live at once (the batch-1
    # launch compiles for sm_90 at 171 registers, no spill: kernels/NOTES.md, session 40)
    k0 = _cache_tile(kc_ptr, bt_row, kpos0, kpos0 < kv_end, h, d, dmask, stride_kb, stride_ks, stride_kh, PAGE)
    k1 = _cache_tile(kc_ptr, bt_row, kpos1, kpos1 < kv_end, h, d, dmask, stride_kb, stride_ks, stride_kh, PAGE)
    if TILES == 4:
        kpos2 = kpos1 + BLOCK_N
        kpos3 = kpos2 + BLOCK_N
        k2 = _cache_tile(kc_ptr, bt_row, kpos2, kpos2 < kv_end, h, d, dmask, stride_kb, stride_ks, stride_kh, PAGE)
        k3 = _cache_tile(kc_ptr, bt_row, kpos3, kpos3 < kv_end, h, d, dmask, stride_kb, stride_ks, stride_kh, PAGE)
    s0 = _tile_scores(q, k0, kpos0, kv_end, q_pos, qk_scale, PREC, UPCAST)
    s1 = _tile_scores(q, k1, kpos1, kv_end, q_pos, qk_scale, PREC, UPCAST)
    m0 = tl.maximum(m_i, tl.max(s0, axis=1))
    m1 = tl.maximum(m0, tl.max(s1, axis=1))
    if TILES == 4:
        s2 = _tile_scores(q, k2, kpos2, kv_end, q_pos, qk_scale, PREC, UPCAST)
        s3 = _tile_scores(q, k3, kpos3, kv_end, q_pos, qk_scale, PREC, UPCAST)
        m2 = tl.maximum(m1, tl.max(s2, axis=1))
        m3 = tl.maximum(m2, tl.max(s3, axis=1))
    v0 = _cache_tile(vc_ptr, bt_row, kpos0, kpos0 < kv_end, h, d, dmask, stride_vb, stride_vs, stride_vh, PAGE)
    v1 = _cache_tile(vc_ptr, bt_row, kpos1, kpos1 < kv_end, h, d, dmask, stride_vb, stride_vs, stride_vh, PAGE)
    if TILES == 4:
        v2 = _cache_tile(vc_ptr, bt_row, kpos2, kpos2 < kv_end, h, d, dmask, stride_vb, stride_vs, stride_vh, PAGE)
        v3 = _cache_tile(vc_ptr, bt_row, kpos3, kpos3 < kv_end, h, d, dmask, stride_vb, stride_vs, stride_vh, PAGE)
    p0, r0 = _tile_weights(s0, m0, v0, PREC, UPCAST, ROWSUM_DOT)
    p1, r1 = _tile_weights(s1, m1, v1, PREC, UPCAST, ROWSUM_DOT)
    pv0 = mma(p0, v0, PREC, UPCAST)
    pv1 = mma(p1, v1, PREC, UPCAST)
    if TILES == 4:
        p2, r2 = _tile_weights(s2, m2, v2, PREC, UPCAST, ROWSUM_DOT)
        p3, r3 = _tile_weights(s3, m3, v3, PREC, UPCAST, ROWSUM_DOT)
        pv2 = mma(p2, v2, PREC, UPCAST)
        pv3 = mma(p3, v3, PREC, UPCAST)
    l_i, acc = _fold(l_i, acc, m_i, m0, r0, pv0)
    l_i, acc = _fold(l_i, acc, m0, m1, r1, pv1)
    m_i = m1
    if TILES == 4:
        l_i, acc = _fold(l_i, acc, m1, m2, r2, pv2)
        l_i, acc = _fold(l_i, acc, m2, m3, r3, pv3)
        m_i = m3
    return m_i, l_i, acc


@triton.jit
def _fold(l_i, acc, m_prev, m_new, rowsum, pv):
    """One tile folded into the running (l, acc): ``_softmax_step``'s expressions for its alpha, l and acc."""
    alpha = tl.exp2(m_prev - m_new)
    return l_i * alpha + rowsum, acc * alpha[:, None] + pv


@triton.jit
def _store_split(out_ptr, part_acc_ptr, part_ml_ptr, acc, m_i, l_i, s, rows, head, d, dmask, rmask, n_row, prow0,
                 split_rows, stride_ot, stride_oh, HEAD_DIM: tl.constexpr):
    """Split s's results for the tile's rows: the final answer of a row with one split (or none:
    l_i == 0 only for seq_len-0 rows -> zeros); the unnormalised partial of a row with several."""
    direct = rmask & (n_row <= 1) & ((n_row * 0 + s) == 0)  # (a [BLOCK_M] mask: the interpreter needs one)
    out = acc / tl.maximum(l_i, 1e-30)[:, None]
    tl.store(out_ptr + rows[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=direct[:, None] & dmask[None, :])
    # part_acc [S, T, Hq, D], part_ml [S, T, Hq, 2] fp32, split-major so a step touches only the first
    # splits' slabs (split_rows = T * Hq rows each)
    partial = (n_row > 1) & (s < n_row)
    prow = prow0 + s * split_rows
    tl.store(part_acc_ptr + prow[:, None] * HEAD_DIM + d[None, :], acc, mask=partial[:, None] & dmask[None, :])
    tl.store(part_ml_ptr + prow * 2, m_i, mask=partial)
    tl.store(part_ml_ptr + prow * 2 + 1, l_i, mask=partial)


@triton.jit(do_not_specialize=["num_splits", "n_tiles", "split_rows"])
def _merge_kernel(
    part_acc_ptr, part_ml_ptr, out_ptr, seq_lens_ptr, qsl_ptr, tiles_ptr, stride_ot, stride_oh, num_splits, n_tiles,
    split_rows,
    GROUP: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, Q_TOK: tl.constexpr,
    KV_SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, USE_PDL: tl.constexpr,
):
    pdl_enter_before_inputs(USE_PDL)
    t = tl.program_id(0)  # step inputs first, before the wait (see _split_kernel)
    b = tl.load(tiles_ptr + t).to(tl.int64)
    mb = tl.load(tiles_ptr + n_tiles + t)
    h = tl.program_id(1)
    q_len = tl.load(qsl_ptr + b + 1) - tl.load(qsl_ptr + b)
    rows, head, q_pos, rmask = _rows(qsl_ptr, seq_lens_ptr, mb, b, h, GROUP, Q_TOK, BLOCK_M)
    n_row = tl.minimum(_num_splits(q_pos, rmask, KV_SPLIT), num_splits)  # the min only guards a lying meta
    active = n_row > 1
    n_max = tl.max(tl.where(active, n_row, 0), axis=0)
    pdl_enter_after_inputs(USE_PDL)
    if mb * Q_TOK >= q_len:
        return
    if n_max < 2:
        return  # every row was written by the split kernel
    d = tl.arange(0, BLOCK_D)
    dmask = d < HEAD_DIM
    prow = rows * (NUM_KV_HEADS * GROUP) + head  # [BLOCK_M], split 0; split s is split_rows rows on
    amask = active[:, None] & dmask[None, :]
    m = tl.load(part_ml_ptr + prow * 2, mask=active, other=0.0)
    l = tl.load(part_ml_ptr + prow * 2 + 1, mask=active, other=1.0)
    acc = tl.load(part_acc_ptr + prow[:, None] * HEAD_DIM + d[None, :], mask=amask, other=0.0)
    # fold splits 1, 2, ... in order; elementwise, so a row's arithmetic is its own
    for s in range(1, n_max):
        take = active & (s < n_row)
        prow_s = prow + s * split_rows
        m_s = tl.load(part_ml_ptr + prow_s * 2, mask=take, other=0.0)
        l_s = tl.load(part_ml_ptr + prow_s * 2 + 1, mask=take, other=0.0)
        acc_s = tl.load(part_acc_ptr + prow_s[:, None] * HEAD_DIM + d[None, :],
                        mask=take[:, None] & dmask[None, :], other=0.0)
        m_new = tl.maximum(m, m_s)
        a = tl.exp2(m - m_new)
        c = tl.exp2(m_s - m_new)
        l = tl.where(take, l * a + l_s * c, l)
        acc = tl.where(take[:, None], acc * a[:, None] + acc_s * c[:, None], acc)
        m = tl.where(take, m_new, m)
    out = acc / l[:, None]
    tl.store(out_ptr + rows[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=amask)


def split_launch(bm: int, small_m: int, n_tiles: int, num_kv_heads: int, num_splits: int, sms: int, decode: bool,
                 rowsum_dot: bool, kv_split: int = KV_SPLIT, block_n: int = BLOCK_N, split_programs: int | None = None,
                 flat: bool | None = None, split_stages: int | None = None, split_warps: int | None = None,
                 phased: bool | None = None) -> tuple[int, bool, int, int, int]:
    """How ``paged_attention_invariant`` launches the split kernel over ``n_tiles`` tiles of ``bm`` rows
    (``small_m``: the small tiles' height) with ``num_splits`` splits on ``sms`` SMs: (programs per tile
    and KV head P, FLAT, stages, warps, PHASED). ``decode``: a decode batch (max_query_len 1);
    ``rowsum_dot``: MMA row sums (``prefill_block_m`` set); the rest as ``paged_attention_invariant``'s
    keywords (None: its policy). None of it changes a bit. Its own function so that the offline audit
    (scripts/t4_compile_audit.py) compiles the launch a step gets."""
    # programs per (tile, KV head), each walking splits first, first + P, ...: from shapes only
    # (graph-safe), enough for ~4 waves, never more than the splits. A decode batch's S follows
    # the block table's width (max_model_len), so one program a split would launch e.g. 512 x
    # 256 programs at 32k, nearly all exiting at once
    P = split_programs or min(num_splits, max(1, cdiv(4 * sms, n_tiles * num_kv_heads)))
    if flat and P != 1:
        raise ValueError(f"flat walks every split of a tile in one program: split_programs must be 1, got {P}")
    walk_flat = (P == 1 and bm == small_m) if flat is None else flat
    stages = split_stages or (2 if bm == small_m else 3)
    small_decode = rowsum_dot and decode and n_tiles * num_kv_heads <= WIDE_WARPS_MAX_TILES
    warps = split_warps or (8 if bm > 64 or small_decode else 4)
    # small tiles only: four tiles' scores of a tall tile would not fit in registers
    tiles_ok = kv_split in (2 * block_n, 4 * block_n)
    mma_decode = rowsum_dot and decode  # MMA row sums: Hopper's launch
    auto = mma_decode and n_tiles * num_kv_heads <= PHASED_MAX_TILES and tiles_ok and not walk_flat
    phases = bm == small_m and (auto if phased is None else phased)
    if phases and (not tiles_ok or walk_flat):
        raise ValueError(f"phased walks a split of two or four key tiles in a loop per split: kv_split {kv_split} "
                         f"must be 2 or 4 * block_n {block_n}, and flat off")
    return P, walk_flat, stages, warps, kv_split // block_n if phases else 0


def paged_attention_invariant(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta, scale: float, *,
    kv_split: int = KV_SPLIT, block_m: int | None = None, block_n: int | None = None,
    prefill_block_m: int | None = None, out: torch.Tensor | None = None, pdl: bool | None = None,
    split_programs: int | None = None, flat: bool | None = None, split_stages: int | None = None,
    split_warps: int | None = None, rope: tuple | None = None, phased: bool | None = None,
) -> torch.Tensor:
    """Batch-invariant paged attention (module docstring). q: [T, Hq, D] flattened by
    ``meta.query_start_loc``; caches [num_blocks, block_size, Hkv, D]; ``meta`` duck-types
    ``AttentionMetadata`` (query_start_loc, seq_lens, block_tables, max_query_len, max_seq_len,
    query_start_loc_cpu). Returns [T, Hq, D]. Rows of seq_len-0 sequences are zero, and so are
    rows past ``query_start_loc[-1]`` when ``query_start_loc_cpu`` is given (eager path).

    A decode batch (``max_query_len == 1``) launches from shapes only (split count from the
    block-table width) and can be captured in a CUDA graph. ``kv_split`` (keys per split, a
    multiple of ``block_n``), ``block_m`` (default ``invariant_block_m(group)``) and ``block_n`` (default
    ``BLOCK_N``; ``FMA_BLOCK_N`` on a GPU whose dots run on FMAs, ``_util.mma_dot_for``: a device's every
    launch takes the same) decide the bits: keep them fixed for a run. ``prefill_block_m``: rows per tile for the chunks of
    a step with chunks (max_query_len > 1; sequences with more new tokens than one small tile
    holds), e.g. 128 = 16 query tokens of a group of 8 instead of 2, so each K/V tile serves 8x
    the queries; the step's decodes keep small tiles in a launch of their own. It turns on the
    MMA row sums (``_softmax_step``) for every step, which is what makes the tile height free,
    and gives other bits than None does, so it too is fixed for a run. ``split_programs``:
    programs per (query tile, KV head), each taking every P-th split (None: from the grid's
    size; it never changes a bit). ``flat``: where a program takes all its tile's splits (P = 1),
    walk them as one loop over key tiles (None: for small tiles with P = 1; False: a loop per
    split; the same arithmetic either way). ``split_stages``: the split kernel's software-pipeline
    depth (None: 2 for small tiles, 3 for tall ones; no bit depends on it). Chosen on the H200, µs
    a call at 32k max_model_len (diagnostics/det_attn_sweep_5ba6fc2.*): decode 512 x 640 flat 103.8
    vs 120.3 a loop per split (at 256 rows level, 65.2 vs 64.2); 16 prompts of 512 (tall tiles) a loop
    per split at 3 stages 182.0, at 2 200.2, flat at 3 188.0. (2 or 8 warps instead of 4 for small
    tiles: no faster where it matters, det_attn_sweep_0960f7a; the knob left with that commit.)
    (Block-table entries one key tile ahead, as the default decode kernel's ``prefetch``: slower at 2
    stages, b64c640 19.1 -> 24.3 µs, diagnostics/det_attn_sweep_prefetch_0b4076b.*; removed.)
    ``split_warps``: the split kernel's warps (None: 8 for decode launches of at most
    ``WIDE_WARPS_MAX_TILES`` small tiles with MMA row sums, else 4 for small tiles, 8 for tall ones).
    Tried and removed at 943114a (no gain at one row, or a loss at large batches): each split's key tiles
    unrolled with the next tile's loads ahead, and the merge folding several splits a trip.
    ``phased``: a loop per split walks each split's key tiles in phases (``_phased_split``: all loads,
    then all score products, ..., then the folds in key order) instead of tile after tile; the same
    operations on the same values, so never a bit changes. Needs ``kv_split`` of 2 or 4 ``block_n`` tiles
    and a loop per split. None: on for decode launches of at most ``PHASED_MAX_TILES`` small tiles with MMA
    row sums (0 until measured on the H200, see there). Small tiles only (a step's chunks in tall tiles keep
    the loop).
    ``pdl``: see ``_util.use_pdl``; the kernels load their step inputs before the wait (``_util``).
    ``rope``: (k, v, positions, cos_sin, slot_mapping) of a decode batch (``max_query_len == 1``): q, k
    and v are then the step's before RoPE (views of the qkv rows), the caches lack each row's newest
    position, and RoPE with the K/V write happen inside this launch (``_split_kernel``'s ROPE), bit for
    bit as ``rope_kv.rotary_write_kv`` followed by this function would compute them."""
    page, Hkv, B = check_paged_meta(q, k_cache, v_cache, meta)
    T, Hq, D = q.shape
    if block_n is None:
        block_n = BLOCK_N if mma_dot_for(q) else FMA_BLOCK_N
    if rope is not None:
        if meta.max_query_len > 1:
            raise ValueError("rope: decode batches only (max_query_len 1); a chunk's rows need rope_kv's launch")
        if D & (D - 1) or D < 2:
            raise ValueError(f"rope: the head size must be a power of two, got {D}")
        kn, vn, positions, cos_sin, slot_mapping = rope
        check("k", kn, shape=(T, Hkv, D), dtype=q.dtype)
        check("v", vn, shape=(T, Hkv, D), dtype=q.dtype)
        check("slot_mapping", slot_mapping, shape=(T,))
        check("positions", positions, shape=(T,))
        rope_args = (kn, vn, positions, cos_sin, slot_mapping, kn.stride(0), kn.stride(1), vn.stride(0), vn.stride(1),
                     cos_sin.stride(0))
    else:
        rope_args = (q, q, q, q, q, 0, 0, 0, 0, 0)  # unused: ROPE off
    group = Hq // Hkv
    small_m = block_m or invariant_block_m(group)
    tall_m = prefill_block_m if prefill_block_m is not None and meta.max_query_len > 1 else None
    for bm in (small_m, tall_m or small_m):
        if bm < group or bm < 16 or bm & (bm - 1):
            raise ValueError(f"block_m {bm} must be a power of two >= 16 and >= the GQA group {group}")
    if block_n < 16 or block_n & (block_n - 1) or kv_split % block_n:
        raise ValueError(f"kv_split {kv_split} must be a multiple of block_n {block_n} (a power of two >= 16)")
    out = torch.empty_like(q) if out is None else out
    check("out", out, shape=(T, Hq, D), dtype=q.dtype)
    qsl_cpu = getattr(meta, "query_start_loc_cpu", None)
    if qsl_cpu is not None and qsl_cpu[-1] < T:
        out[qsl_cpu[-1]:].zero_()
    if B == 0 or T == 0 or meta.max_query_len == 0:
        return out
    # splits: a decode batch sizes them from the table (graph-safe), anything else from max_seq_len
    max_ctx = meta.block_tables.shape[1] * page
    if meta.max_query_len > 1 and getattr(meta, "max_seq_len", None):
        max_ctx = min(max_ctx, meta.max_seq_len)
    S = max(1, cdiv(max_ctx, kv_split))
    BLOCK_D = max(16, next_pow2(D))
    # fp32 even when unused (S == 1), so every call runs the one compiled kernel
    # split-major: a decode batch's S follows max_model_len (128 at 32k) while its rows use ~3 splits;
    # [T, Hq, S, D] put each row's few partials 64 KB from the next row's (at 32k), [S, T, Hq, D]
    # keeps a step's partials in the first S' slabs (H200, W1 at 32k: the det decode step 11.53 -> 10.89 ms
    # with it, diagnostics/w1_profile_modes_97c30a6.* vs _2df709a.*)
    part_acc = torch.empty((S, T, Hq, D) if S > 1 else (1,), dtype=torch.float32, device=q.device)
    part_ml = torch.empty((S, T, Hq, 2) if S > 1 else (1,), dtype=torch.float32, device=q.device)
    launch = pdl_args(q, T, pdl)
    common = dict(GROUP=group, NUM_KV_HEADS=Hkv, HEAD_DIM=D, KV_SPLIT=kv_split, BLOCK_D=BLOCK_D, **launch)
    # taller tiles serve the chunks only: a decode row in a tall tile would pay for 16 tokens'
    # MMAs (a mixed step's attention 14.4 ms against 8.0 for its prompts alone at a47b2281), so
    # sequences that fit one small tile keep small tiles, in a launch of their own
    short_len = small_m // group
    parts = [(small_m, "all")] if tall_m is None else [(small_m, "short"), (tall_m, "long")]
    for bm, part in parts:
        tiles = query_tile_map(meta, bm // group, B, q.device, part, short_len)
        n_tiles = tiles.shape[1]
        if n_tiles == 0:
            continue
        P, walk_flat, stages, warps, phased_tiles = split_launch(
            bm, small_m, n_tiles, Hkv, S, sm_count_for(q), meta.max_query_len == 1, prefill_block_m is not None,
            kv_split, block_n, split_programs, flat, split_stages, split_warps, phased)
        _split_kernel[(n_tiles, P * Hkv)](
            q, k_cache, v_cache, out, part_acc, part_ml, meta.block_tables, meta.seq_lens, meta.query_start_loc,
            tiles, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
            meta.block_tables.stride(0), float(scale) * LOG2E, S, n_tiles, P, T * Hq, *rope_args,
            PAGE=page, BLOCK_N=block_n, PREC=dot_precision(q.dtype), UPCAST=dot_upcast(q.dtype, ordered=True),
            ROWSUM_DOT=prefill_block_m is not None, Q_TOK=bm // group, BLOCK_M=bm,
            FLAT=walk_flat, ROPE=rope is not None, PHASED=phased_tiles, num_warps=warps,
            num_stages=stages, **common,
        )
    if S > 1:
        # the merge is elementwise per row, so its tile height never changes a row's bits: small
        # tiles always (128-row merge tiles took 1.6 ms a prefill step against 1.0 at 16 rows)
        tiles = query_tile_map(meta, small_m // group, B, q.device)
        _merge_kernel[(tiles.shape[1], Hkv)](
            part_acc, part_ml, out, meta.seq_lens, meta.query_start_loc, tiles, out.stride(0), out.stride(1), S,
            tiles.shape[1], T * Hq, Q_TOK=small_m // group, BLOCK_M=small_m,
            num_warps=4, **common,
        )
    return out

"""Paged attention for decode: one query token per sequence, split-K over the context.

Reference: ``pageserve.kernels.reference.paged_attention`` with one query per sequence.

Layout of the work: program (b, h, s) takes sequence b, KV head h and split s. It loads
the query rows of all ``group = Hq // Hkv`` heads that share KV head h (padded to 16 rows
for ``tl.dot``), so each K/V tile is read once for the whole group. Split s covers tokens
``[s * per, min((s + 1) * per, seq_len))`` with ``per = round_up(ceil(seq_len / S), BLOCK_N)``
computed on the device from ``seq_lens[b]``: a long sequence spreads over all S splits, a
short one uses the first few, and the rest exit at once. Each split writes its normalised
partial output and log-sum-exp; a second kernel merges the splits. (Merging in the split
kernel instead — the last split to arrive, on an arrival counter — measured slower on the
H200: kernels/NOTES.md.)

The grid ``(B, Hkv, S)`` and S depend only on tensor shapes (B, Hkv, block_tables.shape[1])
and the SM count, never on host copies of the lengths, and nothing syncs the host: both
launches can be captured in a CUDA graph. A row with seq_len 0 (padding) gets zeros.
``decode_schedule`` picks S, the key tile and the load schedule: the split rule by default, or
the "pipelined" schedule for sm_90 (block-table entries a tile ahead, 3 stages, one split from
moderate batches up; faster at short contexts, slower at long ones). The engine's ops choose
between the two per step from the longest context (``TritonOps(decode_schedule="by_context")``).

``rope_decode_attention`` is the same launch taking the step's q, k and v before RoPE (the qkv
projection's views): each program rotates its group's query rows itself, and the program whose
split holds the sequence's newest position rotates that token's k, writes k and v into the cache
(the work of ``rope_kv.rotary_write_kv``, whose launch it replaces in decode steps) and folds the
token into its softmax from registers; the other positions come from the cache as above
(reference: ``reference.rotary_write_kv``, then ``reference.paged_attention``).
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .reference import paged_attention as paged_attention_reference
from .rotary import rope_first_half, rope_second_half
from ._util import (cdiv, check, check_device, check_paged_qkv, dot_precision, dot_upcast, interpreting, kv_pages,
                    load_kv_at, mma, mma_dot_for, next_pow2, online_softmax_step, pdl_args, pdl_enter_after_inputs,
                    pdl_enter_before_inputs, sm_count_for)

__all__ = ["paged_decode_attention", "rope_decode_attention", "paged_attention_reference", "decode_num_splits",
           "decode_schedule", "schedule_for", "pipelined_device", "DecodeSchedule", "DecodeRope", "SCHEDULES"]

SCHEDULES = ("split", "pipelined")

LOG2E = 1.4426950408889634
MIN_SPLIT_TOKENS = 128  # never split a context into pieces shorter than this
MAX_SPLITS = 64


@triton.jit
def _split_bounds(seq_len, s, NUM_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr):
    per = (seq_len + NUM_SPLITS - 1) // NUM_SPLITS
    per = tl.maximum((per + BLOCK_N - 1) // BLOCK_N * BLOCK_N, BLOCK_N)
    return per, s * per


@triton.jit
def _rope_row(cs_ptr, pos_ptr, b, stride_cs, d, dmask, HEAD_DIM: tl.constexpr):
    """Row b's position's cos and sin spread over the head's lanes (lane d takes entry d mod HALF,
    fp32) and each lane's rotate-half partner (d xor HALF: HEAD_DIM is a power of two). Both index
    vectors run contiguously in HALF-long pieces that start at multiples of HALF: said, so loads vectorize."""
    HALF: tl.constexpr = HEAD_DIM // 2
    pos = tl.load(pos_ptr + b).to(tl.int64)
    lane = tl.max_contiguous(tl.multiple_of(d % HALF, HALF), HALF)
    cos = tl.load(cs_ptr + pos * stride_cs + lane, mask=dmask, other=0.0).to(tl.float32)
    sin = tl.load(cs_ptr + pos * stride_cs + HALF + lane, mask=dmask, other=0.0).to(tl.float32)
    return cos, sin, tl.max_contiguous(tl.multiple_of(d ^ HALF, HALF), HALF)


@triton.jit
def _rotate(x_ptr, d, partner, mask, cos, sin, HALF: tl.constexpr):
    """Rotate-half RoPE of the values at x_ptr + d (any shape broadcasting with d) in fp32, each half by
    ``rotary``'s own FMAs (lane d < HALF: x1 = x, x2 = its partner; above: the other way round), so it
    rounds to ``rope_kv``'s bits."""
    x = tl.load(x_ptr + d, mask=mask, other=0.0).to(tl.float32)
    xp = tl.load(x_ptr + partner, mask=mask, other=0.0).to(tl.float32)
    return tl.where(d < HALF, rope_first_half(x, xp, cos, sin), rope_second_half(xp, x, cos, sin))


@triton.jit
def _load_q(q_row, heads, gmask, d, dmask, stride_qh, cos, sin, partner, HEAD_DIM: tl.constexpr):
    """The group's query rows [BLOCK_G, BLOCK_D] before RoPE, rotated and rounded once to q's dtype."""
    r = _rotate(q_row + heads[:, None] * stride_qh, d[None, :], partner[None, :], gmask[:, None] & dmask[None, :],
                cos[None, :], sin[None, :], HEAD_DIM // 2)
    return r.to(q_row.dtype.element_ty)


@triton.jit
def _newest_kv(kn_row, vn_row, kc_ptr, vc_ptr, slot, store, h, d, dmask, cos, sin, partner,
               stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
               PAGE: tl.constexpr, HEAD_DIM: tl.constexpr):
    """The step's own token for KV head h: k rotated and rounded to the cache's dtype, and v, both
    [BLOCK_D]; stored at ``slot`` where ``store`` (and slot is not -1), a slot no program of this launch
    reads (every key loop stops short of the newest position)."""
    k = _rotate(kn_row, d, partner, dmask, cos, sin, HEAD_DIM // 2).to(kc_ptr.dtype.element_ty)
    v = tl.load(vn_row + d, mask=dmask, other=0.0).to(vc_ptr.dtype.element_ty)
    if store & (slot >= 0):
        page = slot // PAGE
        off = slot % PAGE
        tl.store(kc_ptr + page * stride_kb + off * stride_ks + h * stride_kh + d, k, mask=dmask)
        tl.store(vc_ptr + page * stride_vb + off * stride_vs + h * stride_vh + d, v, mask=dmask)
    return k, v


@triton.jit
def _fold_newest(q, k, v, fold, qk_scale, m_i, l_i, acc):
    """Fold one key (k, v: [BLOCK_D]) into the running softmax (m_i, l_i, acc) as ``online_softmax_step``
    folds a one-key tile (score in fp32, its weight rounded to v's dtype where it meets v, as the tile's
    MMA takes it), where ``fold``; elsewhere its score is -inf, which leaves every bit as it was
    (alpha = 1, weight 0): no branch. Folded into the fresh state before the key loop (m = score, l = 1,
    acc = v), so that k and v die there: folded after the loop they stayed live through it, and the
    split kernel's 64-key launch took 154 registers a thread instead of 111 (sm_90 compile), so 3 programs
    an SM instead of 4 (b200: 400 programs, 396 slots)."""
    score = tl.sum(q.to(tl.float32) * k.to(tl.float32)[None, :], axis=1) * qk_scale  # [BLOCK_G], log2 units
    score = tl.where(fold, score, float("-inf"))
    m_new = tl.maximum(m_i, score)
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(score - m_new)
    l_i = l_i * alpha + p
    acc = acc * alpha[:, None] + p.to(v.dtype).to(tl.float32)[:, None] * v.to(tl.float32)[None, :]
    return m_new, l_i, acc


# stride_bt is the step's block-table width: unspecialised, so a new width never compiles a variant
@triton.jit(do_not_specialize=["stride_bt"])
def _decode_split_kernel(
    q_ptr, kc_ptr, vc_ptr, bt_ptr, seq_lens_ptr, part_o_ptr, part_lse_ptr, out_ptr,
    stride_qb, stride_qh, stride_ob, stride_oh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_bt, qk_scale,
    kn_ptr, vn_ptr, pos_ptr, cs_ptr, slot_ptr, stride_knb, stride_knh, stride_vnb, stride_vnh, stride_cs,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, NUM_SPLITS: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, PREC: tl.constexpr,
    UPCAST: tl.constexpr, DIRECT: tl.constexpr, USE_PDL: tl.constexpr, PREFETCH: tl.constexpr,
    ROPE: tl.constexpr = False,
):
    # DIRECT (one split): the normalised output goes straight to out, and no merge kernel runs.
    # PREFETCH (the pipelined schedule): each tile's block-table entries are loaded one iteration
    # ahead (a loop-carried value), so a tile's K/V addresses never wait on a load issued in the
    # same iteration (kernels/NOTES.md, session 20); the first tile's, with seq_len, before the
    # PDL wait (_util, "Step inputs before the wait").
    # ROPE (``rope_decode_attention``): q is the step's query before RoPE (rotated here, as rope_kv rounds
    # it), the cache lacks the newest position, and kn/vn hold that token's k (before RoPE) and v: the
    # program whose split ends at seq_len writes k (rotated) and v at the row's slot (-1: no write) and
    # starts its running softmax with that token, before its loop; every loop stops short of it. The
    # kn_ptr..stride_cs arguments are unused without ROPE.
    pdl_enter_before_inputs(USE_PDL)
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    s = tl.program_id(2)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    gmask = g < GROUP
    dmask = d < HEAD_DIM
    heads = h * GROUP + g  # query heads of this KV head
    out_ptrs = out_ptr + b * stride_ob + heads[:, None] * stride_oh + d[None, :]
    q_ptrs = q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :]
    # step inputs (seq_lens, the block table) before the wait; q and the cache come from earlier kernels
    seq_len = tl.load(seq_lens_ptr + b)
    per, start = _split_bounds(seq_len, s, NUM_SPLITS, BLOCK_N)
    end = tl.minimum(start + per, seq_len)
    stop = end  # the last position this program reads from the cache (exclusive)
    if ROPE:
        stop = tl.minimum(end, seq_len - 1)
        cos, sin, partner = _rope_row(cs_ptr, pos_ptr, b, stride_cs, d, dmask, HEAD_DIM)
        slot = tl.load(slot_ptr + b).to(tl.int64)
    bt_row = bt_ptr + b * stride_bt
    if PREFETCH:  # the first tile's blocks
        tok = start + tl.arange(0, BLOCK_N)
        page = kv_pages(bt_row, tok, tok < stop, PAGE)
    pdl_enter_after_inputs(USE_PDL)
    if PREFETCH:  # issued before the branch on seq_len
        if ROPE:
            q = _load_q(q_ptr + b * stride_qb, heads, gmask, d, dmask, stride_qh, cos, sin, partner, HEAD_DIM)
        else:
            q = tl.load(q_ptrs, mask=gmask[:, None] & dmask[None, :], other=0.0)  # [BLOCK_G, BLOCK_D]
    if start >= seq_len:
        if DIRECT:  # a padding row (seq_len 0): zeros, as the merge would write
            tl.store(out_ptrs, tl.zeros([BLOCK_G, BLOCK_D], tl.float32).to(out_ptr.dtype.element_ty),
                     mask=gmask[:, None] & dmask[None, :])
        return
    if not PREFETCH:
        if ROPE:
            q = _load_q(q_ptr + b * stride_qb, heads, gmask, d, dmask, stride_qh, cos, sin, partner, HEAD_DIM)
        else:
            q = tl.load(q_ptrs, mask=gmask[:, None] & dmask[None, :], other=0.0)  # [BLOCK_G, BLOCK_D]

    if ROPE:  # the split that ends at seq_len holds the newest position: its k and v come from the step
        newest = end == seq_len
        k_new, v_new = _newest_kv(kn_ptr + b * stride_knb + h * stride_knh, vn_ptr + b * stride_vnb + h * stride_vnh,
                                  kc_ptr, vc_ptr, slot, newest, h, d, dmask, cos, sin, partner, stride_kb, stride_ks,
                                  stride_kh, stride_vb, stride_vs, stride_vh, PAGE, HEAD_DIM)

    m_i = tl.full([BLOCK_G], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    if ROPE:  # the newest token first: nothing of it (k, v, cos, sin) stays live through the loop
        m_i, l_i, acc = _fold_newest(q, k_new, v_new, newest, qk_scale, m_i, l_i, acc)
    for n0 in range(start, stop, BLOCK_N):
        tok = n0 + tl.arange(0, BLOCK_N)
        tmask = tok < stop
        if PREFETCH:
            nxt = tok + BLOCK_N
            page_next = kv_pages(bt_row, nxt, nxt < stop, PAGE)
        else:
            page = kv_pages(bt_row, tok, tmask, PAGE)
        k, v = load_kv_at(kc_ptr, vc_ptr, page, tok, tmask, h, d, dmask,  # [BLOCK_N, BLOCK_D] each
                          stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, PAGE)
        scores = mma(q, tl.trans(k), PREC, UPCAST) * qk_scale  # [BLOCK_G, BLOCK_N], log2 units
        scores = tl.where(tmask[None, :], scores, float("-inf"))
        m_i, l_i, acc = online_softmax_step(scores, v, m_i, l_i, acc, PREC, UPCAST)
        if PREFETCH:
            page = page_next

    out = acc / l_i[:, None]
    if DIRECT:
        tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=gmask[:, None] & dmask[None, :])
        return
    lse = m_i + tl.log2(l_i)
    # partials: o [B, Hq, S, D] fp32, lse [B, Hq, S] fp32, contiguous
    row = (b * (tl.num_programs(1) * GROUP) + heads) * NUM_SPLITS + s  # [BLOCK_G]
    tl.store(part_o_ptr + row[:, None] * HEAD_DIM + d[None, :], out, mask=gmask[:, None] & dmask[None, :])
    tl.store(part_lse_ptr + row, lse, mask=gmask)


@triton.jit
def _decode_merge_kernel(
    part_o_ptr, part_lse_ptr, seq_lens_ptr, out_ptr, stride_ob, stride_oh,
    HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, USE_PDL: tl.constexpr,
):
    pdl_enter_before_inputs(USE_PDL)
    b = tl.program_id(0).to(tl.int64)
    hq = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + b)  # a step input: before the wait
    per, _unused = _split_bounds(seq_len, 0, NUM_SPLITS, BLOCK_N)
    n_valid = (seq_len + per - 1) // per  # 0 when seq_len == 0
    pdl_enter_after_inputs(USE_PDL)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    smask = s < n_valid
    dmask = d < HEAD_DIM
    row = (b * tl.num_programs(1) + hq) * NUM_SPLITS + s
    lse = tl.load(part_lse_ptr + row, mask=smask, other=-1.0e30)
    w = tl.where(smask, tl.exp2(lse - tl.max(lse, axis=0)), 0.0)  # [BLOCK_S]
    o = tl.load(part_o_ptr + row[:, None] * HEAD_DIM + d[None, :], mask=smask[:, None] & dmask[None, :], other=0.0)
    total = tl.sum(w, axis=0)
    merged = tl.sum(o * w[:, None], axis=0) / tl.maximum(total, 1e-30)  # zeros when no split ran
    tl.store(out_ptr + b * stride_ob + hq * stride_oh + d, merged.to(out_ptr.dtype.element_ty), mask=dmask)


def decode_num_splits(batch: int, num_kv_heads: int, max_blocks: int, block_size: int, sms: int) -> int:
    """Splits per sequence, from shapes only: enough programs to fill the GPU about three
    times over, no piece shorter than MIN_SPLIT_TOKENS at the largest context the block
    table can hold. (Three, not four: on the H200 at batch 64, 4 splits beat 5 at contexts
    512 and 2,048 — results/h200/diagnostics/decode_attn_sweep.json.)"""
    want = cdiv(3 * sms, max(1, batch * num_kv_heads))
    cap = max(1, cdiv(max_blocks * block_size, MIN_SPLIT_TOKENS))
    return max(1, min(want, cap, MAX_SPLITS))


class DecodeSchedule(NamedTuple):
    """How the split kernel is launched: splits per sequence, key tile, warps, pipeline stages and
    whether block-table entries are loaded a tile ahead (``prefetch``)."""
    num_splits: int
    block_n: int
    num_warps: int
    num_stages: int
    prefetch: bool


def decode_schedule(batch: int, num_kv_heads: int, head_dim: int, elem_size: int, max_blocks: int,
                    block_size: int, sms: int, pipelined: bool, mma: bool = True) -> DecodeSchedule:
    """The launch for a decode batch, from shapes only (graph-safe).

    The split rule (``pipelined=False``, the default everywhere): ``decode_num_splits``, 32-key
    tiles when few (sequence, KV head) pairs, else 64, 4 warps, 2 stages, with ``prefetch`` (since
    session 21: at 2 stages it moved no step by more than 0.01 ms, det_b1_switches_attn_prefetch_9a8bb02,
    and it lets the first tile's block-table load run before the PDL wait, at 1-8 rows).

    ``pipelined`` (opt-in; sm_90, 2-byte K/V, head_dim <= 128): each tile's block-table entries
    one iteration ahead and 3 stages, so a program's K/V loads stream instead of waiting on each
    tile's table load; from half an SM's worth of pairs up, one split per sequence (no merge
    kernel) with the widest key tile whose 3 stages still fit the programs in one wave (128 keys
    x 8 warps up to one pair per SM, 64 up to two, 32 up to four; above that the split rule's own
    launch: its prefetch made 384 rows x 640 tokens 0.23 ms a step faster than the same tile
    without it, 512 rows level, NOTES.md session 29); below, the split rule's count with 32-key
    tiles. On the H200 (bf16, 3B heads) it wins at contexts of ~512 and loses at ~1,300 (NOTES.md, session 20):
    - kernel, graph-timed µs (diagnostics/decode_attn_sweep_*_9c192f9): 64 x 512 16.2 -> 13.6,
      128 x 512 26.4 -> 21.0, 32 x 512 12.5 -> 11.3, but 64 x 2048 40.7 -> 42.8;
    - engine steps at context 512 (det_b1_switches_attn_schedule_5c810d1): b64 -0.06 ms, b128 -0.12;
    - nano-vllm (contexts ~900-1,400; nanovllm_profile_attn_schedule_ab_20c1dab): 33-64 rows
      +7% a step, 65-128 rows +3%, the run 2% slower. One split leaves SMs idle on long contexts
      at under one pair per SM, and a graph's launch cannot see the context. So it is not the default
      here; the engine's ops pick it per step by the host-known context (``TritonOps(decode_schedule=
      "by_context")``: up to 768 tokens, b64 -0.05 ms, b128 -0.13, nano-vllm level; NOTES.md, session 28).

    ``mma`` False (``_util.mma_dot_for``: a GPU below sm_80, where a dot runs on FMAs): the split rule's
    count with 16-key tiles over 8 warps at every batch, which compile for sm_75 without spilling at
    head_dim 64 and 128, RoPE in the launch or not (64-key tiles spill from ~8-16 rows, 32-key ones at
    head_dim 128 with RoPE: scripts/t4_compile_audit.py)."""
    pairs = max(1, batch * num_kv_heads)
    if pipelined and elem_size == 2 and head_dim <= 128 and pairs <= 4 * sms:
        if 2 * pairs < sms:
            return DecodeSchedule(decode_num_splits(batch, num_kv_heads, max_blocks, block_size, sms), 32, 4, 3, True)
        if pairs <= sms:
            return DecodeSchedule(1, 128, 8, 3, True)
        if pairs <= 2 * sms:
            return DecodeSchedule(1, 64, 4, 3, True)
        return DecodeSchedule(1, 32, 4, 3, True)
    splits = decode_num_splits(batch, num_kv_heads, max_blocks, block_size, sms)
    if not mma:
        return DecodeSchedule(splits, 16, 8, 2, True)
    return DecodeSchedule(splits, 32 if 4 * pairs <= sms else 64, 4, 2, True)


def pipelined_device(device_index: int | None = None) -> bool:
    """Whether the "pipelined" schedule runs on this CUDA device (None: the current one): sm_90,
    whose shared memory holds its 3-stage tiles; never under the interpreter."""
    if not torch.cuda.is_available() or interpreting():
        return False
    return _sm90(torch.cuda.current_device() if device_index is None else device_index)


@functools.lru_cache(maxsize=None)
def _sm90(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index) >= (9, 0)


def schedule_for(q: torch.Tensor, k_cache: torch.Tensor, block_tables: torch.Tensor,
                 schedule: str = "split") -> DecodeSchedule:
    """``decode_schedule`` for these tensors: "pipelined" where it can run (sm_90 GPUs, and the
    interpreter, which ignores stages), else the split rule."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    pipelined = schedule == "pipelined" and (interpreting() or (q.is_cuda and pipelined_device(q.device.index or 0)))
    return decode_schedule(q.shape[0], k_cache.shape[2], q.shape[-1], k_cache.element_size(), block_tables.shape[1],
                           k_cache.shape[1], sm_count_for(q), pipelined, mma_dot_for(q))


class DecodeRope(NamedTuple):
    """The step's own token for ``rope_decode_attention``: k, v [B, Hkv, D] before RoPE (strided views of
    the qkv projection are fine; last dim contiguous), positions [B] int, the cos|sin table [max_pos, D]
    fp32, slot_mapping [B] int (-1: write nothing)."""
    k: torch.Tensor
    v: torch.Tensor
    positions: torch.Tensor
    cos_sin: torch.Tensor
    slot_mapping: torch.Tensor


def rope_supported(head_dim: int) -> bool:
    """Whether ``rope_decode_attention`` takes this head size: a power of two (each lane's rotate-half
    partner is ``d xor head_dim / 2``), at least 16."""
    return head_dim >= 16 and head_dim & (head_dim - 1) == 0


def rope_decode_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
    k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor, seq_lens: torch.Tensor,
    block_tables: torch.Tensor, scale: float, **launch,
) -> torch.Tensor:
    """A decode step's RoPE, K/V write and attention in one launch (plus the merge where it splits):
    ``rotary_write_kv`` then ``paged_decode_attention``, with q [B, Hq, D] and k, v [B, Hkv, D] as the qkv
    projection gives them (before RoPE). Row b's newest position (seq_lens[b] - 1 = positions[b]) is
    not read from the cache, which this call writes; the cache holds the earlier ones. ``launch``:
    ``paged_decode_attention``'s keywords (out, schedule, pdl, ...). Returns [B, Hq, D]."""
    B, Hq, D = q.shape
    Hkv = k_cache.shape[2]
    check("k", k, shape=(B, Hkv, D), dtype=q.dtype)
    check("v", v, shape=(B, Hkv, D), dtype=q.dtype)
    check("positions", positions, shape=(B,), dtype=(torch.int32, torch.int64), last_contiguous=False)
    check("cos_sin", cos_sin, shape=(None, D), dtype=torch.float32)
    check("slot_mapping", slot_mapping, shape=(B,), dtype=(torch.int32, torch.int64), last_contiguous=False)
    check_device(q=q, k=k, v=v, positions=positions, cos_sin=cos_sin, slot_mapping=slot_mapping)
    if not rope_supported(D):
        raise ValueError(f"rope_decode_attention: head_dim must be a power of two >= 16, got {D}")
    rope = DecodeRope(k, v, positions.contiguous(), cos_sin, slot_mapping.contiguous())
    return paged_decode_attention(q, k_cache, v_cache, seq_lens, block_tables, scale, rope=rope, **launch)


def paged_decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    seq_lens: torch.Tensor, block_tables: torch.Tensor, scale: float,
    out: torch.Tensor | None = None, num_splits: int | None = None, block_n: int | None = None,
    num_warps: int | None = None, num_stages: int | None = None, pdl: bool | None = None,
    direct: bool | None = None, prefetch: bool | None = None, schedule: str = "split",
    rope: DecodeRope | None = None,
) -> torch.Tensor:
    """q: [B, Hq, D] (query b belongs to sequence b); caches [num_blocks, block_size, Hkv, D];
    seq_lens: [B] int32 (context after this step, 0 = padding row -> zeros);
    block_tables: [B, max_blocks] int32. Returns [B, Hq, D].
    ``schedule``: how the launch is chosen (``decode_schedule``): "split" (the default) or
    "pipelined" (opt-in, where it can run: ``schedule_for``). ``num_splits`` / ``block_n`` / ``num_warps`` / ``num_stages`` /
    ``prefetch`` override single choices (tuning knobs). ``pdl``: see ``_util.use_pdl`` (rows = sequences).
    ``direct``: with one split, the split kernel writes ``out`` itself and the merge kernel
    (a copy at one split) is skipped; None = whenever there is one split, False = always merge
    (the A/B reference: large batches get one split, results/h200/diagnostics/profile_steps.json).
    ``prefetch``: q with seq_len, and each tile's block-table entries one iteration ahead
    (same bits: the loads move, not the arithmetic). ``rope``: q, and ``rope.k`` / ``rope.v``, are before
    RoPE and the cache lacks each row's newest position (``rope_decode_attention``, which checks them)."""
    page, Hkv = check_paged_qkv(q, k_cache, v_cache)
    B, Hq, D = q.shape
    check("seq_lens", seq_lens, shape=(B,), dtype=torch.int32)
    check("block_tables", block_tables, shape=(B, None), dtype=torch.int32)
    check_device(q=q, k_cache=k_cache, v_cache=v_cache, seq_lens=seq_lens, block_tables=block_tables)
    if not seq_lens.is_contiguous():
        raise ValueError("seq_lens must be contiguous")
    plan = schedule_for(q, k_cache, block_tables, schedule)  # checks ``schedule`` too
    out = torch.empty_like(q) if out is None else out
    check("out", out, shape=(B, Hq, D), dtype=q.dtype)
    if B == 0:
        return out
    group = Hq // Hkv
    S = num_splits or plan.num_splits
    BLOCK_N = block_n or plan.block_n
    num_warps = num_warps or plan.num_warps
    num_stages = num_stages or plan.num_stages
    prefetch = plan.prefetch if prefetch is None else prefetch
    BLOCK_D = max(16, next_pow2(D))
    direct = S == 1 if direct is None else (direct and S == 1)
    if direct:  # no partials: the kernel never touches these pointers, so no buffer is allocated for them
        part_o = part_lse = out
    else:
        part_o = torch.empty((B, Hq, S, D), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((B, Hq, S), dtype=torch.float32, device=q.device)
    launch = pdl_args(q, B, pdl)
    if rope is None:  # unused pointers point at something valid
        step = (q, q, seq_lens, q, seq_lens, 0, 0, 0, 0, 0)
    else:
        step = (rope.k, rope.v, rope.positions, rope.cos_sin, rope.slot_mapping, rope.k.stride(0), rope.k.stride(1),
                rope.v.stride(0), rope.v.stride(1), rope.cos_sin.stride(0))
    _decode_split_kernel[(B, Hkv, S)](
        q, k_cache, v_cache, block_tables, seq_lens, part_o, part_lse, out,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0), float(scale) * LOG2E, *step,
        GROUP=group, HEAD_DIM=D, PAGE=page, NUM_SPLITS=S,
        BLOCK_G=max(16, next_pow2(group)), BLOCK_D=BLOCK_D, BLOCK_N=BLOCK_N,
        PREC=dot_precision(q.dtype), UPCAST=dot_upcast(q.dtype), DIRECT=direct, PREFETCH=bool(prefetch),
        ROPE=rope is not None, num_warps=num_warps, num_stages=num_stages, **launch,
    )
    if direct:
        return out
    _decode_merge_kernel[(B, Hq)](
        part_o, part_lse, seq_lens, out, out.stride(0), out.stride(1),
        HEAD_DIM=D, NUM_SPLITS=S, BLOCK_S=next_pow2(S), BLOCK_D=BLOCK_D, BLOCK_N=BLOCK_N,
        num_warps=2, **launch,
    )
    return out

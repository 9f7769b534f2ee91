"""Each row's top-k candidates for the sampler, without ``torch.topk``: a superset of the k highest logits (by the
race's int64 keys: value, then the lower id), in two launches.

Reference: ``pageserve.kernels.reference.topk_candidates`` (the exact top k by those keys). ``torch.topk`` over
256 rows of Qwen2.5's 151,936 logits took 0.41 ms of device time on an H100 even over bf16 values (a radix
select's passes), three quarters of a sampled step's extra time (NOTES, session 53). Here:

1. ``_chunk_max_kernel`` reads each row once and keeps the largest key of every ``CHUNK`` columns.
2. ``_select_kernel``, one program a row: T = the k-th largest chunk maximum, found by bisection over the keys.
   The k chunks at or above T hold k values at or above T, so the k-th largest value is at least T: every top-k
   value is at or above T, and lies in a chunk whose maximum is. The program lists those chunks (in column order)
   and writes the ids of their values at or above T, up to ``cap``; the rest of the row is never read again. For
   logits spread as a model's are, that is about k to 2k ids. Where more than ``cap`` qualify (many values tied
   with T), it finds the k-th largest value V exactly (bisection over the listed chunks' keys) and writes the ids
   above V, then those equal to V in column order until there are k: exactly the top k, ties toward the lower id.

Keys, not floats, are compared throughout (a float's bits made monotonic: -0.0 below +0.0, as the race orders them),
so no two zeros can disagree about a chunk's maximum. -inf values are never candidates: after the race's filters
their probability is 0, so leaving them out changes no draw. Unused slots hold -1. The values read may be the
model's bf16 / fp16 logits (their exact fp32 values, the same keys) or the penalised fp32 ones; with ``seen``
(``kernels/penalties.py``) a repetition penalty is applied to each value as it is read, the penalty kernel's bits
without a penalised copy of the rows.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .reference import topk_candidates as topk_candidates_reference
from ._util import KERNEL_DTYPES, cdiv, check, check_device, next_pow2, pdl_args, pdl_enter
from .penalties import check_seen, penalise_where, seen_penalty

__all__ = ["topk_candidates", "topk_candidates_reference", "default_cap"]

CHUNK = 128  # columns whose maximum one key stands for (a multiple of 32: whole words of seen bits)
CHUNKS_PER_PROGRAM = 16  # the first launch's tile: 16 chunks (2,048 columns) of one row
TILE_CHUNKS = 8  # listed chunks the second launch reads at a time


def default_cap(k: int) -> int:
    """Candidate slots for a width k: 4k (a model's logits rarely put more than 2k values at or above T)."""
    return 4 * k


@triton.jit
def _key32(v):
    """fp32 values -> int32 keys ordered as the values (negatives' magnitude bits flipped; -0.0 just below +0.0)."""
    bits = v.to(tl.int32, bitcast=True)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


@triton.jit
def _read(x_row, col, ok, words_row, rep, HAS_SEEN: tl.constexpr):
    """fp32 values at ``col`` where ``ok`` (-inf elsewhere), penalised where seen (``HAS_SEEN``)."""
    v = tl.load(x_row + col, mask=ok, other=float("-inf")).to(tl.float32)
    if HAS_SEEN:
        v = seen_penalty(v, col, words_row, rep, ok)
    return v


@triton.jit
def _chunk_max_kernel(x_ptr, stride_x, rows_ptr, V, max_ptr, NC, words_ptr, stride_w, rep_ptr,
                      CHUNK: tl.constexpr, CHUNKS: tl.constexpr, HAS_ROWS: tl.constexpr, HAS_SEEN: tl.constexpr,
                      USE_PDL: tl.constexpr):
    pdl_enter(USE_PDL)
    r = tl.program_id(0).to(tl.int64)
    row = r
    if HAS_ROWS:
        row = tl.load(rows_ptr + r)
    c = tl.program_id(1) * CHUNKS + tl.arange(0, CHUNKS)
    if HAS_SEEN:  # as [chunks, words, bits]: each chunk's seen words loaded once, not once a value
        rep = tl.load(rep_ptr + row)
        wi = tl.arange(0, CHUNK // 32)
        bit = tl.arange(0, 32)
        col3 = c[:, None, None] * CHUNK + wi[None, :, None] * 32 + bit[None, None, :]
        v3 = tl.load(x_ptr + row * stride_x + col3, mask=col3 < V, other=float("-inf")).to(tl.float32)
        w = c[:, None] * (CHUNK // 32) + wi[None, :]
        words = tl.load(words_ptr + row * stride_w + w, mask=w * 32 < V, other=0)
        v3 = penalise_where(v3, ((words[:, :, None] >> bit[None, None, :]) & 1) != 0, rep)
        top = tl.max(tl.max(_key32(v3), axis=2), axis=1)
    else:
        col = c[:, None] * CHUNK + tl.arange(0, CHUNK)[None, :]
        v = tl.load(x_ptr + row * stride_x + col, mask=col < V, other=float("-inf")).to(tl.float32)
        top = tl.max(_key32(v), axis=1)
    tl.store(max_ptr + r * NC + c, top, mask=c < NC)


@triton.jit
def _kth_key(keys, mask, K):
    """The largest int32 t with at least K of ``keys`` (where ``mask``) at or above it: the K-th largest key (the
    smallest int32 where fewer than K are given)."""
    lo = tl.full([], -2147483648, tl.int64)
    hi = tl.full([], 2147483647, tl.int64)
    for _ in range(32):
        mid = lo + (hi - lo + 1) // 2
        n = tl.sum(((keys.to(tl.int64) >= mid) & mask).to(tl.int32), axis=0)
        lo = tl.where(n >= K, mid, lo)
        hi = tl.where(n >= K, hi, mid - 1)
    return lo


@triton.jit
def _listed_tile(x_row, list_row, i, n_list, V, words_row, rep, CHUNK: tl.constexpr, TILE: tl.constexpr,
                 HAS_SEEN: tl.constexpr):
    """Columns, validity and fp32 values of listed chunks i .. i + TILE - 1, flattened in column order."""
    t = tl.arange(0, TILE)
    lanes = tl.arange(0, CHUNK)
    ci = tl.load(list_row + i + t, mask=i + t < n_list, other=0)
    col = tl.reshape(ci[:, None] * CHUNK + lanes[None, :], [TILE * CHUNK])
    ok = tl.reshape(((i + t) < n_list)[:, None] & (lanes[None, :] >= 0), [TILE * CHUNK]) & (col < V)
    return col, ok, _read(x_row, col, ok, words_row, rep, HAS_SEEN)


@triton.jit
def _select_kernel(x_ptr, stride_x, rows_ptr, V, max_ptr, NC, list_ptr, out_ptr, K, CAP, words_ptr, stride_w, rep_ptr,
                   CHUNK: tl.constexpr, BLOCK_NC: tl.constexpr, TILE: tl.constexpr, BLOCK_CAP: tl.constexpr,
                   HAS_ROWS: tl.constexpr, HAS_SEEN: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_enter(USE_PDL)
    r = tl.program_id(0).to(tl.int64)
    row = r
    if HAS_ROWS:
        row = tl.load(rows_ptr + r)
    x_row = x_ptr + row * stride_x
    words_row = words_ptr + row * stride_w
    rep = 1.0
    if HAS_SEEN:
        rep = tl.load(rep_ptr + row)
    c = tl.arange(0, BLOCK_NC)
    cmax = tl.load(max_ptr + r * NC + c, mask=c < NC, other=-2147483648)
    T = _kth_key(cmax, c < NC, K)
    picked = (cmax.to(tl.int64) >= T) & (c < NC)
    tl.store(list_ptr + r * NC + tl.cumsum(picked.to(tl.int32), axis=0) - 1, c, mask=picked)
    n_list = tl.sum(picked.to(tl.int32), axis=0)
    tl.debug_barrier()  # the list is read back below by other threads

    list_row = list_ptr + r * NC
    count = tl.full([], 0, tl.int32)
    for i in range(0, n_list, TILE):  # ids of the listed chunks' values at or above T, in column order, up to CAP
        col, ok, v = _listed_tile(x_row, list_row, i, n_list, V, words_row, rep, CHUNK, TILE, HAS_SEEN)
        keep = ok & (_key32(v).to(tl.int64) >= T) & (v > float("-inf"))
        at = count + tl.cumsum(keep.to(tl.int32), axis=0) - 1
        tl.store(out_ptr + r * CAP + at, col.to(tl.int64), mask=keep & (at < CAP))
        count += tl.sum(keep.to(tl.int32), axis=0)

    if count > CAP:  # too many at or above T: the exact top K, ties toward the lower id
        lo = T
        hi = tl.full([], 2147483647, tl.int64)
        for _ in range(32):  # the K-th largest finite value's key, over the listed chunks
            mid = lo + (hi - lo + 1) // 2
            n = tl.full([], 0, tl.int32)
            for i in range(0, n_list, TILE):
                col, ok, v = _listed_tile(x_row, list_row, i, n_list, V, words_row, rep, CHUNK, TILE, HAS_SEEN)
                n += tl.sum((ok & (_key32(v).to(tl.int64) >= mid) & (v > float("-inf"))).to(tl.int32), axis=0)
            lo = tl.where(n >= K, mid, lo)
            hi = tl.where(n >= K, hi, mid - 1)
        count = tl.full([], 0, tl.int32)
        for above in range(2):  # first the values above the K-th key, then those equal to it, in column order
            for i in range(0, n_list, TILE):
                col, ok, v = _listed_tile(x_row, list_row, i, n_list, V, words_row, rep, CHUNK, TILE, HAS_SEEN)
                key = _key32(v).to(tl.int64)
                keep = ok & (v > float("-inf")) & tl.where(above == 0, key > lo, key == lo)
                at = count + tl.cumsum(keep.to(tl.int32), axis=0) - 1
                tl.store(out_ptr + r * CAP + at, col.to(tl.int64), mask=keep & (at < K))
                count = tl.minimum(count + tl.sum(keep.to(tl.int32), axis=0), K)
    s = tl.arange(0, BLOCK_CAP)
    tl.store(out_ptr + r * CAP + s, tl.full([BLOCK_CAP], -1, tl.int64), mask=(s >= count) & (s < CAP))


def topk_candidates(x: torch.Tensor, k: int, rows: torch.Tensor | None = None, cap: int | None = None,
                    pdl: bool | None = None, seen: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """``x`` [B, V] float (last dim contiguous, rows may be strided); ``rows`` [R] int64 or None (every row) ->
    [R, cap] int64 ids, -1 where unused: for each row a superset of its top k finite values' ids (the reference's),
    in no particular order. ``cap`` (default ``default_cap(k)``) >= k. ``seen``: None, or (words [B, ceil(V / 32)]
    int32, penalty [B] fp32) to pick from ``reference.apply_seen(x, *seen)`` without making it. ``pdl``: see
    ``_util.use_pdl``, except that any row count may use it, as the argmax's (``_util``: a PDL launch between two
    decode graph replays)."""
    check("x", x, ndim=2, dtype=KERNEL_DTYPES)
    words, rep = check_seen(seen, x)
    cap = default_cap(k) if cap is None else cap
    if not 0 < k <= cap:
        raise ValueError(f"topk_candidates: k {k} must be in 1..cap ({cap})")
    if rows is not None:
        check("rows", rows, ndim=1, dtype=torch.int64)
    check_device(x=x, **({} if rows is None else {"rows": rows}), **({} if seen is None else {"words": words,
                                                                                               "penalty": rep}))
    if x.shape[1] > 1 and x.stride(1) != 1:
        raise ValueError("topk_candidates: x needs a contiguous last dimension")
    R = x.shape[0] if rows is None else rows.shape[0]
    V = x.shape[1]
    NC = cdiv(V, CHUNK)
    out = torch.empty(R, cap, dtype=torch.int64, device=x.device)
    if R == 0:
        return out
    maxima = torch.empty(R, NC, dtype=torch.int32, device=x.device)
    listed = torch.empty(R, NC, dtype=torch.int32, device=x.device)
    r = x if rows is None else rows  # a pointer for a launch without rows
    kw = pdl_args(x, 1, pdl)
    w = (maxima, 0, maxima) if seen is None else (words, words.stride(0), rep)  # (pointers a launch does not read)
    _chunk_max_kernel[(R, cdiv(NC, CHUNKS_PER_PROGRAM))](x, x.stride(0), r, V, maxima, NC, *w, CHUNK=CHUNK,
                                                         CHUNKS=CHUNKS_PER_PROGRAM, HAS_ROWS=rows is not None,
                                                         HAS_SEEN=seen is not None, num_warps=4, **kw)
    _select_kernel[(R,)](x, x.stride(0), r, V, maxima, NC, listed, out, k, cap, *w, CHUNK=CHUNK,
                         BLOCK_NC=max(16, next_pow2(NC)), TILE=TILE_CHUNKS, BLOCK_CAP=max(16, next_pow2(cap)),
                         HAS_ROWS=rows is not None, HAS_SEEN=seen is not None, num_warps=8, **kw)
    return out

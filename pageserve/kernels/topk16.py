"""Each row's ``sel`` highest 16-bit values (bf16 or fp16), as ids, ties at the cut toward the lower id: the
sampler's pick of a row's top-k candidates from its logits rounded to the model's dtype (``Sampler._candidates``).

Reference: ``pageserve.kernels.reference.topk_ids_16bit`` (the first ``sel`` of a stable descending sort). On the
H100, ``torch.topk`` of 256 bf16 rows of 151,936 took 0.40 ms (two digit-count passes of 0.09 ms and a gather of
0.18; diagnostics/sampling_bench_coarse_9748e4b), for 78 MB that one pass reads in ~0.03 ms.

A radix select over each value's 16-bit key (its bits mapped to an unsigned int that orders as the values do),
``CHUNK`` columns a program, in three launches that each read the rows once:
  1. each chunk's histogram of its keys' high bytes;
  2. each program finds its row's high byte ``b1`` holding the sel-th key (from the row's chunk histograms), then
     writes its chunk's histogram of the low bytes of the keys whose high byte is ``b1``;
  3. each program finds the sel-th key ``t`` the same way, and from the histograms how many keys above ``t`` and
     equal to it the chunks before its own hold; it writes its ids with keys above ``t`` after theirs, and those
     equal to ``t`` after all of the row's above-``t`` ones, in column order, while the row has room.
So the ids above ``t`` come in column order, then the ties at ``t`` with the lowest ids: the same set as the
reference (which orders them by value), and the same whatever the batch or the chunking.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._util import cdiv, check, check_device, next_pow2
from .reference import topk_ids_16bit as topk_ids_16bit_reference

__all__ = ["topk_ids_16bit", "topk_ids_16bit_reference"]

CHUNK = 16384  # columns a program covers: 10 chunks a row at V = 151,936
BLOCK = 1024  # columns a program reads at a time
MAX_CHUNKS = 64  # chunks a row may have (each program reads its row's [chunks, 256] histograms)


@triton.jit
def _keys(x_ptr, row, stride_x, j, V):
    """The 16-bit values at columns ``j`` of ``row`` as unsigned keys in [0, 65536) that order as the values do
    (a negative value's bits all flipped, a positive one's sign bit set), and which columns are in the row."""
    valid = j < V
    v = tl.load(x_ptr + row * stride_x + j, mask=valid, other=0.0)
    b = v.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    return tl.where(b >= 0x8000, b ^ 0xFFFF, b | 0x8000), valid


@triton.jit
def _cut(h, sel):
    """For a row's histogram ``h`` [256] of key bytes: the byte holding the sel-th highest key, and how many keys
    lie in the bytes above it."""
    bins = tl.arange(0, 256)
    at_or_above = tl.sum(h, axis=0) - tl.cumsum(h, axis=0) + h  # keys in byte b or above, per b
    b = tl.sum((at_or_above >= sel).to(tl.int32), axis=0) - 1
    return b, tl.sum(tl.where(bins > b, h, 0), axis=0)


@triton.jit
def _row_histograms(h_ptr, row, C, BLOCK_C: tl.constexpr):
    cs = tl.arange(0, BLOCK_C)
    bins = tl.arange(0, 256)
    return tl.load(h_ptr + (row * C + cs[:, None]) * 256 + bins[None, :], mask=cs[:, None] < C, other=0)


@triton.jit
def _high_kernel(x_ptr, h1_ptr, V, stride_x, C, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    # columns past the row count in byte 0, which no reader counts: the cut falls to byte 0 only when the bytes
    # above it hold fewer than sel keys whatever byte 0 holds, and the writer counts the bytes above the cut only
    h = tl.zeros([256], dtype=tl.int32)
    for s in range(0, CHUNK, BLOCK):
        j = c * CHUNK + s + tl.arange(0, BLOCK)
        u, valid = _keys(x_ptr, row, stride_x, j, V)
        h += tl.histogram(tl.where(valid, u >> 8, 0), 256)
    tl.store(h1_ptr + (row * C + c) * 256 + tl.arange(0, 256), h)


@triton.jit
def _low_kernel(x_ptr, h1_ptr, h2_ptr, V, stride_x, C, sel,
                CHUNK: tl.constexpr, BLOCK: tl.constexpr, BLOCK_C: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    b1, _ = _cut(tl.sum(_row_histograms(h1_ptr, row, C, BLOCK_C), axis=0), sel)
    h = tl.zeros([256], dtype=tl.int32)
    missing = tl.full([], 0, tl.int32)  # columns whose high byte is not b1 (or past the row): counted in byte 0, taken out below
    for s in range(0, CHUNK, BLOCK):
        j = c * CHUNK + s + tl.arange(0, BLOCK)
        u, valid = _keys(x_ptr, row, stride_x, j, V)
        hit = valid & ((u >> 8) == b1)
        h += tl.histogram(tl.where(hit, u & 255, 0), 256)
        missing += tl.sum((~hit).to(tl.int32), axis=0)
    h -= tl.where(tl.arange(0, 256) == 0, missing, 0)
    tl.store(h2_ptr + (row * C + c) * 256 + tl.arange(0, 256), h)


@triton.jit
def _write_kernel(x_ptr, h1_ptr, h2_ptr, out_ptr, V, stride_x, C, sel,
                  CHUNK: tl.constexpr, BLOCK: tl.constexpr, BLOCK_C: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    bins = tl.arange(0, 256)
    h1 = _row_histograms(h1_ptr, row, C, BLOCK_C)  # [BLOCK_C, 256]
    h2 = _row_histograms(h2_ptr, row, C, BLOCK_C)
    b1, above1 = _cut(tl.sum(h1, axis=0), sel)
    b2, _ = _cut(tl.sum(h2, axis=0), sel - above1)
    t = b1 * 256 + b2  # the sel-th highest key
    # per chunk: keys above t (a higher high byte, or b1 and a higher low byte), keys equal to t
    gt = tl.sum(tl.where(bins[None, :] > b1, h1, 0), axis=1) + tl.sum(tl.where(bins[None, :] > b2, h2, 0), axis=1)
    eq = tl.sum(tl.where(bins[None, :] == b2, h2, 0), axis=1)
    before = tl.arange(0, BLOCK_C) < c
    n_gt = tl.sum(gt, axis=0)  # < sel: t is the sel-th key
    gt_at = tl.sum(tl.where(before, gt, 0), axis=0)
    eq_at = n_gt + tl.sum(tl.where(before, eq, 0), axis=0)
    for s in range(0, CHUNK, BLOCK):
        j = c * CHUNK + s + tl.arange(0, BLOCK)
        u, valid = _keys(x_ptr, row, stride_x, j, V)
        above = (valid & (u > t)).to(tl.int32)
        tie = (valid & (u == t)).to(tl.int32)
        pos = gt_at + tl.cumsum(above, axis=0) - above
        tl.store(out_ptr + row * sel + pos, j.to(tl.int64), mask=above != 0)
        pos = eq_at + tl.cumsum(tie, axis=0) - tie
        tl.store(out_ptr + row * sel + pos, j.to(tl.int64), mask=(tie != 0) & (pos < sel))
        gt_at += tl.sum(above, axis=0)
        eq_at += tl.sum(tie, axis=0)


def topk_ids_16bit(x: torch.Tensor, sel: int, chunk: int | None = None, block: int | None = None) -> torch.Tensor:
    """x: [R, V] bf16 or fp16 (last dim contiguous, rows may be strided), 1 <= sel <= V -> [R, sel] int64: the ids
    of each row's ``sel`` highest values, ties at the cut toward the lower id (NaN above everything, -0 below +0,
    as their bits order), in no particular order. ``chunk`` / ``block``: columns a program covers / reads at a time
    (powers of two, block <= chunk; default ``CHUNK`` / ``BLOCK``)."""
    check("x", x, ndim=2, dtype=(torch.bfloat16, torch.float16))
    check_device(x=x)
    R, V = x.shape
    if not 1 <= sel <= V:
        raise ValueError(f"topk_ids_16bit: sel must be in [1, {V}], got {sel}")
    chunk, block = chunk or CHUNK, block or min(BLOCK, chunk or CHUNK)
    if block & (block - 1) or chunk & (chunk - 1) or block > chunk:
        raise ValueError(f"topk_ids_16bit: chunk {chunk} and block {block} must be powers of two, block <= chunk")
    C = cdiv(V, chunk)
    if C > MAX_CHUNKS or V >= 2**31:
        raise ValueError(f"topk_ids_16bit: rows of {V} columns exceed {chunk * MAX_CHUNKS}")
    out = torch.empty(R, sel, dtype=torch.int64, device=x.device)
    if R == 0:
        return out
    h1 = torch.empty(R, C, 256, dtype=torch.int32, device=x.device)
    h2 = torch.empty_like(h1)
    grid, block_c = (R, C), max(2, next_pow2(C))
    _high_kernel[grid](x, h1, V, x.stride(0), C, CHUNK=chunk, BLOCK=block, num_warps=4)
    _low_kernel[grid](x, h1, h2, V, x.stride(0), C, sel, CHUNK=chunk, BLOCK=block, BLOCK_C=block_c, num_warps=4)
    _write_kernel[grid](x, h1, h2, out, V, x.stride(0), C, sel, CHUNK=chunk, BLOCK=block, BLOCK_C=block_c,
                        num_warps=4)
    return out

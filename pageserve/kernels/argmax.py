"""Each row's argmax over a wide last dimension (the sampler's greedy and exponential-race
pick over the vocabulary), in two short launches.

Reference: ``pageserve.kernels.reference.argmax_rows`` (``torch.argmax(x, -1)``). On the H200
``torch.argmax`` over one 151,936-wide fp32 row took ~13-15 µs (a graphed step's time with and
without it, diagnostics/det_b1_switches_a599196), for 600 KB that sit in L2: a fixed cost
in every decode step at batch 1. Here ``V / BLOCK`` programs per row each take the max of
one block and its first index, then one program per row reduces those partials: the global
maximum, at the lowest index that holds it (as torch, which documents the first maximal
index). NaN counts as larger than any number, as in torch; a row holding both +inf and NaN
is where the two can differ (torch takes the first NaN, this the first of either).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .reference import argmax_rows as argmax_rows_reference
from ._util import KERNEL_DTYPES, cdiv, check, check_device, next_pow2, pdl_args, pdl_enter

__all__ = ["argmax_rows", "argmax_rows_reference"]

BLOCK = 2048  # columns a first-stage program reads (8 KB of fp32): 75 programs a row at V = 151,936
# from this many rows, twice as wide: on the H200 (bf16 [B, 151,936], argmax_kernel_ff78b7f) 4,096 columns took
# 6.8 / 11.3 / 19.2 / 43.4 µs at 64 / 128 / 200 / 512 rows against 2,048's 7.4 / 13.3 / 20.8 / 48.9, and one row
# 2.2 against 2.1
WIDE_ROWS, WIDE_BLOCK = 64, 4096
MAX_PARTS = 1024  # partials the second stage reduces in one tile: rows up to 2M wide


@triton.jit
def _argmax_partial_kernel(x_ptr, val_ptr, idx_ptr, V, stride_x, PARTS,
                           BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_enter(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    j = part * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(x_ptr + row * stride_x + j, mask=j < V, other=float("-inf")).to(tl.float32)
    v = tl.where(v != v, float("inf"), v)  # NaN above every number (torch's order); +inf ties it here
    top = tl.max(v, axis=0)
    first = tl.min(tl.where(v == top, j, V), axis=0)  # the block's first index holding its max
    tl.store(val_ptr + row * PARTS + part, top)
    tl.store(idx_ptr + row * PARTS + part, first)


@triton.jit
def _argmax_reduce_kernel(val_ptr, idx_ptr, out_ptr, V, PARTS,
                          BLOCK_P: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_enter(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    p = tl.arange(0, BLOCK_P)
    m = p < PARTS
    vals = tl.load(val_ptr + row * PARTS + p, mask=m, other=float("-inf"))
    idxs = tl.load(idx_ptr + row * PARTS + p, mask=m, other=V)
    top = tl.max(vals, axis=0)
    # blocks are in column order and each partial is its block's first maximal index, so the
    # smallest index among the partials equal to the row's max is the row's first one
    tl.store(out_ptr + row, tl.min(tl.where(vals == top, idxs, V), axis=0).to(tl.int64))


def default_block(rows: int) -> int:
    """Columns a first-stage program reads for ``rows`` rows (``BLOCK``, ``WIDE_BLOCK`` from ``WIDE_ROWS``):
    its own function so that the offline audit (scripts/t4_compile_audit.py) compiles the launch a step gets."""
    return WIDE_BLOCK if rows >= WIDE_ROWS else BLOCK


def argmax_rows(x: torch.Tensor, pdl: bool | None = None, block: int | None = None) -> torch.Tensor:
    """x: [B, V] float (last dim contiguous, rows may be strided) -> [B] int64, the index of each
    row's first maximum. ``pdl``: see ``_util.use_pdl``, except that any row count may use it.
    ``block``: columns a first-stage program reads, a power of two (default ``BLOCK``, ``WIDE_BLOCK`` from
    ``WIDE_ROWS`` rows)."""
    check("x", x, ndim=2, dtype=KERNEL_DTYPES)
    check_device(x=x)
    B, V = x.shape
    if V == 0:
        raise ValueError("argmax_rows: a row needs at least one column")
    if block is None:
        block = default_block(B)
    if block < 16 or block & (block - 1):
        raise ValueError(f"argmax_rows: block must be a power of two >= 16, got {block}")
    if V >= 2**31 or cdiv(V, block) > MAX_PARTS:
        raise ValueError(f"argmax_rows: rows of {V} columns exceed {block * MAX_PARTS}")
    out = torch.empty(B, dtype=torch.int64, device=x.device)
    if B == 0:
        return out
    parts = cdiv(V, block)
    vals = torch.empty(B, parts, dtype=torch.float32, device=x.device)
    idxs = torch.empty(B, parts, dtype=torch.int32, device=x.device)
    # under PDL at any row count (every other decode kernel stops at PDL_MAX_TOKENS rows): launched so
    # right after a graph replay, it made that graph's next replays 0.14-0.16 ms faster at 2-64 rows,
    # tokens unchanged (H200, one engine, diagnostics/argmax_ab_c6f794a.*; mechanism unknown)
    kw = pdl_args(x, 1, pdl)
    _argmax_partial_kernel[(B, parts)](x, vals, idxs, V, x.stride(0), parts, BLOCK=block, num_warps=4 if block <= 4096 else 8, **kw)
    _argmax_reduce_kernel[(B,)](vals, idxs, out, V, parts, BLOCK_P=max(16, next_pow2(parts)), num_warps=4, **kw)
    return out

"""LoRA's first product for a batch of rows that each use their own adapter slot, masked, in one launch.

Reference: ``pageserve.kernels.reference.lora_shrink``: every row's product with every slot's stacked A
(``linear``), then a select that keeps only the columns of the row's own slot. That is two launches a projection,
four with the second product and its add; at the 3B shape's 36 layers x 4 fused projections a decode step with
LoRA on ran ~600 more kernels than without, and cost 1.53x the plain step at batch 1 and 1.66x at 64 (H100,
session 47, ``scripts/lora_bench.py``). Here each program computes a [BLOCK_M, BLOCK_N] tile of the product and
writes zeros where a row's slot does not own the column; a tile that no row of its block needs (every row of no
adapter, or of other slots) skips its K loop and writes zeros without reading A. The second product and its add
are one ``addmm_`` (``model.lora.LoRASlots.add``).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .reference import lora_shrink as lora_shrink_reference
from ._util import KERNEL_DTYPES, cdiv, check, check_device, dot_precision, dot_upcast, mma

__all__ = ["lora_shrink", "lora_shrink_reference"]

BLOCK_N = 64
BLOCK_K = 64


@triton.jit
def _lora_shrink_kernel(x_ptr, a_ptr, slots_ptr, out_ptr, T, K, C, width, stride_x, stride_a, stride_out,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        PREC: tl.constexpr, UPCAST: tl.constexpr):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    c0 = tl.program_id(1) * BLOCK_N
    rn = c0 + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    in_m, in_n = rm < T, rn < C
    slot = tl.load(slots_ptr + rm, mask=in_m, other=-1)
    # the slots whose columns this tile holds: c0 // width .. (c0 + BLOCK_N - 1) // width
    wanted = (slot >= c0 // width) & (slot <= (c0 + BLOCK_N - 1) // width)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if tl.sum(wanted.to(tl.int32), axis=0) > 0:
        x_rows = x_ptr + rm.to(tl.int64)[:, None] * stride_x
        a_cols = a_ptr + rn.to(tl.int64)[None, :] * stride_a
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + rk
            xt = tl.load(x_rows + kk[None, :], mask=in_m[:, None] & (kk[None, :] < K), other=0.0)
            at = tl.load(a_cols + kk[:, None], mask=in_n[None, :] & (kk[:, None] < K), other=0.0)
            acc += mma(xt, at, PREC, UPCAST)
    own = (rn[None, :] // width) == slot[:, None]
    acc = tl.where(own, acc, 0.0)
    tl.store(out_ptr + rm.to(tl.int64)[:, None] * stride_out + rn[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=in_m[:, None] & in_n[None, :])


def block_m_for(rows: int) -> int:
    """Rows a program covers: 16 (the smallest ``tl.dot`` tile) up to 64 rows, 64 above."""
    return 16 if rows <= 64 else 64


def lora_shrink(x: torch.Tensor, a: torch.Tensor, token_slots: torch.Tensor, width: int) -> torch.Tensor:
    """[T, C]: ``x`` [T, K] @ ``a`` [C, K]^T where column c belongs to slot ``c // width`` and row t keeps only
    the columns of its slot ``token_slots[t]`` (-1, or any slot with no columns: a row of zeros). ``token_slots``:
    [>= T] int64 (its first T entries are read). x and a: one float dtype, last dim contiguous."""
    check("x", x, ndim=2, dtype=KERNEL_DTYPES)
    check("a", a, ndim=2, dtype=(x.dtype,))
    check("token_slots", token_slots, ndim=1, dtype=torch.int64)
    check_device(x=x, a=a, token_slots=token_slots)
    T, K = x.shape
    C = a.shape[0]
    if a.shape[1] != K:
        raise ValueError(f"lora_shrink: x has {K} columns but a has {a.shape[1]}")
    if token_slots.shape[0] < T:
        raise ValueError(f"lora_shrink: {T} rows but {token_slots.shape[0]} slots")
    if width <= 0:
        raise ValueError(f"lora_shrink: width must be positive, got {width}")
    out = torch.empty(T, C, dtype=x.dtype, device=x.device)
    if T and C:
        bm = block_m_for(T)
        _lora_shrink_kernel[(cdiv(T, bm), cdiv(C, BLOCK_N))](
            x, a, token_slots, out, T, K, C, width, x.stride(0), a.stride(0), out.stride(0),
            BLOCK_M=bm, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, PREC=dot_precision(x.dtype), UPCAST=dot_upcast(x.dtype),
            num_warps=4)
    return out

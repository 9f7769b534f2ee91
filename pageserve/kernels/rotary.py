"""Rotate-half RoPE on q and k in one launch: one program per token, all heads.

Reference: ``reference.rotary``. q and k may be strided views (the model splits them out
of the fused qkv output); the last dimension must be contiguous.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import reference
from ._util import KERNEL_DTYPES, check, check_device, next_pow2, pdl_args, pdl_enter

rotary_reference = reference.rotary


@triton.jit
def rope_first_half(x1, x2, cos, sin):
    """Rotate-half RoPE's first half, x1 cos - x2 sin, in fp32 as one FMA over one product. Every kernel
    that rotates (this module's, ``rope_kv``'s, ``paged_decode``'s) spells it this way, so all round it
    alike: left to the compiler, which product goes into the FMA follows the code around it (on the H200
    two kernels' fp32 bits of the same formula differed, NOTES.md session 34)."""
    return tl.fma(x1, cos, -(x2 * sin))


@triton.jit
def rope_second_half(x1, x2, cos, sin):
    """Rotate-half RoPE's second half, x2 cos + x1 sin, as ``rope_first_half`` spells it."""
    return tl.fma(x2, cos, x1 * sin)


@triton.jit
def _rotate_heads(x_ptr, o_ptr, t, H, stride_xt, stride_xh, stride_ot, stride_oh, cos, sin, d, dmask,
                  HALF: tl.constexpr, BLOCK_H: tl.constexpr):
    h = tl.arange(0, BLOCK_H)
    mask = (h < H)[:, None] & dmask[None, :]
    src = x_ptr + t * stride_xt + h[:, None] * stride_xh + d[None, :]
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    dst = o_ptr + t * stride_ot + h[:, None] * stride_oh + d[None, :]
    tl.store(dst, rope_first_half(x1, x2, cos[None, :], sin[None, :]).to(o_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + HALF, rope_second_half(x1, x2, cos[None, :], sin[None, :]).to(o_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _cos_sin(cs_ptr, pos_ptr, t, stride_cs, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """Token t's position's cos and sin rows (fp32, [BLOCK_HALF]) and the lane index and mask."""
    pos = tl.load(pos_ptr + t).to(tl.int64)
    d = tl.arange(0, BLOCK_HALF)
    dmask = d < HALF
    cos = tl.load(cs_ptr + pos * stride_cs + d, mask=dmask, other=0.0).to(tl.float32)
    sin = tl.load(cs_ptr + pos * stride_cs + HALF + d, mask=dmask, other=0.0).to(tl.float32)
    return cos, sin, d, dmask


@triton.jit
def _rotary_kernel(
    q_ptr, k_ptr, qo_ptr, ko_ptr, pos_ptr, cs_ptr,
    HQ, HKV, stride_qt, stride_qh, stride_kt, stride_kh,
    stride_qot, stride_qoh, stride_kot, stride_koh, stride_cs,
    HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HKV: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_enter(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    cos, sin, d, dmask = _cos_sin(cs_ptr, pos_ptr, t, stride_cs, HALF, BLOCK_HALF)
    _rotate_heads(q_ptr, qo_ptr, t, HQ, stride_qt, stride_qh, stride_qot, stride_qoh, cos, sin, d, dmask, HALF, BLOCK_HQ)
    _rotate_heads(k_ptr, ko_ptr, t, HKV, stride_kt, stride_kh, stride_kot, stride_koh, cos, sin, d, dmask, HALF, BLOCK_HKV)


def rotary(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, inplace: bool = False,
    pdl: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [T, Hq, D], k: [T, Hkv, D], positions: [T] int, cos_sin: [max_pos, D] fp32 (cos|sin).
    Returns rotated (q, k): new contiguous tensors, or q and k themselves when ``inplace``.
    ``pdl``: see ``_util.use_pdl``."""
    check("q", q, ndim=3, dtype=KERNEL_DTYPES)
    T, Hq, D = q.shape
    check("k", k, shape=(T, None, D), dtype=q.dtype)
    check("positions", positions, shape=(T,), dtype=(torch.int32, torch.int64), last_contiguous=False)
    check("cos_sin", cos_sin, shape=(None, D), dtype=torch.float32)
    check_device(q=q, k=k, positions=positions, cos_sin=cos_sin)
    if D % 2:
        raise ValueError(f"head_dim must be even, got {D}")
    if positions.stride(0) != 1:
        positions = positions.contiguous()
    Hkv = k.shape[1]
    qo, ko = (q, k) if inplace else (torch.empty((T, Hq, D), dtype=q.dtype, device=q.device),
                                     torch.empty((T, Hkv, D), dtype=k.dtype, device=k.device))
    if T == 0:
        return qo, ko
    half = D // 2
    _rotary_kernel[(T,)](
        q, k, qo, ko, positions, cos_sin, Hq, Hkv,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        qo.stride(0), qo.stride(1), ko.stride(0), ko.stride(1), cos_sin.stride(0),
        HALF=half, BLOCK_HALF=next_pow2(half), BLOCK_HQ=next_pow2(Hq), BLOCK_HKV=next_pow2(Hkv),
        num_warps=4, **pdl_args(q, T, pdl),
    )
    return qo, ko

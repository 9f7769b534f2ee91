"""RMSNorm and fused residual-add + RMSNorm: one program per row.

Reference: ``reference.rms_norm`` / ``reference.add_rms_norm``. Rounding follows the
reference: the residual sum is rounded to the storage dtype before it is normalised,
the normalised row is rounded before the weight multiplies it.

x may also arrive as a split-K product's partials (``gemv.SplitSum``: the decode GEMV of the
down projection, whose reduce kernel this sum replaces), summed and rounded as that kernel does.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import reference
from .gemv import SplitSum
from ._util import (KERNEL_DTYPES, check, check_device, next_pow2, pdl_args, pdl_enter_after_inputs,
                    pdl_enter_before_inputs)

rms_norm_reference = reference.rms_norm
add_rms_norm_reference = reference.add_rms_norm


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, scale_ptr,
    H, stride_x, stride_r, stride_o, stride_ro, stride_split, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr,
    PARTS: tl.constexpr, QUANT: tl.constexpr,
):
    pdl_enter_before_inputs(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < H
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)  # a weight: before the wait
    if QUANT:
        scale = tl.load(scale_ptr + cols, mask=mask, other=0.0).to(tl.float32)  # a weight too
    pdl_enter_after_inputs(USE_PDL)
    if PARTS > 0:  # x is a split-K product's partials (gemv.SplitSum): the reduce kernel's sum, rounded once
        acc = tl.zeros([BLOCK], tl.float32)
        for s in tl.static_range(PARTS):
            acc += tl.load(x_ptr + s * stride_split + row * stride_x + cols, mask=mask, other=0.0)
        if QUANT:
            acc = acc * scale
        x = acc.to(out_ptr.dtype.element_ty).to(tl.float32)
    else:
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        s = (x + r).to(res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * stride_ro + cols, s, mask=mask)
        x = s.to(tl.float32)
    var = tl.sum(x * x, axis=0) / H
    rstd = 1.0 / tl.sqrt(var + eps)
    normed = (x * rstd).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (normed * w).to(out_ptr.dtype.element_ty), mask=mask)


def _check_x(x: "torch.Tensor | SplitSum") -> tuple[torch.Tensor, torch.Tensor | None, torch.dtype]:
    """x as the kernel reads it: (a [T, H] tensor, or a ``SplitSum``'s [splits, T, H] partials; the
    int8 scale or None; the output dtype)."""
    if isinstance(x, SplitSum):
        check("x.parts", x.parts, ndim=3, dtype=torch.float32)
        if not x.parts.is_contiguous():
            raise ValueError("x.parts: the split-K partials must be contiguous [splits, T, H]")
        if x.dtype not in KERNEL_DTYPES:
            raise ValueError(f"x.dtype: {x.dtype} not in {[str(d) for d in KERNEL_DTYPES]}")
        if x.scale is not None:
            check("x.scale", x.scale, shape=(x.parts.shape[2],), dtype=x.dtype)
        return x.parts, x.scale, x.dtype
    check("x", x, ndim=2, dtype=KERNEL_DTYPES)
    return x, None, x.dtype


def _launch(x, residual, weight, eps, out, residual_out, pdl):
    xt, scale, dtype = _check_x(x)
    parts = xt.shape[0] if isinstance(x, SplitSum) else 0
    T, H = xt.shape[-2:]
    check("weight", weight, shape=(H,), dtype=KERNEL_DTYPES)
    tensors = dict(x=xt, weight=weight)
    if scale is not None:
        tensors["scale"] = scale
    if residual is not None:
        check("residual", residual, shape=(T, H), dtype=dtype)
        tensors["residual"] = residual
    check_device(**tensors)
    out = torch.empty((T, H), dtype=dtype, device=xt.device) if out is None else out
    check("out", out, shape=(T, H), dtype=dtype)
    if residual is not None:
        residual_out = torch.empty_like(out) if residual_out is None else residual_out
        check("residual_out", residual_out, shape=(T, H), dtype=dtype)
    if T == 0:
        return out, residual_out
    BLOCK = next_pow2(H)
    num_warps = 4 if BLOCK <= 2048 else 8
    ro = residual_out if residual is not None else out
    r = residual if residual is not None else out  # unused pointers point at something valid
    _rms_norm_kernel[(T,)](
        xt, r, weight, out, ro, scale if scale is not None else weight, H, xt.stride(-2), r.stride(0), out.stride(0),
        ro.stride(0), xt.stride(0) if parts else 0, float(eps),
        HAS_RESIDUAL=residual is not None, BLOCK=BLOCK, num_warps=num_warps, PARTS=parts, QUANT=scale is not None,
        **pdl_args(xt, T, pdl),
    )
    return out, residual_out


def rms_norm(x: "torch.Tensor | SplitSum", weight: torch.Tensor, eps: float, out: torch.Tensor | None = None,
             pdl: bool | None = None) -> torch.Tensor:
    """x: [T, H] -> [T, H] (dtype of x). x may be a split-K product's ``gemv.SplitSum``, summed here
    exactly as its reduce kernel would have (``reference.split_sum``). ``pdl``: see ``_util.use_pdl``."""
    return _launch(x, None, weight, eps, out, None, pdl)[0]


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
    out: torch.Tensor | None = None, residual_out: torch.Tensor | None = None, pdl: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """residual' = x + residual; returns (rms_norm(residual'), residual'). One pass:
    reads x, residual, weight once, writes both outputs once. ``residual_out`` may be
    ``residual`` itself (in place). x may be a ``gemv.SplitSum`` (as in ``rms_norm``).
    ``pdl``: see ``_util.use_pdl``."""
    return _launch(x, residual, weight, eps, out, residual_out, pdl)

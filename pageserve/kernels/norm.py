"""RMSNorm and fused residual-add + RMSNorm: one program per row.

Reference: ``reference.rms_norm`` / ``reference.add_rms_norm``. Rounding follows the
reference: the residual sum is rounded to the storage dtype before it is normalised,
the normalised row is rounded before the weight multiplies it.

x may also arrive as a product's K-slice partials (``SplitSum``: a decoder layer's down projection, and
optionally its o projection, as one batched cuBLAS call over K slices, ``TritonOps(split_to_norm=)``),
added here in slice order and rounded once to the output dtype before the residual add: the work of a
split-K reduce launch, done by the kernel that reads the product anyway.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from . import reference
from ._util import (KERNEL_DTYPES, check, check_device, next_pow2, pdl_args, pdl_enter_after_inputs,
                    pdl_enter_before_inputs)

rms_norm_reference = reference.rms_norm
add_rms_norm_reference = reference.add_rms_norm


@dataclass(frozen=True)
class SplitSum:
    """A product left as its K slices' fp32 partials for the norm that reads it next to sum:
    ``parts`` [slices, T, H] fp32, contiguous; ``dtype``: the product's own (x's). The sum is
    ``reference.split_sum``: slices added in order, rounded once to ``dtype``."""

    parts: torch.Tensor
    dtype: torch.dtype

    @property
    def shape(self) -> torch.Size:
        return self.parts.shape[1:]

    @property
    def device(self) -> torch.device:
        return self.parts.device


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr,
    H, stride_x, stride_r, stride_o, stride_ro, stride_part, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr, PARTS: tl.constexpr = 0,
):
    pdl_enter_before_inputs(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < H
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)  # a weight: before the wait
    pdl_enter_after_inputs(USE_PDL)
    if PARTS > 0:  # x is a SplitSum's partials: summed in slice order, rounded once to the output dtype
        acc = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
        for p in tl.static_range(1, PARTS):
            acc += tl.load(x_ptr + p * stride_part + row * stride_x + cols, mask=mask, other=0.0)
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


def norm_launch(H: int) -> tuple[int, int]:
    """(BLOCK, warps) of a row of H: its own function so that the offline audit
    (scripts/t4_compile_audit.py) compiles the launch a step gets."""
    block = next_pow2(H)
    return block, 4 if block <= 2048 else 8


def _rows(x: "torch.Tensor | SplitSum") -> tuple[torch.Tensor, int, torch.dtype]:
    """x as the kernel reads it: ([T, H], or a SplitSum's [slices, T, H] partials; the slice count, 0
    for a plain tensor; the output dtype)."""
    if isinstance(x, SplitSum):
        check("x.parts", x.parts, ndim=3, dtype=(torch.float32,))
        if not x.parts.is_contiguous():
            raise ValueError("x.parts: a SplitSum's partials must be contiguous [slices, T, H]")
        if x.dtype not in KERNEL_DTYPES:
            raise ValueError(f"x.dtype: {x.dtype} not in {[str(d) for d in KERNEL_DTYPES]}")
        return x.parts, x.parts.shape[0], x.dtype
    check("x", x, ndim=2, dtype=KERNEL_DTYPES)
    return x, 0, x.dtype


def _launch(x, residual, weight, eps, out, residual_out, pdl):
    xt, parts, dtype = _rows(x)
    T, H = xt.shape[-2:]
    check("weight", weight, shape=(H,), dtype=KERNEL_DTYPES)
    tensors = dict(x=xt, weight=weight)
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
    BLOCK, num_warps = norm_launch(H)
    ro = residual_out if residual is not None else out
    r = residual if residual is not None else out  # unused pointers point at something valid
    _rms_norm_kernel[(T,)](
        xt, r, weight, out, ro, H, xt.stride(-2), r.stride(0), out.stride(0), ro.stride(0),
        xt.stride(0) if parts else 0, float(eps),
        HAS_RESIDUAL=residual is not None, BLOCK=BLOCK, num_warps=num_warps, PARTS=parts, **pdl_args(xt, T, pdl),
    )
    return out, residual_out


def rms_norm(x: "torch.Tensor | SplitSum", weight: torch.Tensor, eps: float, out: torch.Tensor | None = None,
             pdl: bool | None = None) -> torch.Tensor:
    """x: [T, H] (or a ``SplitSum``, summed first as ``reference.split_sum``) -> [T, H] (dtype of x).
    ``pdl``: see ``_util.use_pdl``."""
    return _launch(x, None, weight, eps, out, None, pdl)[0]


def add_rms_norm(
    x: "torch.Tensor | SplitSum", residual: torch.Tensor, weight: torch.Tensor, eps: float,
    out: torch.Tensor | None = None, residual_out: torch.Tensor | None = None, pdl: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """residual' = x + residual; returns (rms_norm(residual'), residual'). One pass:
    reads x, residual, weight once, writes both outputs once. ``residual_out`` may be
    ``residual`` itself (in place). x may be a ``SplitSum`` (as in ``rms_norm``). ``pdl``: see
    ``_util.use_pdl``."""
    return _launch(x, residual, weight, eps, out, residual_out, pdl)

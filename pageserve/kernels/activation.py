"""Fused SiLU(gate) * up over the fused gate|up projection output.

Reference: ``reference.silu_and_mul``. The kernel computes in fp32 and rounds once.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import reference
from ._util import KERNEL_DTYPES, check, check_device, cdiv, pdl_args, pdl_enter

silu_and_mul_reference = reference.silu_and_mul


@triton.jit
def silu_mul_f32(g, u):
    """SiLU(g) * u in fp32: the one expression every SiLU·mul of the deterministic mode computes
    (this kernel, and the invariant matmul's gate_up epilogue), so both round alike."""
    return g / (1.0 + tl.exp(-g)) * u


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, I, stride_x, stride_o, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_enter(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < I
    g = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * stride_x + I + cols, mask=mask, other=0.0).to(tl.float32)
    y = silu_mul_f32(g, u)
    tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(gate_up: torch.Tensor, out: torch.Tensor | None = None, pdl: bool | None = None) -> torch.Tensor:
    """gate_up: [T, 2I] -> [T, I]. ``pdl``: see ``_util.use_pdl``."""
    check("gate_up", gate_up, ndim=2, dtype=KERNEL_DTYPES)
    check_device(gate_up=gate_up)
    T, I2 = gate_up.shape
    if I2 % 2:
        raise ValueError(f"gate_up: last dim must be even (gate|up), got {I2}")
    I = I2 // 2
    out = torch.empty((T, I), dtype=gate_up.dtype, device=gate_up.device) if out is None else out
    check("out", out, shape=(T, I), dtype=gate_up.dtype)
    if T == 0:
        return out
    BLOCK = 1024 if I >= 1024 else 128
    _silu_and_mul_kernel[(T, cdiv(I, BLOCK))](gate_up, out, I, gate_up.stride(0), out.stride(0), BLOCK=BLOCK,
                                              num_warps=4, **pdl_args(gate_up, T, pdl))
    return out

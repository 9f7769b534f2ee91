"""The MLP's gate|up product with SiLU·mul in its epilogue, for prefill-sized row counts:
out[M, I] = SiLU(x @ gate^T) * (x @ up^T), where w = [gate; up] is the [2I, K] gate|up matrix.

Reference: ``reference.gate_up_silu_reference`` (the product, each half rounded to the dtype,
then ``reference.silu_and_mul``: what cuBLAS followed by the SiLU·mul kernel computes).

Why a kernel of its own. ``matmul_invariant(silu_mul=True)`` gives each program a gate tile and
the matching up tile, two accumulators and two MMA chains a K step; at ~8k rows that measured
slower than cuBLAS followed by the SiLU·mul kernel (NOTES.md, 00ce090: 256 x (64 + 64) tiles).
Here a program's weight tile holds gate and up rows interleaved -- tile row 2j is gate row
n0 + j, row 2j + 1 is up row n0 + j -- so one MMA chain the full width of the tile computes
both halves, and the epilogue splits the accumulator's column pairs with ``tl.split`` (in the
MMA's accumulator layout a thread holds adjacent columns, so the split moves no data). The
[M, 2I] intermediate is never written, and the SiLU·mul launch is gone.

Two load paths, one MMA chain (the bits are the same on the GPU, where each output element is
the same chain of k16 MMAs over K whatever the tile):
- pointers: the tile's rows gathered by index (each row's BLOCK_K elements are contiguous, so
  the interleave costs the loads nothing);
- TMA: a 3-D descriptor over w viewed as [I, 2, K] (strides K, I*K, 1), whose [BLOCK_N / 2, 2,
  BLOCK_K] box is the interleaved tile (Hopper; ``_tma_ok``).
The gate and up sums are each rounded to the output dtype before SiLU·mul (``silu_mul_f32``, the
expression the separate kernel computes), so the result is bitwise what the two-launch path
gives wherever the products agree bitwise.
"""
from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from . import reference
from ._util import (cdiv, check, check_linear, dot_precision, dot_upcast, grouped_tile, pdl_args, pdl_enter,
                    sm_count_for)
from .activation import silu_mul_f32
from .matmul_invariant import InvariantMatmulConfig, TensorDescriptor, _acc_dot, _tma_ok, fit_shared_memory, smem_budget

gate_up_silu_reference = reference.gate_up_silu_reference

# BLOCK_N counts the tile's weight rows: BLOCK_N / 2 output columns, their gate and up rows. The H200's best
# (diagnostics/gate_up_silu_probe_{83d553f,c3d080f}.*): the persistent walk, 128 x 256 x 64, 3 stages -- 974 us at
# 8,192 rows of the 3B gate_up where the same tile one program a tile took 1,195 and cuBLAS's product alone 943;
# 4 stages, GROUP_M 16, BLOCK_K 128 slower, 256 x 256 with 16 warps out of registers. Off Hopper (no TMA) the
# pointer kernel at the same tile, shrunk to the GPU's shared memory.
DEFAULT_CONFIG = InvariantMatmulConfig(128, 256, 64, 8, 3, tma=True, persistent=True)
INTERPRETER_CONFIG = InvariantMatmulConfig(16, 32, 32, 4, 2)


@triton.jit
def _silu_pairs(acc, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, out_ty: tl.constexpr):
    """[BLOCK_M, BLOCK_N] sums with gate and up in alternate columns -> SiLU(gate) * up,
    [BLOCK_M, BLOCK_N / 2], each sum rounded to ``out_ty`` first."""
    gate, up = tl.split(tl.reshape(acc, [BLOCK_M, BLOCK_N // 2, 2]))
    return silu_mul_f32(gate.to(out_ty).to(tl.float32), up.to(out_ty).to(tl.float32)).to(out_ty)


@triton.jit
def _store(out_ptr, y, pid_m, pid_n, M, I, stride_om, BLOCK_M: tl.constexpr, HALF: tl.constexpr):
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n = pid_n * HALF + tl.arange(0, HALF)
    tl.store(out_ptr + m.to(tl.int64)[:, None] * stride_om + n[None, :], y, mask=(m < M)[:, None] & (n < I)[None, :])


# M not specialized: eager prefill steps' row counts vary, and each specialization would be a compile
@triton.jit(do_not_specialize=["M"])
def _gate_up_silu_kernel(
    x_ptr, w_ptr, out_ptr, M, I, K, stride_xm, stride_wn, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    PREC: tl.constexpr, UPCAST: tl.constexpr, USE_PDL: tl.constexpr,
):
    HALF: tl.constexpr = BLOCK_N // 2
    pid_m, pid_n = grouped_tile(tl.program_id(0), M, I, BLOCK_M, HALF, GROUP_M)
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    c = tl.arange(0, BLOCK_N)
    col = pid_n * HALF + c // 2  # the output column of tile row c: its gate row, or (odd c) its up row
    mmask, cmask = m < M, col < I
    x_rows = x_ptr + m.to(tl.int64)[:, None] * stride_xm
    w_rows = w_ptr + (col + (c % 2) * I).to(tl.int64)[:, None] * stride_wn
    pdl_enter(USE_PDL)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        kmask = k < K
        a = tl.load(x_rows + k[None, :], mask=mmask[:, None] & kmask[None, :], other=0.0)
        b = tl.load(w_rows + k[None, :], mask=cmask[:, None] & kmask[None, :], other=0.0)
        acc = _acc_dot(a, b, acc, PREC, UPCAST)
    y = _silu_pairs(acc, BLOCK_M, BLOCK_N, out_ptr.dtype.element_ty)
    _store(out_ptr, y, pid_m, pid_n, M, I, stride_om, BLOCK_M, HALF)


@triton.jit
def _tma_tile_sums(x_desc, w_desc, pid_m, pid_n, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr):
    """The tile's [BLOCK_M, BLOCK_N] fp32 sums, gate and up in alternate columns, through TMA: rows past
    M, columns past K and output columns past I come back as zeros (the descriptors' bounds)."""
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        a = x_desc.load([pid_m * BLOCK_M, k0])  # [BLOCK_M, BLOCK_K]
        b = tl.reshape(w_desc.load([pid_n * (BLOCK_N // 2), 0, k0]), [BLOCK_N, BLOCK_K])  # [BLOCK_N / 2, 2, BLOCK_K]
        acc = _acc_dot(a, b, acc, PREC, UPCAST)
    return acc


@triton.jit(do_not_specialize=["M"])
def _gate_up_silu_tma_kernel(
    x_desc, w_desc, out_ptr, M, I, K, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    PREC: tl.constexpr, UPCAST: tl.constexpr, USE_PDL: tl.constexpr,
):
    pid_m, pid_n = grouped_tile(tl.program_id(0), M, I, BLOCK_M, BLOCK_N // 2, GROUP_M)
    pdl_enter(USE_PDL)
    acc = _tma_tile_sums(x_desc, w_desc, pid_m, pid_n, K, BLOCK_M, BLOCK_N, BLOCK_K, PREC, UPCAST)
    y = _silu_pairs(acc, BLOCK_M, BLOCK_N, out_ptr.dtype.element_ty)
    _store(out_ptr, y, pid_m, pid_n, M, I, stride_om, BLOCK_M, BLOCK_N // 2)


@triton.jit(do_not_specialize=["M"])
def _gate_up_silu_persistent_kernel(
    x_desc, w_desc, out_desc, M, I, K, num_programs,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    PREC: tl.constexpr, UPCAST: tl.constexpr, USE_PDL: tl.constexpr,
):
    # the TMA kernel's tile for tiles pid, pid + num_programs, ...: one launch wave, the tile loop
    # flattened into the K loop so that the next tile's first loads are in flight during this
    # one's epilogue, and the output stored through a descriptor (rows past M and columns past I
    # are dropped by its bounds). The same K loop from zero each tile: the same bits.
    HALF: tl.constexpr = BLOCK_N // 2
    num_tiles = tl.cdiv(M, BLOCK_M) * tl.cdiv(I, HALF)
    pdl_enter(USE_PDL)
    for tile in tl.range(tl.program_id(0), num_tiles, num_programs, flatten=True):
        pid_m, pid_n = grouped_tile(tile, M, I, BLOCK_M, HALF, GROUP_M)
        acc = _tma_tile_sums(x_desc, w_desc, pid_m, pid_n, K, BLOCK_M, BLOCK_N, BLOCK_K, PREC, UPCAST)
        out_desc.store([pid_m * BLOCK_M, pid_n * HALF], _silu_pairs(acc, BLOCK_M, BLOCK_N, out_desc.dtype))


def gate_up_silu_config(x: torch.Tensor) -> InvariantMatmulConfig:
    """The launch config: ``DEFAULT_CONFIG`` (persistent only where TMA can run: Hopper-class GPUs)
    shrunk to the device's shared memory (a T4's 64 KB); the interpreter a small tile."""
    if not x.is_cuda:
        return INTERPRETER_CONFIG
    cfg = DEFAULT_CONFIG
    if TensorDescriptor is None or torch.cuda.get_device_capability(x.device)[0] < 9:
        cfg = dataclasses.replace(cfg, tma=False, persistent=False)
    return fit_shared_memory(cfg, x.dtype, smem_budget(x))


def gate_up_silu(x: torch.Tensor, w: torch.Tensor, *, out: torch.Tensor | None = None,
                 config: InvariantMatmulConfig | None = None, pdl: bool | None = None) -> torch.Tensor:
    """x: [M, K], w: the gate|up matrix [2I, K] (gate rows first) -> SiLU(x @ gate^T) * (x @ up^T):
    [M, I] in x's dtype (fp32, fp16, bf16), fp32 accumulation. ``out``: a [M, I] buffer to write
    (row stride free). ``config``: the tile (``block_n`` counts weight rows: half of them gate,
    half up; ``tma`` uses the descriptor path where ``_tma_ok``; ``persistent`` (with ``tma``) one
    program per SM walking the tiles, the output stored through a descriptor).
    ``pdl``: see ``_util.use_pdl``. No host syncs: safe to capture in a CUDA graph."""
    M, N2, K = check_linear(x, w, None, "w")
    if N2 % 2:
        raise ValueError(f"w must stack gate and up rows (an even row count), got {N2}")
    I = N2 // 2
    out = torch.empty((M, I), dtype=x.dtype, device=x.device) if out is None else out
    check("out", out, shape=(M, I), dtype=x.dtype)
    if M == 0 or I == 0:
        return out
    if K == 0:
        return out.zero_()  # SiLU(0) * 0
    cfg = config or gate_up_silu_config(x)
    if cfg.block_n < 2 or cfg.block_n & (cfg.block_n - 1):
        raise ValueError(f"block_n must be a power of two >= 2 (gate and up rows), got {cfg.block_n}")
    half = cfg.block_n // 2
    grid = (cdiv(M, cfg.block_m) * cdiv(I, half),)
    consts = dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
                  PREC=dot_precision(x.dtype), UPCAST=dot_upcast(x.dtype, ordered=True),
                  num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_args(x, M, pdl))
    tma = cfg.tma and _tma_ok(x, w) and (w.stride(0) * I * w.element_size()) % 16 == 0
    if cfg.persistent and not (tma and _tma_ok(out, out)) and config is None:
        cfg = dataclasses.replace(cfg, persistent=False)  # the default tile, one program a tile (TMA loads where they fit)
    elif cfg.persistent and not (tma and _tma_ok(out, out)):
        raise ValueError("gate_up_silu: the persistent variant needs TMA descriptors (tma=True, a Hopper-class GPU, "
                         "16-byte aligned rows)")
    if tma:
        x_desc = TensorDescriptor(x, [M, K], [x.stride(0), 1], [cfg.block_m, cfg.block_k])
        # w as [I, 2, K]: box [half, 2, BLOCK_K] = gate and up rows of half output columns, interleaved
        w_desc = TensorDescriptor(w, [I, 2, K], [w.stride(0), I * w.stride(0), 1], [half, 2, cfg.block_k])
        if cfg.persistent:
            programs = min(grid[0], sm_count_for(x))
            out_desc = TensorDescriptor(out, [M, I], [out.stride(0), 1], [cfg.block_m, half])
            _gate_up_silu_persistent_kernel[(programs,)](x_desc, w_desc, out_desc, M, I, K, programs, **consts)
        else:
            _gate_up_silu_tma_kernel[grid](x_desc, w_desc, out, M, I, K, out.stride(0), **consts)
    else:
        _gate_up_silu_kernel[grid](x, w, out, M, I, K, x.stride(0), w.stride(0), out.stride(0), **consts)
    return out


__all__ = ["gate_up_silu", "gate_up_silu_config", "gate_up_silu_reference", "DEFAULT_CONFIG"]

"""Split-K GEMM for the decode band between the GEMV and cuBLAS's large tiles (issue 14):
out[M, N] = x[M, K] @ w[N, K]^T + b, for M of about 65 to 512 rows.

Reference: ``reference.linear``. Why it exists: at 129-256 rows cuBLAS runs the 3B model's down
projection (N = 2,048, K = 11,008) at 0.53-0.68 of the tensor-core ceiling
(results/h200/diagnostics/kernels_cublas_band_c7894dc.*): 128 x 128 output tiles give it only
16-32 tiles for 132 SMs, each walking all of K. Here program (tile, s) computes its output tile
over the s-th K slice only, so N = 2,048 at 200 rows can fill the SMs with 64-wide tiles and 4
slices. With one slice the program adds the bias and writes the output; with several it writes
fp32 partials [splits, M, N] that ``gemv.reduce_splits`` sums in slice order (+ bias, one rounding).

``swap_ab``: the tile is accumulated transposed, w_tile @ x_tile^T ([BLOCK_N, BLOCK_M]), so the
weight rows are the MMA's M side (a 64-row wgmma) and the batch its N side (up to 256 wide): at
200 rows one row tile covers the batch, and each weight tile is read once.
``tma``: tiles fetched by Hopper's tensor-memory accelerator (``matmul_invariant._tma_ok``);
otherwise masked pointer loads (the CPU interpreter runs either).

Not batch-invariant (slices and tiles follow the shape): the deterministic mode keeps
``matmul_invariant``. No host syncs, the grid from shapes alone: safe inside a CUDA graph.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from . import reference
from ._util import cdiv, check, check_linear, dot_precision, dot_upcast, grouped_tile, pdl_args, pdl_enter
from .gemv import reduce_splits
from .matmul_invariant import TensorDescriptor, _acc_dot, _epilogue, _tma_ok

splitk_matmul_reference = reference.linear


@dataclass(frozen=True)
class SplitKConfig:
    block_m: int  # batch rows a tile (the MMA's N side under swap_ab)
    block_n: int  # weight rows (output columns) a tile
    block_k: int
    splits: int = 1  # K slices (each a multiple of block_k long); 1: no partials, no reduce launch
    num_warps: int = 4
    num_stages: int = 4
    swap_ab: bool = False
    tma: bool = True  # where the tensors allow it (``_tma_ok``); else pointer loads
    group_m: int = 8  # launch order only (L2 reuse of a weight tile across row tiles)


@triton.jit
def _splitk_kernel(
    x_src, w_src, bias_ptr, out_ptr, part_ptr, M, N, K, K_PER_SPLIT, stride_xm, stride_wn, stride_om,
    HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, TMA: tl.constexpr, SWAP_AB: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    PREC: tl.constexpr, UPCAST: tl.constexpr, USE_PDL: tl.constexpr,
):
    """Program (tile, s): the [BLOCK_M, BLOCK_N] output tile over K slice s. x_src / w_src are TMA
    descriptors (TMA) or base pointers."""
    pid_m, pid_n = grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    s = tl.program_id(1)
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mmask, nmask = m < M, n < N
    k_lo = s * K_PER_SPLIT
    k_hi = tl.minimum(k_lo + K_PER_SPLIT, K)
    pdl_enter(USE_PDL)
    if SWAP_AB:
        acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        if TMA:  # slices are BLOCK_K multiples: only the last one reads past K (zeros, the descriptor's bounds)
            a = x_src.load([pid_m * BLOCK_M, k0])
            b = w_src.load([pid_n * BLOCK_N, k0])
        else:
            k = k0 + tl.arange(0, BLOCK_K)
            kmask = k < k_hi
            a = tl.load(x_src + m.to(tl.int64)[:, None] * stride_xm + k[None, :], mask=mmask[:, None] & kmask[None, :],
                        other=0.0)
            b = tl.load(w_src + n.to(tl.int64)[:, None] * stride_wn + k[None, :], mask=nmask[:, None] & kmask[None, :],
                        other=0.0)
        if SWAP_AB:
            acc = _acc_dot(b, a, acc, PREC, UPCAST)  # [BLOCK_N, BLOCK_M] += w @ x^T
        else:
            acc = _acc_dot(a, b, acc, PREC, UPCAST)
    if SWAP_AB:
        acc = tl.trans(acc)
    omask = mmask[:, None] & nmask[None, :]
    if SPLIT:
        tl.store(part_ptr + (s * M + m).to(tl.int64)[:, None] * N + n[None, :], acc, mask=omask)
    else:
        y = _epilogue(acc, acc, bias_ptr, n, nmask, out_ptr.dtype.element_ty, HAS_BIAS, False)
        tl.store(out_ptr + m.to(tl.int64)[:, None] * stride_om + n[None, :], y, mask=omask)


def splitk_matmul(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, config: SplitKConfig, *,
                  out: torch.Tensor | None = None, pdl: bool | None = None) -> torch.Tensor:
    """x: [M, K], w: [N, K] row-major, bias: [N] or None -> x @ w^T + bias: [M, N] in x's dtype,
    fp32 accumulation, tiles and K slices from ``config`` (module docstring). ``out``: a [M, N]
    buffer (row stride free). ``pdl``: see ``_util.use_pdl``."""
    M, N, K = check_linear(x, w, bias, "w")
    out = torch.empty((M, N), dtype=x.dtype, device=x.device) if out is None else out
    check("out", out, shape=(M, N), dtype=x.dtype)
    if M == 0 or N == 0:
        return out
    if K == 0:
        return out.copy_(bias.expand(M, N)) if bias is not None else out.zero_()
    cfg = config
    k_per_split = cdiv(cdiv(K, max(1, cfg.splits)), cfg.block_k) * cfg.block_k
    splits = cdiv(K, k_per_split)
    part = torch.empty((splits, M, N), dtype=torch.float32, device=x.device) if splits > 1 else out
    tma = cfg.tma and _tma_ok(x, w)
    if tma:
        x_src = TensorDescriptor(x, [M, K], [x.stride(0), 1], [cfg.block_m, cfg.block_k])
        w_src = TensorDescriptor(w, [N, K], [w.stride(0), 1], [cfg.block_n, cfg.block_k])
    else:
        x_src, w_src = x, w
    launch = pdl_args(x, M, pdl)
    _splitk_kernel[(cdiv(M, cfg.block_m) * cdiv(N, cfg.block_n), splits)](
        x_src, w_src, bias if bias is not None else w, out, part, M, N, K, k_per_split,
        x.stride(0), w.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, SPLIT=splits > 1, TMA=tma, SWAP_AB=cfg.swap_ab,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        PREC=dot_precision(x.dtype), UPCAST=dot_upcast(x.dtype), num_warps=cfg.num_warps,
        num_stages=cfg.num_stages, **launch,
    )
    if splits > 1:
        reduce_splits(part, None, bias, out, launch)
    return out

"""Split-K GEMV / skinny GEMM for decode-sized batches: out[M, N] = x[M, K] @ W[N, K]^T + b.

Reference: ``TorchOps.linear`` (torch.nn.functional.linear). Large M belongs to cuBLAS;
this kernel is for M <= ~8, where the product is a pass over the weights and the goal is
to stream them at close to the memory bandwidth.

Program (n, s) owns BLOCK_N weight rows and the s-th slice of K (K_PER_SPLIT columns). It
streams [BLOCK_N, BLOCK_K] tiles of W (each row a contiguous run of BLOCK_K elements, so
loads are wide) and keeps only a [BLOCK_N] (M = 1) or [BLOCK_M, BLOCK_N] (M > 1, via
``tl.dot`` with M padded to 16) fp32 accumulator, which leaves registers free for many
programs per SM, hence many loads in flight. With one split the kernel adds the bias and
writes the output; with several it writes fp32 partials that a small kernel sums.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..ops import TorchOps
from ._util import KERNEL_DTYPES, cdiv, check, check_device, dot_precision, dot_upcast, mma, next_pow2, sm_count_for

linear_reference = TorchOps().linear


@dataclass(frozen=True)
class GemvConfig:
    block_n: int
    block_k: int
    split_k: int
    num_warps: int = 4
    num_stages: int = 3


# (N, K) -> config, filled by tuning runs (bench.tune_gemv); the heuristic covers the rest
GEMV_CONFIGS: dict[tuple[int, int, int], GemvConfig] = {}


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, bias_ptr, out_ptr, part_ptr,
    M, N, K, K_PER_SPLIT, stride_xm, stride_wn, stride_om,
    HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PREC: tl.constexpr, UPCAST: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n < N
    w_rows = w_ptr + n.to(tl.int64)[:, None] * stride_wn
    k_lo = pid_k * K_PER_SPLIT
    k_hi = tl.minimum(k_lo + K_PER_SPLIT, K)
    m = tl.arange(0, BLOCK_M)
    mmask = m < M
    if BLOCK_M == 1:
        acc = tl.zeros([BLOCK_N], tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        kmask = k < k_hi
        w = tl.load(w_rows + k[None, :], mask=nmask[:, None] & kmask[None, :], other=0.0)  # [BLOCK_N, BLOCK_K]
        if BLOCK_M == 1:
            x = tl.load(x_ptr + k, mask=kmask, other=0.0).to(tl.float32)
            acc += tl.sum(w.to(tl.float32) * x[None, :], axis=1)
        else:
            x = tl.load(x_ptr + m[:, None] * stride_xm + k[None, :], mask=mmask[:, None] & kmask[None, :], other=0.0)
            acc += mma(x, tl.trans(w), PREC, UPCAST)
    if BLOCK_M == 1:
        acc2 = acc[None, :]
    else:
        acc2 = acc
    omask = mmask[:, None] & nmask[None, :]
    if SPLIT:
        part = part_ptr + (pid_k * M + m)[:, None].to(tl.int64) * N + n[None, :]
        tl.store(part, acc2, mask=omask)
    else:
        if HAS_BIAS:
            acc2 += tl.load(bias_ptr + n, mask=nmask, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + m[:, None] * stride_om + n[None, :], acc2.to(out_ptr.dtype.element_ty), mask=omask)


@triton.jit
def _gemv_reduce_kernel(part_ptr, bias_ptr, out_ptr, M, N, stride_om, SPLITS: tl.constexpr,
                        HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    m = tl.program_id(1)
    n = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    nmask = n < N
    acc = tl.zeros([BLOCK], tl.float32)
    for s in range(SPLITS):
        acc += tl.load(part_ptr + (s * M + m).to(tl.int64) * N + n, mask=nmask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + n, mask=nmask, other=0.0).to(tl.float32)
    tl.store(out_ptr + m * stride_om + n, acc.to(out_ptr.dtype.element_ty), mask=nmask)


def gemv_config(M: int, N: int, K: int, sms: int) -> GemvConfig:
    """Tuned entry if present, else: 16-row tiles, 256-512 wide K tiles, and enough K splits
    that the grid covers the SMs about four times, each split at least two tiles long."""
    tuned = GEMV_CONFIGS.get((next_pow2(M), N, K))
    if tuned is not None:
        return tuned
    block_n = 16 if M == 1 else 32
    block_k = 512 if (M == 1 and K >= 2048) else 256 if M == 1 else 64
    row_blocks = cdiv(N, block_n)
    split = max(1, min(cdiv(4 * sms, row_blocks), K // (2 * block_k)))
    return GemvConfig(block_n=block_n, block_k=block_k, split_k=split, num_warps=4)


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
         config: GemvConfig | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """x: [M, K] (M small), weight: [N, K] row-major, bias: [N] or None -> [M, N]."""
    check("x", x, ndim=2, dtype=KERNEL_DTYPES)
    M, K = x.shape
    check("weight", weight, shape=(None, K), dtype=x.dtype)
    N = weight.shape[0]
    tensors = dict(x=x, weight=weight)
    if bias is not None:
        check("bias", bias, shape=(N,), dtype=x.dtype)
        tensors["bias"] = bias
    check_device(**tensors)
    if M > 64:
        raise ValueError(f"gemv is for small M (got M={M}); use torch.nn.functional.linear")
    out = torch.empty((M, N), dtype=x.dtype, device=x.device) if out is None else out
    check("out", out, shape=(M, N), dtype=x.dtype)
    if M == 0 or N == 0:
        return out
    cfg = config or gemv_config(M, N, K, sm_count_for(x))
    k_per_split = cdiv(cdiv(K, cfg.split_k), cfg.block_k) * cfg.block_k
    splits = cdiv(K, k_per_split)
    block_m = 1 if M == 1 else max(16, next_pow2(M))
    part = torch.empty((splits, M, N), dtype=torch.float32, device=x.device) if splits > 1 else out
    b = bias if bias is not None else weight
    _gemv_kernel[(cdiv(N, cfg.block_n), splits)](
        x, weight, b, out, part, M, N, K, k_per_split, x.stride(0), weight.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, SPLIT=splits > 1,
        BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        PREC=dot_precision(x.dtype), UPCAST=dot_upcast(x.dtype),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if splits > 1:
        BLOCK = 256
        _gemv_reduce_kernel[(cdiv(N, BLOCK), M)](
            part, b, out, M, N, out.stride(0), SPLITS=splits, HAS_BIAS=bias is not None, BLOCK=BLOCK, num_warps=2,
        )
    return out

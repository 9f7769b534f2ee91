"""INT8 weight-only linears on the integer tensor cores: out[M, N] = (x[M, K] @ q[N, K]^T) * scale[N] + b.

Reference: ``reference.linear_int8`` / ``reference.silu_mul_linear_int8`` (dequantize, then the
float product). The weights are ``gemv_int8``'s (per-row symmetric int8), and so is the API; what
changes is who converts. ``gemv_int8`` turns every int8 weight into a float on the CUDA cores
(~6 instructions a weight at one row: issue 12's batch 1 is bound by them before the memory
bandwidth). Here the weights go to the MMA as they are and the *activations* are made integer:

- each [ROWS, BLOCK_K] tile of x gets a power-of-two scale per row, 2^(21 - e) where 2^e <= the
  row's largest |x| in the tile < 2^(e+1), so x * 2^(21 - e) is below 2^22 in magnitude;
- that value, rounded to an integer v (exact for every bf16 element whose exponent is at most 14
  below the tile's largest, every fp16 one at most 11 below: their mantissas fit in the 22 bits), is written as three
  signed int8 digits, v = d2 * 2^16 + d1 * 2^8 + d0 with d0, d1 in [-128, 127] and |d2| <= 64;
- the three digit planes, stacked as 3 of 4 row groups of one [4 * ROWS, BLOCK_K] int8 tile,
  meet the int8 weight tile in one integer MMA (int32 accumulation: exact, at most
  BLOCK_K * 127 * 128 < 2^24 in magnitude, so exact again as fp32);
- each plane's int32 sums, times 2^(8 * place) / 2^(21 - e), are added to an fp32 accumulator of
  the tile's plane rows; after the K loop the planes are summed and the per-column scale applied.

So the dot product is exact per K tile up to the digits' rounding of very small elements
(|error| <= 2^(e - 22) per element, e the tile's largest exponent: far below bf16's own
rounding of x), then summed in fp32 like the float kernels. The work per weight is the MMA's;
the per-x work (the digits, ~15 integer ops an element) is shared by the BLOCK_N weight rows of
a program, so tiles are wide (64-128 rows) and K is split for enough programs.

Needs integer MMAs in Triton (compute capability 8.0+; on a T4 ``TritonOps`` keeps ``gemv_int8``)
and bf16/fp16 x (fp32 x would lose its low mantissa bits to the 22-bit digits).
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ._util import cdiv, next_pow2, pdl_args, pdl_enter, sm_count_for
from .gemv import GemvConfig, _load_x, reduce_splits, store_rows
from .gemv_int8 import Int8Configs, _check_gate_up_int8, _check_linear_int8, _out

# Small decode batches only. Each program makes the digits of its rows of x, work that grows with the rows
# while its weights do not: on the H200 (int8_planes_bench at 6df6c74 / f307388) the four 3B linears took
# 40-49 us at 2-8 rows (gemv_int8: 78-83) but 58-70 at 16 rows against gemv_int8's tuned 45; with the
# digits made once by a kernel of their own (f307388's prepass) 58 at 16 rows, 78 at 32 (int8 55), and
# 94 us for gate_up alone at 64 rows (int8 34). Larger batches keep gemv_int8 and dequantize + cuBLAS.
PLANES_MAX_M = 8


def supported(device: torch.device) -> bool:
    """Integer MMAs in Triton: sm_80+ (and the CPU interpreter, for the tests). Asked on every int8
    decode linear (``TritonOps`` routes by it, the wrappers check it): one cached lookup per GPU."""
    if device.type != "cuda":
        return True
    return _major(device.index if device.index is not None else torch.cuda.current_device()) >= 8


@functools.cache
def _major(device_index: int) -> int:
    return torch.cuda.get_device_capability(device_index)[0]


@triton.jit
def _digits(x):
    """x [R, BLOCK_K] (bf16/fp16) -> (d2, d1, d0: [R, BLOCK_K] int32 digits in [-128, 127],
    inv: [R] fp32, 1 / the row's scale)."""
    xf = x.to(tl.float32)
    amax = tl.max(tl.abs(xf), axis=1)  # [R]
    e = (amax.to(tl.int32, bitcast=True) >> 23) & 0xFF  # biased exponent of the row's largest |x|
    # scale 2^(21 - (e - 127)) as a biased exponent, kept normal both ways (all-zero rows: any scale)
    se = tl.minimum(tl.maximum(275 - e, 17), 237)
    s = (se << 23).to(tl.float32, bitcast=True)
    v = xf * s[:, None]
    v = tl.where(v >= 0, v + 0.5, v - 0.5).to(tl.int32)  # round half away from zero (exact values stay)
    d0 = ((v + 128) & 255) - 128
    r = (v - d0) >> 8  # exact: v - d0 is a multiple of 256
    d1 = ((r + 128) & 255) - 128
    d2 = (r - d1) >> 8
    return d2, d1, d0, ((254 - se) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _digit_planes(x, ROWS: tl.constexpr):
    """x [ROWS, BLOCK_K] (bf16/fp16) -> (planes [4 * ROWS, BLOCK_K] int8: row groups d2, d1, d0, 0;
    weights [4 * ROWS] fp32: 2^(8 * place) / the row's scale, 0 for the zero group)."""
    d2, d1, d0, inv = _digits(x)
    planes = tl.join(tl.join(d2, d1), tl.join(d0, tl.zeros_like(d0)))  # [ROWS, BLOCK_K, 2, 2]
    planes = tl.reshape(tl.permute(planes, (3, 2, 0, 1)), (4 * ROWS, x.shape[1])).to(tl.int8)
    w = tl.join(tl.join(inv * 65536.0, inv * 256.0), tl.join(inv, inv * 0.0))  # [ROWS, 2, 2]
    return planes, tl.reshape(tl.permute(w, (2, 1, 0)), (4 * ROWS,))


@triton.jit
def _planes_kernel(
    x_ptr, q_ptr, scale_ptr, bias_ptr, out_ptr, part_ptr,
    M, N, K, K_PER_SPLIT, stride_xm, stride_qn, stride_om,
    HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, SILU_MUL: tl.constexpr, ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr, SWAP_AB: tl.constexpr,
):
    """Program (n, s, r): BLOCK_N output columns of the r-th ROWS rows over the s-th K slice.
    SWAP_AB: the product taken transposed, [BLOCK_N, 4 * ROWS] = w @ planes^T, so that the weight
    tile is the MMA's M side (64+ rows: Hopper's wgmma) and the planes its N side."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n < N
    m = pid_m * ROWS + tl.arange(0, ROWS)
    mmask = m < M
    q_rows = q_ptr + n.to(tl.int64)[:, None] * stride_qn
    k_lo = pid_k * K_PER_SPLIT
    k_hi = tl.minimum(k_lo + K_PER_SPLIT, K)
    pdl_enter(USE_PDL)
    if SWAP_AB:
        acc = tl.zeros([BLOCK_N, 4 * ROWS], tl.float32)
    else:
        acc = tl.zeros([4 * ROWS, BLOCK_N], tl.float32)  # one row per (plane, x row)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        kmask = k < k_hi
        w = tl.load(q_rows + k[None, :], mask=nmask[:, None] & kmask[None, :], other=0)  # [BLOCK_N, BLOCK_K] int8
        x = _load_x(x_ptr, m, k, mmask, kmask, stride_xm, K, SILU_MUL, False)  # [ROWS, BLOCK_K]
        planes, weights = _digit_planes(x, ROWS)
        if SWAP_AB:
            sums = tl.dot(w, tl.trans(planes), out_dtype=tl.int32)  # [BLOCK_N, 4 * ROWS], exact
            acc += sums.to(tl.float32) * weights[None, :]
        else:
            sums = tl.dot(planes, tl.trans(w), out_dtype=tl.int32)  # [4 * ROWS, BLOCK_N], exact
            acc += sums.to(tl.float32) * weights[:, None]
    if SWAP_AB:
        y = tl.trans(tl.sum(tl.reshape(acc, (BLOCK_N, 4, ROWS)), axis=1))  # [ROWS, BLOCK_N]
    else:
        y = tl.sum(tl.reshape(acc, (4, ROWS, BLOCK_N)), axis=0)
    store_rows(y, m, n, mmask, nmask, pid_k, M, N, part_ptr, out_ptr, scale_ptr, bias_ptr, stride_om,
               SPLIT, True, HAS_BIAS)


def planes_rows(M: int) -> int:
    """x rows a program takes: 4 4-row plane groups fill the MMA's 16 rows at M <= 4."""
    return max(4, next_pow2(M))


def planes_config_key(M: int, N: int, K: int, silu_mul: bool = False) -> tuple:
    """The tuned-config key, beside ``gemv_int8``'s in a device JSON's ``int8_tuned_configs``:
    (next_pow2(M), N, K, "int8_planes"[, "silu_mul"])."""
    key = (next_pow2(M), N, K, "int8_planes")
    return key + ("silu_mul",) if silu_mul else key


def planes_config(M: int, N: int, K: int, sms: int, silu_mul: bool = False,
                  configs: Int8Configs | None = None) -> GemvConfig:
    """The tuned entry of ``configs`` (``planes_config_key``), else the heuristic, what the H200 bench
    (6df6c74) ranked first or close at 1-16 rows: 64-row weight tiles of 256 int8 columns, the
    product transposed (the weight tile as wgmma's M side), K split until the grid covers the SMs
    ~4x with each split at least two tiles long. Wide tiles share the digits' work over more
    weights; the split gives the programs back (fp32 partials, then the reduce kernel)."""
    tuned = (configs or {}).get(planes_config_key(M, N, K, silu_mul))
    if isinstance(tuned, GemvConfig):
        return tuned
    block_n, block_k = 64, 256
    tiles = cdiv(N, block_n) * cdiv(M, planes_rows(M))
    split = max(1, min(cdiv(4 * sms, tiles), K // (2 * block_k)))
    return GemvConfig(block_n=block_n, block_k=block_k, split_k=split, num_warps=4, num_stages=4, swap_ab=True)


def _launch(x, qweight, scale, bias, out, config, configs, pdl, silu_mul=False) -> torch.Tensor:
    M, N, K = x.shape[0], qweight.shape[0], qweight.shape[1]
    if M == 0 or N == 0:
        return out
    cfg = config or planes_config(M, N, K, sm_count_for(x), silu_mul, configs)
    if cfg.block_n < 16 or cfg.block_k < 32:
        raise ValueError(f"int8 planes need block_n >= 16 and block_k >= 32 (tl.dot), got {cfg}")
    if cfg.block_k > 1024:  # keeps each tile's int32 sums below 2^24 (exact in fp32)
        raise ValueError(f"int8 planes need block_k <= 1024, got {cfg.block_k}")
    rows = planes_rows(M)
    k_per_split = cdiv(cdiv(K, cfg.split_k), cfg.block_k) * cfg.block_k
    splits = cdiv(K, k_per_split)
    part = torch.empty((splits, M, N), dtype=torch.float32, device=x.device) if splits > 1 else out
    launch = pdl_args(x, M, pdl)
    _planes_kernel[(cdiv(N, cfg.block_n), splits, cdiv(M, rows))](
        x, qweight, scale, bias if bias is not None else scale, out, part,
        M, N, K, k_per_split, x.stride(0), qweight.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, SPLIT=splits > 1, SILU_MUL=silu_mul, ROWS=rows,
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SWAP_AB=cfg.swap_ab,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **launch,
    )
    if splits > 1:
        reduce_splits(part, scale, bias, out, launch)
    return out


def _check_x(x: torch.Tensor) -> None:
    if x.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"int8 planes take bf16/fp16 activations (fp32 keeps gemv_int8), got {x.dtype}")
    if not supported(x.device):
        raise ValueError("int8 planes need integer MMAs in Triton (compute capability 8.0+)")


def gemv_int8_planes(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
                     config: GemvConfig | None = None, out: torch.Tensor | None = None,
                     configs: Int8Configs | None = None, pdl: bool | None = None) -> torch.Tensor:
    """x: [M, K] bf16/fp16 (M <= ``PLANES_MAX_M``), qweight: [N, K] int8, scale: [N] and bias: [N] or
    None in x's dtype -> [M, N]. ``config``: block_n, block_k, split_k, warps, stages, swap_ab (else
    the entry of ``configs`` or the heuristic: ``planes_config``); ``pdl``: see ``_util.use_pdl``."""
    M, N, K = _check_linear_int8(x, qweight, scale, bias)
    _check_x(x)
    if M > PLANES_MAX_M:
        raise ValueError(f"gemv_int8_planes is for M <= {PLANES_MAX_M} (got M={M})")
    return _launch(x, qweight, scale, bias, _out(out, M, N, x), config, configs, pdl)


def silu_mul_gemv_int8_planes(gate_up: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor,
                              config: GemvConfig | None = None, out: torch.Tensor | None = None,
                              configs: Int8Configs | None = None, pdl: bool | None = None) -> torch.Tensor:
    """gate_up: [M, 2I] (gate | up), qweight: [N, I] int8, scale: [N] -> (SiLU(gate) * up) @ (q * scale)^T:
    [M, N], the activation applied to each K tile as it is loaded (``gemv._load_x``)."""
    M, N = _check_gate_up_int8(gate_up, qweight, scale)
    _check_x(gate_up)
    if M > PLANES_MAX_M:
        raise ValueError(f"silu_mul_gemv_int8_planes is for M <= {PLANES_MAX_M} (got M={M})")
    return _launch(gate_up, qweight, scale, None, _out(out, M, N, gate_up), config, configs, pdl, silu_mul=True)

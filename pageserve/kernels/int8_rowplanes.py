"""INT8 weight-only linears for decode batches of many rows, on the integer tensor cores:
out[M, N] = (x[M, K] @ q[N, K]^T) * scale[N] + b.

Reference: ``reference.linear_int8`` / ``reference.silu_mul_linear_int8``. Same weights and API as
``gemv_int8`` and ``int8_planes``. ``int8_planes`` makes x's digit planes inside the product, per
(row, K tile), which is right at 2-8 rows but costs every program work that grows with the rows,
and its per-tile scales force an int32 -> fp32 rescale of the whole accumulator after every K
tile (at 16-64 rows it lost to ``gemv_int8``). Here the digits are made once, by a kernel of their
own, under one scale per *row*:

- ``_row_planes_kernel`` (one program a row): the row's largest |x| sets a power-of-two scale,
  2^(21 - e) with 2^e <= max |x| < 2^(e+1); each element, times it, rounded to an integer v
  (|v| < 2^22), is written as three signed int8 digits, v = d2 * 2^16 + d1 * 2^8 + d0, into
  planes [3, M, K] (``int8_planes._digits_under``). Exact for every bf16 element whose exponent is
  at most 14 below the row's largest (fp16: 11); smaller ones are rounded at 2^(e - 22), far below
  the int8 weights' own rounding. With SiLU·mul the row is SiLU(gate) * up, rounded to x's dtype
  as ``silu_and_mul`` stores it. ``planes=2``: v under 2^(13 - e) (|v| < 2^14), two digits: x as a
  15-bit fixed-point number per row (exact within 6 binades of the row's largest, fp16 within 3, the
  rest rounded at 2^(e - 14), still ~100x below the int8 weights' rounding), two products, not three.
- ``_rowplanes_gemm_kernel``: three int8 x int8 products per K tile, the weight tile as the MMA's
  M side (the product transposed), each plane's sums kept in an int32 accumulator over the whole
  K (exact: |sum| <= K * 128 * 127 < 2^31 for K <= ``MAX_K``); no conversion of the weights, no
  per-tile rescale. The epilogue joins the planes exactly in int64 (d2 * 2^16 + d1 * 2^8 + d0),
  rounds that once to fp32, divides by the row's scale (a power of two) and applies the column
  scale and bias. Split K adds int32 partials (exact, so the split moves no bit) in a reduce
  kernel that does the same epilogue.

The MMA work is three int8 products (each at twice bf16's rate): 1.5x a bf16 product's, so this
pays where the weights' bytes, not the MMAs, bound the product (decode batches up to a few hundred
rows), not for prefill chunks; with two planes it is a bf16 product's. Needs integer MMAs (sm_80+; ``int8_planes.supported``) and bf16/fp16 x.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ._util import cdiv, next_pow2, pdl_args, pdl_enter, sm_count_for
from .gemv import _load_x
from .gemv_int8 import Int8Configs, _check_gate_up_int8, _check_linear_int8, _out
from .int8_planes import _check_x, _digits_under

# the int32 sums stay exact: K * 128 * 127 < 2^31 (|d| <= 128, |q| <= 127)
MAX_K = (2 ** 31 - 1) // (128 * 127)


@dataclass(frozen=True)
class RowPlanesConfig:
    block_n: int = 64  # weight rows a program (the MMA's M side)
    block_m: int = 64  # x rows a program (the MMA's N side, once per plane)
    block_k: int = 128
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 4


@triton.jit
def _row_planes_kernel(x_ptr, p_ptr, inv_ptr, M, K, stride_xm, SILU_MUL: tl.constexpr, PLANES: tl.constexpr,
                       BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr):
    """Program m: row m of x (or of SiLU(gate) * up) -> planes[:, m, :] (d2, d1, d0, or d1, d0 for two planes,
    the most significant first) and inv[m] = 1 / its scale."""
    row = tl.program_id(0) + tl.arange(0, 1)
    rmask = row < M
    pdl_enter(USE_PDL)
    amax = tl.zeros([1], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        x = _load_x(x_ptr, row, k, rmask, k < K, stride_xm, K, SILU_MUL, False)  # [1, BLOCK_K]
        amax = tl.maximum(amax, tl.max(tl.abs(x.to(tl.float32)), axis=1))
    e = (amax.to(tl.int32, bitcast=True) >> 23) & 0xFF
    top: tl.constexpr = 21 if PLANES == 3 else 13
    se = tl.minimum(tl.maximum(254 + top - e, 17), 237)  # the scale's biased exponent, as _digits_under's
    tl.store(inv_ptr + row, ((254 - se) << 23).to(tl.float32, bitcast=True), mask=rmask)
    plane = M.to(tl.int64) * K
    out = p_ptr + row.to(tl.int64)[:, None] * K
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        kmask = (k < K)[None, :]
        x = _load_x(x_ptr, row, k, rmask, k < K, stride_xm, K, SILU_MUL, False)
        if PLANES == 3:
            d2, d1, d0, _ = _digits_under(x.to(tl.float32), e)
            tl.store(out + k[None, :], d2.to(tl.int8), mask=kmask)
            tl.store(out + plane + k[None, :], d1.to(tl.int8), mask=kmask)
            tl.store(out + 2 * plane + k[None, :], d0.to(tl.int8), mask=kmask)
        else:
            _, d1, d0, _ = _digits_under(x.to(tl.float32), e, 13)
            tl.store(out + k[None, :], d1.to(tl.int8), mask=kmask)
            tl.store(out + plane + k[None, :], d0.to(tl.int8), mask=kmask)


@triton.jit
def _join_planes(acc2, acc1, acc0, m, n, mmask, nmask, inv_ptr, scale_ptr, bias_ptr, out_ptr, stride_om,
                 HAS_BIAS: tl.constexpr, PLANES: tl.constexpr):
    """[BLOCK_N, BLOCK_M] int32 plane sums (most significant first; acc0 unused for two planes) -> out[m, n]:
    joined exactly in int64, rounded once to fp32, over the row's scale (a power of two), times the column's
    scale, plus its bias, in out's dtype."""
    if PLANES == 3:
        v = acc2.to(tl.int64) * 65536 + acc1.to(tl.int64) * 256 + acc0.to(tl.int64)
    else:
        v = acc2.to(tl.int64) * 256 + acc1.to(tl.int64)
    y = v.to(tl.float32) * tl.load(inv_ptr + m, mask=mmask, other=0.0)[None, :]
    y = y * tl.load(scale_ptr + n, mask=nmask, other=0.0).to(tl.float32)[:, None]
    if HAS_BIAS:
        y += tl.load(bias_ptr + n, mask=nmask, other=0.0).to(tl.float32)[:, None]
    tl.store(out_ptr + m.to(tl.int64)[None, :] * stride_om + n[:, None], y.to(out_ptr.dtype.element_ty),
             mask=nmask[:, None] & mmask[None, :])


@triton.jit
def _rowplanes_gemm_kernel(
    p_ptr, q_ptr, inv_ptr, scale_ptr, bias_ptr, out_ptr, part_ptr, M, N, K, K_PER_SPLIT, stride_qn, stride_om,
    HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, PLANES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr,
):
    """Program (n, m, s): BLOCK_N output columns of BLOCK_M rows over the s-th K slice, taken transposed
    ([BLOCK_N, BLOCK_M] = q @ planes^T, one int32 accumulator per plane, the most significant first)."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    nmask, mmask = n < N, m < M
    q_rows = q_ptr + n.to(tl.int64)[:, None] * stride_qn
    p_rows = p_ptr + m.to(tl.int64)[:, None] * K
    plane = M.to(tl.int64) * K
    k_lo = pid_k * K_PER_SPLIT
    k_hi = tl.minimum(k_lo + K_PER_SPLIT, K)
    pdl_enter(USE_PDL)
    acc2 = tl.zeros([BLOCK_N, BLOCK_M], tl.int32)
    acc1 = tl.zeros([BLOCK_N, BLOCK_M], tl.int32)
    acc0 = tl.zeros([BLOCK_N, BLOCK_M], tl.int32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        kmask = k < k_hi
        w = tl.load(q_rows + k[None, :], mask=nmask[:, None] & kmask[None, :], other=0)  # [BLOCK_N, BLOCK_K] int8
        pmask = mmask[:, None] & kmask[None, :]
        p2 = tl.load(p_rows + k[None, :], mask=pmask, other=0)  # [BLOCK_M, BLOCK_K] int8
        p1 = tl.load(p_rows + plane + k[None, :], mask=pmask, other=0)
        acc2 = tl.dot(w, tl.trans(p2), acc2, out_dtype=tl.int32)
        acc1 = tl.dot(w, tl.trans(p1), acc1, out_dtype=tl.int32)
        if PLANES == 3:
            p0 = tl.load(p_rows + 2 * plane + k[None, :], mask=pmask, other=0)
            acc0 = tl.dot(w, tl.trans(p0), acc0, out_dtype=tl.int32)
    if SPLIT:  # int32 partials [splits, PLANES, M, N]: summed exactly by the reduce kernel
        mn = M.to(tl.int64) * N
        ptrs = part_ptr + pid_k * PLANES * mn + m.to(tl.int64)[None, :] * N + n[:, None]
        mask = nmask[:, None] & mmask[None, :]
        tl.store(ptrs, acc2, mask=mask)
        tl.store(ptrs + mn, acc1, mask=mask)
        if PLANES == 3:
            tl.store(ptrs + 2 * mn, acc0, mask=mask)
        return
    _join_planes(acc2, acc1, acc0, m, n, mmask, nmask, inv_ptr, scale_ptr, bias_ptr, out_ptr, stride_om, HAS_BIAS,
                 PLANES)


@triton.jit
def _rowplanes_reduce_kernel(part_ptr, inv_ptr, scale_ptr, bias_ptr, out_ptr, M, N, SPLITS, stride_om,
                             HAS_BIAS: tl.constexpr, PLANES: tl.constexpr, BLOCK_N: tl.constexpr,
                             USE_PDL: tl.constexpr):
    """Program (m, n): row m's BLOCK_N columns, the splits' int32 partials added (exact), then ``_join_planes``."""
    m = tl.program_id(0) + tl.arange(0, 1)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask, mmask = n < N, m < M
    mask = nmask[:, None] & mmask[None, :]
    mn = M.to(tl.int64) * N
    ptrs = part_ptr + m.to(tl.int64)[None, :] * N + n[:, None]  # [BLOCK_N, 1]
    pdl_enter(USE_PDL)
    acc2 = tl.zeros([BLOCK_N, 1], tl.int32)
    acc1 = tl.zeros([BLOCK_N, 1], tl.int32)
    acc0 = tl.zeros([BLOCK_N, 1], tl.int32)
    for s in range(SPLITS):
        base = ptrs + s * PLANES * mn
        acc2 += tl.load(base, mask=mask, other=0)
        acc1 += tl.load(base + mn, mask=mask, other=0)
        if PLANES == 3:
            acc0 += tl.load(base + 2 * mn, mask=mask, other=0)
    _join_planes(acc2, acc1, acc0, m, n, mmask, nmask, inv_ptr, scale_ptr, bias_ptr, out_ptr, stride_om, HAS_BIAS,
                 PLANES)


def rowplanes_config_key(M: int, N: int, K: int) -> tuple:
    """The tuned-config key, beside ``gemv_int8``'s in a device JSON's ``int8_tuned_configs``."""
    return (next_pow2(M), N, K, "int8_rowplanes")


def rowplanes_config(M: int, N: int, K: int, sms: int, configs: Int8Configs | None = None) -> RowPlanesConfig:
    """The tuned entry of ``configs``, else the heuristic: 64 weight rows x up to 64 x rows a program (all of a
    64-row batch's planes read once per weight tile), 128 int8 columns a step, K split until the grid gives
    ~2 programs per SM with each slice at least two steps long."""
    tuned = (configs or {}).get(rowplanes_config_key(M, N, K))
    if isinstance(tuned, RowPlanesConfig):
        return tuned
    block_n, block_m, block_k = 64, min(max(16, next_pow2(M)), 64), 128
    tiles = cdiv(N, block_n) * cdiv(M, block_m)
    split = max(1, min(cdiv(2 * sms, tiles), K // (2 * block_k)))
    return RowPlanesConfig(block_n=block_n, block_m=block_m, block_k=block_k, split_k=split)


def row_planes(x: torch.Tensor, silu_mul: bool = False, pdl: bool | None = None,
               planes: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [M, K] bf16/fp16 (with ``silu_mul``: gate|up [M, 2K]) -> (planes [3, M, K] int8: d2, d1, d0;
    inv [M] fp32: 1 / the row's scale), so that x ~= (d2 * 2^16 + d1 * 2^8 + d0) * inv, exactly for every
    element within 14 binades (fp16: 11) of its row's largest. ``planes=2``: [2, M, K] (d1, d0),
    x ~= (d1 * 2^8 + d0) * inv, exact within 6 binades (fp16: 3)."""
    _check_x(x)
    if planes not in (2, 3):
        raise ValueError(f"int8 row planes come as 2 or 3 digits, got planes={planes}")
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"row_planes takes a 2-D x with contiguous rows, got shape {tuple(x.shape)}")
    M, K = x.shape[0], x.shape[1] // 2 if silu_mul else x.shape[1]
    digits = torch.empty((planes, M, K), dtype=torch.int8, device=x.device)
    inv = torch.empty((M,), dtype=torch.float32, device=x.device)
    if M and K:
        _row_planes_kernel[(M,)](x, digits, inv, M, K, x.stride(0), SILU_MUL=silu_mul, PLANES=planes,
                                 BLOCK_K=min(1024, next_pow2(K)), num_warps=4, **pdl_args(x, M, pdl))
    return digits, inv


def _launch(x, qweight, scale, bias, out, config, configs, pdl, silu_mul=False, planes=3) -> torch.Tensor:
    M, N, K = x.shape[0], qweight.shape[0], qweight.shape[1]
    if K > MAX_K:
        raise ValueError(f"int8 row planes keep exact int32 sums up to K = {MAX_K}, got K = {K}")
    if M == 0 or N == 0:
        return out
    cfg = config or rowplanes_config(M, N, K, sm_count_for(x), configs)
    if min(cfg.block_n, cfg.block_m, cfg.block_k) < 16:
        raise ValueError(f"int8 row planes need block_n, block_m, block_k >= 16 (tl.dot), got {cfg}")
    digits, inv = row_planes(x, silu_mul, pdl, planes)
    k_per_split = cdiv(cdiv(K, cfg.split_k), cfg.block_k) * cfg.block_k
    splits = cdiv(K, k_per_split)
    part = torch.empty((splits, planes, M, N), dtype=torch.int32, device=x.device) if splits > 1 else inv
    b = bias if bias is not None else scale  # unused pointers point at something valid
    launch = pdl_args(x, M, pdl)
    _rowplanes_gemm_kernel[(cdiv(N, cfg.block_n), cdiv(M, cfg.block_m), splits)](
        digits, qweight, inv, scale, b, out, part, M, N, K, k_per_split, qweight.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, SPLIT=splits > 1, PLANES=planes, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k, num_warps=cfg.num_warps, num_stages=cfg.num_stages, **launch,
    )
    if splits > 1:
        block = min(1024, next_pow2(N))
        _rowplanes_reduce_kernel[(M, cdiv(N, block))](part, inv, scale, b, out, M, N, splits, out.stride(0),
                                                      HAS_BIAS=bias is not None, PLANES=planes, BLOCK_N=block,
                                                      num_warps=4, **launch)
    return out


def linear_int8_rowplanes(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
                          config: RowPlanesConfig | None = None, out: torch.Tensor | None = None,
                          configs: Int8Configs | None = None, pdl: bool | None = None,
                          planes: int = 3) -> torch.Tensor:
    """x: [M, K] bf16/fp16 (any M; meant for decode batches), qweight: [N, K] int8, scale: [N] and bias:
    [N] or None in x's dtype -> [M, N]. ``config``: else the entry of ``configs`` or ``rowplanes_config``;
    ``planes``: x's digits, 3 (exact within 14 binades of the row's largest) or 2 (6; two products)."""
    M, N, K = _check_linear_int8(x, qweight, scale, bias)
    _check_x(x)
    return _launch(x, qweight, scale, bias, _out(out, M, N, x), config, configs, pdl, planes=planes)


def silu_mul_linear_int8_rowplanes(gate_up: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor,
                                   config: RowPlanesConfig | None = None, out: torch.Tensor | None = None,
                                   configs: Int8Configs | None = None, pdl: bool | None = None,
                                   planes: int = 3) -> torch.Tensor:
    """gate_up: [M, 2I] (gate | up), qweight: [N, I] int8, scale: [N] -> (SiLU(gate) * up) @ (q * scale)^T:
    [M, N], the activation applied as the planes are made."""
    M, N = _check_gate_up_int8(gate_up, qweight, scale)
    _check_x(gate_up)
    return _launch(gate_up, qweight, scale, None, _out(out, M, N, gate_up), config, configs, pdl, silu_mul=True,
                   planes=planes)

"""Batch-invariant matmul for the deterministic mode (issue 15): out[M, N] = x[M, K] @ w[N, K]^T + b.

Reference: ``reference.matmul_invariant_reference``. The contract: the bits of output row r
depend only on x[r], w and b, never on M, on r's position in the batch or on the other rows.
One kernel serves every M (1 to ~16k), in place of both the decode GEMVs (whose tiles and
K splits change with M) and cuBLAS (which picks kernels, and split-K, by shape).

Why it is invariant. Program (m, n) owns a BLOCK_M x BLOCK_N output tile and walks K from 0
to K in steps of BLOCK_K, ``acc = tl.dot(x_tile, w_tile^T, acc)``, then adds the bias in
fp32 and rounds once to the output dtype. Each output element is therefore the same chain
of MMAs over the same K slices in the same order whatever tile it sits in, provided that
- on the CPU interpreter BLOCK_K is one constant per dtype: there each tile's product is a
  separate sum added to the accumulator, so BLOCK_K sets where the chain is cut. On the GPU
  the accumulator feeds the MMA, and the H200 sweep at 8df43651 measured BLOCK_K 64 and 128
  (and TMA-loaded tiles) giving the same bits on every 3B shape: there BLOCK_K follows the tile
  (``measured_config``);
- there is no split-K, ever (that would re-associate the sum into partials);
- the MMA's k16 step rounds alike whatever the tile: on Hopper Triton issues wgmma
  (m64nNk16) when BLOCK_M >= 64 and mma.sync (m16n8k16) below. That the two agree bit for bit
  was not assumed but measured: on the H200 at 65f7a342 (results/h200/gpu_det_tests.log) rows
  computed with 16-, 32- and 128-row tiles equalled the 64-row tiles' on every 3B shape and
  the LM head, bf16 and fp16, at M = 1..1024; two sweeps at 8df43651 and 68fe4215
  (results/h200/diagnostics/invariant_sweep_*) then found 16- to 256-row tiles, 16- to
  256-column tiles, BLOCK_K 64/128/256, 4 or 8 warps, 3 to 8 stages and TMA-loaded tiles all
  bitwise equal at M = 1..8192. So on the GPU bf16/fp16 take whatever tile is fastest for the
  shape (``measured_config``), and the GPU tests keep asserting rows alone = rows in batches of
  2..2048 under that policy. On Triton's CPU interpreter (tl.dot = a numpy matmul of the tile,
  whose rounding can follow the tile's shape) BLOCK_M, BLOCK_N and BLOCK_K stay fixed;
- rows past M and columns past K load zeros, which add exact zeros.
fp32 inputs take ``input_precision="ieee"``: Triton lowers that dot to FMAs on the CUDA cores,
one fma per k in order, so it is invariant for any BLOCK_M; fp32 uses BLOCK_M 16 throughout.
``block_m=`` overrides the policy (tests, the lab's ``invariance_report``).

``InvariantMatmulConfig.swap_ab`` swaps the operands (w as the MMA's M side, the rows as its N side), so a
one-row tile feeds the MMA weight rows instead of 15 padding rows of x. The same products over the same K
slices: on the interpreter's ordered dot the same bits by construction; on the GPU the sweep's ``same_bits``
and the GPU tests say whether the MMA rounds them alike (no policy takes it before they have).

Defaults: ``measured_config`` (the H200 sweeps' bests by row count; over the decoder's four
linears x 36 (+ the LM head up to M = 1024) 0.99x cuBLAS's time at M = 1, 0.98x at M = 8192 and
1.04-1.28x between, at 68fe4215), shrunk to the
device's shared memory by ``fit_shared_memory`` (a T4's 64 KB). fp32 and the interpreter use
``invariant_config``'s occupancy rule: the widest BLOCK_N that keeps >= 2 programs per SM.
``pdl`` as the GEMV: on for launches of at most ``PDL_MAX_TOKENS`` rows where supported.
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from . import reference
from .activation import silu_mul_f32
from ._util import (cdiv, check, check_linear, dot_precision, dot_upcast, grouped_tile, interpreting, mma,
                    mma_dot_for, pdl_args, pdl_enter, pdl_release, pdl_wait, sm_count_for)

try:  # host-side TMA descriptors (Triton >= 3.4)
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - older Triton: the pointer kernel only
    TensorDescriptor = None

matmul_invariant_reference = reference.matmul_invariant_reference

# BLOCK_K and BLOCK_M on the CPU interpreter and for fp32 (module docstring); on the GPU bf16/fp16
# follow measured_config (tiles measured invariant on the H200)
BLOCK_K = {torch.bfloat16: 128, torch.float16: 128, torch.float32: 32}
BLOCK_M = {torch.bfloat16: 64, torch.float16: 64, torch.float32: 16}


def default_block_m(M: int, dtype: torch.dtype) -> int:
    """The row tile for M rows: fixed on the interpreter and for fp32, else by M (see above)."""
    if interpreting() or dtype == torch.float32:
        return BLOCK_M[dtype]
    return 16 if M <= 16 else 32 if M <= 32 else 64 if M < 256 else 128
BLOCK_N_CHOICES = (16, 32, 64, 128, 256)
PDL_RELEASES = ("top", "after_loop")  # matmul_invariant's pdl_release


@dataclass(frozen=True)
class InvariantMatmulConfig:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3
    group_m: int = 8  # launch order only (L2 reuse of weight tiles across row tiles): no effect on the bits
    tma: bool = False  # tiles loaded by the Hopper tensor-memory accelerator (``_tma_ok``); same MMAs, same K order
    persistent: bool = False  # with tma: one program per SM walking the tiles (the same tiles, the same K loop)
    # the product taken transposed, out^T = w @ x^T (pointer loads only): the weight tile is the MMA's M side
    # (wgmma's 64-row A operand from BLOCK_N 64 on) and the rows its N side; each output element is the same
    # products over the same K slices in the same order (``_swapped_k_loop``)
    swap_ab: bool = False

    def __post_init__(self) -> None:
        if self.swap_ab and self.tma:
            raise ValueError("swap_ab: the pointer kernel only (no TMA tiles)")


def invariant_config(M: int, N: int, dtype: torch.dtype, sms: int, block_m: int | None = None,
                     block_n: int | None = None, K: int | None = None,
                     smem_bytes: int = 200 << 10, mma: bool = True) -> InvariantMatmulConfig:
    """The launch config for an [M, K] x [N, K]^T product.

    bf16/fp16 on the GPU (no override): ``measured_config``, the tiles the H200 sweep picked
    (every config there gave the same bits). Otherwise, and for fp32 and the interpreter:
    BLOCK_M and BLOCK_K from the dtype (``block_m`` overrides BLOCK_M); BLOCK_N the widest
    choice that keeps >= 2 programs per SM (16 if none does; ``block_n`` overrides it: the lab's
    sweeps); warps and stages follow the tile. ``smem_bytes``: the shared memory a program may
    use (stages, then tiles, shrink to fit: no effect on the bits on the GPU).

    ``mma`` False (``_util.mma_dot_for``: a GPU below sm_80, where Triton runs a dot as FMAs, each output
    element one fma chain over K in K order, so no tile choice changes a bit): ``FMA_CONFIG``'s tiles,
    16 rows up to 16, else 32, which compile for sm_75 without spilling (the MMA tiles spill 1-28 KB
    a thread there: scripts/t4_compile_audit.py)."""
    if not mma and block_m is None and block_n is None:
        return FMA_CONFIG[16 if M <= 16 else 32]
    if block_m is None and block_n is None and not interpreting() and dtype != torch.float32:
        return fit_shared_memory(measured_config(M, N, K if K is not None else 4096, sms), dtype, smem_bytes)
    bm = default_block_m(M, dtype) if block_m is None else block_m
    if bm < 16 or bm > 256 or bm & (bm - 1):
        raise ValueError(f"block_m must be a power of two in [16, 256], got {block_m}")
    # On the GPU each output element is the same chain of MMA k-steps whatever the tile's width,
    # so BLOCK_N may follow M (tests/test_matmul_invariant.py checks it there). Triton's CPU
    # interpreter runs tl.dot as a numpy matmul of the whole tile, whose per-element sum order
    # depends on the tile's width: there BLOCK_N follows N alone.
    row_tiles = 1 if interpreting() else cdiv(M, bm)
    widest = 128 if dtype == torch.float32 else 256  # fp32 runs on FMAs: its accumulator lives in registers
    bn = 16
    for cand in BLOCK_N_CHOICES:
        if cand <= widest and row_tiles * cdiv(N, cand) >= 2 * sms:
            bn = cand
    bn = bn if block_n is None else block_n
    stage_bytes = (bm + bn) * BLOCK_K[dtype] * dtype.itemsize
    stages = max(2, min(8 if bm <= 32 else 4, smem_bytes // stage_bytes))
    warps = 8 if bm * bn >= 64 * 256 else 4
    return InvariantMatmulConfig(block_m=bm, block_n=bn, block_k=BLOCK_K[dtype], num_warps=warps, num_stages=stages)


# by row tile: 32-wide K slices, 64 columns (32 with SILU_MUL, which halves a tile's columns), 2 stages
FMA_CONFIG = {16: InvariantMatmulConfig(block_m=16, block_n=64, block_k=32, num_warps=4, num_stages=2),
              32: InvariantMatmulConfig(block_m=32, block_n=64, block_k=32, num_warps=8, num_stages=2)}


def measured_config(M: int, N: int, K: int, sms: int) -> InvariantMatmulConfig:
    """bf16/fp16 tiles by row count, from the H200 sweeps at 8df43651 and 68fe4215
    (results/h200/diagnostics/invariant_sweep_*.json: every config there, BLOCK_K 64 to 256,
    pointer or TMA loads, 16- to 256-row tiles, gave the default config's bits and row 0 its
    bits alone, on every Qwen2.5-3B shape at M = 1..8192):
    - up to 16 rows: 16-row tiles streaming the weights through pointer loads, 256-wide K slices
      for the narrow matrices (down at M = 1: 17.2 us against 24.1 with 128);
    - up to 64: 32/64-row tiles, TMA, narrow columns where N is small;
    - up to 1024 (large decode batches): TMA, 128 x 128 for wide N and from 513 rows, else 64-row
      tiles 32 to 128 columns wide as the sweep ranked them; the third sweep (12c46862, with the
      persistent variant) moved the LM head from 129 rows and gate_up at 257-512 rows to the
      persistent walk (lm_head 477 vs 493 us at M = 512, 930 vs 1019 at 1024; gate_up 73 vs 79);
    - beyond (prefill chunks): 256 x 128 x 64, 8 warps, 4 stages, TMA (0.98x cuBLAS's time over
      the four linears at M = 8192)."""
    if M <= 16:
        if N >= 8192:
            return InvariantMatmulConfig(16, 64, 128, 4, 4)
        return InvariantMatmulConfig(16, 16, 256, 4, 6) if N <= 2048 else InvariantMatmulConfig(16, 32, 256, 4, 4)
    if M <= 64:
        bm = 32 if M <= 32 else 64
        if N >= 8192:
            return InvariantMatmulConfig(bm, 64, 64, 4, 4, tma=True)
        if K > 4096 or N <= 2048:
            return InvariantMatmulConfig(bm, 16, 128, 4, 6, tma=True)
        return InvariantMatmulConfig(bm, 32, 128, 4, 4, tma=True)
    if M <= 1024:
        if M > 128 and N > 32768:  # the LM head: the persistent walk, 3-9% at M = 256..1024
            return InvariantMatmulConfig(128, 128, 64, 8, 5, tma=True, persistent=True)
        if 256 < M <= 512 and N >= 8192:  # gate_up at ~500 rows (W1's decode): 73 us vs 79
            return InvariantMatmulConfig(128, 256, 64, 8, 3, tma=True, persistent=True)
        if N >= 8192 or M > 512:
            return InvariantMatmulConfig(128, 128, 64, 8, 5, tma=True)
        if M <= 128:  # narrow N: enough column tiles for ~one program per SM
            return InvariantMatmulConfig(64, 64, 128, 4, 4, tma=True) if N > 2048 else \
                InvariantMatmulConfig(64, 32, 128, 4, 6, tma=True)
        if M <= 256:
            return InvariantMatmulConfig(64, 64, 128, 4, 4, tma=True) if K > 4096 else \
                InvariantMatmulConfig(64, 64, 64, 4, 6, tma=True)
        return InvariantMatmulConfig(64, 128, 64, 4, 4, tma=True) if N > 2048 else \
            InvariantMatmulConfig(64, 64, 64, 4, 6, tma=True)
    return InvariantMatmulConfig(256, 128, 64, 8, 4, tma=True)


def fit_shared_memory(cfg: InvariantMatmulConfig, dtype: torch.dtype, smem_bytes: int) -> InvariantMatmulConfig:
    """Fewer stages (down to 2), then narrower and shorter tiles, until the pipeline's buffers
    fit in ``smem_bytes`` (a T4 has 64 KB a block, an H200 227 KB). On the GPU the tiles do not
    change the bits (``measured_config``); BLOCK_K stays."""
    bm, bn, stages = cfg.block_m, cfg.block_n, cfg.num_stages
    while (bm + bn) * cfg.block_k * dtype.itemsize * stages > smem_bytes:
        if stages > 2:
            stages -= 1
        elif bn > 16 and bn >= bm:
            bn //= 2
        elif bm > 16:
            bm //= 2
        else:
            break
    warps = cfg.num_warps if (bm, bn) == (cfg.block_m, cfg.block_n) else 8 if bm * bn >= 128 * 128 else 4
    return dataclasses.replace(cfg, block_m=bm, block_n=bn, num_stages=stages, num_warps=warps)


def smem_budget(t: torch.Tensor) -> int:
    """Shared memory a program of this kernel may plan for on ``t``'s device (7/8 of the
    opt-in limit: Triton keeps some for itself). The interpreter: the H200's."""
    return _smem_limit(t.device.index or 0) * 7 // 8 if t.is_cuda else 200 << 10


@functools.cache
def _smem_limit(device_index: int) -> int:
    try:  # what Triton itself checks a kernel's shared memory against
        return int(triton.runtime.driver.active.utils.get_device_properties(device_index)["max_shared_mem"])
    except Exception:  # noqa: BLE001 - an older Triton: torch's figure, else the smallest of the GPU's generation
        props = torch.cuda.get_device_properties(device_index)
        return getattr(props, "shared_memory_per_block_optin", 0) or (99 << 10 if props.major >= 8 else 64 << 10)


@triton.jit
def _pdl_top(USE_PDL: tl.constexpr, LATE_RELEASE: tl.constexpr):
    """The wait for the previous kernel, and the next kernel's release unless LATE_RELEASE moves it
    after the K loop (``matmul_invariant``'s ``pdl_release``)."""
    if LATE_RELEASE:
        pdl_wait(USE_PDL)
    else:
        pdl_enter(USE_PDL)


@triton.jit
def _acc_dot(a, b, acc, PREC: tl.constexpr, UPCAST: tl.constexpr):
    """acc + a @ b^T, the MMA accumulating into acc (a: [BLOCK_M, BLOCK_K], b: [BLOCK_N, BLOCK_K])."""
    if UPCAST == 2:  # the interpreter: products summed in K order (see _util.dot_upcast)
        return acc + mma(a, tl.trans(b), PREC, UPCAST)
    if UPCAST:  # the interpreter's bf16 (see _util.dot_upcast)
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, tl.trans(b), acc, input_precision=PREC)


@triton.jit
def _epilogue(acc, acc_up, bias_ptr, n, nmask, out_ty: tl.constexpr, HAS_BIAS: tl.constexpr,
              SILU_MUL: tl.constexpr):
    """The tile's output values: bias added after the whole K sum, in fp32, one rounding; with
    SILU_MUL, SiLU(gate) * up from the gate and up sums each rounded to the output dtype first,
    which is what the gate_up product followed by ``silu_and_mul`` computes, bit for bit."""
    if HAS_BIAS:
        acc += tl.load(bias_ptr + n, mask=nmask, other=0.0).to(tl.float32)[None, :]
    if SILU_MUL:
        return silu_mul_f32(acc.to(out_ty).to(tl.float32), acc_up.to(out_ty).to(tl.float32)).to(out_ty)
    return acc.to(out_ty)


@triton.jit
def _k_loop(x_rows, w_rows, up_offset, K, mmask, nmask, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
            BLOCK_K: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr, SILU_MUL: tl.constexpr):
    """The pointer kernel's K loop: (acc, acc_up) [BLOCK_M, BLOCK_N] fp32, x tile as the MMA's A side.
    ``up_offset``: N * stride_wn, where SILU_MUL's up rows start."""
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)  # SILU_MUL: the up columns, rows N.. of w
    # the same K slices in the same order for every tile, the whole of K in one program
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        kmask = k < K
        a = tl.load(x_rows + k[None, :], mask=mmask[:, None] & kmask[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
        b = tl.load(w_rows + k[None, :], mask=nmask[:, None] & kmask[None, :], other=0.0)  # [BLOCK_N, BLOCK_K]
        acc = _acc_dot(a, b, acc, PREC, UPCAST)
        if SILU_MUL:
            b_up = tl.load(w_rows + up_offset + k[None, :], mask=nmask[:, None] & kmask[None, :], other=0.0)
            acc_up = _acc_dot(a, b_up, acc_up, PREC, UPCAST)
    return acc, acc_up


@triton.jit
def _swapped_k_loop(x_rows, w_rows, up_offset, K, mmask, nmask, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr, SILU_MUL: tl.constexpr):
    """``_k_loop`` with the product transposed: acc^T [BLOCK_N, BLOCK_M] += w_tile @ x_tile^T, the weight tile as
    the MMA's A side (at one row the MMA's M side is then weights, not 15 padding rows of x), returned transposed.
    Element (m, n) is still x[m, k] * w[n, k] summed over the same K slices in K order; that the MMA rounds such
    a sum alike whichever operand is A is what the GPU tests and the sweep's ``same_bits`` check (on the
    interpreter's ordered dot it is the same sum by construction)."""
    acc_t = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    up_t = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        kmask = k < K
        a = tl.load(x_rows + k[None, :], mask=mmask[:, None] & kmask[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
        b = tl.load(w_rows + k[None, :], mask=nmask[:, None] & kmask[None, :], other=0.0)  # [BLOCK_N, BLOCK_K]
        acc_t = _acc_dot(b, a, acc_t, PREC, UPCAST)
        if SILU_MUL:
            b_up = tl.load(w_rows + up_offset + k[None, :], mask=nmask[:, None] & kmask[None, :], other=0.0)
            up_t = _acc_dot(b_up, a, up_t, PREC, UPCAST)
    return tl.trans(acc_t), tl.trans(up_t)


def _matmul_invariant_kernel(
    x_ptr, w_ptr, bias_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr, USE_PDL: tl.constexpr,
    SILU_MUL: tl.constexpr, LATE_RELEASE: tl.constexpr, SWAP_AB: tl.constexpr = False,
):
    pid_m, pid_n = grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mmask, nmask = m < M, n < N
    x_rows = x_ptr + m.to(tl.int64)[:, None] * stride_xm
    w_rows = w_ptr + n.to(tl.int64)[:, None] * stride_wn
    _pdl_top(USE_PDL, LATE_RELEASE)
    if SWAP_AB:
        acc, acc_up = _swapped_k_loop(x_rows, w_rows, N * stride_wn, K, mmask, nmask, BLOCK_M, BLOCK_N, BLOCK_K,
                                      PREC, UPCAST, SILU_MUL)
    else:
        acc, acc_up = _k_loop(x_rows, w_rows, N * stride_wn, K, mmask, nmask, BLOCK_M, BLOCK_N, BLOCK_K,
                              PREC, UPCAST, SILU_MUL)
    if LATE_RELEASE:
        pdl_release(USE_PDL)
    y = _epilogue(acc, acc_up, bias_ptr, n, nmask, out_ptr.dtype.element_ty, HAS_BIAS, SILU_MUL)
    tl.store(out_ptr + m.to(tl.int64)[:, None] * stride_om + n[None, :], y, mask=mmask[:, None] & nmask[None, :])


@triton.jit
def _tma_tile(x_desc, w_desc, bias_ptr, out_ptr, pid_m, pid_n, M, N, K, stride_om,
              HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
              PREC: tl.constexpr, UPCAST: tl.constexpr, SILU_MUL: tl.constexpr, USE_PDL: tl.constexpr,
              LATE_RELEASE: tl.constexpr):
    # the pointer kernel's tile with x and w fetched by TMA descriptors: rows past M and columns
    # past K come back as zeros (the descriptor's bounds), as the masked loads give. With
    # SILU_MUL the gate tile of a last column tile may read up rows past N: columns that are
    # never stored (each output column is its own chain)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        a = x_desc.load([pid_m * BLOCK_M, k0])  # [BLOCK_M, BLOCK_K]
        acc = _acc_dot(a, w_desc.load([pid_n * BLOCK_N, k0]), acc, PREC, UPCAST)  # w tile: [BLOCK_N, BLOCK_K]
        if SILU_MUL:
            acc_up = _acc_dot(a, w_desc.load([N + pid_n * BLOCK_N, k0]), acc_up, PREC, UPCAST)
    if LATE_RELEASE:
        pdl_release(USE_PDL)
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n < N
    y = _epilogue(acc, acc_up, bias_ptr, n, nmask, out_ptr.dtype.element_ty, HAS_BIAS, SILU_MUL)
    tl.store(out_ptr + m.to(tl.int64)[:, None] * stride_om + n[None, :], y, mask=(m < M)[:, None] & nmask[None, :])


def _matmul_invariant_tma_kernel(
    x_desc, w_desc, bias_ptr, out_ptr, M, N, K, stride_om,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr, USE_PDL: tl.constexpr,
    SILU_MUL: tl.constexpr, LATE_RELEASE: tl.constexpr,
):
    pid_m, pid_n = grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    _pdl_top(USE_PDL, LATE_RELEASE)
    _tma_tile(x_desc, w_desc, bias_ptr, out_ptr, pid_m, pid_n, M, N, K, stride_om,
              HAS_BIAS, BLOCK_M, BLOCK_N, BLOCK_K, PREC, UPCAST, SILU_MUL, USE_PDL, LATE_RELEASE)


def _matmul_invariant_persistent_kernel(
    x_desc, w_desc, bias_ptr, out_ptr, M, N, K, stride_om, num_programs,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr, USE_PDL: tl.constexpr,
    SILU_MUL: tl.constexpr, LATE_RELEASE: tl.constexpr,
):
    # the TMA kernel's tile, for tiles pid, pid + num_programs, ...: one launch wave, and a
    # program's next tile's loads can start under its last one's epilogue. Each tile is the
    # same K loop from zero, so its bits are the non-persistent kernel's. (LATE_RELEASE: not
    # here, where a program walks several tiles; the next kernel is released at the top.)
    pdl_enter(USE_PDL)
    num_tiles = tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N)
    for tile in range(tl.program_id(0), num_tiles, num_programs):
        pid_m, pid_n = grouped_tile(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
        _tma_tile(x_desc, w_desc, bias_ptr, out_ptr, pid_m, pid_n, M, N, K, stride_om,
                  HAS_BIAS, BLOCK_M, BLOCK_N, BLOCK_K, PREC, UPCAST, SILU_MUL, USE_PDL, False)


def _two_compiles(fn):
    """(specialized, generic) kernels of one body. Triton specializes an int argument on its
    divisibility by 16 and on == 1, and compiles a variant per combination. The generic kernel
    (M not specialized) serves eager calls, whose row counts vary with every prefill chunk: one
    compile per tile config, where specializing paid ~0.8 s of compiles inside the first W1 on an
    engine (results/h200/diagnostics/w1_profile_modes_80ed5d6e.*). The specialized kernel serves
    CUDA-graph captures, whose row counts are the capture buckets, compiled at start-up. Timed
    alone on the H200 the two are level on every 3B shape at M = 1, 64 and 512 but the down
    projection at M = 1 (17.1 vs 17.6 us; diagnostics/det_m1_bench_a41ec7b.*). Both run the same
    MMAs over the same K slices: the same bits (tests/test_matmul_invariant.py)."""
    return triton.jit(fn), triton.jit(fn, do_not_specialize=["M"])


_POINTER_KERNELS = _two_compiles(_matmul_invariant_kernel)
_TMA_KERNELS = _two_compiles(_matmul_invariant_tma_kernel)
_PERSISTENT_KERNELS = _two_compiles(_matmul_invariant_persistent_kernel)


def _tma_ok(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether TMA descriptors can address x and w: Triton's host descriptors, a Hopper-class
    GPU (or the interpreter), unit inner stride, 16-byte aligned bases and row strides."""
    if TensorDescriptor is None:
        return False
    if x.is_cuda and torch.cuda.get_device_capability(x.device)[0] < 9:
        return False
    es = x.element_size()
    return all(t.stride(1) == 1 and t.data_ptr() % 16 == 0 and (t.stride(0) * es) % 16 == 0 for t in (x, w))


def matmul_invariant(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, *,
                     out: torch.Tensor | None = None, block_m: int | None = None, pdl: bool | None = None,
                     config: InvariantMatmulConfig | None = None, silu_mul: bool = False,
                     specialize: bool | None = None, pdl_release: str = "top") -> torch.Tensor:
    """x: [M, K], w: [N, K] row-major, bias: [N] or None -> x @ w^T + bias: [M, N] in x's dtype
    (fp32, fp16, bf16), fp32 accumulation, each row's bits independent of the batch (module
    docstring). ``out``: a [M, N] buffer to write (row stride free). ``block_m``: force another
    BLOCK_M (a power of two in [16, 256]) -- only for measuring whether it stays invariant.
    ``config``: the whole tile choice (tests, sweeps); a BLOCK_K or BLOCK_M other than the
    default's gives rows that need not equal the default's. ``pdl``: see ``_util.use_pdl``.

    ``silu_mul``: w is the MLP's gate|up matrix [2I, K] (gate rows first) and the result is
    SiLU(gate) * up: [M, I], bitwise what ``silu_and_mul(matmul_invariant(x, w))`` gives, without
    the [M, 2I] intermediate or the second launch. Each program computes a gate tile and the
    matching up tile (BLOCK_N / 2 columns each, at least 16: the work of the config's tile). No bias.

    ``specialize``: which compile of the kernel (``_two_compiles``): None = the M-specialized one
    inside a CUDA-graph capture, the generic one otherwise; the bits are the same.
    ``pdl_release`` (with PDL on): where a program lets the next kernel launch, "top" (right after its
    wait, as every PDL kernel here) or "after_loop" (after its last MMA, before the epilogue's stores:
    the next kernel's programs then do not wait on the SMs through the whole K loop; ``DeterministicOps``
    releases the down projection after the fused gate_up's loop that way). Persistent tiles release at
    the top either way. No effect on any bit.
    No host syncs, the grid from shapes alone: safe to capture in a CUDA graph."""
    M, N, K = check_linear(x, w, bias, "w")
    if pdl_release not in PDL_RELEASES:
        raise ValueError(f"pdl_release must be one of {PDL_RELEASES}, got {pdl_release!r}")
    if silu_mul:
        if bias is not None:
            raise ValueError("silu_mul: the gate|up product takes no bias")
        if N % 2:
            raise ValueError(f"silu_mul: w must stack gate and up rows (an even row count), got {N}")
        N //= 2
    out = torch.empty((M, N), dtype=x.dtype, device=x.device) if out is None else out
    check("out", out, shape=(M, N), dtype=x.dtype)
    if M == 0 or N == 0:
        return out
    if K == 0:
        return out.copy_(bias.expand(M, N)) if bias is not None else out.zero_()
    cfg = config or invariant_config(M, w.shape[0], x.dtype, sm_count_for(x), block_m, K=K, smem_bytes=smem_budget(x),
                                     mma=mma_dot_for(x))
    if silu_mul:
        cfg = dataclasses.replace(cfg, block_n=max(16, cfg.block_n // 2))
    if specialize is None:
        specialize = x.is_cuda and torch.cuda.is_current_stream_capturing()
    _launch(x, w, bias, out, cfg, pdl, silu_mul, specialize, pdl_release == "after_loop")
    return out


def _launch(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor,
            cfg: InvariantMatmulConfig, pdl: bool | None, silu_mul: bool = False, specialize: bool = False,
            late_release: bool = False):
    """One launch over checked arguments (``silu_mul``: w holds gate then up rows, out the up
    rows' count of columns); returns Triton's compiled kernel (the lab reads its PTX to see which
    MMA instruction a config got). ``specialize``: ``_two_compiles``; ``late_release``: ``pdl_release``
    "after_loop"."""
    M, N, K = x.shape[0], out.shape[1], w.shape[1]
    pick = 0 if specialize else 1
    grid = (cdiv(M, cfg.block_m) * cdiv(N, cfg.block_n),)
    consts = dict(HAS_BIAS=bias is not None, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                  GROUP_M=cfg.group_m, PREC=dot_precision(x.dtype), UPCAST=dot_upcast(x.dtype, ordered=True),
                  SILU_MUL=silu_mul, LATE_RELEASE=late_release, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                  **pdl_args(x, M, pdl))
    b = bias if bias is not None else w
    if cfg.tma and _tma_ok(x, w):
        descs = (TensorDescriptor(x, [M, K], [x.stride(0), 1], [cfg.block_m, cfg.block_k]),
                 TensorDescriptor(w, [w.shape[0], K], [w.stride(0), 1], [cfg.block_n, cfg.block_k]))
        if cfg.persistent:
            programs = min(grid[0], sm_count_for(x))
            return _PERSISTENT_KERNELS[pick][(programs,)](*descs, b, out, M, N, K, out.stride(0), programs, **consts)
        return _TMA_KERNELS[pick][grid](*descs, b, out, M, N, K, out.stride(0), **consts)
    return _POINTER_KERNELS[pick][grid](x, w, b, out, M, N, K, x.stride(0), w.stride(0), out.stride(0),
                                        SWAP_AB=cfg.swap_ab, **consts)

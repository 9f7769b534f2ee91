"""GEMV / skinny GEMM for decode-sized batches: out[M, N] = x[M, K] @ W[N, K]^T + b.

Reference: ``reference.linear`` (torch.nn.functional.linear). Large M belongs to cuBLAS;
this kernel is for M <= ~8, where the product is a pass over the weights and the goal is
to stream them at close to the memory bandwidth.

Program (n, s) owns BLOCK_N weight rows and the s-th slice of K (K_PER_SPLIT columns). It
streams [BLOCK_N, BLOCK_K] tiles of W (each row a contiguous run of BLOCK_K elements, so
loads are wide) and keeps only a small fp32 accumulator, which leaves registers free for
many programs per SM, hence many loads in flight. With one split the kernel adds the bias
and writes the output; with several it writes fp32 partials that a small kernel sums.

Two ways to get enough programs for a skinny N (``split_k``):
- ``"auto"``: 16/32-row tiles and as many K splits as cover the SMs ~4x (two kernels when
  it splits: the GEMV and the reduce).
- ``"never"``: one kernel; the grid comes from rows alone, so BLOCK_N shrinks (down to 2
  rows at M = 1) until there are ~4 programs per SM. At M = 1 such a program keeps a
  [BLOCK_N, BLOCK_K] accumulator and reduces it once at the end (``defer_reduce``); at
  M > 1 a BLOCK_N under 16 (too narrow for ``tl.dot``) multiplies on the CUDA cores.

``silu_mul_gemv`` is the same kernel reading the fused gate|up activation: it loads gate
and up and applies SiLU(gate) * up to each K tile of x before the product, so the MLP's
down projection needs no separate activation kernel (reference: ``reference.silu_mul_linear``).
"""
from __future__ import annotations

import ast
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
import triton
import triton.language as tl

from . import reference
from ._util import (KERNEL_DTYPES, cdiv, check, check_device, check_linear, dot_precision, dot_upcast, interpreting,
                    mma, next_pow2, pdl_args, pdl_enter, sm_count_for)

linear_reference = reference.linear
silu_mul_linear_reference = reference.silu_mul_linear

SPLIT_K_MODES = ("auto", "never")


@dataclass(frozen=True)
class GemvConfig:
    block_n: int
    block_k: int
    split_k: int
    num_warps: int = 4
    num_stages: int = 3
    defer_reduce: bool = False  # M = 1: accumulate [BLOCK_N, BLOCK_K], reduce once after the K loop
    # M > 1 on tl.dot: out^T = w @ x^T, the weight tile as the MMA's A (M) side and the batch as its
    # N side: the converted int8 tile can feed the MMA from registers, and a 64-row MMA is filled
    # by weight rows instead of padded batch rows (BLOCK_N >= 64 then)
    swap_ab: bool = False


# Tuned configs are a plain mapping config_key(...) -> GemvConfig that the caller owns and passes
# (``configs=``): TritonOps holds the one for its GPU (``load_device_configs``), the lab's sweeps
# build their own (``parse_configs`` reads their JSON). Shapes without an entry use the heuristic.
GemvConfigs = Mapping[tuple, GemvConfig]


def config_key(M: int, N: int, K: int, silu_mul: bool = False) -> tuple:
    """The tuned-config key: (next_pow2(M), N, K), plus "silu_mul" for ``silu_mul_gemv`` (which
    falls back to the plain key when it has no entry of its own)."""
    key = (next_pow2(M), N, K)
    return key + ("silu_mul",) if silu_mul else key


def parse_config(text: str) -> GemvConfig:
    """A GemvConfig from its repr (as the bench JSON stores it), without eval."""
    node = ast.parse(text.strip(), mode="eval").body
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "GemvConfig"):
        raise ValueError(f"not a GemvConfig(...) repr: {text!r}")
    args = [ast.literal_eval(a) for a in node.args]
    return GemvConfig(*args, **{kw.arg: ast.literal_eval(kw.value) for kw in node.keywords})


def parse_configs(record: Mapping) -> dict[tuple, GemvConfig]:
    """Tuned configs as a new dict ``config_key -> GemvConfig`` (nothing is installed anywhere).

    ``record`` maps ``str(config_key(...))`` to ``repr(GemvConfig)``, as ``kernels_bench.json``
    holds them under ``gemv_tuned_configs`` (every config tuned in that run) and
    ``bench.sweep_m1_gemv_configs`` (the M = 1 sweep's). A whole record, or its ``bench`` dict,
    is also accepted (its ``gemv_tuned_configs``, else the sweep's)."""
    if any(name in record for name in ("bench", "gemv_tuned_configs", "sweep_m1_gemv_configs")):
        bench = record.get("bench", record)
        record = record.get("gemv_tuned_configs") or bench.get("sweep_m1_gemv_configs") or {}
    out = {}
    for key, text in record.items():
        k = ast.literal_eval(key) if isinstance(key, str) else key
        out[tuple(k)] = text if isinstance(text, GemvConfig) else parse_config(text)
    return out


CONFIG_DIR = Path(__file__).parent / "configs"  # <device slug>.json: configs tuned on that GPU


def device_config_path(device_name: str) -> Path:
    """``configs/nvidia_h200.json`` for "NVIDIA H200"."""
    return CONFIG_DIR / (re.sub(r"[^a-z0-9]+", "_", device_name.lower()).strip("_") + ".json")


def load_device_configs(device_name: str) -> dict[tuple, GemvConfig]:
    """The GEMV configs tuned on this GPU model if the package ships them (``python -m
    pageserve.lab.kernel_bench --parts sweep_m1`` measures them), else an empty dict."""
    path = device_config_path(device_name)
    if not path.exists():
        return {}
    with open(path) as f:
        return parse_configs(json.load(f))


@triton.jit
def _load_x(x_ptr, m, k, mmask, kmask, stride_xm, K, SILU_MUL: tl.constexpr, ONE_ROW: tl.constexpr):
    """The activation tile in x's dtype: [BLOCK_K] for one row, else [BLOCK_M, BLOCK_K]. With
    SILU_MUL, x is the gate|up output [M, 2K]: SiLU(gate) * up in fp32, rounded once to x's
    dtype (as ``silu_and_mul`` stores it)."""
    if ONE_ROW:
        ptrs = x_ptr + k
        mask = kmask
    else:
        ptrs = x_ptr + m[:, None] * stride_xm + k[None, :]
        mask = mmask[:, None] & kmask[None, :]
    x = tl.load(ptrs, mask=mask, other=0.0)
    if SILU_MUL:
        g = x.to(tl.float32)
        u = tl.load(ptrs + K, mask=mask, other=0.0).to(tl.float32)
        x = (g / (1.0 + tl.exp(-g)) * u).to(x.dtype)
    return x


@triton.jit
def _int8_to(w, like, UPCAST: tl.constexpr, MAGIC: tl.constexpr):
    """An int8 tile in ``like``'s dtype for tl.dot (exact: |q| <= 127). Under UPCAST (the CPU
    interpreter's bf16, see ``_util.dot_upcast``) straight to fp32: the interpreter stores bf16
    as raw uint16 and would convert the integers' values into those bits. MAGIC: without the
    int-to-float unit (``_int8_to_f32``); fp16 has its own exact trick (1024 + q + 128 under the
    exponent of 2^10, 10 mantissa bits), bf16 (7 bits: too few) goes through the fp32 one."""
    if UPCAST:
        return _int8_to_f32(w, MAGIC)
    if MAGIC:
        if like.dtype == tl.float16:
            b = w.to(tl.uint8, bitcast=True).to(tl.uint16)
            return ((b ^ 0x80) | 0x6400).to(tl.float16, bitcast=True) - 1152.0
        return _int8_to_f32(w, MAGIC).to(like.dtype)
    return w.to(like.dtype)


@triton.jit
def _int8x4_to_f32_ptx(w):
    """``_int8_to_f32``'s exponent trick in PTX, four weights at a time: one XOR flips the four
    bytes of a 32-bit word to q + 128, and a byte permute (PRMT) per weight places its byte under
    0x4B000000's exponent, giving the float 2^23 + q + 128 (bits returned as uint32). Per weight
    that is 1.25 instructions where the compiler's version of the same arithmetic emits a PRMT to
    extract the byte and a LOP3 to flip and OR it (2.25): scripts/gemv_sass.py counts both.
    Compiled code only (the CPU interpreter runs no PTX)."""
    return tl.inline_asm_elementwise(
        asm="""{
        .reg .b32 t;
        xor.b32 t, $4, 0x80808080;
        prmt.b32 $0, t, 0x4B000000, 0x7540;
        prmt.b32 $1, t, 0x4B000000, 0x7541;
        prmt.b32 $2, t, 0x4B000000, 0x7542;
        prmt.b32 $3, t, 0x4B000000, 0x7543;
        }""",
        constraints="=r,=r,=r,=r,r",
        args=[w],
        dtype=tl.uint32,
        is_pure=True,
        pack=4,
    )


@triton.jit
def _int8_to_f32(w, MAGIC: tl.constexpr):
    """An int8 tile as exact fp32 values. MAGIC 0: the int-to-float conversion (I2F), whose rate
    is a fraction of the FMA's (16 a clock per SM on recent GPUs, as we read NVIDIA's throughput
    table). MAGIC 1: the byte b = q mod 256, flipped to q + 128 and ORed under the exponent of
    2^23, is the float 2^23 + q + 128 exactly; one subtraction leaves q: a logic op and an FADD a
    weight instead of an I2F, for a GEMV that must turn ~4.4 G weights a ms into floats to stream
    int8 at the read bandwidth. MAGIC 2: the same floats built by ``_int8x4_to_f32_ptx`` (GPU only)."""
    if MAGIC == 2:
        return _int8x4_to_f32_ptx(w).to(tl.float32, bitcast=True) - 8388736.0
    if MAGIC == 1:
        b = w.to(tl.uint8, bitcast=True).to(tl.uint32)
        return ((b ^ 0x80) | 0x4B000000).to(tl.float32, bitcast=True) - 8388736.0
    return w.to(tl.float32)


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, scale_ptr, bias_ptr, out_ptr, part_ptr,
    M, N, K, K_PER_SPLIT, stride_xm, stride_wn, stride_om,
    HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, SILU_MUL: tl.constexpr, QUANT: tl.constexpr,
    MAGIC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    USE_DOT: tl.constexpr, DEFER_REDUCE: tl.constexpr,
    PREC: tl.constexpr, UPCAST: tl.constexpr, USE_PDL: tl.constexpr, W_VEC: tl.constexpr = 0,
    SWAP_AB: tl.constexpr = False,
):
    """Program (n, s): BLOCK_N output columns over the s-th K slice. QUANT: w is int8 with one
    scale per column (``gemv_int8``), applied once after the K loop (or by the reduce kernel to
    the partials' sum); without it ``scale_ptr`` is unused. MAGIC (with QUANT): int8 tiles are
    converted by exponent tricks (``_int8_to_f32``, ``_int8_to``) instead of the conversion unit.
    W_VEC (M = 1; ``weight_vector``): the weight tile is read W_VEC elements a thread, x's vector
    width, so its layout is x's and the product needs no shared-memory shuffle (0: the compiler's
    choice, which for int8 is 16 a thread against bf16 x's 8: scripts/gemv_sass.py). SWAP_AB (with
    USE_DOT): the product is accumulated transposed, [BLOCK_N, BLOCK_M] = w @ x^T (``GemvConfig.swap_ab``)."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n < N
    w_rows = w_ptr + n.to(tl.int64)[:, None] * stride_wn
    k_lo = pid_k * K_PER_SPLIT
    k_hi = tl.minimum(k_lo + K_PER_SPLIT, K)
    pdl_enter(USE_PDL)
    m = tl.arange(0, BLOCK_M)
    mmask = m < M
    if BLOCK_M == 1:
        if DEFER_REDUCE:
            acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
        else:
            acc = tl.zeros([BLOCK_N], tl.float32)
    elif SWAP_AB:
        acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        kmask = k < k_hi
        if W_VEC > 0 and BLOCK_M == 1:
            kw = tl.max_contiguous(k, W_VEC)  # true (k is contiguous over BLOCK_K), and caps the vector at W_VEC
        else:
            kw = k
        w = tl.load(w_rows + kw[None, :], mask=nmask[:, None] & kmask[None, :], other=0.0)  # [BLOCK_N, BLOCK_K]
        x = _load_x(x_ptr, m, k, mmask, kmask, stride_xm, K, SILU_MUL, BLOCK_M == 1)
        if BLOCK_M == 1:  # x: [BLOCK_K]
            if QUANT:
                wf = _int8_to_f32(w, MAGIC)
            else:
                wf = w.to(tl.float32)
            if DEFER_REDUCE:
                acc += wf * x.to(tl.float32)[None, :]
            else:
                acc += tl.sum(wf * x.to(tl.float32)[None, :], axis=1)
        elif USE_DOT:
            if QUANT:  # q -> x's dtype is exact (|q| <= 127)
                wt = _int8_to(w, x, UPCAST, MAGIC)
            else:
                wt = w
            if SWAP_AB:
                acc += mma(wt, tl.trans(x), PREC, UPCAST)
            else:
                acc += mma(x, tl.trans(wt), PREC, UPCAST)
        else:  # BLOCK_N < 16: too narrow for tl.dot, multiply-add on the CUDA cores
            if QUANT:
                wf = _int8_to_f32(w, MAGIC)
            else:
                wf = w.to(tl.float32)
            acc += tl.sum(x.to(tl.float32)[:, None, :] * wf[None, :, :], axis=2)
    if BLOCK_M == 1:
        if DEFER_REDUCE:
            acc2 = tl.sum(acc, axis=1)[None, :]
        else:
            acc2 = acc[None, :]
    elif SWAP_AB:
        acc2 = tl.trans(acc)
    else:
        acc2 = acc
    store_rows(acc2, m, n, mmask, nmask, pid_k, M, N, part_ptr, out_ptr, scale_ptr, bias_ptr, stride_om,
               SPLIT, QUANT, HAS_BIAS)


@triton.jit
def store_rows(y, m, n, mmask, nmask, pid_k, M, N, part_ptr, out_ptr, scale_ptr, bias_ptr, stride_om,
               SPLIT: tl.constexpr, QUANT: tl.constexpr, HAS_BIAS: tl.constexpr):
    """A program's [rows, BLOCK_N] fp32 result y: with SPLIT its unscaled partial for K slice pid_k
    (the reduce kernel scales (QUANT) and biases their sum), else y [* scale] [+ bias], rounded once."""
    omask = mmask[:, None] & nmask[None, :]
    if SPLIT:
        tl.store(part_ptr + (pid_k * M + m)[:, None].to(tl.int64) * N + n[None, :], y, mask=omask)
    else:
        if QUANT:
            y = y * tl.load(scale_ptr + n, mask=nmask, other=0.0).to(tl.float32)[None, :]
        if HAS_BIAS:
            y += tl.load(bias_ptr + n, mask=nmask, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + m[:, None] * stride_om + n[None, :], y.to(out_ptr.dtype.element_ty), mask=omask)


@triton.jit
def _gemv_reduce_kernel(part_ptr, scale_ptr, bias_ptr, out_ptr, M, N, stride_om, SPLITS: tl.constexpr,
                        HAS_BIAS: tl.constexpr, QUANT: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    """out = (sum of the SPLITS partials, in order) [* scale] [+ bias], rounded once."""
    pdl_enter(USE_PDL)
    m = tl.program_id(1)
    n = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    nmask = n < N
    acc = tl.zeros([BLOCK], tl.float32)
    for s in range(SPLITS):
        acc += tl.load(part_ptr + (s * M + m).to(tl.int64) * N + n, mask=nmask, other=0.0)
    if QUANT:
        acc = acc * tl.load(scale_ptr + n, mask=nmask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + n, mask=nmask, other=0.0).to(tl.float32)
    tl.store(out_ptr + m * stride_om + n, acc.to(out_ptr.dtype.element_ty), mask=nmask)


def reduce_splits(part: torch.Tensor, scale: torch.Tensor | None, bias: torch.Tensor | None, out: torch.Tensor,
                  launch: dict) -> None:
    """out[M, N] = the sum of part[splits, M, N] [* scale] [+ bias] (the split-K epilogue)."""
    splits, M, N = part.shape
    BLOCK = 256
    anything = bias if bias is not None else scale if scale is not None else part  # unused pointers
    _gemv_reduce_kernel[(cdiv(N, BLOCK), M)](
        part, anything if scale is None else scale, anything if bias is None else bias, out, M, N, out.stride(0),
        SPLITS=splits, HAS_BIAS=bias is not None, QUANT=scale is not None, BLOCK=BLOCK, num_warps=2, **launch,
    )


def gemv_config(M: int, N: int, K: int, sms: int, split_k: str = "auto", configs: GemvConfigs | None = None,
                silu_mul: bool = False) -> GemvConfig:
    """The entry of ``configs`` (tuned, keyed by ``config_key``) if present (under ``"never"``: only
    a one-split entry), else the heuristic. ``silu_mul``: for ``silu_mul_gemv`` (its own entry
    first, then the plain one). ``configs`` None or empty: the heuristic.

    ``"auto"``: 16-row tiles (32 at M > 1), 256-512 wide K tiles, and enough K splits that
    the grid covers the SMs about four times, each split at least two tiles long.
    ``"never"``: no split; the largest power-of-two BLOCK_N (at most 16 at M = 1, 32 above)
    that still gives ~4 programs per SM, but at least 2 rows (4 at M > 1). Where rows alone
    already give that many programs (gate_up, lm_head) this is the "auto" tile.
    """
    if split_k not in SPLIT_K_MODES:
        raise ValueError(f"split_k must be one of {SPLIT_K_MODES}, got {split_k!r}")
    tuned = None
    if configs:
        tuned = configs.get(config_key(M, N, K, silu_mul))
        if tuned is None:
            tuned = configs.get(config_key(M, N, K))
        if tuned is None and M > SKINNY_M:  # its own kind's nearest entry first, then the plain one's
            tuned = nearest_tuned(configs, M, N, K, silu_mul)
            if tuned is None and silu_mul:
                tuned = nearest_tuned(configs, M, N, K)
    if tuned is not None and (split_k == "auto" or tuned.split_k == 1):
        return tuned
    return _heuristic_config(M, N, K, sms, split_k)


SKINNY_M = 8  # above this many rows the GEMV's tl.dot tiles are a skinny GEMM (sweeps: kernel_bench --gemv-batches)


def nearest_tuned(configs: Mapping, M: int, N: int, K: int, silu_mul: bool = False) -> "GemvConfig | None":
    """For a skinny M (> SKINNY_M) with no entry of its own: the entry of the smallest tuned M' >= M
    (also > SKINNY_M) for the same (N, K[, silu_mul]) — the decode graphs' buckets (16, 32, 48, 64)
    then share the configs a sweep measured at a few of them. None if there is none."""
    best = None
    for key, cfg in configs.items():
        if len(key) < 3 or key[1:3] != (N, K) or (len(key) == 4) != silu_mul:
            continue
        m = key[0]
        if SKINNY_M < m and M <= m and (best is None or m < best[0]):
            best = (m, cfg)
    return None if best is None else best[1]


def _heuristic_config(M: int, N: int, K: int, sms: int, split_k: str) -> GemvConfig:
    if split_k == "never":
        lo, hi = (2, 16) if M == 1 else (4, 32)
        block_n = hi
        while block_n > lo and cdiv(N, block_n) < 4 * sms:
            block_n //= 2
        if M == 1:
            block_k = 512 if K >= 2048 else 256
            # a [BLOCK_N, BLOCK_K] fp32 accumulator only where it stays small (<= 32 registers a thread)
            return GemvConfig(block_n=block_n, block_k=block_k, split_k=1, defer_reduce=block_n * block_k <= 4096)
        return GemvConfig(block_n=block_n, block_k=128, split_k=1, num_stages=4)
    block_n = 16 if M == 1 else 32
    block_k = 512 if (M == 1 and K >= 2048) else 256 if M == 1 else 64
    row_blocks = cdiv(N, block_n)
    split = max(1, min(cdiv(4 * sms, row_blocks), K // (2 * block_k)))
    return GemvConfig(block_n=block_n, block_k=block_k, split_k=split, num_warps=4)


def weight_vector(x_elem_size: int, quant: bool, match_x: bool = True) -> int:
    """The M = 1 GEMV's ``W_VEC``: int8 weights read in x's 16-byte vector width (8 elements for
    bf16/fp16 x, 4 for fp32), so the weight tile and x share one register layout. 0 (the
    compiler's 16-byte int8 vectors) for float weights, which already match, and when
    ``match_x`` is False (the A/B: at ca551bec that layout cost 2 STS.128, 4 LDS.128 and 4
    BAR.SYNC a K-loop trip, and the int8 GEMV streamed at 2.36 TB/s; scripts/gemv_sass.py)."""
    return 16 // x_elem_size if quant and match_x else 0


MAGIC_MODES = {"cvt": 0, "ops": 1, "ptx": 2}


def magic_code(magic: bool | str) -> int:
    """The kernels' MAGIC for an int8 to fp32 conversion mode (``_int8_to_f32``): "cvt" (or
    False) the conversion unit, "ops" the exponent trick in Triton ops, "ptx" the same values by
    ``_int8x4_to_f32_ptx`` (compiled code only); True, the default: "ptx", or "ops" on the CPU
    interpreter, which runs no PTX."""
    if magic is True:
        magic = "ops" if interpreting() else "ptx"
    elif magic is False:
        magic = "cvt"
    if magic not in MAGIC_MODES:
        raise ValueError(f"magic must be True, False or one of {sorted(MAGIC_MODES)}, got {magic!r}")
    if magic == "ptx" and interpreting():
        raise ValueError("magic='ptx' needs compiled kernels (the CPU interpreter runs no PTX)")
    return MAGIC_MODES[magic]


def gemv_tiles(M: int, K: int, cfg: GemvConfig) -> tuple[int, int, int, bool]:
    """What ``launch_gemv`` derives from a config for M rows of K: (K_PER_SPLIT, splits, BLOCK_M,
    USE_DOT). Its own function so that the offline audit (scripts/t4_compile_audit.py) compiles the
    very tiles a launch gets."""
    k_per_split = cdiv(cdiv(K, cfg.split_k), cfg.block_k) * cfg.block_k
    use_dot = M > 1 and cfg.block_n >= 16
    block_m = 1 if M == 1 else max(16, next_pow2(M)) if use_dot else next_pow2(M)
    return k_per_split, cdiv(K, k_per_split), block_m, use_dot


def launch_gemv(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None, bias: torch.Tensor | None,
                out: torch.Tensor, cfg: GemvConfig, pdl: bool | None, silu_mul: bool = False,
                magic: bool | str = True, match_x: bool = True) -> torch.Tensor:
    """One GEMV over checked arguments with its config chosen: ``weight`` in x's dtype
    (``scale`` None) or int8 with a per-column ``scale`` (``gemv_int8``; ``magic``: its int8 to
    fp32 conversion, ``magic_code``; ``match_x``:
    int8 read in x's vector width at M = 1, ``weight_vector``)."""
    M, N, K = x.shape[0], weight.shape[0], weight.shape[1]
    if M == 0 or N == 0:
        return out
    k_per_split, splits, block_m, use_dot = gemv_tiles(M, K, cfg)
    part = torch.empty((splits, M, N), dtype=torch.float32, device=x.device) if splits > 1 else out
    anything = weight if scale is None else scale  # unused pointers point at something valid
    launch = pdl_args(x, M, pdl)
    _gemv_kernel[(cdiv(N, cfg.block_n), splits)](
        x, weight, anything if scale is None else scale, bias if bias is not None else anything, out, part,
        M, N, K, k_per_split, x.stride(0), weight.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, SPLIT=splits > 1, SILU_MUL=silu_mul, QUANT=scale is not None,
        MAGIC=magic_code(magic) if scale is not None else 0, BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        USE_DOT=use_dot, DEFER_REDUCE=cfg.defer_reduce and M == 1,
        PREC=dot_precision(x.dtype), UPCAST=dot_upcast(x.dtype),
        W_VEC=weight_vector(x.element_size(), scale is not None, match_x) if M == 1 else 0,
        SWAP_AB=cfg.swap_ab and use_dot,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **launch,
    )
    if splits > 1:
        reduce_splits(part, scale, bias, out, launch)
    return out


def _launch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor,
            config: GemvConfig | None, split_k: str, configs: GemvConfigs | None, pdl: bool | None,
            silu_mul: bool = False) -> torch.Tensor:
    M, N, K = x.shape[0], weight.shape[0], weight.shape[1]
    if M == 0 or N == 0:
        return out
    cfg = config or gemv_config(M, N, K, sm_count_for(x), split_k, configs, silu_mul=silu_mul)
    return launch_gemv(x, weight, None, bias, out, cfg, pdl, silu_mul)


def _check_out(out, M, N, x) -> torch.Tensor:
    out = torch.empty((M, N), dtype=x.dtype, device=x.device) if out is None else out
    check("out", out, shape=(M, N), dtype=x.dtype)
    return out


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
         config: GemvConfig | None = None, out: torch.Tensor | None = None, split_k: str = "auto",
         configs: GemvConfigs | None = None, pdl: bool | None = None) -> torch.Tensor:
    """x: [M, K] (M small), weight: [N, K] row-major, bias: [N] or None -> [M, N].
    ``config``: this launch's tiles; without it the entry of ``configs`` (tuned, keyed by
    ``config_key``) for this shape, else the ``split_k`` ("auto" | "never") heuristic.
    ``pdl``: see ``_util.use_pdl``."""
    M, N, K = check_linear(x, weight, bias)
    if M > 64:
        raise ValueError(f"gemv is for small M (got M={M}); use torch.nn.functional.linear")
    return _launch(x, weight, bias, _check_out(out, M, N, x), config, split_k, configs, pdl)


def silu_mul_gemv(gate_up: torch.Tensor, weight: torch.Tensor, config: GemvConfig | None = None,
                  out: torch.Tensor | None = None, split_k: str = "auto", configs: GemvConfigs | None = None,
                  pdl: bool | None = None) -> torch.Tensor:
    """gate_up: [M, 2I] (gate | up, M small), weight: [N, I] -> SiLU(gate) * up @ weight^T: [M, N],
    in one pass (plus the split-K reduce when the config splits). ``config`` / ``configs`` /
    ``split_k`` / ``pdl`` as ``gemv`` (its own ``config_key(..., silu_mul=True)`` entry first)."""
    check("gate_up", gate_up, ndim=2, dtype=KERNEL_DTYPES)
    M, I2 = gate_up.shape
    if I2 % 2:
        raise ValueError(f"gate_up: last dim must be even (gate|up), got {I2}")
    check("weight", weight, shape=(None, I2 // 2), dtype=gate_up.dtype)
    check_device(gate_up=gate_up, weight=weight)
    if M > 64:
        raise ValueError(f"silu_mul_gemv is for small M (got M={M})")
    return _launch(gate_up, weight, None, _check_out(out, M, weight.shape[0], gate_up), config, split_k, configs,
                   pdl, silu_mul=True)

"""INT8 weight-only linears (W8A16): out[M, N] = (x[M, K] @ q[N, K]^T) * scale[N] + b.

The weight is stored as int8 with one scale per output row (``reference.quantize_int8``); the
activations stay in the model dtype. References: ``reference.linear_int8`` and
``reference.silu_mul_linear_int8`` (dequantize, then the float product).

Three kernels, for three regimes:

- ``gemv_int8`` (decode, M <= 8): the bf16 GEMV's kernel (``gemv.py``) with QUANT on: program (n, s)
  streams [BLOCK_N, BLOCK_K] int8 tiles of its rows over the s-th K slice, converts them in
  registers and accumulates x * q in fp32; the scale is applied once per output column after
  the K loop (a column's scale is a constant factor of its whole dot product). Half the bytes
  of the bf16 weight, so the same number of programs moves twice the columns per load: the
  heuristic's M = 1 tile is 2 rows x 2048 int8 columns (4 KB, the bytes of the bf16 GEMV's
  tuned 2 x 1024 tile) with the deferred reduction. Split-K partials are unscaled fp32; the
  reduce kernel applies scale and bias. ``silu_mul_gemv_int8`` reads the gate|up activation
  and applies SiLU(gate) * up to each K tile (the fused down projection).
- ``gemm_int8`` (larger M): a tiled ``tl.dot`` GEMM whose B tiles are int8 converted to the
  activation dtype in registers (exact: |q| <= 127 fits any of fp16/bf16/fp32), scale and bias
  in the epilogue (or, split-K where the output tiles are too few for the SMs, in the reduce). Reads half the weight bytes of a bf16 GEMM: the choice while the product is
  still memory-bound (decode batches of tens to a few hundred rows).
- ``dequantize_int8`` (prefill): writes q * scale to a float buffer once per call, after which
  cuBLAS runs the product. Costs one read of q and one write of the float weight per call,
  negligible against a long prefill chunk's FLOPs; ``TritonOps(int8_gemm=...)`` picks between
  this and ``gemm_int8`` by M. (Running the two slice by slice through one L2-sized scratch was
  slower at every M on the H200: NOTES.md, commit 929b1e8.)

Tuned configs: a mapping ``int8_config_key(...) -> GemvConfig | Int8GemmConfig`` that the caller
owns and passes (``configs=``), like the bf16 GEMVs; ``load_int8_device_configs`` reads the
``int8_tuned_configs`` section of ``configs/<gpu>.json``; shapes without an entry use the heuristics.
"""
from __future__ import annotations

import ast
import json
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from . import reference
from ._util import (KERNEL_DTYPES, cdiv, check, check_device, dot_precision, dot_upcast, grouped_tile, mma, next_pow2,
                    pdl_args, pdl_enter, sm_count_for)
from .gemv import SPLIT_K_MODES, GemvConfig, _int8_to, device_config_path, launch_gemv, magic_code, reduce_splits

linear_int8_reference = reference.linear_int8
silu_mul_linear_int8_reference = reference.silu_mul_linear_int8
quantize_int8 = reference.quantize_int8


@dataclass(frozen=True)
class Int8GemmConfig:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3
    group_m: int = 8  # programs walk GROUP_M row tiles per column tile (the weight tile stays in L2)
    split_k: int = 1  # K slices in parallel (fp32 partials, then the GEMV's reduce kernel scales their sum)


Int8Configs = Mapping[tuple, "GemvConfig | Int8GemmConfig"]

# ``silu_mul_gemv_int8`` applies SiLU(gate) * up to its K tile in every program, so each gate|up
# element is activated cdiv(N, BLOCK_N) times: its row tiles are at least this tall.
SILU_MIN_ROWS = 16


def int8_config_key(M: int, N: int, K: int, kind: str = "gemv") -> tuple:
    """The tuned-config key: (next_pow2(M), N, K, "int8") for ``gemv_int8``, with "silu_mul" added
    for ``silu_mul_gemv_int8`` (which falls back to the plain entry), (…, "int8_gemm") for ``gemm_int8``."""
    if kind not in ("gemv", "silu_mul", "gemm"):
        raise ValueError(f"kind must be gemv, silu_mul or gemm, got {kind!r}")
    key = (next_pow2(M), N, K)
    return key + ("int8_gemm",) if kind == "gemm" else key + ("int8", "silu_mul") if kind == "silu_mul" else key + ("int8",)


def parse_int8_configs(record: Mapping) -> dict[tuple, "GemvConfig | Int8GemmConfig"]:
    """``str(int8_config_key(...)) -> repr(config)`` (the ``int8_tuned_configs`` section of a device
    JSON, or that JSON whole) as a new dict ``key -> GemvConfig | Int8GemmConfig``, without eval."""
    record = record.get("int8_tuned_configs", record) if "int8_tuned_configs" in record else record
    classes = {"GemvConfig": GemvConfig, "Int8GemmConfig": Int8GemmConfig}
    out = {}
    for key, text in record.items():
        k = tuple(ast.literal_eval(key) if isinstance(key, str) else key)
        if isinstance(text, (GemvConfig, Int8GemmConfig)):
            out[k] = text
            continue
        node = ast.parse(str(text).strip(), mode="eval").body
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in classes):
            raise ValueError(f"not a GemvConfig(...) or Int8GemmConfig(...) repr: {text!r}")
        args = [ast.literal_eval(a) for a in node.args]
        out[k] = classes[node.func.id](*args, **{kw.arg: ast.literal_eval(kw.value) for kw in node.keywords})
    return out


def load_int8_device_configs(device_name: str) -> dict[tuple, "GemvConfig | Int8GemmConfig"]:
    """The int8 configs tuned on this GPU model (``int8_tuned_configs`` in ``configs/<gpu>.json``), else {}."""
    path = device_config_path(device_name)
    if not path.exists():
        return {}
    with open(path) as f:
        record = json.load(f)
    return parse_int8_configs(record["int8_tuned_configs"]) if "int8_tuned_configs" in record else {}


# ---------------------------------------------------------------------------- decode: the GEMV
# the kernels are gemv.py's with QUANT on (int8 tiles, per-column scale in the epilogue)


def gemv_int8_config(M: int, N: int, K: int, sms: int, split_k: str = "auto", configs: Int8Configs | None = None,
                     silu_mul: bool = False) -> GemvConfig:
    """The tuned entry of ``configs`` (``int8_config_key``; under ``"never"`` only a one-split one),
    else the heuristic.

    M = 1: 2-row tiles, BLOCK_K up to 2048 int8 columns (4 KB a tile, what the bf16 GEMV's tuned
    2 x 1024 tile reads), the [2, BLOCK_K] fp32 accumulator reduced once after the K loop; K split
    (``"auto"``) only where rows alone give fewer than 4 programs per SM. ``silu_mul`` at M = 1:
    ``SILU_MIN_ROWS``-row tiles of 512 columns, K split to ~4 programs per SM (its own tuned entry,
    else the plain one only if it is that tall: see ``SILU_MIN_ROWS``).
    M = 2..8: 32-row tiles of 128 int8 columns on ``tl.dot`` (x padded to 16 rows), K split until
    the grid covers the SMs ~4x, each split at least two tiles long (``"never"``: 16-row tiles, no split);
    at 5-8 rows, without an entry of their own, the tuned 16-row entry where there is one (H200, the graphed
    3B step at 8 rows 2.49 -> 2.21 ms on the 16-row tiles: diagnostics/det_b1_switches_int8_5_8_a2e8d86.*).
    M = 9..64 (``TritonOps(int8_gemv_max_m=)``: decode batches): 32-row tiles up to 16 rows, 64 above,
    K split only where the row tiles give under 2 programs per SM.
    """
    if split_k not in SPLIT_K_MODES:
        raise ValueError(f"split_k must be one of {SPLIT_K_MODES}, got {split_k!r}")
    if configs:
        tuned = configs.get(int8_config_key(M, N, K, "silu_mul" if silu_mul else "gemv"))
        if tuned is None and silu_mul:
            plain = configs.get(int8_config_key(M, N, K))
            # the plain GEMV's tuned M = 1 tiles are 1-2 rows: fused, every program would apply SiLU
            # to the whole gate|up row (2,048 programs x 11,008 columns at the 3B down shape)
            tuned = plain if isinstance(plain, GemvConfig) and plain.block_n >= SILU_MIN_ROWS else None
        if tuned is None and not silu_mul and 4 < M <= 8:
            tuned = configs.get(int8_config_key(16, N, K))
        if isinstance(tuned, GemvConfig) and (split_k == "auto" or tuned.split_k == 1):
            return tuned
    if M == 1 and silu_mul:
        # SiLU(gate) * up is recomputed by each row tile: 16-row tiles (as the bf16 GEMV's tuned
        # fused down) and K split until the grid covers the SMs ~4x
        block_n, block_k = SILU_MIN_ROWS, 512
        split = 1
        if split_k == "auto":
            split = max(1, min(cdiv(4 * sms, cdiv(N, block_n)), K // (2 * block_k)))
        return GemvConfig(block_n=block_n, block_k=block_k, split_k=split)
    if M == 1:
        block_n, block_k = 2, min(2048, max(64, next_pow2(K)))
        split = 1
        if split_k == "auto" and cdiv(N, block_n) < 4 * sms:
            split = max(1, min(cdiv(4 * sms, cdiv(N, block_n)), K // (2 * block_k)))
        return GemvConfig(block_n=block_n, block_k=block_k, split_k=split, defer_reduce=block_n * block_k <= 4096)
    if split_k == "never":
        return GemvConfig(block_n=16, block_k=128, split_k=1, num_stages=4)
    if M <= 8:
        block_n, block_k = 32, 128
        split = max(1, min(cdiv(4 * sms, cdiv(N, block_n)), K // (2 * block_k)))
        return GemvConfig(block_n=block_n, block_k=block_k, split_k=split, num_warps=4)
    # M = 9..64 (a split-K skinny GEMM): taller row tiles as M grows, since every row tile re-reads
    # x [M, K] from L2; K split only where the rows give under two programs per SM, because the fp32
    # partials (splits x M x N x 4 bytes) now cost a share of the weight bytes
    block_n, block_k = (32 if M <= 16 else 64), 128
    rows = cdiv(N, block_n)
    split = 1 if rows >= 2 * sms else max(1, min(cdiv(2 * sms, rows), K // (2 * block_k)))
    return GemvConfig(block_n=block_n, block_k=block_k, split_k=split, num_warps=4)


def _check_int8(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, K: int) -> int:
    check("qweight", qweight, shape=(None, K), dtype=torch.int8)
    N = qweight.shape[0]
    check("scale", scale, shape=(N,), dtype=x.dtype)
    return N


def _check_linear_int8(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor,
                       bias: torch.Tensor | None) -> tuple[int, int, int]:
    """M, N, K of x [M, K] @ (qweight [N, K] int8 * scale [N])^T + bias [N], every argument checked."""
    check("x", x, ndim=2, dtype=KERNEL_DTYPES)
    M, K = x.shape
    N = _check_int8(x, qweight, scale, K)
    tensors = dict(x=x, qweight=qweight, scale=scale)
    if bias is not None:
        check("bias", bias, shape=(N,), dtype=x.dtype)
        tensors["bias"] = bias
    check_device(**tensors)
    return M, N, K


def _check_gate_up_int8(gate_up: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor) -> tuple[int, int]:
    """M, N of the fused down projection: gate_up [M, 2I] (gate | up), qweight [N, I] int8, scale [N]."""
    check("gate_up", gate_up, ndim=2, dtype=KERNEL_DTYPES)
    M, I2 = gate_up.shape
    if I2 % 2:
        raise ValueError(f"gate_up: last dim must be even (gate|up), got {I2}")
    N = _check_int8(gate_up, qweight, scale, I2 // 2)
    check_device(gate_up=gate_up, qweight=qweight, scale=scale)
    return M, N


def _out(out: torch.Tensor | None, M: int, N: int, x: torch.Tensor) -> torch.Tensor:
    out = torch.empty((M, N), dtype=x.dtype, device=x.device) if out is None else out
    check("out", out, shape=(M, N), dtype=x.dtype)
    return out


def _launch_gemv(x, qweight, scale, bias, out, config, split_k, configs, pdl, silu_mul=False,
                 magic=True, match_x=True) -> torch.Tensor:
    M, N, K = x.shape[0], qweight.shape[0], qweight.shape[1]
    if M == 0 or N == 0:
        return out
    cfg = config or gemv_int8_config(M, N, K, sm_count_for(x), split_k, configs, silu_mul=silu_mul)
    return launch_gemv(x, qweight, scale, bias, out, cfg, pdl, silu_mul, magic, match_x)


def gemv_int8(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
              config: GemvConfig | None = None, out: torch.Tensor | None = None, split_k: str = "auto",
              configs: Int8Configs | None = None, pdl: bool | None = None, magic: bool | str = True,
              match_x: bool = True) -> torch.Tensor:
    """x: [M, K] (M small), qweight: [N, K] int8, scale: [N] and bias: [N] or None in x's dtype -> [M, N].
    ``config`` / ``configs`` / ``split_k`` / ``pdl`` as ``gemv.gemv`` (configs keyed by ``int8_config_key``).
    ``magic``: int8 to fp32 on the CUDA cores by an exponent trick instead of the conversion unit
    (``gemv._int8_to_f32``; the same values exactly): True (in PTX where compiled), "ops" (in
    Triton ops), False (the plain conversion): ``gemv.magic_code``.
    ``match_x``: at M = 1 the int8 tile is read in x's vector width (``gemv.weight_vector``);
    False: in its own 16-byte vectors, for comparison."""
    M, N, K = _check_linear_int8(x, qweight, scale, bias)
    if M > 64:
        raise ValueError(f"gemv_int8 is for small M (got M={M}); use gemm_int8 or dequantize_int8 + linear")
    return _launch_gemv(x, qweight, scale, bias, _out(out, M, N, x), config, split_k, configs, pdl, magic=magic,
                        match_x=match_x)


def silu_mul_gemv_int8(gate_up: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor,
                       config: GemvConfig | None = None, out: torch.Tensor | None = None, split_k: str = "auto",
                       configs: Int8Configs | None = None, pdl: bool | None = None, magic: bool | str = True,
                       match_x: bool = True) -> torch.Tensor:
    """gate_up: [M, 2I] (gate | up, M small), qweight: [N, I] int8, scale: [N] ->
    (SiLU(gate) * up) @ (q * scale)^T: [M, N], in one pass (plus the reduce when split); ``magic`` and
    ``match_x`` as ``gemv_int8``."""
    M, N = _check_gate_up_int8(gate_up, qweight, scale)
    if M > 64:
        raise ValueError(f"silu_mul_gemv_int8 is for small M (got M={M})")
    return _launch_gemv(gate_up, qweight, scale, None, _out(out, M, N, gate_up), config, split_k, configs, pdl,
                        silu_mul=True, magic=magic, match_x=match_x)


# ---------------------------------------------------------------------------- larger M: the GEMM
@triton.jit
def _gemm_int8_kernel(
    x_ptr, q_ptr, scale_ptr, bias_ptr, out_ptr, part_ptr, M, N, K, K_PER_SPLIT, stride_xm, stride_qn, stride_om,
    HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr, USE_PDL: tl.constexpr,
    MAGIC: tl.constexpr,
):
    pid_m, pid_n = grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mmask, nmask = m < M, n < N
    x_rows = x_ptr + m.to(tl.int64)[:, None] * stride_xm
    q_rows = q_ptr + n.to(tl.int64)[:, None] * stride_qn
    pid_k = tl.program_id(1)
    k_lo = pid_k * K_PER_SPLIT
    k_hi = tl.minimum(k_lo + K_PER_SPLIT, K)
    pdl_enter(USE_PDL)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        kmask = k < k_hi
        a = tl.load(x_rows + k[None, :], mask=mmask[:, None] & kmask[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
        w = tl.load(q_rows + k[None, :], mask=nmask[:, None] & kmask[None, :], other=0)  # [BLOCK_N, BLOCK_K] int8
        acc += mma(a, tl.trans(_int8_to(w, a, UPCAST, MAGIC)), PREC, UPCAST)
    if SPLIT:  # unscaled partials [splits, M, N]; the reduce kernel scales their sum
        tl.store(part_ptr + (pid_k * M + m).to(tl.int64)[:, None] * N + n[None, :], acc,
                 mask=mmask[:, None] & nmask[None, :])
        return
    acc = acc * tl.load(scale_ptr + n, mask=nmask, other=0.0).to(tl.float32)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + n, mask=nmask, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + m.to(tl.int64)[:, None] * stride_om + n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=mmask[:, None] & nmask[None, :])


def gemm_int8_config(M: int, N: int, K: int, configs: Int8Configs | None = None, sms: int = 132) -> Int8GemmConfig:
    """The tuned entry (``int8_config_key(M, N, K, "gemm")``) or the heuristic: row tiles of 16-128
    (the smallest power of two >= M up to 64, then 128), 64-wide column tiles up to M = 64 (more
    programs for the memory-bound batches) and 128 above, 128 int8 columns of K per step (64 at
    128-row tiles). K is split where the output tiles alone give under two programs per SM (on the
    H200 at M = 64 the 2048-row shapes had 32 tiles: a quarter of the SMs streamed the weights)."""
    if configs:
        tuned = configs.get(int8_config_key(M, N, K, "gemm"))
        if isinstance(tuned, Int8GemmConfig):
            return tuned
    block_m = min(max(16, next_pow2(M)), 128)
    if block_m <= 64:
        block_n, block_k, warps, stages = 64, 128, 4, 4
    else:
        block_m, block_n, block_k, warps, stages = 128, 128, 64, 8, 3
    tiles = cdiv(M, block_m) * cdiv(N, block_n)
    split = 1 if tiles >= 2 * sms else max(1, min(cdiv(2 * sms, tiles), K // (4 * block_k)))
    return Int8GemmConfig(block_m=block_m, block_n=block_n, block_k=block_k, num_warps=warps, num_stages=stages,
                          split_k=split)


def gemm_int8(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
              config: Int8GemmConfig | None = None, out: torch.Tensor | None = None,
              configs: Int8Configs | None = None, pdl: bool | None = None, magic: bool | str = True) -> torch.Tensor:
    """x: [M, K] (any M), qweight: [N, K] int8, scale / bias: [N] in x's dtype -> [M, N]; int8
    tiles dequantized in registers, fp32 accumulation, scale and bias in the epilogue. ``magic``
    as ``gemv_int8`` (the tile's conversion without the int-to-float unit)."""
    M, N, K = _check_linear_int8(x, qweight, scale, bias)
    out = _out(out, M, N, x)
    if M == 0 or N == 0:
        return out
    cfg = config or gemm_int8_config(M, N, K, configs, sm_count_for(x))
    k_per_split = cdiv(cdiv(K, cfg.split_k), cfg.block_k) * cfg.block_k
    splits = cdiv(K, k_per_split)
    part = torch.empty((splits, M, N), dtype=torch.float32, device=x.device) if splits > 1 else out
    b = bias if bias is not None else scale  # unused pointers point at something valid
    launch = pdl_args(x, M, pdl)
    _gemm_int8_kernel[(cdiv(M, cfg.block_m) * cdiv(N, cfg.block_n), splits)](
        x, qweight, scale, b, out, part, M, N, K, k_per_split, x.stride(0), qweight.stride(0),
        out.stride(0), HAS_BIAS=bias is not None, SPLIT=splits > 1, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m, PREC=dot_precision(x.dtype), UPCAST=dot_upcast(x.dtype),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, MAGIC=magic_code(magic), **launch,
    )
    if splits > 1:
        reduce_splits(part, scale, bias, out, launch)
    return out


# ---------------------------------------------------------------------------- prefill: dequantize, then cuBLAS
@triton.jit
def _dequant_kernel(q_ptr, scale_ptr, out_ptr, N, K, stride_qn, stride_on,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr):
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (n < N)[:, None] & (k < K)[None, :]
    pdl_enter(USE_PDL)
    q = tl.load(q_ptr + n.to(tl.int64)[:, None] * stride_qn + k[None, :], mask=mask, other=0)
    s = tl.load(scale_ptr + n, mask=n < N, other=0.0)
    w = (q.to(tl.float32) * s.to(tl.float32)[:, None]).to(s.dtype)  # exact product, rounded once: as q * s in s's dtype
    tl.store(out_ptr + n.to(tl.int64)[:, None] * stride_on + k[None, :], w, mask=mask)


def dequantize_int8(qweight: torch.Tensor, scale: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """qweight: [N, K] int8, scale: [N] -> q * scale: [N, K] in scale's dtype (``out`` may be a
    reused buffer of that shape). Equal to ``reference.dequantize_int8`` bit for bit."""
    check("scale", scale, ndim=1, dtype=KERNEL_DTYPES)
    check("qweight", qweight, shape=(scale.shape[0], None), dtype=torch.int8)
    check_device(qweight=qweight, scale=scale)
    N, K = qweight.shape
    out = torch.empty((N, K), dtype=scale.dtype, device=scale.device) if out is None else out
    check("out", out, shape=(N, K), dtype=scale.dtype)
    if N == 0 or K == 0:
        return out
    BLOCK_N, BLOCK_K = 16, 256
    # the prefill path (large M): launched without PDL, like every launch over more than 8 rows
    _dequant_kernel[(cdiv(N, BLOCK_N), cdiv(K, BLOCK_K))](
        qweight, scale, out, N, K, qweight.stride(0), out.stride(0), BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
        num_warps=4, USE_PDL=False,
    )
    return out
